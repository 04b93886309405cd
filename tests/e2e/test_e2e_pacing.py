"""Pacing end to end ([queues] pace_producers = true, docs/policies.md "Pacing"): the SDK against a real
`BrokerServer` on 127.0.0.1. A producer far faster than its queue's consumer is paced once more than twice
the consumer's prefetch is ready (its completions wait), which keeps the queue near that, and loses
nothing; a producer beside it, to a queue whose consumer may hold everything it sends, is not paced:
pacing is per producer, by the queues it routes to. With the default (false) no one is paced. A UDP
producer is paced the same way: the consumption position the broker reports (its completion point) waits."""

from __future__ import annotations

from typing import Any

import trio

import flowbroker.client as fc
from flowbroker.broker.views import connection_view

LIMIT = 30.0  # seconds: an upper bound for the whole exchange (it takes one or two)
SLOW = 600
WINDOW = 50  # the slow pair's producer window: what it may send beyond a pace
FAST = 3000


def view_of(broker: Any, client_name: str) -> dict[str, Any]:
    [session] = [s for s in broker.core.sessions.values() if s.client_name == client_name]
    return connection_view(session, broker.core.clock_ns())


async def run_pair(url: str, queue: str, count: int, prefetch: int, delay: float, got: list[bytes],
                   window: int = 1000) -> None:
    """`count` messages from a producer connection named after the queue (with `window`) to a consumer that
    sleeps `delay` after each one."""
    async with await fc.connect(url, client_name=f"producer-{queue}", timeout=LIMIT) as pconn:
        await pconn.declare_queue(queue)
        async with await fc.connect(url, client_name=f"consumer-{queue}", timeout=LIMIT) as cconn:
            async with cconn.consumer(queue, prefetch=prefetch) as consumer, trio.open_nursery() as nursery:
                async def consume() -> None:
                    async for msg in consumer:
                        got.append(msg.body)
                        await msg.ack()
                        if delay:
                            await trio.sleep(delay)
                        if len(got) == count:
                            return

                nursery.start_soon(consume)
                async with pconn.producer(routing_key=queue, window=window) as producer:
                    for i in range(count):
                        await producer.send(b"%s-%05d" % (queue.encode(), i), timeout=LIMIT)


async def test_a_producer_ahead_of_its_consumer_is_paced_and_one_beside_it_is_not(start_flowbroker) -> None:
    broker = await start_flowbroker(queues={"pace_producers": True})
    slow: list[bytes] = []
    ready: list[int] = []
    fast: list[bytes] = []
    views: dict[str, dict[str, Any]] = {}

    async def watch() -> None:  # the connection views while both run (the connections end with the pairs)
        while True:
            for name in ("producer-slow", "producer-fast"):
                try:
                    views[name] = view_of(broker, name)
                except ValueError:
                    pass
            queue = broker.core.queues.get("slow")
            if queue is not None:
                ready.append(len(queue.store))
            await trio.sleep(0.005)

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as pairs:
                pairs.start_soon(run_pair, broker.url, "slow", SLOW, 10, 0.001, slow, WINDOW)
                pairs.start_soon(run_pair, broker.url, "fast", FAST, FAST, 0.0, fast)  # never more ready than its prefetch
            nursery.cancel_scope.cancel()
    assert slow == [b"slow-%05d" % i for i in range(SLOW)]  # nothing lost, duplicated or reordered
    assert fast == [b"fast-%05d" % i for i in range(FAST)]
    assert views["producer-slow"]["producer"]["paced_total"] > 0
    assert views["producer-fast"]["producer"]["paced_total"] == 0
    # paced past 20 ready (twice the prefetch of 10), with at most its window more in flight: unpaced, the
    # queue would have taken nearly all 600 at once (the consumer takes 1 a millisecond)
    assert max(ready) <= 20 + 2 * WINDOW


