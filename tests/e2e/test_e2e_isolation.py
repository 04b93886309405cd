"""One connection must not stall, crash or overrun the broker (issue 8, the server's part), over real TCP.

Each attack runs beside a well-behaved SDK connection (the bystander of test_e2e_faults) that must lose
nothing and must never go STALL seconds without a delivery: a broker bug hit by one connection, a burst
of expensive frames, slowloris partial frames, a flood of silent sockets. Also: frames pipelined behind
HELLO are handled without more bytes, a connection closed with unread input still gets its ERROR and a
clean end of stream, and what peers name or say reaches the log escaped.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.server import RECEIVE_SIZE
from flowbroker.broker.session import Session
from flowbroker.protocol import (
    PROTOCOL_VERSION,
    BufferAck,
    Close,
    DeclareQueue,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    Hello,
    Noop,
    Ok,
    Welcome,
    encode_frame,
)

from tests.e2e.test_e2e_faults import LIMIT, Bystander, RawClient, bystander, closing_frames, raw_frame, wait_until

STALL = 0.5  # seconds the bystander may go without a delivery (it normally waits about a millisecond)
MiB = 1024 * 1024


class _TimedList(list[bytes]):
    """The bystander's `received`, noting the longest time between two messages since `start()`."""

    def start(self) -> None:
        self.last = trio.current_time()
        self.longest = 0.0

    def append(self, item: bytes) -> None:
        now = trio.current_time()
        self.longest = max(self.longest, now - self.last)
        self.last = now
        super().append(item)


@asynccontextmanager
async def never_stalls(b: Bystander) -> AsyncIterator[None]:
    """Fails if, while the block runs, the bystander goes STALL seconds without receiving a message
    (measured as each message arrives, so a blocked event loop shows as the gap it left)."""
    received = _TimedList(b.received)
    b.received = received
    received.start()
    yield
    longest = max(received.longest, trio.current_time() - received.last)
    assert longest < STALL, f"the bystander stalled for {longest:.3f} s"


async def read_until_eof(stream: trio.SocketStream) -> list[Frame]:
    """Every frame on a stream that never said HELLO (decoded bare), until the broker ends it."""
    decoder = FrameDecoder()
    frames: list[Frame] = []
    with trio.fail_after(LIMIT):
        while data := await stream.receive_some(65536):
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
    return frames


# -- 1. a broker bug hit by one connection ends that connection only ----------------------------------------


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RecursionError("maximum recursion depth exceeded (injected)")


@pytest.mark.parametrize("where", ["handle", "writer", "timer"])
async def test_an_exception_while_serving_one_connection_ends_that_connection_only(
    start_flowbroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    broker = await start_flowbroker(server={"idle_timeout": 0.9})  # the timer ticks every 0.3 s
    async with bystander(broker) as b, never_stalls(b):
        raw = await RawClient.connect(broker.port)
        assert raw.welcome is not None
        conn_id = raw.welcome.connection_id
        victim = broker.core.sessions[conn_id]
        if where == "handle":  # the core fails on one frame from this client (as the recursive matcher did)
            real_handle = BrokerCore.handle

            def handle(core: BrokerCore, session: Session, frame: Frame) -> None:
                if session is victim and isinstance(frame, DeclareQueue):
                    _boom()
                real_handle(core, session, frame)

            monkeypatch.setattr(BrokerCore, "handle", handle)
        elif where == "writer":  # collecting its outbox fails (in the direct write, then in the writer)
            monkeypatch.setattr(victim, "collect", _boom)
        else:
            monkeypatch.setattr(victim, "poll_credit", _boom)
        await raw.send(DeclareQueue(1, "boom"))
        frames = await raw.frames_until_closed()
        error, close = closing_frames(frames)
        assert error.code is ErrorCode.INTERNAL_ERROR and "RecursionError" in error.text
        if where == "handle":
            assert error.frame_seq == 2 and "handling frame 2" in error.text
        await wait_until(lambda: conn_id not in broker.core.sessions and conn_id not in broker.server.connections)
        await raw.aclose()
        await b.progress()
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and "internal error" in r.getMessage()]
    assert logged and logged[0].exc_info is not None and logged[0].exc_info[0] is RecursionError
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:  # and the broker still accepts
        await conn.declare_queue("after")
    await wait_until(lambda: broker.server.open_sockets == 0)


# -- 2. a reader yields between frames ----------------------------------------------------------------------


