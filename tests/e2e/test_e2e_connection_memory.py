"""What a connection costs the broker, and for how long. A closed connection is freed when it closes, not at the collector's next full pass: its handler held
the session, whose outbox held the handler's wake-up method, a cycle of about 5 KB with its buffers per
connection. The broker's tuned collector (broker/cli.py) runs a full pass rarely, so a storm of 3,000
dropped connections grew the broker ~15 MiB each time, 45 -> 229 MiB over eight storms (a tester)."""

from __future__ import annotations

import gc
import socket
import struct

import trio

from flowbroker.broker.server import ConnectionHandler
from flowbroker.broker.session import Session
from flowbroker.protocol import PROTOCOL_VERSION
from flowbroker.protocol.connection import Connection, Role
from flowbroker.protocol.frames import Hello
import flowbroker.client as fb
from tests.e2e.test_e2e_faults import wait_until

CONNECTIONS = 20


def _tracked(kind: type) -> int:
    """Objects of `kind` alive or waiting for the collector (no collection here)."""
    return sum(1 for o in gc.get_objects() if type(o) is kind)


def _reset_after_hello(port: int) -> None:
    hello = Connection(Role.CLIENT).send(Hello(PROTOCOL_VERSION, "dropper", True, []))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(hello)
        s.recv(4096)  # WELCOME
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_closed_connections_leave_no_cycle_for_the_collector(start_flowbroker) -> None:
    broker = await start_flowbroker()
    gc.collect()
    gc.disable()
    try:
        sessions, handlers = _tracked(Session), _tracked(ConnectionHandler)
        for i in range(CONNECTIONS):
            async with await fb.connect(broker.url) as conn:  # closed by the client
                await conn.declare_queue("gq")
                if i % 2:
                    async with conn.consumer("gq"):
                        pass
            await trio.to_thread.run_sync(_reset_after_hello, broker.port)  # dropped without CLOSE
        await wait_until(lambda: not broker.core.sessions and not broker.server.connections)
        await trio.sleep(0.2)  # the handlers' last steps
        assert _tracked(Session) == sessions
        assert _tracked(ConnectionHandler) == handlers
    finally:
        gc.enable()


async def test_udp_producers_and_consumers_leave_no_cycle_with_their_terms(start_flowbroker) -> None:
    """The broker's UDP publication, its session and their callbacks referred to each other, and so did the
    SDK's UDP consumer, its channel and its image with 3 x term_length of terms: each waited for a full
    collection after its close."""
    from flowbroker.broker.udp.ingress import UdpPublication
    from flowbroker.transport.image import Image

    broker = await start_flowbroker()
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("uq")
    await wait_until(lambda: not broker.core.sessions and not broker.server.connections)
    await trio.sleep(0.2)
    gc.collect()
    gc.disable()
    try:
        counts = [_tracked(kind) for kind in (Session, UdpPublication, Image)]
        for _ in range(3):
            async with await fb.connect(broker.url) as conn:
                async with conn.producer("", "uq", transport="udp") as producer:
                    for n in range(20):
                        await producer.send(b"%d" % n)
                    await producer.flush(timeout=10)
                async with conn.consumer("uq", transport="udp") as consumer:
                    for _ in range(20):
                        msg = await consumer.receive(timeout=10)
                        await msg.ack()
        await wait_until(lambda: not broker.core.sessions and not broker.server.connections)
        await trio.sleep(0.5)  # the handlers' and the UDP tasks' last steps
        assert [_tracked(kind) for kind in (Session, UdpPublication, Image)] == counts
    finally:
        gc.enable()


async def test_a_client_name_is_kept_to_255_characters(start_flowbroker) -> None:
    """A HELLO's client_name was kept whole (free text, up to a frame): 3,000 connections named with 64,000
    characters made one GET /api/policy 192 MB of JSON (a tester, memory bound round 6)."""
    broker = await start_flowbroker()
    async with await fb.connect(broker.url, client_name="n" * 64_000) as conn:
        await conn.declare_queue("named")
        [session] = broker.core.sessions.values()
        assert session.client_name == "n" * 255


async def test_a_client_whose_unread_answers_pass_their_byte_bound_is_cut_off(start_flowbroker) -> None:
    """Each refused request's ERROR carries up to 1 KiB of text, and only their count was bounded (10,000,
    then the client is cut off): clients sending 9,500 refused DECLARE_QUEUEs and never reading held ~12 MiB
    each (a tester: 40 of them, 485 MiB against a 382 MiB bound). Past MAX_CONTROL_BYTES of control frames
    waiting, the connection is cut off as past the count; a bystander is served meanwhile."""
    from flowbroker.broker.outbox import MAX_CONTROL_BYTES
    from flowbroker.protocol.frames import DeclareQueue
    from tests.e2e.test_e2e_faults import RawClient

    broker = await start_flowbroker()
    raw = await RawClient.connect(broker.port)
    raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    [handler] = broker.server.connections.values()
    handler.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # (the kernel's buffers aside)
    session = handler.session
    bad = {"x" * 1000: 1}  # an unknown argument: refused, the key in the ERROR's text
    most = 0

    async def flood() -> None:
        nonlocal most
        for i in range(9_000):
            await raw.send(DeclareQueue(i + 1, f"q{i}", False, bad))
            most = max(most, session.outbox.control_bytes)

    with trio.move_on_after(10):
        try:
            await flood()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # cut off
    await wait_until(lambda: not broker.server.connections)
    assert most <= MAX_CONTROL_BYTES + 2048, most
    assert session.fault is not None and "client is not reading" in str(session.fault)
    assert handler.conn.frames_received < 9_000  # cut off before all of them were taken
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("bystander")
    await raw.stream.aclose()
