"""Containment (issue 9.4): an exception raised anywhere in one connection's work ends that connection
alone, with ERROR INTERNAL_ERROR where it can still be said and a logged traceback; the broker carries
on, and nothing reaches the accept loop or the serve nursery (which would end the test's nursery here).

An `InjectedFault` is raised at each place a connection's work runs that test_e2e_isolation does not
already cover (the core's handle(), collecting the outbox, the timer): the direct write made by the
connection's own reader and by another connection's, encoding, the writer task's send, the reader's
receive, the handshake, closing the session, building the handler and admitting the socket. The
bystander of test_e2e_faults publishes and consumes throughout and must lose nothing; afterwards the
broker still accepts connections and every socket it counted is closed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.server import ConnectionHandler
from flowbroker.broker.session import Session
from flowbroker.protocol import (
    PROTOCOL_VERSION,
    Close,
    DeclareQueue,
    ErrorCode,
    Frame,
    Hello,
    Ok,
    Subscribe,
)

from tests.e2e.test_e2e_faults import LIMIT, RawClient, bystander, closing_frames, wait_until


StartBroker = Callable[..., Awaitable[Any]]
"""The `start_flowbroker` fixture."""

class InjectedFault(RuntimeError):
    """The bug a test plants."""


def boom(*args: Any, **kwargs: Any) -> Any:
    raise InjectedFault("injected by the test")


def fault_logged(caplog: pytest.LogCaptureFixture, words: str) -> None:
    """An ERROR line containing `words`, with the injected fault's traceback."""
    found = [
        r for r in caplog.records
        if r.levelno == logging.ERROR and words in r.getMessage() and r.exc_info and r.exc_info[0] is InjectedFault
    ]
    assert found, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def still_serving(broker: Any) -> None:
    """The broker accepts and serves a new connection, and every socket it counted gets closed."""
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("after")
    await wait_until(lambda: broker.server.open_sockets == 0)


async def victim(broker: Any) -> tuple[RawClient, ConnectionHandler]:
    raw = await RawClient.connect(broker.port)
    assert raw.welcome is not None
    return raw, broker.server.connections[raw.welcome.connection_id]