async def test_a_burst_of_expensive_frames_does_not_hold_the_event_loop(
    start_flowbroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3,000 frames in one write, each costing the broker 0.5 ms: 1.5 seconds of work in one read."""
    broker = await start_flowbroker()
    async with bystander(broker) as b:
        raw = await RawClient.connect(broker.port)
        assert raw.welcome is not None
        attacker = broker.core.sessions[raw.welcome.connection_id]
        real_handle = BrokerCore.handle

        def handle(core: BrokerCore, session: Session, frame: Frame) -> None:
            if session is attacker:
                time.sleep(0.0005)
            real_handle(core, session, frame)

        monkeypatch.setattr(BrokerCore, "handle", handle)
        count = 3000
        burst = b"".join(raw.proto.send(Noop(i, False)) for i in range(1, count + 1))
        assert len(burst) < RECEIVE_SIZE  # one read's worth
        async with never_stalls(b):
            await raw.send_raw(burst)
            replies: list[Any] = []
            while len(replies) < count:
                frame = await raw.next_frame()
                assert frame is not None, "closed"
                if isinstance(frame, Noop) and frame.reply:  # (credit frames and the broker's noops may come too)
                    replies.append(frame.nonce)
        assert replies == list(range(1, count + 1))  # and every one of them was answered, in order
        await raw.aclose()


# -- 3. slowloris: partial frames are bounded in bytes and in time ------------------------------------------


async def test_slowloris_partial_frames_stay_within_the_budget_and_are_cut_off(
        start_flowbroker, monkeypatch: pytest.MonkeyPatch) -> None:
    # Those waiting for the budget are served in turn (their frame_timeout paused meanwhile: the broker is
    # not reading them), and each is cut by its frame_timeout or as stalled once it holds the budget: two at
    # a time here, about a second each, so the last ones end some seconds after the first.
    from tests.e2e import test_e2e_faults

    monkeypatch.setattr(test_e2e_faults, "LIMIT", 30.0)
    frame_size, budget, frame_timeout, attackers = MiB, 2 * MiB, 1.0, 12
    broker = await start_flowbroker(server={
        "max_frame_size": frame_size, "max_message_size": frame_size // 2,
        "max_partial_frame_bytes": budget, "frame_timeout": frame_timeout,
    })
    held_peak = 0

    async def sample_held() -> None:
        nonlocal held_peak
        while True:
            held_peak = max(held_peak, sum(h.conn.buffered for h in broker.server.connections.values()))
            await trio.sleep(0.002)

    async def start_a_frame_and_stall(raw: RawClient) -> None:
        """All of one maximal frame but its last 1,000 bytes, then nothing."""
        try:
            # the start of a TRANSFER ([3 fields, type 10, first id 1, ...]): only data frames may be this large
            await raw.send_raw(struct.pack(">I", frame_size) + b"\x93\x0a\x01" + bytes(frame_size - 1003))
        except trio.BrokenResourceError:  # the broker closed us while we were still sending
            pass

    endings: list[list[Frame]] = []

    async def attack() -> None:
        raw = await RawClient.connect(broker.port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(start_a_frame_and_stall, raw)
            endings.append(await raw.frames_until_closed())
            nursery.cancel_scope.cancel()
        await raw.aclose()

    async with bystander(broker) as b, never_stalls(b):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_held)
            async with trio.open_nursery() as attacks:
                for _ in range(attackers):
                    attacks.start_soon(attack)
            nursery.cancel_scope.cancel()
        await b.progress()

    assert len(endings) == attackers
    for frames in endings:
        error, _ = closing_frames(frames)
        assert error.code is ErrorCode.IDLE_TIMEOUT and error.frame_seq == 2
        # its frame_timeout, or cut sooner for the attackers that waited for the budget behind it
        assert (f"frame 2 not complete within frame_timeout {frame_timeout:g}s" in error.text
                or "frame 2 stalled" in error.text), error.text
    # 12 MiB were on their way; the broker held at most the budget beyond one read per connection.
    frame_budget = broker.server.frame_budget
    assert budget // 2 < frame_budget.peak <= budget  # it was spent, and never overspent
    assert held_peak <= budget + (attackers + 1) * RECEIVE_SIZE
    await wait_until(lambda: frame_budget.charged == 0)


async def test_stalled_partial_frames_that_spent_the_budget_are_cut_for_a_producer_that_waits(
        start_flowbroker) -> None:
    """Ten connections each sent all but the last byte of a maximal frame (8 MiB) and stopped: the 64 MiB
    budget was spent, and a producer beside them whose TRANSFER frames are over one read waited for their
    frame_timeout (30 s: 25-27 s, a tester). A connection that must wait has the frame stalled longest cut
    (not grown by 256 KiB in a second): the producer goes on within seconds, long before frame_timeout."""
    frame_size = 8 * MiB
    broker = await start_flowbroker(server={"frame_timeout": 60.0})  # the defaults otherwise: 64 MiB budget
    attackers: list[RawClient] = []
    for _ in range(10):
        raw = await RawClient.connect(broker.port)
        await raw.send_raw(struct.pack(">I", frame_size) + b"\x93\x0a\x01" + bytes(frame_size - 4))
        attackers.append(raw)
    await wait_until(lambda: broker.server.frame_budget.charged >= 56 * MiB)  # the budget is spent
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("q")
        producer = conn.producer(routing_key="q")
        for i in range(2000):
            await producer.send(b"%04d" % i + b"x" * 4092)  # frames of 256 such: over one read each
        await producer.flush(timeout=20)  # (a third of frame_timeout: before, it waited for all of it)
    assert broker.server.frame_budget.cuts >= 1
    texts = []
    for raw in attackers:
        with trio.move_on_after(0.5):  # the ones cut have closed; the others still wait for their frame
            texts.append(closing_frames(await raw.frames_until_closed())[0].text)
        await raw.aclose()
    assert texts and all("frame 2 stalled" in text and "partial-frame budget" in text for text in texts), texts
    assert broker.core.queues["q"].count == 2000


async def test_complete_large_frames_from_many_connections_are_all_read(start_flowbroker) -> None:
    """Twelve connections each sent a whole 8 MiB frame into a 16 MiB partial-frame budget: read piecemeal,
    each got part of its frame, all waited for the rest, and none was read to its end until frame_timeout
    closed them (20 s here). A large frame is now charged whole before its bytes past the allowance are read,
    so those charged complete and the others follow."""
    frame_size = 8 * MiB
    broker = await start_flowbroker(server={"max_partial_frame_bytes": 2 * frame_size, "frame_timeout": 60.0})
    answers: list[Frame] = []

    async def send_a_whole_frame() -> None:
        raw = await RawClient.connect(broker.port)
        head, tail = b"\x93\x0a\x01\x91\x96\xa0\xa1q\xc6", b"\xc0\xc0\xc0"
        body = frame_size - len(head) - 4 - len(tail) - 100  # one message: over max_message_size
        payload = head + struct.pack(">I", body) + bytes(body) + tail
        await raw.send_raw(struct.pack(">I", len(payload)) + payload)
        while not isinstance(frame := await raw.next_frame(), Error):  # (credit frames first) within LIMIT
            assert frame is not None, "closed"
        answers.append(frame)
        await raw.aclose()

    with trio.fail_after(2 * LIMIT):
        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(send_a_whole_frame)
    assert len(answers) == 12
    assert all(isinstance(f, Error) and f.code is ErrorCode.MESSAGE_TOO_LARGE for f in answers), answers
    await wait_until(lambda: broker.server.frame_budget.charged == 0)


async def test_large_frames_before_the_handshake_are_refused_and_charge_no_budget(start_flowbroker) -> None:
    """A frame typed TRANSFER may be as large as max_frame_size, but not before WELCOME: nine sockets that
    never logged in each sent 8 MiB of one and held the 64 MiB budget, and a logged-in producer waited for
    their handshake_timeout, 10 s, again and again (a tester). Refused now from its length prefix."""
    broker = await start_flowbroker()
    frame_size = 8 * MiB
    endings: list[list[Frame]] = []

    async def attack() -> None:
        raw = await RawClient.connect(broker.port, hello=False)
        try:
            await raw.send_raw(struct.pack(">I", frame_size) + b"\x96\x0a" + bytes(frame_size - 2))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # closed while still sending
        endings.append(await raw.frames_until_closed())
        await raw.aclose()

    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("q")
        producer = conn.producer(routing_key="q")
        async with trio.open_nursery() as nursery:
            for _ in range(9):
                nursery.start_soon(attack)
            for i in range(500):
                await producer.send(b"%04d" % i + b"x" * 4092)
            await producer.flush(timeout=LIMIT)
    assert len(endings) == 9  # closed (their ERROR is usually lost to the reset: they were still sending)
    assert broker.core.errors_sent[ErrorCode.UNEXPECTED_FRAME] == 9
    assert broker.server.frame_budget.peak < frame_size  # none of theirs was ever charged
    # One that sends the prefix alone and reads is told why (the ERROR was refused by the state machine
    # and the socket just closed, a tester)
    raw = await RawClient.connect(broker.port, hello=False)
    await raw.send_raw(struct.pack(">I", frame_size) + b"\x96\x0a")
    error, _ = closing_frames(await raw.frames_until_closed())
    assert error.code is ErrorCode.UNEXPECTED_FRAME and "before the handshake is over" in error.text
    await raw.aclose()


# -- 4. every socket counts toward max_connections -------------------------------------------------------


async def test_silent_sockets_count_toward_max_connections_and_the_limit_holds(start_flowbroker) -> None:
    limit, handshake_timeout, silent_count = 5, 0.5, 30
    broker = await start_flowbroker(server={"max_connections": limit, "handshake_timeout": handshake_timeout})
    async with bystander(broker) as b, never_stalls(b):  # the bystander holds one of the five
        silent = [await trio.open_tcp_stream("127.0.0.1", broker.port) for _ in range(silent_count)]
        endings = []
        for stream in silent:  # the refused at once, the others when their handshake time is up
            endings.append(await read_until_eof(stream))
            await stream.aclose()
        refused = [frames for frames in endings if frames]
        for frames in refused:
            assert [type(f) for f in frames] == [Error, Close]
            assert isinstance(frames[0], Error) and frames[0].code is ErrorCode.RESOURCE_EXHAUSTED
            assert frames[0].text == f"too many connections (max_connections {limit})"
        assert len(refused) == broker.server.refused >= silent_count - (limit - 1) - 4
        assert broker.server.peak_sockets <= limit
        await wait_until(lambda: broker.server.open_sockets == 1)
        async with await fc.connect(broker.url, client_name="latecomer", timeout=LIMIT) as late:
            await late.declare_queue("late")
        await b.progress()
    assert broker.server.peak_sockets <= limit


# -- 5. frames pipelined behind HELLO ------------------------------------------------------------------------


async def test_a_frame_sent_with_hello_is_handled_without_more_bytes(start_flowbroker) -> None:
    broker = await start_flowbroker()
    raw = RawClient(await trio.open_tcp_stream("127.0.0.1", broker.port))
    hello = raw.proto.send(Hello(PROTOCOL_VERSION, "pipelining", True, []))
    await raw.send_raw(hello + encode_frame(DeclareQueue(1, "early")))  # one write, then we wait
    with trio.fail_after(LIMIT):
        welcome = await raw.next_frame()
        assert isinstance(welcome, Welcome)
        assert await raw.next_frame() == Ok(1, {"queue": "early", "count": 0, "size": 0, "durable": False})
    await raw.aclose()


# -- 6. closing with unread input ------------------------------------------------------------------------------


async def test_a_connection_closed_with_unread_input_still_reads_its_error_and_a_clean_end(start_flowbroker) -> None:
    """A bad frame followed by 256 KiB the broker will never process: the broker stops reading there.
    Closing with those bytes unread would reset the connection; it shuts down its side and drains first."""
    broker = await start_flowbroker()
    raw = await RawClient.connect(broker.port)
    await raw.send_raw(raw_frame(b"\xc1") + bytes(256 * 1024))
    frames = await raw.frames_until_closed()  # a reset here would raise BrokenResourceError
    error, _ = closing_frames(frames)
    assert error.code is ErrorCode.MALFORMED_FRAME and error.frame_seq == 2
    await raw.aclose()


# -- 7. what peers name or say is escaped in the log ---------------------------------------------------------


async def test_names_and_error_texts_from_peers_are_escaped_and_capped_in_the_log(
    start_flowbroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="flowbroker")  # a connection's client name is logged at DEBUG
    broker = await start_flowbroker()
    forged = "evil\n2026-01-01 00:00:00 INFO flowbroker: forged line\x1b[2J"
    async with await fc.connect(broker.url, client_name=forged, timeout=LIMIT) as conn:
        await conn.declare_queue("q")
    raw = await RawClient.connect(broker.port)
    await raw.send(Error(ErrorCode.INTERNAL_ERROR, "bad\r\nthing" + "x" * 10_000))
    await raw.send(Noop(1, False))
    assert await raw.next_frame() == Noop(1, True)  # the ERROR was handled (and logged) before it
    await raw.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert not any("\n" in m or "\r" in m or "\x1b" in m for m in messages)
    assert any("evil\\n2026-01-01 00:00:00 INFO flowbroker: forged line\\x1b[2J" in m for m in messages)
    reported = [m for m in messages if "reported error" in m]
    assert len(reported) == 1 and "bad\\r\\nthing" in reported[0] and len(reported[0]) < 400


async def test_errors_a_client_sends_are_a_warning_at_most_once_per_10_s(
    start_flowbroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Each ERROR a client sent was a WARNING, and an ERROR does not end its connection: one client wrote
    160,100 lines (50 MB of log) in 10 s (a tester). One WARNING per 10 s broker-wide, the rest at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="flowbroker")
    broker = await start_flowbroker()
    raw = await RawClient.connect(broker.port)
    for _ in range(200):
        await raw.send(Error(ErrorCode.INTERNAL_ERROR, "noise"))
    await raw.send(Noop(1, False))
    try:
        frame = await raw.next_frame()
        while isinstance(frame, BufferAck):  # (the flow timer's once-a-second re-advertisement may come first)
            frame = await raw.next_frame()
        assert frame == Noop(1, True)  # every ERROR handled before it
    finally:
        await raw.aclose()
    reported = [r for r in caplog.records if "reported error" in r.getMessage()]
    assert len(reported) == 200
    assert [r.levelno for r in reported].count(logging.WARNING) == 1
