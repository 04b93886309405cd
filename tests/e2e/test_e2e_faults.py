"""Faults end to end over real TCP on 127.0.0.1: malformed, truncated, oversize and out-of-order frames
from a raw client, a peer that goes silent, a producer that overruns its credit, and broker shutdown.

A raw client does the handshake with `flowbroker.protocol.Connection(Role.CLIENT)` and then writes
whatever bytes the test needs. In every fault test a well-behaved SDK connection (the *bystander*)
publishes and consumes on its own queue the whole time; it must keep flowing through the fault and
end with every message it sent received exactly once, in order, and its connection never closed.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import trio

import flowbroker.client as fc
from flowbroker.protocol import (
    PROTOCOL_VERSION,
    Close,
    Connection,
    Deliver,
    DeliveryEntry,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    Hello,
    Noop,
    Ok,
    Role,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    Welcome,
    encode_frame,
    Outcome,
    DeclareQueue,
    message_size,
)
from flowbroker.protocol.credit import MESSAGE_OVERHEAD

LIMIT = 5.0  # seconds: an upper bound for any single wait in these tests (they take far less)


async def wait_until(predicate: Callable[[], bool], timeout: float = LIMIT) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


def raw_frame(body: bytes) -> bytes:
    """A length prefix and whatever body bytes the test wants."""
    return struct.pack(">I", len(body)) + body


# -- the raw client ----------------------------------------------------------------------------


class RawClient:
    """A TCP connection that speaks the protocol only as far as the test wants it to."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.proto = Connection(Role.CLIENT)
        self.welcome: Welcome | None = None
        self._raw_decoder: FrameDecoder | None = None
        self.eof = False

    @classmethod
    async def connect(cls, port: int, *, hello: bool = True, flow_control: bool = True) -> RawClient:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        if hello:
            await client.send(Hello(PROTOCOL_VERSION, "raw-test-client", flow_control, []))
            frame = await client.next_frame()
            assert isinstance(frame, Welcome), frame
            client.welcome = frame
        else:
            # Without a handshake our state machine would refuse the broker's frames: decode them bare.
            client._raw_decoder = FrameDecoder()
        return client

    async def send(self, frame: Frame) -> None:
        await self.stream.send_all(self.proto.send(frame))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def next_frame(self) -> Frame | None:
        """The broker's next frame, or None once it has closed the socket (end of stream seen)."""
        decoder = self._raw_decoder
        with trio.fail_after(LIMIT):
            while True:
                frame = decoder.next_frame() if decoder is not None else self.proto.next_frame()
                if frame is not None:
                    return frame
                if self.eof:
                    return None
                data = await self.stream.receive_some(65536)
                self.eof = not data
                if decoder is not None:
                    decoder.feed(data)
                else:
                    self.proto.receive_data(data)

    async def frames_until_closed(self) -> list[Frame]:
        """Everything the broker sends until it closes the connection."""
        frames: list[Frame] = []
        while (frame := await self.next_frame()) is not None:
            frames.append(frame)
        return frames

    async def deliveries(self, count: int) -> list[DeliveryEntry]:
        entries: list[DeliveryEntry] = []
        while len(entries) < count:
            frame = await self.next_frame()
            assert frame is not None, "closed while waiting for deliveries"
            if isinstance(frame, Deliver):
                entries.extend(frame.entries)
        return entries

    async def aclose(self) -> None:
        await self.stream.aclose()


def closing_frames(frames: list[Frame]) -> tuple[Error, Close]:
    """The broker's last two frames when it ends a connection at fault: ERROR, then CLOSE."""
    assert len(frames) >= 2, frames
    error, close = frames[-2], frames[-1]
    assert isinstance(error, Error) and isinstance(close, Close), frames[-2:]
    assert close.code is error.code
    return error, close


# -- the bystander -----------------------------------------------------------------------------