@pytest.mark.parametrize("where", ["direct write", "encoding", "writer", "reader"])
async def test_a_fault_in_a_connections_own_io_ends_that_connection_only(
    start_flowbroker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    broker = await start_flowbroker()
    async with bystander(broker) as b:
        raw, handler = await victim(broker)
        conn_id = handler.session.conn_id if handler.session is not None else -1
        if where == "direct write":  # the write without waiting its own reader makes after a chunk
            monkeypatch.setattr(handler.io, "try_send", boom)
            what = "writing"
        elif where == "encoding":  # the state machine or msgpack fails on an answer
            real_send = handler.conn.send

            def send(frame: Frame, *, fields_checked: bool = False) -> bytes:
                if isinstance(frame, Ok):
                    boom()
                return real_send(frame, fields_checked=fields_checked)

            monkeypatch.setattr(handler.conn, "send", send)
            what = "encoding"
        elif where == "writer":  # the kernel takes nothing at once, and the writer task's send fails
            monkeypatch.setattr(handler.io, "try_send", lambda data: 0)
            monkeypatch.setattr(handler.io, "send_some", boom)
            what = "the writer"
        else:  # the reader's next receive fails
            monkeypatch.setattr(handler.io, "receive", boom)
            what = "the reader"
        await raw.send(DeclareQueue(1, "boom"))
        error, close = closing_frames(await raw.frames_until_closed())
        assert error.code is ErrorCode.INTERNAL_ERROR
        assert f"internal error in {what} (InjectedFault)" in error.text
        await wait_until(lambda: conn_id not in broker.core.sessions and conn_id not in broker.server.connections)
        await raw.aclose()
        await b.progress()
    fault_logged(caplog, f"internal error in {what}")
    await still_serving(broker)


async def test_a_fault_in_a_direct_write_made_by_another_connections_reader_ends_only_the_receiver(
    start_flowbroker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A publisher's reader writes the deliveries its messages made due to the consumer at once; that
    write failing ends the consumer's connection, not the publisher's reader or connection."""
    broker = await start_flowbroker()
    async with bystander(broker) as b, await fc.connect(broker.url, timeout=LIMIT) as publisher:
        await publisher.declare_queue("v")
        raw, handler = await victim(broker)
        await raw.send(Subscribe(1, 1, "v", 10, 0))
        assert isinstance(await raw.next_frame(), Ok)
        monkeypatch.setattr(handler.io, "try_send", boom)
        producer = publisher.producer(routing_key="v")
        for i in range(5):
            await producer.send(b"m%d" % i)
        await producer.flush(timeout=LIMIT)
        error, _ = closing_frames(await raw.frames_until_closed())
        assert error.code is ErrorCode.INTERNAL_ERROR and "internal error in writing" in error.text
        await raw.aclose()
        await wait_until(lambda: broker.core.queues["v"].count == 5)  # requeued, none lost
        await publisher.declare_queue("v")  # the publisher's connection carries on
        assert not publisher.is_closed
        await b.progress()
    fault_logged(caplog, "internal error in writing")
    await still_serving(broker)


async def test_a_fault_while_opening_the_session_ends_that_handshake_only(
    start_flowbroker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_flowbroker()
    real_open = BrokerCore.open_session

    def open_session(core: BrokerCore, client_name: str, *args: Any) -> Session:
        if client_name == "victim":
            boom()
        return real_open(core, client_name, *args)

    async with bystander(broker) as b:
        monkeypatch.setattr(BrokerCore, "open_session", open_session)
        raw = RawClient(await trio.open_tcp_stream("127.0.0.1", broker.port))
        await raw.send(Hello(PROTOCOL_VERSION, "victim", True, []))
        error, _ = closing_frames(await raw.frames_until_closed())
        assert error.code is ErrorCode.INTERNAL_ERROR and "internal error in the handshake" in error.text
        await raw.aclose()
        await b.progress()
    fault_logged(caplog, "internal error in the handshake")
    await still_serving(broker)


async def test_a_fault_while_closing_the_session_still_closes_and_forgets_the_connection(
    start_flowbroker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_flowbroker()
    real_close = BrokerCore.close_session
    async with bystander(broker) as b:
        raw, handler = await victim(broker)
        doomed = handler.session

        def close_session(core: BrokerCore, session: Session, unsent: dict[int, bool] | None = None) -> None:
            if session is doomed:
                boom()
            real_close(core, session, unsent)

        monkeypatch.setattr(BrokerCore, "close_session", close_session)
        await raw.send(Close(ErrorCode.NORMAL, "bye"))
        frames = await raw.frames_until_closed()
        assert isinstance(frames[-1], Close), frames
        assert doomed is not None
        await wait_until(lambda: doomed.conn_id not in broker.server.connections)
        await raw.aclose()
        await b.progress()
    fault_logged(caplog, "closing its session failed")
    await still_serving(broker)


async def test_a_handler_that_cannot_be_built_closes_that_socket_only(
    start_flowbroker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_flowbroker()
    real_init = ConnectionHandler.__init__
    planted = [True]

    def init(handler: ConnectionHandler, *args: Any) -> None:
        if planted and planted.pop():
            boom()
        real_init(handler, *args)

    async with bystander(broker) as b:
        monkeypatch.setattr(ConnectionHandler, "__init__", init)
        stream = await trio.open_tcp_stream("127.0.0.1", broker.port)
        with trio.fail_after(LIMIT):
            assert await stream.receive_some(100) == b""  # closed at once, nothing said
        await stream.aclose()
        await b.progress()
    fault_logged(caplog, "unhandled error; closed")
    await still_serving(broker)


class _StartFailsOnce:
    """Stands for the serve nursery: starting the first connection's task fails."""

    def __init__(self, nursery: trio.Nursery):
        self.nursery = nursery
        self.failed = False

    def start_soon(self, *args: Any) -> None:
        if not self.failed:
            self.failed = True
            boom()
        self.nursery.start_soon(*args)


async def test_a_fault_while_admitting_a_socket_closes_it_uncounted_and_the_accept_loop_goes_on(
    start_flowbroker: StartBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_flowbroker()
    async with bystander(broker) as b:
        handlers = broker.server._handlers
        assert handlers is not None
        monkeypatch.setattr(broker.server, "_handlers", _StartFailsOnce(handlers))
        stream = await trio.open_tcp_stream("127.0.0.1", broker.port)
        with trio.fail_after(LIMIT):
            assert await stream.receive_some(100) == b""
        await stream.aclose()
        await b.progress()
    fault_logged(caplog, "admitting a connection failed")
    await still_serving(broker)  # and open_sockets did not keep the socket that was never served
