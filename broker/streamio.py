"""One connection's bytes: any `trio.abc.Stream`, with the direct-write fast path for a plain TCP socket.

The broker reads and writes each connection through a `StreamIO` made by `stream_io(stream)`, so a
`trio.SSLStream` (TLS), or an in-memory stream in a test, drops in where the accepted socket was.
What a generic stream cannot do, the broker does not ask of it:

- **Writing without waiting.** When a reader has handed a chunk of frames to the core, the broker
  writes what they made due on every woken connection at once (broker/server.py, "Writing first,
  then queueing"). trio streams have no synchronous send, so `SocketIO.try_send` calls `os.write` on
  the socket's descriptor (measured: it saves a scheduler round, p50 0.13 ms of a message's way
  through the broker at 5,000 msgs/s). Any other stream takes nothing here (`direct` is False), and
  the connection's writer task sends with `send_all`.
- **Knowing how far a cancelled write got.** A closing connection ends its stream on a frame boundary
  when it can: trio's socket `send` raises Cancelled only when it sent nothing, so `SocketIO` knows
  exactly what is left. A generic `send_all` that is cancelled or fails leaves the stream in an unknown
  state (an `SSLStream` is broken by it): `torn` is then True, and nothing more is written on it.
- **Holding no read grant while idle.** The partial-frame budget (broker/framebudget.py) is charged
  before a read; `SocketIO.receive` gives the charge back before it waits for the socket to become
  readable. A generic stream waits inside `receive_some` with the charge held, which the caller's
  frame deadline bounds (a charge exists only in the middle of a frame).
- **Half-closing.** A connection is closed with a FIN after its last frame where the stream can
  half-close; a TLS stream cannot, and the broker goes straight to reading what the peer still sends.

Only `SocketIO` touches descriptors (`os.read`, `os.write`: POSIX only), and only for an exact
`trio.SocketStream`; `refuse_now` is the same write-without-waiting for a socket refused at accept.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import trio

__all__ = ["StreamIO", "SocketIO", "stream_io", "peer_name", "refuse_now"]


def peer_name(stream: trio.abc.Stream) -> str:
    """host:port of the peer for a TCP stream (under TLS, of the TCP stream it runs on); else the stream's kind."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if isinstance(stream, trio.SocketStream):
        try:
            return "%s:%s" % stream.socket.getpeername()[:2]
        except OSError:
            return "?"
    return type(stream).__name__


def peer_host(stream: trio.abc.Stream) -> str | None:
    """The peer's IP address for a TCP stream (under TLS, of the TCP stream it runs on), else None."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if isinstance(stream, trio.SocketStream):
        try:
            return str(stream.socket.getpeername()[0])
        except OSError:
            return None
    return None


class StreamIO:
    """Reads and writes one connection through any trio stream (TLS, in-memory); no fast path."""

    direct = False
    """Whether `try_send` can take bytes: only a plain TCP socket's can."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self.torn = False
        """A write was cut off at an unknown point: the stream may end inside a frame, write nothing more."""

    def try_send(self, data: bytes) -> int:
        """How many bytes of `data` were sent without waiting: none, on a generic stream."""
        return 0

    async def send_some(self, data: memoryview) -> int:
        """Send some of `data` (all of it, here) and return how many bytes; raises BrokenResourceError
        or ClosedResourceError when the stream is gone. If this raises or is cancelled, `torn` is set."""
        self.torn = True
        await self.stream.send_all(data)
        self.torn = False
        return len(data)

    async def receive(self, max_bytes: int, before_waiting: Callable[[], None]) -> bytes | None:
        """The next bytes from the peer, at most `max_bytes` (b"" once it ended its stream), or None when
        it had to wait for the peer first, after calling `before_waiting` (then the caller asks again:
        what it may read can have changed meanwhile). A generic stream waits inside `receive_some`, so it
        never returns None nor calls `before_waiting`."""
        return bytes(await self.stream.receive_some(max_bytes))

    async def send_eof(self) -> None:
        """End our sending side (a FIN) if the stream can half-close; a TLS stream cannot."""
        if isinstance(self.stream, trio.abc.HalfCloseableStream):
            await self.stream.send_eof()

    async def close(self) -> None:
        """Close the stream at once, without a graceful shutdown (`trio.aclose_forcefully`)."""
        await trio.aclose_forcefully(self.stream)


class SocketIO(StreamIO):
    """A plain TCP socket: the same, plus writes without waiting (`os.write` on its descriptor), writes
    that say how far they got when cancelled, and reads that hold no grant while they wait."""

    direct = True

    def __init__(self, stream: trio.SocketStream):
        super().__init__(stream)
        self.socket = stream.socket
        self._waited = False  # the last receive waited for readiness: the next one does not yield again

    def try_send(self, data: bytes) -> int:
        # os.write: trio sockets have no synchronous send. The descriptor is asked for each time (-1 once
        # closed: EBADF), never kept, since a closed one may be reused by another connection's socket.
        try:
            return os.write(self.socket.fileno(), data)
        except OSError:  # would block, or the socket failed: the writer task retries, or reports it
            return 0

    async def close(self) -> None:
        """`socket.close()`, which is what `SocketStream.aclose` does before its checkpoint: closing with
        `aclose_forcefully` cancels that checkpoint, and the Cancelled raised and caught was a seventh of
        what a connection's whole life cost the broker (docs/performance.md)."""
        self.socket.close()

    async def send_some(self, data: memoryview) -> int:
        try:  # trio's socket send raises Cancelled only when it sent nothing in that call
            return await self.socket.send(data)
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    async def receive(self, max_bytes: int, before_waiting: Callable[[], None]) -> bytes | None:
        """Yields once per read, as trio's own receive does (once while waiting, or once after reading)."""
        fd = self.socket.fileno()
        try:  # os.read: trio sockets have no synchronous receive
            data = os.read(fd, max_bytes)
        except BlockingIOError:
            before_waiting()
            await trio.lowlevel.wait_readable(fd)
            self._waited = True
            return None
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        if self._waited:
            self._waited = False
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return data


def stream_io(stream: trio.abc.Stream) -> StreamIO:
    """The I/O for `stream`: the fast path for exactly a `trio.SocketStream` (a subclass may send
    differently), the generic one for anything else."""
    if type(stream) is trio.SocketStream:
        return SocketIO(stream)
    return StreamIO(stream)


def refuse_now(stream: trio.SocketStream, farewell: bytes) -> None:
    """Read what already arrived, send `farewell`, shut down our side and close, without waiting: a new
    socket's send buffer is empty, so the kernel takes a few frames at once; reading first makes the
    close a FIN, not a reset that could lose them."""
    sock = stream.socket
    fd = sock.fileno()
    try:
        os.read(fd, 64 * 1024)
    except OSError:  # nothing arrived yet (would block), or the peer is gone
        pass
    try:
        os.write(fd, farewell)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()