class Bystander:
    def __init__(self, conn: fc.Connection, producer: fc.Producer):
        self.conn = conn
        self.producer = producer
        self.sent = 0
        self.received: list[bytes] = []
        self.redelivered = 0
        self.stop = trio.Event()
        self.stopped = trio.Event()  # the producing loop has ended: `sent` is final

    async def produce(self) -> None:
        try:
            while not self.stop.is_set():
                await self.producer.send(b"calm-%d" % self.sent, timeout=LIMIT)
                self.sent += 1
                if self.sent % 10 == 0:
                    await trio.sleep(0.001)
        finally:
            self.stopped.set()

    async def consume(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.conn.consumer("calm", prefetch=20) as consumer:
            task_status.started()
            async for msg in consumer:
                self.received.append(msg.body)
                self.redelivered += msg.redelivered
                await msg.ack()

    async def progress(self, count: int = 50) -> None:
        """Wait until `count` more messages went through (it is really flowing, now)."""
        target = len(self.received) + count
        await wait_until(lambda: len(self.received) >= target)


@asynccontextmanager
async def bystander(broker: Any, *, window: int = 50) -> AsyncIterator[Bystander]:
    async with await fc.connect(broker.url, client_name="bystander", timeout=LIMIT) as conn:
        await conn.declare_queue("calm", flow_stop_count=200, flow_resume_count=100)
        b = Bystander(conn, conn.producer(routing_key="calm", window=window))
        async with trio.open_nursery() as nursery:
            await nursery.start(b.consume)
            nursery.start_soon(b.produce)
            await b.progress()
            yield b
            await b.progress()  # still flowing after the fault
            b.stop.set()
            with trio.fail_after(LIMIT):  # a send in progress when it was told to stop still goes (and counts)
                await b.stopped.wait()
            await b.producer.flush(timeout=LIMIT)
            await wait_until(lambda: len(b.received) >= b.sent)
            nursery.cancel_scope.cancel()
        assert not conn.is_closed and conn.connection_id in broker.core.sessions
    assert b.received == [b"calm-%d" % i for i in range(b.sent)]  # none lost, none doubled, in order
    assert b.redelivered == 0 and b.producer.stats.failed == 0


async def publish(broker: Any, queue: str, count: int, **queue_args: Any) -> None:
    """Declare `queue` and put `count` completed messages b"m0".. in it with the SDK."""
    async with await fc.connect(broker.url, client_name="setup", timeout=LIMIT) as conn:
        await conn.declare_queue(queue, **queue_args)
        producer = conn.producer(routing_key=queue)
        for i in range(count):
            await producer.send(b"m%d" % i)
        await producer.flush(timeout=LIMIT)


async def receive_all(broker: Any, queue: str, count: int) -> list[tuple[bytes, bool]]:
    """(body, redelivered) of the next `count` messages of `queue`, acked, via the SDK."""
    async with await fc.connect(broker.url, client_name="checker", timeout=LIMIT) as conn:
        got: list[tuple[bytes, bool]] = []
        async with conn.consumer(queue, prefetch=100) as consumer:
            with trio.fail_after(LIMIT):
                while len(got) < count:
                    msg = await consumer.receive()
                    got.append((msg.body, msg.redelivered))
                    await msg.ack()
    return got


# -- 7. malformed, oversize, truncated, wrong-typed and out-of-order frames --------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"\x93\x14\x01", id="truncated-array"),
        pytest.param(b"\xa5ab", id="truncated-str"),
        pytest.param(msgpack.packb([20, 1, True]) + b"\x00", id="trailing-data"),
        pytest.param(msgpack.packb({"type": 20}), id="map-not-array"),
        pytest.param(msgpack.packb([99, 1]), id="unknown-type"),
        pytest.param(b"\xd4\x01\x00", id="ext-type"),
    ],
)
async def test_garbage_after_hello_is_malformed_frame_then_close(start_flowbroker, body: bytes) -> None:
    broker = await start_flowbroker()
    async with bystander(broker) as b:
        raw = await RawClient.connect(broker.port)
        assert raw.welcome is not None
        conn_id = raw.welcome.connection_id
        await raw.send(DeclareQueue(1, "rawq"))  # frame 2
        assert await raw.next_frame() == Ok(1, {"queue": "rawq", "count": 0, "size": 0, "durable": False})
        await raw.send(Noop(7, False))  # frame 3
        assert await raw.next_frame() == Noop(7, True)
        await raw.send_raw(raw_frame(body))  # frame 4
        frames = await raw.frames_until_closed()  # and the broker closed the socket
        error, close = closing_frames(frames)
        assert error.code is ErrorCode.MALFORMED_FRAME and error.frame_seq == 4
        assert frames == [error, close]
        await wait_until(lambda: conn_id not in broker.core.sessions)
        await raw.aclose()
        await b.progress()


