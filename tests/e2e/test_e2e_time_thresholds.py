"""Latency-bounded flow control end to end: the SDK against a real `BrokerServer` on 127.0.0.1, its flow
timer measuring a consumer slowed by sleeps. A fast producer is stopped by `flow_stop_drain_time` (the
FLOW_STOPPED the SDK reports names it), resumed when the consumer speeds up, and nothing is lost."""

from __future__ import annotations

import trio

import flowbroker.client as fc

LIMIT = 30.0  # seconds: an upper bound for the whole exchange (it takes a few)
MAX_SENT = 20_000


async def test_a_slow_consumer_stops_the_producer_by_drain_time_and_a_fast_one_resumes_it(start_flowbroker) -> None:
    broker = await start_flowbroker()
    received: list[bytes] = []
    sent = 0
    done = trio.Event()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("lat", flow_stop_drain_time=0.3, flow_resume_drain_time=0.15)
        producer = conn.producer(routing_key="lat", window=50)

        async def consume() -> None:
            async with await fc.connect(broker.url, timeout=LIMIT) as cconn:
                async with cconn.consumer("lat", prefetch=10) as consumer:
                    while not done.is_set() or len(received) < sent:
                        with trio.move_on_after(0.5):
                            msg = await consumer.receive()
                            await msg.ack()
                            received.append(msg.body)
                            if producer.flow_state.stop_count == 0:
                                await trio.sleep(0.004)  # at most 250 msgs/s until the producer is stopped

        with trio.fail_after(LIMIT):
            async with producer.flow_events() as events, trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                # about 2,000 msgs/s offered until the producer has been stopped and resumed
                while producer.flow_state.resume_count == 0 and sent < MAX_SENT:
                    await producer.send(b"m%05d" % sent, timeout=LIMIT)
                    sent += 1
                    if sent % 10 == 0:
                        await trio.sleep(0.005)
                await producer.flush(timeout=LIMIT)
                done.set()
                seen = []
                while (event := events.get_nowait()) is not None:
                    seen.append(event)
    stops = [e.stop for e in seen if e.kind == "stopped" and e.stop is not None]
    assert stops, "a producer far faster than its consumer was never stopped"
    assert {s.threshold for s in stops} == {"flow_stop_drain_time"}
    assert all(s.limit == 300 and s.value > 300 for s in stops)  # milliseconds
    assert seen[-1].kind == "resumed"
    assert received == [b"m%05d" % i for i in range(sent)]  # nothing lost, nothing refused, in order
    queue = broker.core.queues["lat"]
    assert queue.counters.flow_stopped_count == len(stops) and queue.counters.rejected == 0
    assert not queue.saturated
