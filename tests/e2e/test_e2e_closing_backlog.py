"""A connection that closes with answers its client has not read, over real sockets on 127.0.0.1.

Closing, the broker encoded everything still due at once (`b"".join(conn.send(f) ...)`), even for a
peer that had reset: 3,541 pending ERRORs took 42-84 ms, and 100 such connections reset together
stalled every other client 8.9-10.2 s (a tester), each holding an encoded copy of its backlog. Now
what is due is encoded CLOSE_PIECE_BYTES at a time, each piece sent before the next is encoded, and a
client cut off for not reading is sent only why. Counted in frames encoded (`Connection.frames_sent`),
never in time.
"""

from __future__ import annotations

import socket
import struct

import trio

from flowbroker.broker.outbox import MAX_CONTROL_BYTES, control_cost
from flowbroker.broker.server import CLOSE_PIECE_BYTES, ConnectionHandler
from flowbroker.broker.streamio import SocketIO
from flowbroker.protocol import PROTOCOL_VERSION, Close, Error, ErrorCode, Hello, Subscribe, Welcome
from tests.conftest import RunningBroker
from tests.e2e.test_e2e_faults import RawClient, wait_until

NAME = "x" * 255
"""A missing queue: each SUBSCRIBE to it is refused by an ERROR quoting it twice, 500-600 bytes encoded."""
PIECE_FRAMES = CLOSE_PIECE_BYTES // 500 + 1  # such ERRORs encoded in one piece at most
REQUESTS = 2_000  # their answers stay under the outbox's bounds (10,000 frames, MAX_CONTROL_BYTES)


async def _unread(broker: RunningBroker) -> tuple[RawClient, ConnectionHandler]:
    """A client with a small receive window and the broker's end of it, with a small send buffer: what
    the client does not read soon waits in the broker (the writer's unsent bytes, then the outbox)."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (set once connected, reading it later stalled)
    await sock.connect(("127.0.0.1", broker.port))
    raw = RawClient(trio.SocketStream(sock))
    await raw.send(Hello(PROTOCOL_VERSION, "unread", True, []))
    assert isinstance(await raw.next_frame(), Welcome)
    [handler] = broker.server.connections.values()
    assert isinstance(handler.io, SocketIO)
    handler.io.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    return raw, handler


def _requests(raw: RawClient, count: int) -> bytes:
    """`count` SUBSCRIBEs to NAME, each refused."""
    return b"".join(raw.proto.send(Subscribe(i, i, NAME, 10, 0)) for i in range(1, count + 1))


async def test_a_peer_that_reset_has_none_of_its_backlog_encoded(start_flowbroker) -> None:
    broker = await start_flowbroker()
    raw, handler = await _unread(broker)
    await raw.send_raw(_requests(raw, REQUESTS))  # none of their answers read
    session = handler.session
    assert session is not None
    await wait_until(lambda: handler.conn.frames_received == 1 + REQUESTS)  # (HELLO and the requests)
    assert len(session.outbox.control) > REQUESTS // 2  # waiting, unencoded
    encoded = handler.conn.frames_sent
    raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await raw.aclose()  # a reset
    await wait_until(lambda: broker.server.closed == 1)
    assert handler.conn.frames_sent - encoded <= PIECE_FRAMES, handler.conn.frames_sent - encoded


async def test_a_closing_connection_sends_its_backlog_a_piece_at_a_time(start_flowbroker) -> None:
    """A client that closes normally still gets everything due (its answers here; a producer's
    completions), encoded as it reads them: the broker runs other tasks between pieces."""
    broker = await start_flowbroker()
    raw, handler = await _unread(broker)
    await raw.send_raw(_requests(raw, REQUESTS))  # none of their answers read
    await wait_until(lambda: handler.conn.frames_received == 1 + REQUESTS)
    encoded_per_turn: list[int] = []  # frames the broker encoded between two turns of this task

    async def watch() -> None:
        last = handler.conn.frames_sent
        while True:
            await trio.lowlevel.checkpoint()
            encoded_per_turn.append(handler.conn.frames_sent - last)
            last = handler.conn.frames_sent

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await raw.send(Close(ErrorCode.NORMAL, "done"))
        await wait_until(lambda: not broker.server.connections)  # closing, its backlog unsent
        frames = await raw.frames_until_closed()
        nursery.cancel_scope.cancel()
    await raw.aclose()
    answers = [f.ref_id for f in frames if isinstance(f, Error)]
    assert answers == list(range(1, REQUESTS + 1)) and isinstance(frames[-1], Close)
    assert sum(encoded_per_turn) >= REQUESTS // 2  # most of them encoded at close, while watched
    # a task's turn and the next: the closing one's two turns at most, one piece each
    assert max(encoded_per_turn) <= 2 * PIECE_FRAMES, max(encoded_per_turn)


async def test_a_client_cut_off_for_not_reading_is_sent_only_why(start_flowbroker) -> None:
    """It did not read up to MAX_CONTROL_BYTES of answers: at close they are dropped, not encoded."""
    broker = await start_flowbroker()
    cost = control_cost(Error(ErrorCode.NOT_FOUND, f"no queue named {NAME!r}", None, 1, NAME))
    raw, handler = await _unread(broker)
    session = handler.session
    assert session is not None
    async with trio.open_nursery() as nursery:  # (the socket takes a few hundred answers: a thousand more)
        nursery.start_soon(raw.send_raw, _requests(raw, MAX_CONTROL_BYTES // cost + 1_000))
        await wait_until(lambda: session.outbox.overflowed)
        frames = await raw.frames_until_closed()  # (read while the rest is sent: the broker waits for neither)
    await raw.aclose()
    answers = [f for f in frames if isinstance(f, Error) and f.code is ErrorCode.NOT_FOUND]
    # what the broker had encoded before the cut-off (the socket's worth), not the outbox's thousands
    assert len(answers) < MAX_CONTROL_BYTES // cost // 2, len(answers)
    error, close = frames[-2:]
    assert isinstance(error, Error) and "client is not reading" in error.text and isinstance(close, Close)
