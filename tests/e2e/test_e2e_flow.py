"""Producer flow control end to end: the SDK (`flowbroker.client`) against a real `BrokerServer` over
TCP on 127.0.0.1.

tests/broker/ proves these rules in memory against `BrokerCore`; here they are proved through the
real client, its credit and window, real sockets and the broker's reader/writer tasks: pacing by
watermarks, FLOW_STOPPED/FLOW_RESUMED, held completions over two destinations, purge/delete/threshold
changes that release held transfers, legacy producers and hard limits, and send deadlines.
`broker.core` is used for assertions (queue depths) and for operator actions (thresholds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.protocol import ErrorCode, message_size

LIMIT = 5.0  # seconds: an upper bound for any single wait in these tests (they take far less)


async def wait_until(predicate: Callable[[], bool], timeout: float = LIMIT) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def consume(conn: fc.Connection, queue: str, count: int, *, prefetch: int = 100) -> list[fc.Message]:
    """Receive and ack exactly `count` messages from `queue`."""
    got: list[fc.Message] = []
    async with conn.consumer(queue, prefetch=prefetch) as consumer:
        with trio.fail_after(LIMIT):
            while len(got) < count:
                msg = await consumer.receive()
                await msg.ack()
                got.append(msg)
    return got


async def saturate(producer: fc.Producer, prefix: bytes = b"m") -> int:
    """Send until the producer has no credit left (a saturated queue holds its window); returns how many."""
    sent = 0
    with trio.fail_after(LIMIT):
        while True:
            try:
                await producer.send(prefix + b"%d" % sent, timeout=0.2)
            except fc.FlowControlTimeout:
                return sent
            sent += 1


# -- 1. a producer 10x faster than its consumer is paced ----------------------------------------


@pytest.mark.parametrize("dimension", ["count", "size"])
async def test_fast_producers_are_paced_and_queue_stays_within_bounds(start_flowbroker, dimension: str) -> None:
    """Two producers, each offering 10x what the consumer takes (50 vs 5 messages per millisecond
    tick). The queue's depth, sampled after every send and every delivery, never exceeds its stop
    threshold by more than the producers' windows (count) or their byte buffers plus one message each
    (size); every message arrives once, in each producer's order."""
    per_producer = 1500
    body_size = 200
    if dimension == "count":
        buffer = 1 << 20  # bytes never limit: the window does
        windows = (16, 32)
        args: dict[str, Any] = {"flow_stop_count": 100, "flow_resume_count": 50}
    else:
        buffer = 4096  # the byte buffer limits: windows are far larger
        windows = (1000, 1000)
        args = {"flow_stop_size": 16_000, "flow_resume_size": 8_000}
    broker = await start_flowbroker(credit={"policy": "static", "static_size": buffer})
    msg_size = message_size(b"x" * body_size, None)
    if dimension == "count":
        bound = args["flow_stop_count"] + sum(windows)
    else:
        bound = args["flow_stop_size"] + len(windows) * (buffer + msg_size)
    peak = {"count": 0, "size": 0}

    def sample() -> None:
        q = broker.core.queues["paced"]
        peak["count"] = max(peak["count"], q.count)
        peak["size"] = max(peak["size"], q.size)

    producers: list[fc.Producer] = []

    async def produce(name: bytes, window: int) -> None:
        async with await fc.connect(broker.url, client_name=name.decode(), timeout=LIMIT) as conn:
            producer = conn.producer(routing_key="paced", window=window)
            producers.append(producer)
            assert conn.welcome.buffer_size == 1  # provisional: one message, then its share
            for i in range(per_producer):
                await producer.send(name + b"-%06d-" % i + b"x" * (body_size - 10), timeout=LIMIT)
                sample()
                if i % 50 == 49:
                    await trio.sleep(0.001)  # 50 per tick
            await producer.flush(timeout=LIMIT)
            assert producer.stats.completed == per_producer and producer.stats.failed == 0
            assert conn.sender_window.window == buffer  # static: the same share for both

    received: list[bytes] = []
    redelivered = 0
    async with await fc.connect(broker.url, client_name="slow-consumer", timeout=LIMIT) as conn:
        await conn.declare_queue("paced", **args)
        with trio.fail_after(10 * LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce, b"p1", windows[0])
                nursery.start_soon(produce, b"p2", windows[1])
                async with conn.consumer("paced", prefetch=10) as consumer:
                    while len(received) < 2 * per_producer:
                        msg = await consumer.receive()
                        sample()
                        received.append(msg.body)
                        redelivered += msg.redelivered
                        await msg.ack()
                        if len(received) % 5 == 0:
                            await trio.sleep(0.001)  # 5 per tick: a tenth of each producer's rate

    q = broker.core.queues["paced"]
    # flow control really acted: the queue saturated (repeatedly) and both producers had to wait
    assert q.counters.flow_stopped_count >= 2 and q.counters.held_total > 0
    assert all(p.stats.blocked_count > 0 for p in producers)
    assert peak[dimension] <= bound, (peak, bound)
    assert peak[dimension] > (args["flow_stop_count"] if dimension == "count" else args["flow_stop_size"])
    # exactly once, in order per producer
    assert redelivered == 0 and len(received) == len(set(received)) == 2 * per_producer
    for name in (b"p1", b"p2"):
        mine = [b[:10] for b in received if b.startswith(name)]
        assert mine == [name + b"-%06d-" % i for i in range(per_producer)]
    assert (q.count, q.size, q.saturated, len(q.held)) == (0, 0, False, 0)


