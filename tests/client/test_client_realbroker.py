"""A few SDK checks against the real broker (the lead's `start_flowbroker` fixture)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.client import blocking


async def test_saturated_queue_times_out_send_naming_it_then_drain_resumes(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("sat", flow_stop_count=5, flow_resume_count=2)
        producer = conn.producer(routing_key="sat", window=8)
        async with producer.flow_events() as events:
            with pytest.raises(fc.FlowControlTimeout) as info:
                for i in range(100):
                    await producer.send(b"m%d" % i, timeout=0.5)
            assert info.value.destinations == ("sat",)
            assert producer.flow_state.stopped["sat"].threshold == "flow_stop_count"
            event = await events.get()
            assert event is not None and (event.kind, event.destination) == ("stopped", "sat")
            sent = producer.stats.sent
            async with conn.consumer("sat", prefetch=4) as consumer:
                got = 0
                async for msg in consumer:
                    await msg.ack()
                    got += 1
                    if got == sent:
                        break
            await producer.flush(timeout=5)
            with trio.fail_after(5):
                while producer.flow_state.is_stopped:
                    event = await events.get()
            assert producer.flow_state.resume_count >= 1


async def test_overflow_reject_is_queue_full_naming_the_queue(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=5, flow_control=False) as conn:
        await conn.declare_queue("small", max_count=3, overflow="reject", flow_stop_count=3, flow_resume_count=1)
        producer = conn.producer(routing_key="small")
        for i in range(5):
            await producer.send(b"%d" % i)
        async with conn.consumer("small") as consumer:  # drain, so that held transfers complete
            for _ in range(3):
                await (await consumer.receive(timeout=5)).ack()
        with pytest.raises(fc.QueueFull) as info:
            await producer.flush(timeout=5)
        assert info.value.destination == "small"
        assert producer.stats.failed == 2


async def test_blocking_api_round_trip_with_real_broker(start_flowbroker) -> None:
    broker = await start_flowbroker()

    def work() -> list[bytes]:
        with blocking.connect(broker.url, timeout=5) as conn:
            conn.declare_queue("bq")
            producer = conn.producer(routing_key="bq")
            producer.send_many([b"b%d" % i for i in range(50)], timeout=5)
            producer.flush(timeout=5)
            with conn.consumer("bq", prefetch=10, buffer_size=4096) as consumer:
                bodies = []
                for msg in consumer:
                    bodies.append(msg.body)
                    msg.ack()
                    if len(bodies) == 50:
                        break
            return bodies

    assert await trio.to_thread.run_sync(work) == [b"b%d" % i for i in range(50)]


async def test_a_udp_send_that_must_wait_names_its_wait_for_a_nan_timeout(start_flowbroker) -> None:
    broker = await start_flowbroker(credit={"policy": "static", "static_size": 64 * 1024})
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("full", flow_stop_count=50, flow_resume_count=10)
        producer = conn.producer("", "full", transport="udp")
        with trio.fail_after(10):
            while True:  # until the broker's window closes
                try:
                    await producer.send(b"x" * 100, block=False)
                except fc.FlowControlled:
                    break
                await trio.sleep(0)
        # A tester's said only trio's "deadline must not be NaN".
        with pytest.raises(ValueError, match="send timeout must be a number of seconds"):
            await producer.send(b"x", timeout=math.nan)
        async with conn.consumer("full", prefetch=1000) as consumer:  # drained, so that the close waits for nothing

            async def drain() -> None:
                async for msg in consumer:
                    await msg.ack()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                await producer.flush(timeout=10)
                nursery.cancel_scope.cancel()


async def test_a_send_with_credit_free_refuses_a_nan_timeout_as_one_that_waits(start_flowbroker) -> None:
    """NaN was a ValueError only when the send had to wait, so it went unnoticed until the first wait
    (session 33's note); TCP and UDP producers refuse it before anything is sent."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("q")
        for producer in (conn.producer(routing_key="q"), conn.producer("", "q", transport="udp")):
            with pytest.raises(ValueError, match="send timeout must be a number of seconds"):
                await producer.send(b"x", timeout=math.nan)
            assert producer.statistics().sent == 0
            await producer.send(b"y", timeout=5)
            await producer.flush(timeout=5)
        async with conn.consumer("q") as consumer:
            assert [(await consumer.receive(timeout=5)).body for _ in range(2)] == [b"y", b"y"]


async def test_the_connections_own_timeouts_refuse_nan_when_given_and_take_a_negative_one_as_0(start_flowbroker) -> None:
    """close_timeout=-1 failed the close with trio's "seconds must be non-negative" (the blocking close with
    ConnectionClosed INTERNAL_ERROR and a traceback); close_timeout, request_timeout, reconnect_timeout and
    a producer's send_timeout of NaN were taken, and failed later in trio's words if at all (a tester)."""
    from flowbroker.client import blocking

    broker = await start_flowbroker()
    for option in ("request_timeout", "close_timeout", "reconnect_timeout"):
        with pytest.raises(ValueError, match=f"{option} must be a number of seconds, got nan"):
            options: dict[str, Any] = {option: math.nan}
            await fc.connect(broker.url, timeout=5, **options)
    async with await fc.connect(broker.url, timeout=5, close_timeout=-1) as conn:
        await conn.declare_queue("q")
        with pytest.raises(ValueError, match="send_timeout must be a number of seconds, got nan"):
            conn.producer(routing_key="q", send_timeout=math.nan)
        with pytest.raises(ValueError, match="send_timeout must be a number of seconds, got nan"):
            conn.producer("", "q", transport="udp", send_timeout=math.nan)
        # negative: a deadline already passed, as 0 (it alone was a ValueError, a tester): credit there
        producer = conn.producer(routing_key="q", send_timeout=-1)
        await producer.send(b"at once")
        await producer.flush(timeout=5)
    assert conn.is_closed and "closed by the application" in str(conn.close_error)  # as any other close

    def work() -> None:
        with blocking.connect(broker.url, timeout=5, close_timeout=-1) as bconn:
            bconn.declare_queue("q")
        assert bconn.is_closed
        with pytest.raises(ValueError, match="close_timeout must be a number of seconds, got nan"):
            blocking.connect(broker.url, timeout=5, close_timeout=math.nan)

    await trio.to_thread.run_sync(work)


async def test_connecting_to_another_protocols_server_says_it_is_not_a_flowbroker_broker() -> None:
    """An SSH server's banner read as a frame: "frame of 1397966893 bytes exceeds max_frame_size" (a tester)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def ssh_like(stream: trio.SocketStream) -> None:
        await stream.send_all(b"SSH-2.0-OpenSSH_9.2p1\r\n")
        await trio.sleep(5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, ssh_like, listeners)
        with pytest.raises(fc.HandshakeError) as info:
            await fc.connect(f"flowbroker://127.0.0.1:{port}", timeout=5)
        assert "does not speak the flowbroker protocol" in str(info.value) and "b'SSH-'" in str(info.value)
        nursery.cancel_scope.cancel()


async def test_aclose_of_a_connection_never_entered_closes_it(start_flowbroker) -> None:
    """client.md: `await conn.aclose()` closes at once. On a connection from `await fc.connect()` never
    entered with `async with`, it marked the connection closed and sent nothing: the socket stayed open (a
    tester). It sends CLOSE and closes the socket now."""
    broker = await start_flowbroker()
    conn = await fc.connect(broker.url)
    with trio.fail_after(5):
        while not broker.core.sessions:
            await trio.sleep(0.01)
    await conn.aclose()
    await conn.aclose()  # (again: nothing more)
    with trio.fail_after(5):
        while broker.core.sessions:  # the broker saw it close
            await trio.sleep(0.01)
    with pytest.raises(fc.ConnectionClosed):
        await conn.declare_queue("after")
