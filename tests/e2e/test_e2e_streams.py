"""The broker's connection handler and the SDK over streams that are not a plain TCP socket (issue 9.3).

TLS: a `trio.SSLStream` on each side, with a certificate from a CA made in the test (trustme), over real
TCP on 127.0.0.1 and over trio's in-memory stream pair. Plain streams that are not sockets: trio's
memory stream pair and its lockstep pair (every send waits for the other side's receive). Each carries
a whole conversation: declare, publish past the broker's socket-sized writes, consume and settle,
then a clean close on both sides. A TLS connection the broker ends at fault still reads why.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
import trustme

import flowbroker.client as fc
from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.server import BrokerServer
from flowbroker.broker.session import Session
from flowbroker.broker.streamio import SocketIO, StreamIO
from flowbroker.client.handshake import connect_stream
from flowbroker.protocol import DeclareQueue, ErrorCode, Frame

from tests.e2e.test_e2e_faults import LIMIT, wait_until

StartBroker = Callable[..., Awaitable[Any]]
"""The `start_flowbroker` fixture."""

COUNT = 300
BODY = 8 * 1024  # 2.4 MiB in all: many TLS records, and more than a socket buffer holds at once

StreamPair = tuple[trio.abc.Stream, trio.abc.Stream]  # (the client's end, the broker's end)


@pytest.fixture(scope="module")
def tls() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context, client context): a test CA, and a certificate it issued for "localhost"."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


def make_broker() -> BrokerServer:
    """A broker that serves only the streams the test hands it (`serve_connection`), no listener."""
    return BrokerServer(load_config(None, {"server": {"memory_quota": 1 << 30}, "admin": {"enabled": False}, "udp": {"enabled": False}}))


@asynccontextmanager
async def tcp_pair() -> AsyncIterator[StreamPair]:
    """Two ends of a real TCP connection on 127.0.0.1."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    try:
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
    finally:
        for listener in listeners:
            await listener.aclose()
    yield client, server


@asynccontextmanager
async def memory_pair() -> AsyncIterator[StreamPair]:
    yield trio.testing.memory_stream_pair()


@asynccontextmanager
async def lockstep_pair() -> AsyncIterator[StreamPair]:
    yield trio.testing.lockstep_stream_pair()


def over_tls(pair: StreamPair, contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> StreamPair:
    client, server = pair
    server_ctx, client_ctx = contexts
    return (
        trio.SSLStream(client, client_ctx, server_hostname="localhost"),
        trio.SSLStream(server, server_ctx, server_side=True),
    )


async def conversation(server: BrokerServer, conn: fc.Connection) -> None:
    """Declare, publish COUNT messages of BODY bytes, consume and ack them all in order."""
    await conn.declare_queue("q")
    producer = conn.producer(routing_key="q", window=COUNT)
    for i in range(COUNT):
        await producer.send(i.to_bytes(4, "big") + bytes(BODY - 4))
    await producer.flush(timeout=LIMIT)
    assert server.core.queues["q"].count == COUNT
    got = []
    async with conn.consumer("q", prefetch=100) as consumer:
        with trio.fail_after(LIMIT * 4):
            async for msg in consumer:
                got.append(int.from_bytes(msg.body[:4], "big"))
                await msg.ack()
                if len(got) == COUNT:
                    break
    assert got == list(range(COUNT))
    await wait_until(lambda: server.core.queues["q"].count == 0)


PAIRS: dict[str, Callable[[], Any]] = {"tcp": tcp_pair, "memory": memory_pair}


@pytest.mark.parametrize("transport", ["tcp", "memory"])
async def test_a_whole_conversation_over_tls(
    tls: tuple[ssl.SSLContext, ssl.SSLContext], transport: str
) -> None:
    server = make_broker()
    async with PAIRS[transport]() as pair, trio.open_nursery() as nursery:
        client_end, broker_end = over_tls(pair, tls)
        nursery.start_soon(server.serve_connection, broker_end)
        async with await connect_stream(client_end, client_name="tls-client", timeout=LIMIT) as conn:
            handler = server.connections[conn.connection_id]
            assert type(handler.io) is StreamIO  # no descriptor is touched under TLS
            await conversation(server, conn)
        await wait_until(lambda: not server.connections and not server.core.sessions)
    assert server.frame_budget.charged == 0


@pytest.mark.parametrize("make_pair", [memory_pair, lockstep_pair], ids=["memory", "lockstep"])
async def test_a_whole_conversation_over_a_stream_that_is_not_a_socket(
    make_pair: Callable[[], Any]
) -> None:
    server = make_broker()
    async with make_pair() as (client_end, broker_end), trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_connection, broker_end)
        async with await connect_stream(client_end, timeout=LIMIT) as conn:
            assert type(server.connections[conn.connection_id].io) is StreamIO
            await conversation(server, conn)
        await wait_until(lambda: not server.connections and not server.core.sessions)


async def test_the_broker_port_still_uses_the_direct_write(start_flowbroker: StartBroker) -> None:
    """The fast path stays where it was measured: a plain TCP socket from the accept loop."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        handler = broker.server.connections[conn.connection_id]
        assert type(handler.io) is SocketIO and handler.io.direct
        await conversation(broker.server, conn)


async def test_a_tls_connection_the_broker_ends_at_fault_reads_why(
    tls: tuple[ssl.SSLContext, ssl.SSLContext], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ERROR + CLOSE over TLS, where the broker cannot half-close: the SDK's call gets the broker's reason."""
    server = make_broker()
    real_handle = BrokerCore.handle

    def handle(core: BrokerCore, session: Session, frame: Frame) -> None:
        if isinstance(frame, DeclareQueue) and frame.queue == "boom":
            raise RuntimeError("injected by the test")
        real_handle(core, session, frame)

    monkeypatch.setattr(BrokerCore, "handle", handle)
    async with tcp_pair() as pair, trio.open_nursery() as nursery:
        client_end, broker_end = over_tls(pair, tls)
        nursery.start_soon(server.serve_connection, broker_end)
        async with await connect_stream(client_end, timeout=LIMIT) as conn:
            await conn.declare_queue("fine")
            with pytest.raises(fc.ConnectionClosed) as info, trio.fail_after(LIMIT):
                await conn.declare_queue("boom")
            assert info.value.code is ErrorCode.INTERNAL_ERROR
            assert "internal error in handling frame" in info.value.reason
        await wait_until(lambda: not server.connections)