async def test_pace_producers_is_off_by_default(start_flowbroker) -> None:
    broker = await start_flowbroker()
    got: list[bytes] = []
    seen: list[int] = []

    async def watch() -> None:
        while True:
            try:
                seen.append(view_of(broker, "producer-slow")["producer"]["paced_total"])
            except ValueError:
                pass
            await trio.sleep(0.01)

    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await run_pair(broker.url, "slow", 300, 10, 0.001, got, WINDOW)
            nursery.cancel_scope.cancel()
    assert got == [b"slow-%05d" % i for i in range(300)]
    assert seen and set(seen) == {0}


async def test_a_stuck_consumer_paces_no_one_for_long_and_the_watermark_still_stops(start_flowbroker) -> None:
    """The consumer takes its prefetch and never settles: the flow timer releases the paced producer's
    completions every 0.1-0.2 s, so it keeps going, a window at a time, until the queue's stop threshold
    stops it with FLOW_STOPPED, as without pacing."""
    broker = await start_flowbroker(queues={"pace_producers": True})
    async with await fc.connect(broker.url, client_name="producer", timeout=LIMIT) as conn:
        await conn.declare_queue("stuck", flow_stop_count=100, flow_resume_count=50)
        async with await fc.connect(broker.url, timeout=LIMIT) as cconn:
            async with cconn.consumer("stuck", prefetch=5):  # takes its prefetch, never settles
                producer = conn.producer(routing_key="stuck", window=20)
                with trio.fail_after(LIMIT):
                    async with producer.flow_events() as events:
                        sent = 0
                        while not producer.flow_state.is_stopped:
                            await producer.send(b"s%04d" % sent, timeout=LIMIT)
                            sent += 1
                        event = await events.get()
                queue = broker.core.queues["stuck"]
                assert event is not None and (event.kind, event.destination) == ("stopped", "stuck")
                assert queue.counters.flow_stopped_count == 1 and queue.count > 100
                assert view_of(broker, "producer")["producer"]["paced_total"] >= 2  # paced, released, paced again
        await conn.delete_queue("stuck")  # its held transfers complete: the block ends with nothing left


async def test_a_udp_producer_is_paced_as_a_tcp_one_is(start_flowbroker) -> None:
    """Over UDP the consumption position the broker reports is the completion point: paced, it waits, so
    the producer's window closes one window past the pace (64 KiB here: about 60 messages of 1 KiB)."""
    broker = await start_flowbroker(queues={"pace_producers": True},
                                    credit={"policy": "static", "static_size": 64 * 1024})
    count, body = 600, b"u" * 1000
    got: list[bytes] = []
    ready: list[int] = []
    paced: list[int] = []

    async with await fc.connect(broker.url, client_name="udp", timeout=LIMIT) as conn:
        await conn.declare_queue("slow")
        queue = broker.core.queues["slow"]

        async def consume() -> None:
            async with conn.consumer("slow", prefetch=10) as consumer:
                async for msg in consumer:
                    got.append(msg.body)
                    await msg.ack()
                    await trio.sleep(0.001)  # a thousand a second at most
                    if len(got) == count:
                        return

        async def watch() -> None:
            while True:
                ready.append(len(queue.store))
                paced.extend(s.paced_total for s in broker.core.sessions.values()
                             if s.client_name.startswith("udp udp:"))
                await trio.sleep(0.005)

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                async with trio.open_nursery() as pair:
                    pair.start_soon(consume)
                    async with conn.producer("", "slow", transport="udp", send_timeout=LIMIT) as producer:
                        for i in range(count):
                            await producer.send(b"%05d" % i + body)
                        await producer.flush()
                nursery.cancel_scope.cancel()
    assert got == [b"%05d" % i + body for i in range(count)]  # nothing lost, duplicated or reordered
    assert paced and max(paced) > 0
    # twice the prefetch, then a window of messages (and a second one should the flow timer release it first
    # on a loaded machine); unpaced, the queue takes nearly all 600 as they come (582 when measured)
    assert max(ready) <= 20 + 2 * (64 * 1024 // 1000 + 2), max(ready)
