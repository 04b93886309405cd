"""Containment in the SDK (issue 9.4): a bug in one of a connection's background tasks (reader, writer,
timer) closes that connection with a typed error, `ConnectionClosed(INTERNAL_ERROR)` naming the task and
the error, which the calls waiting at that moment and every later call raise: never a hang, never a bare
exception out of the application's `async with` block, never silence (a traceback is logged at ERROR).
The broker is told with ERROR + CLOSE INTERNAL_ERROR while the writer can still write. The blocking API
raises the same, and a failure of its thread itself surfaces at `close()`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.client import blocking
from flowbroker.client.connection import Connection
from flowbroker.protocol import Close, Error, ErrorCode, Frame, Ok

StartBroker = Callable[..., Awaitable[Any]]
"""The `start_broker` fixture."""

LIMIT = 5.0


class InjectedFault(RuntimeError):
    """The bug a test plants."""


def boom(*args: Any, **kwargs: Any) -> Any:
    raise InjectedFault("injected by the test")


def fault_logged(caplog: pytest.LogCaptureFixture, task: str) -> None:
    found = [
        r for r in caplog.records
        if r.levelno == logging.ERROR and f"internal error in the SDK's {task}" in r.getMessage()
        and r.exc_info and r.exc_info[0] is InjectedFault
    ]
    assert found, [r.getMessage() for r in caplog.records]


def assert_internal_error(error: BaseException, task: str) -> None:
    assert isinstance(error, fc.ConnectionClosed), repr(error)
    assert error.code is ErrorCode.INTERNAL_ERROR
    assert error.reason == f"internal error in the client's {task} (InjectedFault): injected by the test"


async def test_a_fault_in_the_reader_fails_the_waiting_call_and_every_later_one(
    start_broker: StartBroker, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        real_dispatch = conn._dispatch

        def dispatch(frame: Frame) -> None:
            if isinstance(frame, Ok):
                boom()
            real_dispatch(frame)

        conn._dispatch = dispatch  # type: ignore[method-assign]
        with pytest.raises(fc.ConnectionClosed) as waiting, trio.fail_after(LIMIT):
            await conn.declare_queue("q")
        assert_internal_error(waiting.value, "reader")
        assert conn.is_closed and conn.close_error is waiting.value
        with pytest.raises(fc.ConnectionClosed) as later:
            await conn.producer(routing_key="q").send(b"after")
        assert_internal_error(later.value, "reader")
    fake = await broker.connection()
    await fake.wait_for(lambda: fake.closed)
    error, close = fake.received[-2:]
    assert isinstance(error, Error) and error.code is ErrorCode.INTERNAL_ERROR
    assert isinstance(close, Close) and close.code is ErrorCode.INTERNAL_ERROR
    fault_logged(caplog, "reader")


async def test_a_fault_in_the_writer_fails_the_waiting_call_and_still_tells_the_broker(
    start_broker: StartBroker, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        conn._encode_control = boom  # type: ignore[method-assign]
        with pytest.raises(fc.ConnectionClosed) as waiting, trio.fail_after(LIMIT):
            await conn.declare_queue("q")
        assert_internal_error(waiting.value, "writer")
        with pytest.raises(fc.ConnectionClosed) as later:
            await conn.declare_queue("r")
        assert_internal_error(later.value, "writer")
    fake = await broker.connection()
    await fake.wait_for(lambda: fake.closed)
    errors = fake.frames(Error)
    assert [e.code for e in errors] == [ErrorCode.INTERNAL_ERROR]
    assert errors[0].text == "internal error in the client's writer (InjectedFault)"
    assert fake.frames(Close)[-1].code is ErrorCode.INTERNAL_ERROR
    fault_logged(caplog, "writer")


async def test_a_fault_in_the_timer_wakes_a_waiting_consumer_with_the_error(
    start_broker: StartBroker, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_broker(idle_timeout_ms=600)  # the timer ticks every 0.1 s
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        async with conn.consumer("q") as consumer:
            conn._write_stalled = boom  # type: ignore[method-assign]
            with pytest.raises(fc.ConnectionClosed) as waiting, trio.fail_after(LIMIT):
                await consumer.receive()
        assert_internal_error(waiting.value, "timer")
        with pytest.raises(fc.ConnectionClosed) as later:
            await conn.set_buffer_size(1024)
        assert_internal_error(later.value, "timer")
    fake = await broker.connection()
    await fake.wait_for(lambda: fake.closed)
    assert [e.code for e in fake.frames(Error)] == [ErrorCode.INTERNAL_ERROR]
    fault_logged(caplog, "timer")


async def test_the_blocking_api_raises_a_background_fault_on_the_next_call(
    start_broker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_broker()
    monkeypatch.setattr(Connection, "_encode_control", boom)

    def use() -> tuple[BaseException, BaseException]:
        with blocking.connect(broker.url, timeout=LIMIT) as conn:
            with pytest.raises(fc.ConnectionClosed) as waiting:
                conn.declare_queue("q", timeout=LIMIT)
            with pytest.raises(fc.ConnectionClosed) as later:
                conn.producer(routing_key="q").send(b"after", timeout=LIMIT)
            assert conn.is_closed
            return waiting.value, later.value

    waiting, later = await trio.to_thread.run_sync(use)
    assert_internal_error(waiting, "writer")
    assert_internal_error(later, "writer")
    fault_logged(caplog, "writer")


async def test_the_blocking_api_reports_a_failure_of_its_thread_at_close(
    start_broker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug that ends the connection's trio thread (here in leaving the trio block) is not lost: close()
    raises ConnectionClosed(INTERNAL_ERROR) naming it, once, and the traceback is logged."""
    broker = await start_broker()
    monkeypatch.setattr(Connection, "_take_failures", boom)

    def use() -> tuple[BaseException, BaseException]:
        conn = blocking.connect(broker.url, timeout=LIMIT)
        conn.declare_queue("q", timeout=LIMIT)
        with pytest.raises(fc.ConnectionClosed) as closing:
            conn.close()
        conn.close()  # said once
        with pytest.raises(fc.ConnectionClosed) as later:
            conn.declare_queue("r", timeout=LIMIT)
        return closing.value, later.value

    closing, later = await trio.to_thread.run_sync(use)
    assert isinstance(closing, fc.ConnectionClosed) and closing.code is ErrorCode.INTERNAL_ERROR
    assert "the connection thread failed: InjectedFault('injected by the test')" in closing.reason
    assert isinstance(later, fc.ConnectionClosed)
    assert any(r.levelno == logging.ERROR and "its thread failed" in r.getMessage() for r in caplog.records)
