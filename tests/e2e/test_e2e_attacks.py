"""Attacks from issue 8 over real TCP on 127.0.0.1, each with a well-behaved client beside it that must
lose nothing and must not stall: a remote kill through the topic matcher, amplification by SETTLE ranges,
by blocked subscriptions and by a frame of many empty messages, a poison message, and a producer without
flow control that would grow the broker without bound (the memory watermark).

The stall bound is generous (STALL) so the tests never flake on a busy machine; the amplifications it
guards against took 1.3 s to 72 s. benchmarks/fuzz_broker.py prints the real worst stall.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from tests.e2e.test_e2e_faults import LIMIT, RawClient, closing_frames, wait_until

import flowbroker.client as fc
from flowbroker.protocol.frames import Headers
from flowbroker.protocol import (
    Bind,
    Complete,
    DeclareExchange,
    DeclareQueue,
    Error,
    ErrorCode,
    Ok,
    Outcome,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    encode_frame,
)
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME, MAX_RANGES_PER_FRAME

STALL = 0.5  # seconds: the most a well-behaved client may wait for its next message during an attack


class Watched:
    """A well-behaved producer and consumer on their own queue, timing the gaps between receipts."""

    def __init__(self, conn: fc.Connection, producer: fc.Producer):
        self.conn = conn
        self.producer = producer
        self.sent = 0
        self.received: list[bytes] = []
        self.worst_gap = 0.0
        self.stop = trio.Event()
        self.stopped = trio.Event()  # the producing loop has ended: `sent` is final

    async def produce(self) -> None:
        try:
            while not self.stop.is_set():
                await self.producer.send(b"calm-%d" % self.sent, timeout=LIMIT)
                self.sent += 1
                await trio.sleep(0.001)
        finally:
            self.stopped.set()

    async def consume(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.conn.consumer("calm", prefetch=20) as consumer:
            task_status.started()
            last = trio.current_time()
            async for msg in consumer:
                now = trio.current_time()
                if not self.stop.is_set():
                    self.worst_gap = max(self.worst_gap, now - last)
                last = now
                self.received.append(msg.body)
                await msg.ack()


@asynccontextmanager
async def watched(broker: Any, *, stall: float | None = STALL) -> AsyncIterator[Watched]:
    async with await fc.connect(broker.url, client_name="calm", timeout=LIMIT) as conn:
        await conn.declare_queue("calm")
        w = Watched(conn, conn.producer(routing_key="calm", window=50))
        async with trio.open_nursery() as nursery:
            await nursery.start(w.consume)
            nursery.start_soon(w.produce)
            await wait_until(lambda: len(w.received) >= 20)
            yield w
            target = len(w.received) + 20
            await wait_until(lambda: len(w.received) >= target)  # still flowing after the attack
            w.stop.set()
            with trio.fail_after(LIMIT):  # a send in progress when it was told to stop still goes (and counts)
                await w.stopped.wait()
            await w.producer.flush(timeout=LIMIT)
            await wait_until(lambda: len(w.received) >= w.sent)
            nursery.cancel_scope.cancel()
        assert not conn.is_closed and conn.connection_id in broker.core.sessions
    assert w.received == [b"calm-%d" % i for i in range(w.sent)]  # none lost, none doubled, in order
    print(f"worst gap {w.worst_gap * 1000:.1f} ms")  # shown with -s (benchmarks/fuzz_broker.py prints it too)
    if stall is not None:
        assert w.worst_gap < stall, f"the well-behaved client waited {w.worst_gap:.3f} s for a message"


async def request(raw: RawClient, frame: Any) -> Any:
    await raw.send(frame)
    while True:
        answer = await raw.next_frame()
        if isinstance(answer, (Ok, Error)):
            return answer


async def test_a_routing_key_of_5000_words_is_refused_and_the_broker_carries_on(start_flowbroker) -> None:
    """It raised RecursionError in the topic matcher, which escaped the connection and stopped the broker."""
    broker = await start_flowbroker()
    async with watched(broker):
        raw = await RawClient.connect(broker.port, flow_control=False)  # not paced: two messages at once
        assert isinstance(await request(raw, DeclareExchange(1, "t", "topic")), Ok)
        assert isinstance(await request(raw, DeclareQueue(2, "words")), Ok)
        assert isinstance(await request(raw, Bind(3, "words", "t", "#.w")), Ok)
        key = ".".join(["w"] * 5000)
        await raw.send(Transfer(1, [TransferEntry("t", key, b"x"), TransferEntry("t", "w.w", b"y")]))
        errors: list[Error] = []
        while len(errors) < 1:
            frame = await raw.next_frame()
            if isinstance(frame, Error):
                errors.append(frame)
        assert errors[0].code is ErrorCode.KEY_TOO_LONG and errors[0].ref_id == 1
        await wait_until(lambda: broker.core.queues["words"].count == 1)  # the short key was routed
        bind = await request(raw, Bind(4, "words", "t", key))
        assert isinstance(bind, Error) and bind.code is ErrorCode.KEY_TOO_LONG
        await raw.aclose()


async def test_settle_ranges_over_never_delivered_tags_do_not_stall_anyone(start_flowbroker) -> None:
    """80,000 ranges over 10,000 never-delivered tags froze every connection for 72 s."""
    broker = await start_flowbroker()
    async with watched(broker):
        raw = await RawClient.connect(broker.port)
        assert isinstance(await request(raw, DeclareQueue(1, "bait")), Ok)
        assert isinstance(await request(raw, Subscribe(2, 1, "bait", 10, 0)), Ok)
        wide = [(10_000 * k + 1, 10_000 * (k + 1)) for k in range(MAX_RANGES_PER_FRAME)]
        for _ in range(80):  # 81,920 ranges in all, at the frame limit each time
            await raw.send(Settle(Outcome.ACK, wide))
        seqs: list[int | None] = []
        while len(seqs) < 80:
            frame = await raw.next_frame()
            assert frame is not None
            if isinstance(frame, Error):
                assert frame.code is ErrorCode.UNKNOWN_DELIVERY
                seqs.append(frame.frame_seq)
        assert seqs == list(range(4, 84))  # each names its SETTLE (HELLO 1, DECLARE 2, SUBSCRIBE 3)
        await raw.aclose()


async def test_blocked_subscriptions_do_not_slow_enqueues(start_flowbroker) -> None:
    """20,000 blocked subscriptions made every enqueue walk them all (1,000 messages took 2.6 s)."""
    broker = await start_flowbroker()
    async with watched(broker):
        attackers = [await RawClient.connect(broker.port) for _ in range(4)]
        assert isinstance(await request(attackers[0], DeclareQueue(1, "crowded")), Ok)
        for raw in attackers:
            for sub_id in range(1, 1001):
                await raw.send(Subscribe(sub_id, sub_id, "crowded", 1, 0))
        await wait_until(lambda: sum(len(s.subscriptions) for s in broker.core.sessions.values()) >= 4000)
        async with await fc.connect(broker.url, client_name="feeder", timeout=LIMIT) as feeder:
            producer = feeder.producer(routing_key="crowded")
            for i in range(6000):  # 4,000 fill every subscription's prefetch of 1; 2,000 more stay ready
                await producer.send(b"%d" % i)
            await producer.flush(timeout=LIMIT)
        assert broker.core.queues["crowded"].count == 6000
        for raw in attackers:
            await raw.aclose()


async def test_a_frame_of_a_million_empty_messages_is_refused_from_its_count(start_flowbroker) -> None:
    """An 8 MiB TRANSFER of 932k empty messages took the broker 6.1 s."""
    broker = await start_flowbroker()
    async with watched(broker):
        raw = await RawClient.connect(broker.port, flow_control=False)
        await raw.send(DeclareQueue(1, "void"))
        entries = [TransferEntry("", "void", b"")] * (MAX_ENTRIES_PER_FRAME + 1)
        await raw.send(Transfer(1, entries[:1]))
        await raw.send_raw(encode_frame(Transfer(2, entries)))  # built by hand: a sender must not build it
        error, _ = closing_frames(await raw.frames_until_closed())
        assert error.code is ErrorCode.LIMIT_EXCEEDED and "MAX_ENTRIES_PER_FRAME" in error.text
        assert broker.core.queues["void"].count == 1
        await raw.aclose()


async def test_a_message_that_cannot_be_delivered_is_refused_at_publish(start_flowbroker) -> None:
    """A TRANSFER exactly max_frame_size became a DELIVER 2 bytes over it; every consumer of its queue
    died with ProtocolViolation, forever. Now the publisher hears MESSAGE_TOO_LARGE and consumers carry on."""
    broker = await start_flowbroker(server={"max_frame_size": 65536, "max_message_size": 32768})
    async with watched(broker):
        raw = await RawClient.connect(broker.port, flow_control=False)
        assert isinstance(await request(raw, DeclareQueue(1, "poison")), Ok)
        headers: Headers = {f"h{i}": "v" * 900 for i in range(60)}  # 54 KB of headers on a 1-byte body
        await raw.send(Transfer(1, [TransferEntry("", "poison", b"x", headers), TransferEntry("", "poison", b"ok")]))
        while True:
            frame = await raw.next_frame()
            if isinstance(frame, Error):
                break
        assert frame.code is ErrorCode.MESSAGE_TOO_LARGE and frame.ref_id == 1
        async with await fc.connect(broker.url, client_name="victim", timeout=LIMIT) as conn:
            async with conn.consumer("poison") as consumer:
                with trio.fail_after(LIMIT):
                    msg = await consumer.receive()
                assert msg.body == b"ok"
                await msg.ack()
            assert not conn.is_closed
        await raw.aclose()


async def test_the_memory_watermark_stops_producers_and_refuses_unpaced_ones(start_flowbroker) -> None:
    """A producer without flow control on a queue with max_size = 0 took the broker from 39 MB to 1.7 GB.
    Over the memory watermark it is refused with RESOURCE_EXHAUSTED, flow-controlled producers are held
    with FLOW_STOPPED '*' (threshold memory), and everything resumes once a consumer drains the queue."""
    watermark = 2_000_000
    broker = await start_flowbroker(
        server={"memory_watermark": watermark}, credit={"policy": "static", "static_size": 64 * 1024}
    )
    # The well-behaved producer is held by the alarm too (it is broker-wide), so no stall bound here;
    # it must still lose nothing.
    async with watched(broker, stall=None) as w:
        raw = await RawClient.connect(broker.port, flow_control=False)
        assert isinstance(await request(raw, DeclareQueue(1, "sink", False, {"max_size": 0, "flow_stop_size": 0})), Ok)
        body = b"z" * 60_000
        refused: Error | None = None
        with trio.fail_after(LIMIT):
            for tid in range(1, 200):  # 12 MB offered against a 2 MB watermark
                await raw.send(Transfer(tid, [TransferEntry("", "sink", body)]))
                while True:  # its answer: ERROR (if refused) then COMPLETE
                    frame = await raw.next_frame()
                    if isinstance(frame, Error) and frame.code is ErrorCode.RESOURCE_EXHAUSTED:
                        refused = frame
                    if isinstance(frame, Complete) and frame.cumulative_id >= tid:
                        break
                if refused is not None:
                    break
        assert refused is not None, "never refused: the broker kept growing"
        assert refused.destination == "*" and "memory watermark" in refused.text
        held = broker.core.memory.held
        assert held < watermark + 2 * len(body) + 4096, held  # over by at most one frame
        await wait_until(lambda: "*" in w.producer.flow_state.stopped)
        stop = w.producer.flow_state.stopped["*"]
        assert stop.threshold == "memory" and stop.limit == watermark
        # A consumer drains the sink: the alarm clears and the held producer resumes.
        async with await fc.connect(broker.url, client_name="drain", timeout=LIMIT) as conn:
            async with conn.consumer("sink", prefetch=50) as consumer:
                with trio.fail_after(LIMIT):
                    for _ in range(broker.core.queues["sink"].count):
                        msg = await consumer.receive()
                        await msg.ack()
        await wait_until(lambda: not broker.core.memory.alarm)
        await wait_until(lambda: "*" not in w.producer.flow_state.stopped)
        await raw.aclose()