# -- 2. saturate -> FLOW_STOPPED -> FlowControlTimeout -> drain -> FLOW_RESUMED -> flowing again --


async def test_saturation_stops_then_drain_resumes_the_producer(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("sat", flow_stop_count=10, flow_resume_count=4)
        producer = conn.producer(routing_key="sat", window=5)
        async with producer.flow_events() as events:
            assert not producer.flow_state.is_stopped
            with pytest.raises(fc.FlowControlTimeout) as info:
                for i in range(1000):
                    await producer.send(b"m%d" % i, timeout=0.25)
            # what stopped us, by name
            assert info.value.destinations == ("sat",) and info.value.destination == "sat"
            assert info.value.limit == "window" and info.value.timeout == 0.25
            assert "sat" in str(info.value)
            state = producer.flow_state
            assert state.destinations == ("sat",) and state.stop_count == 1
            stop = state.stopped["sat"]
            assert (stop.threshold, stop.limit) == ("flow_stop_count", 10)
            assert stop.value == 11 and "sat" in stop.reason
            event = events.get_nowait()
            assert event is not None and (event.kind, event.destination) == ("stopped", "sat")
            assert event.stop == stop and event.stopped == frozenset({"sat"})
            with pytest.raises(fc.FlowControlled) as refused:
                await producer.send(b"no credit", block=False)
            assert refused.value.destinations == ("sat",) and "flow-stopped: sat" in str(refused.value)
            sent = producer.stats.sent
            assert sent == 15  # 10 completed + the window of 5 held
            assert producer.outstanding == 5 and broker.core.queues["sat"].count == sent
            with pytest.raises(fc.FlowControlTimeout) as held:
                await producer.flush(timeout=0.1)  # still held
            assert held.value.limit == "completions" and held.value.destinations == ("sat",)

            got = await consume(conn, "sat", sent)  # the consumer drains the queue
            assert [m.body for m in got] == [b"m%d" % i for i in range(sent)]
            with trio.fail_after(LIMIT):
                event = await events.get()
            assert event is not None and (event.kind, event.destination) == ("resumed", "sat")
            assert event.stopped == frozenset() and event.stop == stop
            await producer.flush(timeout=LIMIT)
            state = producer.flow_state
            assert not state.is_stopped and state.resume_count == 1 and state.stopped_seconds > 0

            # sends flow again, without waiting
            for i in range(sent, sent + 5):
                await producer.send(b"m%d" % i, block=False)
            await producer.flush(timeout=LIMIT)
            got = await consume(conn, "sat", 5)
            assert [m.body for m in got] == [b"m%d" % i for i in range(sent, sent + 5)]
            assert events.get_nowait() is None  # no spurious transitions


# -- 3. two destinations, one saturated: the transfer waits for both ----------------------------


@pytest.mark.parametrize("kind", ["fanout", "topic"])
async def test_transfer_to_two_queues_is_held_until_the_saturated_one_drains(start_flowbroker, kind: str) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_exchange("ex", kind)
        await conn.declare_queue("slow", flow_stop_count=3, flow_resume_count=1)
        await conn.declare_queue("fast")
        await conn.bind("slow", "ex", "orders.#" if kind == "topic" else "")
        await conn.bind("fast", "ex", "orders.*" if kind == "topic" else "")
        producer = conn.producer(exchange="ex", routing_key="orders.new")
        for i in range(3):
            await producer.send(b"pre%d" % i)
        await producer.flush(timeout=LIMIT)  # 3 messages: not over the stop threshold
        assert not producer.flow_state.is_stopped

        await producer.send(b"held")  # the 4th saturates "slow"
        with pytest.raises(fc.FlowControlTimeout) as info:
            await producer.flush(timeout=0.3)
        assert info.value.destinations == ("slow",)
        assert producer.outstanding == 1
        slow, fast = broker.core.queues["slow"], broker.core.queues["fast"]
        assert slow.saturated and len(slow.held) == 1 and not fast.saturated
        assert (slow.count, fast.count) == (4, 4)  # both got their copy; only one holds it
        got = await consume(conn, "fast", 4)  # draining the other queue releases nothing
        assert [m.body for m in got] == [b"pre0", b"pre1", b"pre2", b"held"]
        with pytest.raises(fc.FlowControlTimeout):
            await producer.flush(timeout=0.1)
        assert producer.outstanding == 1

        got = await consume(conn, "slow", 4, prefetch=1)
        assert [m.body for m in got] == [b"pre0", b"pre1", b"pre2", b"held"]
        await producer.flush(timeout=LIMIT)
        assert producer.stats.completed == 4
        await wait_until(lambda: not producer.flow_state.is_stopped)


# -- 4. purge and delete release held transfers -------------------------------------------------


async def test_purge_releases_held_transfers(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("p", flow_stop_count=5, flow_resume_count=2)
        producer = conn.producer(routing_key="p", window=4)
        sent = await saturate(producer)
        assert sent == 9 and producer.outstanding == 4
        assert producer.flow_state.destinations == ("p",)
        with pytest.raises(fc.FlowControlTimeout):
            await producer.flush(timeout=0.1)

        assert await conn.purge_queue("p") == {"purged": 9}
        await producer.flush(timeout=LIMIT)  # released by the purge
        assert producer.stats.completed == 9
        await wait_until(lambda: not producer.flow_state.is_stopped)
        q = broker.core.queues["p"]
        assert (q.count, q.saturated, len(q.held)) == (0, False, 0)
        await producer.send(b"after", block=False)  # credit is back
        await producer.flush(timeout=LIMIT)
        assert [m.body for m in await consume(conn, "p", 1)] == [b"after"]


async def test_delete_releases_held_transfers_and_tells_the_consumer(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, client_name="consumer", timeout=LIMIT) as consumer_conn:
        async with await fc.connect(broker.url, client_name="producer", timeout=LIMIT) as conn:
            await conn.declare_queue("d", flow_stop_count=5, flow_resume_count=2)
            async with consumer_conn.consumer("d", prefetch=2) as consumer:
                producer = conn.producer(routing_key="d", window=4)
                sent = await saturate(producer)
                assert sent == 9  # 5 completed (2 of them delivered, unsettled) + 4 held
                first = await consumer.receive(timeout=LIMIT)
                assert first.body == b"m0"
                with pytest.raises(fc.FlowControlTimeout):
                    await producer.flush(timeout=0.1)

                assert await conn.delete_queue("d") == {"deleted": 9}
                await producer.flush(timeout=LIMIT)  # released by the delete
                assert producer.stats.completed == 9 and producer.stats.failed == 0
                await wait_until(lambda: not producer.flow_state.is_stopped)
                assert "d" not in broker.core.queues
                # the consumer's connection is told which queue went away
                await wait_until(lambda: any(e.code is ErrorCode.NOT_FOUND for e in consumer_conn.connection_errors))
                (notice,) = consumer_conn.connection_errors
                assert notice.destination == "d" and "'d'" in notice.text
                # the subscription is gone at the broker; the connection is fine
                assert broker.core.sessions[consumer_conn.connection_id].subscriptions == {}
                assert not consumer_conn.is_closed
                # the consumer hands out what it had received, then says why it ends
                rest = []
                with trio.fail_after(LIMIT), pytest.raises(fc.NotFound) as gone:
                    async for msg in consumer:
                        rest.append(msg.body)
                assert rest == [b"m1"] and gone.value.destination == "d"
                assert gone.value.code is ErrorCode.NOT_FOUND
                # and the producer's sends to the deleted queue are refused by name
                await producer.send(b"late")
                with pytest.raises(fc.NotFound) as info:
                    await producer.flush(timeout=LIMIT)
                assert info.value.destination == "d"


# -- 5. runtime threshold changes --------------------------------------------------------------


async def test_runtime_threshold_change_releases_and_stops_producers(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("t", flow_stop_count=5, flow_resume_count=3)
        producer = conn.producer(routing_key="t", window=4)
        sent = await saturate(producer)
        assert sent == 9 and producer.outstanding == 4
        assert producer.flow_state.stopped["t"].limit == 5

        # raised: everything held is released at once, and the producer resumes
        broker.core.set_queue_thresholds("t", {"flow_stop_count": 100, "flow_resume_count": 50})
        await producer.flush(timeout=LIMIT)
        await wait_until(lambda: not producer.flow_state.is_stopped)
        for i in range(sent, sent + 20):
            await producer.send(b"m%d" % i, timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
        q = broker.core.queues["t"]
        assert (q.count, q.saturated) == (29, False)

        # lowered below the depth: the queue is saturated at once, and the next transfer is held
        broker.core.set_queue_thresholds("t", {"flow_stop_count": 10, "flow_resume_count": 5})
        assert q.saturated
        await producer.send(b"m29")
        with pytest.raises(fc.FlowControlTimeout) as info:
            await producer.flush(timeout=0.2)
        assert info.value.destinations == ("t",)
        stop = producer.flow_state.stopped["t"]
        assert (stop.threshold, stop.limit, stop.value) == ("flow_stop_count", 10, 29)  # the depth when it tripped
        assert list(q.held)[0].body == b"m29"

        # draining to the new resume threshold releases it
        got = await consume(conn, "t", 26, prefetch=1)
        assert [m.body for m in got] == [b"m%d" % i for i in range(26)]
        await producer.flush(timeout=LIMIT)
        await wait_until(lambda: not producer.flow_state.is_stopped)
        assert q.count == 4 and not q.saturated


# -- 6. legacy producers and hard limits --------------------------------------------------------


async def test_legacy_producer_reject_names_queue_and_keeps_connection(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, flow_control=False, timeout=LIMIT) as conn:
        assert conn.welcome.buffer_size == 0
        await conn.declare_queue("small", max_count=5, overflow="reject")
        producer = conn.producer(routing_key="small")
        for i in range(8):
            await producer.send(b"m%d" % i, block=False)  # never paced
        with pytest.raises(fc.QueueFull) as info:
            await producer.flush(timeout=LIMIT)
        assert info.value.destination == "small" and "small" in str(info.value)
        assert info.value.code is ErrorCode.QUEUE_FULL and info.value.transfer_id == 6
        assert producer.stats.failed == 3 and producer.outstanding == 0
        q = broker.core.queues["small"]
        assert q.count == 5 and q.counters.rejected == 3

        # the connection is still usable, and later sends work once there is room
        assert not conn.is_closed and conn.connection_id in broker.core.sessions
        got = await consume(conn, "small", 2, prefetch=2)
        assert [m.body for m in got] == [b"m0", b"m1"]
        await producer.send(b"again1")
        await producer.send(b"again2")
        await producer.flush(timeout=LIMIT)  # no error this time
        got = await consume(conn, "small", 5)
        assert [m.body for m in got] == [b"m2", b"m3", b"m4", b"again1", b"again2"]


async def test_legacy_producer_drop_head_keeps_the_newest(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, flow_control=False, timeout=LIMIT) as conn:
        await conn.declare_queue("ring", max_count=3, overflow="drop-head")
        producer = conn.producer(routing_key="ring")
        for i in range(10):
            await producer.send(b"m%d" % i, block=False)
        await producer.flush(timeout=LIMIT)  # nothing refused
        assert producer.stats.failed == 0
        q = broker.core.queues["ring"]
        assert (q.count, q.counters.dropped) == (3, 7)
        got = await consume(conn, "ring", 3)
        assert [m.body for m in got] == [b"m7", b"m8", b"m9"]


# -- 8. send deadlines -------------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["window", "buffer"])
async def test_send_deadline_block_false_and_timeout(start_flowbroker, limit: str) -> None:
    """Out of credit (a saturated queue holds the window, or the bytes): `block=False` raises
    FlowControlled at once; a timeout raises FlowControlTimeout after that time, not before."""
    buffer = 3 * message_size(b"x" * 300) + 4  # takes 4 of those (the 4th overflows it), and 3 b"x" easily
    broker = await start_flowbroker(credit={"policy": "static", "static_size": buffer})
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("dl", flow_stop_count=2, flow_resume_count=1)
        if limit == "window":
            producer = conn.producer(routing_key="dl", window=3)
            body = b"x"
        else:
            producer = conn.producer(routing_key="dl", window=1000)
            body = b"x" * 300
        sent = await saturate(producer, body)
        assert sent == (2 + 3 if limit == "window" else 2 + 4)
        assert producer.flow_state.destinations == ("dl",)

        start = trio.current_time()
        with pytest.raises(fc.FlowControlled) as info:
            await producer.send(body, block=False)
        assert trio.current_time() - start < 0.1
        assert type(info.value) is fc.FlowControlled and info.value.limit == limit
        assert info.value.destinations == ("dl",)

        for timeout in (0.05, 0.3):
            start = trio.current_time()
            with pytest.raises(fc.FlowControlTimeout) as tinfo:
                await producer.send(body, timeout=timeout)
            elapsed = trio.current_time() - start
            assert timeout <= elapsed < timeout + 1.0  # not before; the upper bound only catches a hang
            assert tinfo.value.timeout == timeout and tinfo.value.limit == limit
            assert tinfo.value.destinations == ("dl",)
        assert producer.stats.sent == sent  # nothing refused was sent

        # a send waiting with a deadline goes through as soon as credit returns
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume, conn, "dl", sent)
            await producer.send(body + b"!", timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
        assert [m.body for m in await consume(conn, "dl", 1)] == [body + b"!"]
