"""Handshake, requests, liveness and closing of the trio client connection, against the fake broker."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import flowbroker.client as fc
from flowbroker.protocol import Bind, Close, DeclareQueue, Error, ErrorCode, FlowStopped, Hello, Noop, Ok, Unbind


async def test_connect_handshake_and_declare(start_broker) -> None:
    broker = await start_broker(buffer_size=4096)
    async with await fc.connect(broker.url, client_name="t1", timeout=5) as conn:
        assert conn.sender_window.window == 4096
        assert conn.server_name == "fake"
        result = await conn.declare_queue("q1", flow_stop_count=10, flow_resume_count=5, overflow="drop-head")
        assert result == {"name": "q1", "type": "DeclareQueue"}
        fake = await broker.connection()
        hello = fake.frames(Hello)[0]
        assert hello.client_name == "t1" and hello.flow_control is True and hello.version == 1
        declare = fake.frames(DeclareQueue)[0]
        assert declare.queue == "q1"
        assert declare.arguments == {"flow_stop_count": 10, "flow_resume_count": 5, "overflow": "drop-head"}
        assert declare.request_id >= 2**62
        for call in (
            conn.declare_exchange("x", "topic"),
            conn.bind("q1", "x", "a.*"),
            conn.unbind("q1", "x", "a.*"),
            conn.purge_queue("q1"),
            conn.delete_queue("q1"),
        ):
            assert (await call)["name"] in ("x", "q1")
    await fake.wait_for(lambda: fake.frames(Close) != [])
    assert fake.frames(Close)[0].code == ErrorCode.NORMAL


async def test_request_error_is_typed(start_broker) -> None:
    broker = await start_broker()
    broker.missing.add("nope")
    async with await fc.connect(broker.url, timeout=5) as conn:
        with pytest.raises(fc.RequestError) as info:
            await conn.purge_queue("nope")
        assert info.value.code == ErrorCode.NOT_FOUND and info.value.destination == "nope"


async def test_a_binding_key_over_max_key_bytes_is_refused_before_sending(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        for call in (conn.bind, conn.unbind):
            with pytest.raises(fc.RequestError, match="257 bytes.*MAX_KEY_BYTES") as info:
                await call("q", "ex", "é" * 128 + "k")
            assert info.value.code == ErrorCode.KEY_TOO_LONG
        assert (await conn.bind("q", "ex", "k" * 255))["type"] == "Bind"
        assert len(fake.frames(Bind)) == 1 and fake.frames(Unbind) == []


async def test_request_timeout(start_broker, io_clock) -> None:
    broker = await start_broker(answer_requests=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        start = trio.current_time()
        with pytest.raises(fc.RequestTimeout):
            await conn.declare_queue("q", timeout=3)
        assert trio.current_time() - start == pytest.approx(3, abs=0.1)


async def test_requests_past_the_slots_wait_within_their_timeout_and_name_it(start_broker, io_clock) -> None:
    """At most REQUESTS_IN_FLIGHT unanswered; the rest wait for a slot within their own timeout. One that
    gets its slot only as its deadline passes is not sent, and the errors name the timeout the caller gave,
    not what was left of it ("within 0 s", a tester)."""
    from flowbroker.client.connection import REQUESTS_IN_FLIGHT

    broker = await start_broker(answer_requests=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        errors: list[str] = []

        async def declare(name: str, timeout: float) -> None:
            try:
                await conn.declare_queue(name, timeout=timeout)
            except fc.RequestTimeout as exc:
                errors.append(str(exc))

        async with trio.open_nursery() as nursery:
            for i in range(REQUESTS_IN_FLIGHT):
                nursery.start_soon(declare, f"q{i}", 3)
            await trio.sleep(0.1)
            nursery.start_soon(declare, "late", 3)  # a slot at 3.0, 0.1 s before its deadline: sent
            nursery.start_soon(declare, "never", 1)  # none within its second: not sent
        assert len(errors) == REQUESTS_IN_FLIGHT + 2
        assert sum("within 3 s" in e for e in errors) == REQUESTS_IN_FLIGHT + 1  # ("within 0.1 s", before)
        assert sum("this one was not sent" in e for e in errors) == 1
        assert len(fake.frames(DeclareQueue)) == REQUESTS_IN_FLIGHT + 1


async def test_connect_refused_port_raises_handshake_error() -> None:
    # Bind a port and close it again: nothing listens there.
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(fc.HandshakeError):
        await fc.connect(f"flowbroker://127.0.0.1:{port}", timeout=2)


async def test_connect_times_out_without_welcome(start_broker, io_clock) -> None:
    broker = await start_broker(welcome=False)
    start = trio.current_time()
    with pytest.raises(fc.HandshakeError, match="no WELCOME"):
        await fc.connect(broker.url, timeout=2)
    assert trio.current_time() - start == pytest.approx(2, abs=0.1)


async def test_noop_is_answered(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5):
        fake = await broker.connection()
        await fake.send(Noop(77, False))
        await fake.wait_for(lambda: any(f.nonce == 77 and f.reply for f in fake.frames(Noop)))


async def test_idle_client_sends_noops_and_declares_silent_broker_dead(start_broker, io_clock) -> None:
    broker = await start_broker(idle_timeout_ms=3000, answer_noops=False, answer_requests=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        start = trio.current_time()
        # Quiet client: a noop after a third of the idle timeout.
        await fake.wait_for(lambda: len(fake.frames(Noop)) >= 1, timeout=10)
        assert 1.0 <= trio.current_time() - start <= 1.6
        with pytest.raises(fc.ConnectionClosed) as info:
            await conn.declare_queue("q", timeout=10)
        assert info.value.code == ErrorCode.IDLE_TIMEOUT
        assert 3.0 <= trio.current_time() - start <= 3.6
        await fake.wait_for(lambda: fake.frames(Close) != [])
        assert fake.frames(Close)[0].code == ErrorCode.IDLE_TIMEOUT


async def test_answered_noops_keep_the_connection_alive(start_broker, io_clock) -> None:
    broker = await start_broker(idle_timeout_ms=3000)
    async with await fc.connect(broker.url, timeout=5) as conn:
        await trio.sleep(20)
        assert not conn.is_closed
        assert (await conn.declare_queue("q"))["name"] == "q"


async def test_a_broker_that_reads_nothing_is_declared_dead_after_the_idle_timeout(start_broker, io_clock) -> None:
    """The writer's wait for the broker to take its bytes is bounded: a broker that still sends (so the
    reader hears it) but reads nothing ends the connection after one idle timeout of a stalled write."""
    broker = await start_broker(idle_timeout_ms=3000, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            fake = await broker.connection()
            fake.pause_reading()
            async with trio.open_nursery() as nursery:

                async def keep_talking() -> None:
                    for nonce in range(1, 100):
                        await fake.send(Noop(nonce, False))
                        await trio.sleep(0.5)

                nursery.start_soon(keep_talking)
                producer = conn.producer(routing_key="q", window=10_000)
                body = b"x" * 65536
                for _ in range(400):  # 26 MB: more than the kernel buffers of a loopback connection hold
                    await producer.send(body)
                start = trio.current_time()
                with pytest.raises(fc.ConnectionClosed) as info:
                    await producer.flush(timeout=60)
                nursery.cancel_scope.cancel()
            assert info.value.code == ErrorCode.IDLE_TIMEOUT
            assert "took none of our bytes for 3 s" in info.value.reason
            assert 3.0 <= trio.current_time() - start <= 4.6  # one idle timeout after the write stalled, plus ticks
            assert not conn._writing and conn._writer_done.is_set()
    assert closing.value.unconfirmed == 400 and closing.value.failed == 0


async def test_a_silent_broker_that_reads_nothing_ends_the_block_without_waiting_close_timeout(
        start_broker, io_clock) -> None:
    """A broker frozen (SIGSTOP) with a producer's megabytes queued: the idle timeout closed the connection
    at 3 s, but the writer stayed in the middle of a frame nobody read, and the block's end waited the
    whole close_timeout (5 s) for it to send CLOSE (a tester: 8.0 s instead of 3.0). The writer is cut off
    with the connection."""
    broker = await start_broker(idle_timeout_ms=3000, auto_complete=False, answer_noops=False)
    start = trio.current_time()
    with pytest.raises(fc.PublishFailures) as closing:
        async with await fc.connect(broker.url, timeout=5, close_timeout=5) as conn:
            fake = await broker.connection()
            fake.pause_reading()
            producer = conn.producer(routing_key="q", window=10_000)
            body = b"x" * 65536
            for _ in range(400):  # 26 MB: more than the kernel buffers of a loopback connection hold
                await producer.send(body)
            with pytest.raises(fc.ConnectionClosed) as info:
                await producer.flush(timeout=60)
            assert info.value.code == ErrorCode.IDLE_TIMEOUT and "no frame from the broker" in info.value.reason
    assert trio.current_time() - start < 3 + 1  # the idle timeout and ticks, not close_timeout besides
    assert closing.value.unconfirmed == 400


async def test_broker_close_wakes_waiters_with_code(start_broker) -> None:
    broker = await start_broker(answer_requests=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with trio.open_nursery() as nursery:

            async def closer() -> None:
                await fake.wait_for(lambda: fake.frames(DeclareQueue) != [])
                await fake.send(Close(ErrorCode.SHUTDOWN, "broker stopping"))

            nursery.start_soon(closer)
            with pytest.raises(fc.ConnectionClosed) as info:
                await conn.declare_queue("q", timeout=5)
        assert info.value.code == ErrorCode.SHUTDOWN and info.value.reason == "broker stopping"
        assert conn.is_closed


async def test_connection_level_error_is_recorded_not_fatal(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        await fake.send(Error(ErrorCode.UNKNOWN_DELIVERY, "tag 5 is not outstanding", 3))
        assert (await conn.declare_queue("q"))["name"] == "q"
        assert [e.code for e in conn.connection_errors] == [ErrorCode.UNKNOWN_DELIVERY]


async def test_malformed_frame_from_broker_is_a_protocol_violation(start_broker) -> None:
    broker = await start_broker(answer_requests=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        await fake.stream.send_all(b"\x00\x00\x00\x02\xc1\xc1")  # 0xc1 is never valid msgpack
        with pytest.raises(fc.ProtocolViolation):
            await conn.declare_queue("q", timeout=5)
        await fake.wait_for(lambda: fake.frames(Error) != [] or fake.closed)
        assert [e.code for e in fake.frames(Error)] == [ErrorCode.MALFORMED_FRAME]


async def test_body_exception_passes_through_and_tasks_end(start_broker) -> None:
    broker = await start_broker()
    with pytest.raises(KeyError):
        async with await fc.connect(broker.url, timeout=5):
            raise KeyError("mine")
    fake = await broker.connection()
    await fake.wait_for(lambda: fake.closed)


def test_parse_url() -> None:
    assert fc.parse_url("flowbroker://example.org:1234") == fc.BrokerAddress("example.org", 1234)
    assert fc.parse_url("flowbroker://") == fc.BrokerAddress("127.0.0.1", 5680)
    assert str(fc.parse_url()) == "flowbroker://127.0.0.1:5680"
    for bad in ("amqp://h:1", "flowbroker://h:99999", "flowbroker://u:p@h:1", "flowbroker://h:1/vhost",
                "flowbroker://h:1?vhost=x", "flowbroker://h:1?udp=h", "flowbroker://h:1?udp=h:0",
                "flowbroker://h:1?udp=h:1&udp=h:2", "flowbroker://h:1#x"):
        with pytest.raises(ValueError):
            fc.parse_url(bad)
    with_udp = fc.parse_url("flowbroker://example.org:1234?udp=10.0.0.7:5682")
    assert with_udp == fc.BrokerAddress("example.org", 1234, "10.0.0.7:5682")
    assert str(with_udp) == "flowbroker://example.org:1234?udp=10.0.0.7:5682"
    assert Ok(1, {}).request_id == 1


async def test_frames_in_the_same_read_as_welcome_are_handled_at_once(start_broker) -> None:
    """The broker sends a new connection FLOW_STOPPED('*') right after WELCOME during a stop-all; when both
    arrived in one read, the reader used to wait for the broker's next bytes before decoding what the
    handshake had left buffered, so `flow_state` missed the stop (up to the next noop: 20 s)."""
    stopped = FlowStopped("*", "admin", 0, 0, "an operator's stop-all")
    broker = await start_broker(after_welcome=(stopped,))
    async with await fc.connect(broker.url, timeout=5) as conn:
        with trio.fail_after(2):
            while conn.flow_state.destinations != ("*",):
                await trio.sleep(0.01)
        assert conn.statistics().frames_received == 2


async def test_aclose_and_then_the_blocks_end_wait_one_close_timeout_in_all(start_broker) -> None:
    """With the writer stalled (a broker that reads nothing), aclose() waited close_timeout, and leaving the
    block waited it again (a tester: 2 x 2 s)."""
    broker = await start_broker(auto_complete=False)
    began = 0.0
    with pytest.raises(fc.PublishFailures):
        async with await fc.connect(broker.url, timeout=5, close_timeout=1) as conn:
            fake = await broker.connection()
            fake.pause_reading()
            producer = conn.producer(routing_key="q", window=10_000)
            for _ in range(400):  # 26 MB: more than the kernel buffers of a loopback connection hold
                await producer.send(b"x" * 65536)
            began = trio.current_time()
            await conn.aclose()
            assert 0.9 <= trio.current_time() - began <= 1.5
    assert trio.current_time() - began <= 1.6  # not a second close_timeout


async def test_a_connection_reset_by_the_broker_says_it_ended_without_a_close(start_broker) -> None:
    """A broker killed with bytes unread resets the connection: the reason was a bare "read failed: ...
    Connection reset by peer", which did not say the broker went away (a tester, 2 of 4 kill -9s)."""
    import socket
    import struct

    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        sock = fake.stream.socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        sock.close()
        with trio.fail_after(5):
            while conn.close_error is None:
                await trio.sleep(0.05)
        assert isinstance(conn.close_error, fc.ConnectionClosed)
        assert "without a CLOSE from the broker" in conn.close_error.reason
        assert "reset" in conn.close_error.reason.lower()