async def test_oversize_length_prefix_is_refused_before_the_body(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with bystander(broker) as b:
        raw = await RawClient.connect(broker.port)
        assert raw.welcome is not None
        limit = raw.welcome.max_frame_size
        await raw.send_raw(struct.pack(">I", limit + 1))  # the prefix only: no body is ever sent
        frames = await raw.frames_until_closed()
        error, close = closing_frames(frames)
        assert error.code is ErrorCode.FRAME_TOO_LARGE and error.frame_seq == 2
        assert str(limit) in error.text and str(limit + 1) in error.text
        await wait_until(lambda: raw.welcome is not None and raw.welcome.connection_id not in broker.core.sessions)
        await raw.aclose()
        await b.progress()


async def test_frame_truncated_by_close_cleans_up_and_requeues(start_flowbroker) -> None:
    broker = await start_flowbroker()
    await publish(broker, "work", 10)
    async with bystander(broker) as b:
        raw = await RawClient.connect(broker.port)
        assert raw.welcome is not None
        conn_id = raw.welcome.connection_id
        await raw.send(Subscribe(1, 1, "work", 4, 0))
        entries = await raw.deliveries(4)
        assert [e.body for e in entries] == [b"m0", b"m1", b"m2", b"m3"]
        session = broker.core.sessions[conn_id]
        assert len(session.unsettled) == 4
        settle = encode_frame(Settle(Outcome.ACK, [(1, 4)]))
        await raw.send_raw(settle[: len(settle) - 3])  # all but the last 3 bytes of an ACK of all four
        await raw.aclose()  # mid-frame
        await wait_until(lambda: conn_id not in broker.core.sessions)
        assert not session.open and session.unsettled == {} and session.subscriptions == {}
        q = broker.core.queues["work"]
        assert (q.count, len(q.store), q.subscriptions) == (10, 10, {})  # the half ACK settled nothing
        await b.progress()
    got = await receive_all(broker, "work", 10)
    assert got == [(b"m%d" % i, i < 4) for i in range(10)]  # requeued in order, marked redelivered


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        pytest.param([3, 1, 123], "queue", id="declare-queue-int-name"),
        pytest.param([10, "1", [["", "calm", b"evil"]]], "first_id", id="transfer-str-id"),
        pytest.param([10, 1, [["", "calm", "evil-not-bin"]]], "entries", id="transfer-str-body"),
        pytest.param([16, 1, 1, "calm", -1, 0], "prefetch", id="subscribe-negative-prefetch"),
        pytest.param([20, 1, 1], "reply", id="noop-int-bool"),
    ],
)
async def test_wrong_typed_field_is_malformed_frame_naming_the_field(
    start_flowbroker, wire: list[Any], field: str
) -> None:
    broker = await start_flowbroker()
    async with bystander(broker) as b:
        raw = await RawClient.connect(broker.port)
        assert raw.welcome is not None
        await raw.send_raw(raw_frame(msgpack.packb(wire, use_bin_type=True)))
        frames = await raw.frames_until_closed()
        error, _ = closing_frames(frames)
        assert error.code is ErrorCode.MALFORMED_FRAME and error.frame_seq == 2
        assert f"field {field}" in error.text
        await wait_until(lambda: raw.welcome is not None and raw.welcome.connection_id not in broker.core.sessions)
        await raw.aclose()
        await b.progress()
    # the bystander's check proves nothing of the raw frames reached its queue


async def test_transfer_before_hello_is_refused(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with bystander(broker) as b:
        sessions = set(broker.core.sessions)
        raw = await RawClient.connect(broker.port, hello=False)
        await raw.send_raw(encode_frame(Transfer(1, [TransferEntry("", "calm", b"evil")])))
        frames = await raw.frames_until_closed()
        error, close = closing_frames(frames)
        assert error.code is ErrorCode.UNEXPECTED_FRAME and error.frame_seq == 1
        assert "TRANSFER" in error.text
        assert frames == [error, close]
        assert set(broker.core.sessions) == sessions  # no session was ever opened
        await raw.aclose()
        await b.progress()
    # and "evil" never reached the bystander's queue (its exact-content check above)


# -- 9. noop idle timeout requeues ----------------------------------------------------------


async def test_silent_consumer_is_dropped_after_idle_timeout_and_its_deliveries_redelivered(
    start_flowbroker,
) -> None:
    idle = 0.5
    broker = await start_flowbroker(server={"idle_timeout": idle})
    await publish(broker, "work", 10)
    raw = await RawClient.connect(broker.port)
    assert raw.welcome is not None and raw.welcome.idle_timeout_ms == 500
    conn_id = raw.welcome.connection_id
    await raw.send(Subscribe(1, 1, "work", 3, 0))
    silent_since = trio.current_time()  # the last byte we send
    entries = await raw.deliveries(3)
    assert [(e.body, e.redelivered) for e in entries] == [(b"m0", False), (b"m1", False), (b"m2", False)]
    # now silent: no reads, no settlements, no answers to NOOPs
    await wait_until(lambda: conn_id not in broker.core.sessions, timeout=idle + 2)
    dropped_after = trio.current_time() - silent_since
    assert idle <= dropped_after < idle + 1.5  # not before the idle timeout
    frames = await raw.frames_until_closed()  # what the broker sent while we did not listen
    asked = [f for f in frames if isinstance(f, Noop)]
    assert asked and not any(f.reply for f in asked)  # it asked, and nobody answered
    error, close = closing_frames(frames)
    assert error.code is ErrorCode.IDLE_TIMEOUT and "idle" in error.text
    await raw.aclose()
    q = broker.core.queues["work"]
    assert (q.count, len(q.store)) == (10, 10)
    got = await receive_all(broker, "work", 10)  # another consumer gets them, in order, flagged
    assert got == [(b"m%d" % i, i < 3) for i in range(10)]


async def test_a_consumer_that_answers_noops_is_not_dropped(start_flowbroker) -> None:
    """The counterpart: the same silent application, but its SDK connection answers NOOPs."""
    idle = 0.2
    broker = await start_flowbroker(server={"idle_timeout": idle})
    await publish(broker, "work", 5)
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        async with conn.consumer("work", prefetch=3) as consumer:
            msg = await consumer.receive(timeout=LIMIT)
            await trio.sleep(3 * idle)  # the application does nothing for several idle timeouts
            assert not conn.is_closed and conn.connection_id in broker.core.sessions
            await msg.ack()
        assert await conn.purge_queue("work") == {"purged": 4}


# -- 10. credit violation ------------------------------------------------------------------


async def test_producer_beyond_its_credit_is_disconnected_others_carry_on(start_flowbroker) -> None:
    buffer = 4096
    broker = await start_flowbroker(credit={"policy": "static", "static_size": buffer})
    # a saturated queue: everything sent to it is held, so the broker grants nothing back
    await publish(broker, "victim", 0, flow_stop_count=1, flow_resume_count=1)
    async with await fc.connect(broker.url, client_name="filler", timeout=LIMIT) as filler:
        fill = filler.producer(routing_key="victim")
        await fill.send(b"a")
        await fill.send(b"b")
        await wait_until(lambda: broker.core.queues["victim"].saturated)
        async with bystander(broker) as b:  # its own buffer is 4096 bytes too, and it is fine
            raw = await RawClient.connect(broker.port)
            # provisional: one byte, one message; that first transfer registers it, and the later ones
            # are checked against its 4096-byte share
            assert raw.welcome is not None and raw.welcome.buffer_size == 1
            conn_id = raw.welcome.connection_id
            size = buffer // 4 + 8  # starts at 0, size, 2 size, 3 size are in credit; 4 size is not
            body = b"x" * (size - MESSAGE_OVERHEAD)
            assert message_size(body) == size
            data = b"".join(
                raw.proto.send(Transfer(i, [TransferEntry("", "victim", body)])) for i in range(1, 7)
            )
            await raw.send_raw(data)  # without waiting for any BUFFER_ACK
            frames = await raw.frames_until_closed()
            error, close = closing_frames(frames)
            assert error.code is ErrorCode.CREDIT_VIOLATION and error.frame_seq == 6
            assert f"credit limit {buffer}" in error.text and f"starts at byte {4 * size}," in error.text
            assert f"buffer {buffer}" in error.text
            await wait_until(lambda: conn_id not in broker.core.sessions)
            q = broker.core.queues["victim"]
            assert q.count == 2 + 4  # the four in credit were taken (and held); the rest refused
            # what /metrics reports of it (broker/metrics.py): one violation, its closing ERROR counted
            assert broker.core.credit_violations == 1
            assert broker.core.errors_sent[ErrorCode.CREDIT_VIOLATION] == 1
            await raw.aclose()
            await b.progress()
        assert not filler.is_closed
        await filler.purge_queue("victim")  # releases what it holds: leaving the block would report it


async def test_producer_that_honours_credit_is_never_disconnected_under_load(start_flowbroker) -> None:
    buffer = 4096
    broker = await start_flowbroker(credit={"policy": "static", "static_size": buffer})
    sizes = [(i * 7919) % 3000 for i in range(1500)]
    sizes[100] = sizes[700] = 3 * buffer  # bigger than the whole buffer: goes when the buffer is empty
    received: list[bytes] = []
    async with await fc.connect(broker.url, client_name="consumer", timeout=LIMIT) as cconn:
        async with await fc.connect(broker.url, client_name="producer", timeout=LIMIT) as pconn:
            assert pconn.welcome.buffer_size == 1  # provisional until its first transfer
            await pconn.declare_queue("load", flow_stop_size=16 * 1024, flow_resume_size=8 * 1024)
            producer = pconn.producer(routing_key="load", window=200)

            async def produce() -> None:
                for i, size in enumerate(sizes):
                    body = b"%06d" % i + b"y" * size
                    await producer.send(body, timeout=LIMIT)
                    assert pconn.sender_window.outstanding < buffer + message_size(body)  # never more than one message over
                await producer.flush(timeout=LIMIT)

            with trio.fail_after(4 * LIMIT):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(produce)
                    async with cconn.consumer("load", prefetch=50) as consumer:
                        async for msg in consumer:
                            received.append(msg.body[:6])
                            await msg.ack()
                            if len(received) % 10 == 0:
                                await trio.sleep(0.001)  # slower than the producer
                            if len(received) == len(sizes):
                                break
            assert not pconn.is_closed and pconn.connection_id in broker.core.sessions
            assert producer.stats.blocked_count > 0  # credit really paced it
            assert broker.core.queues["load"].counters.flow_stopped_count > 0
    assert received == [b"%06d" % i for i in range(len(sizes))]


# -- 11. clean shutdown ----------------------------------------------------------------------


async def test_shutdown_closes_clients_with_shutdown_and_loses_nothing_completed(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, client_name="consumer", timeout=LIMIT) as cconn:
        async with await fc.connect(broker.url, client_name="producer", timeout=LIMIT) as pconn:
            await pconn.declare_queue("keep")
            producer = pconn.producer(routing_key="keep")
            for i in range(50):
                await producer.send(b"m%d" % i)
            await producer.flush(timeout=LIMIT)  # all 50 completed
            async with cconn.consumer("keep", prefetch=10) as consumer:
                for i in range(20):
                    msg = await consumer.receive(timeout=LIMIT)
                    assert msg.body == b"m%d" % i
                    await msg.ack()
                unacked = await consumer.receive(timeout=LIMIT)
                assert unacked.body == b"m20"
                q = broker.core.queues["keep"]
                await wait_until(lambda: q.count == 30)  # the 20 acks arrived

                broker.server.shutdown()
                with trio.fail_after(LIMIT):
                    with pytest.raises(fc.ConnectionClosed) as info:
                        async for _ in consumer:  # what was buffered, then the close
                            pass
                assert info.value.code is ErrorCode.SHUTDOWN
            await wait_until(lambda: pconn.is_closed)
            closed = pconn.close_error
            assert isinstance(closed, fc.ConnectionClosed) and closed.code is ErrorCode.SHUTDOWN
            with pytest.raises(fc.ConnectionClosed) as info:
                await producer.send(b"late")
            assert info.value.code is ErrorCode.SHUTDOWN
    await wait_until(lambda: not broker.server.connections and not broker.core.sessions)
    # nothing completed is lost: the 30 not acked are in the queue, in order, delivered ones flagged
    assert [m.body for m in q.store] == [b"m%d" % i for i in range(20, 50)]
    assert all(m.redelivered for m in list(q.store)[:10]) and q.count == 30


async def test_connection_over_max_connections_is_refused_with_a_reason(start_flowbroker) -> None:
    """The refusal comes at accept as ERROR + CLOSE (RESOURCE_EXHAUSTED), which the client reads as the
    answer to its HELLO, so it is told why; the open one is untouched."""
    broker = await start_flowbroker(server={"max_connections": 1})
    async with await fc.connect(broker.url, timeout=LIMIT) as first:
        with pytest.raises(fc.HandshakeError, match=r"too many connections \(max_connections 1\)") as refused:
            await fc.connect(broker.url, timeout=LIMIT)
        assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert broker.core.errors_sent[ErrorCode.RESOURCE_EXHAUSTED] == 1  # (flowbroker_frames_refused_total)
        await first.declare_queue("still-served")
    assert "still-served" in broker.core.queues


async def test_a_consumer_that_never_reads_holds_at_most_a_piece_of_its_deliveries_encoded(start_flowbroker) -> None:
    """The writer encoded everything it collected at once: a subscriber with prefetch 0 that never read its
    socket had all of a 200 MiB queue encoded beside the messages (RSS twice the watermark, a tester). Now
    it encodes PIECE_DELIVERS DELIVER frames at a time and the rest waits unencoded."""
    from flowbroker.broker.server import PIECE_DELIVERS
    from flowbroker.protocol import Subscribe

    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("big", max_size=0)
        producer = conn.producer(routing_key="big")
        for _ in range(160):  # 40 MiB
            await producer.send(b"y" * (256 * 1024), timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
    reader = await RawClient.connect(broker.port, flow_control=False)
    try:
        await reader.send(Subscribe(1, 1, "big", 0, 0))  # no prefetch, no buffer: everything is due
        handler = None
        with trio.fail_after(LIMIT):
            while handler is None or not handler._rest:
                await trio.sleep(0.05)
                handler = next((h for h in broker.server.connections.values()
                                if h.session is not None and h.session.subscriptions), None)
        await trio.sleep(0.5)
        encoded = len(handler._unsent)
        assert encoded <= PIECE_DELIVERS * (512 * 1024 + 256 * 1024 + 4096), encoded
        # the rest of what it collected (at most an outbox's worth, MAX_DELIVERY_BYTES_WAITING): not encoded
        assert sum(1 for f in handler._rest if type(f).__name__ == "Deliver") > PIECE_DELIVERS
    finally:
        await reader.stream.aclose()
    queue = broker.core.queues["big"]
    with trio.fail_after(LIMIT):  # requeued with the connection: all there, none lost
        while len(queue.store) != 160:
            await trio.sleep(0.05)


async def test_a_connection_closed_for_a_large_bad_transfer_leaves_its_bytes_behind_in_no_buffer(
        start_flowbroker) -> None:
    """The decoder's buffer kept the last read, a whole large frame, for as long as the connection's
    objects lived, and they live in reference cycles until a full garbage collection, which the broker
    process runs seldom (cli.GC_GENERATION0_THRESHOLD): one client opening connections one after another,
    each closed CREDIT_VIOLATION for a 6 MB TRANSFER, took the broker from 46 MiB to 1.6 GiB (a tester).
    With the collector off, no decoder of a closed connection holds its frame."""
    import gc

    from flowbroker.protocol.codec import FrameDecoder

    broker = await start_flowbroker(udp={"enabled": False})
    body = b"x" * 3_000_000
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            raw = await RawClient.connect(broker.port)
            assert raw.welcome is not None and raw.welcome.buffer_size == 1  # one message, then a violation
            await raw.send_raw(raw.proto.send(Transfer(1, [TransferEntry("", "none", body)] * 2)))
            error, _ = closing_frames(await raw.frames_until_closed())
            assert error.code is ErrorCode.CREDIT_VIOLATION
            await raw.aclose()
        await wait_until(lambda: len(broker.core.sessions) == 0)

        def held() -> list[int]:
            return [len(o._buf) for o in gc.get_objects() if isinstance(o, FrameDecoder)]

        # (the last handler's cleanup runs a moment after its session closed: waited for, not raced)
        await wait_until(lambda: max(held(), default=0) < 1_000_000)
    finally:
        gc.enable()


async def test_a_consumer_that_never_read_leaves_no_encoded_deliveries_behind_when_it_closes(start_flowbroker) -> None:
    """What the writer had encoded and could not send (up to four DELIVER frames: 8 MB with 1 MiB
    messages) stayed with the connection's objects, in reference cycles, until a full garbage collection,
    which the broker runs seldom: 100 consumers that subscribed, never read and closed, one after
    another, held 900 MiB (a tester). With the collector off, no closed connection's writer holds any."""
    import gc

    from flowbroker.broker.server import ConnectionHandler

    broker = await start_flowbroker(udp={"enabled": False})
    async with await fc.connect(broker.url, client_name="setup", timeout=LIMIT) as conn:
        await conn.declare_queue("big")
        producer = conn.producer(routing_key="big")
        for _ in range(12):
            await producer.send(b"b" * (1 << 20))
        await producer.flush(timeout=LIMIT)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            raw = await RawClient.connect(broker.port, flow_control=False)
            await raw.send(Subscribe(1, 1, "big", 5, 0))
            await trio.sleep(0.3)  # the broker writes what the socket takes and keeps the rest encoded
            await raw.aclose()
            await wait_until(lambda: len(broker.core.sessions) == 0)
        # (each handler's cleanup runs a moment after its session closed: waited for, not raced)
        await wait_until(lambda: max((len(h._unsent) for h in gc.get_objects() if isinstance(h, ConnectionHandler)),
                                     default=0) == 0)
    finally:
        gc.enable()
