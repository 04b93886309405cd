"""Serving an HTTP app (the admin API, /metrics on a port of its own) on a listening socket: our accept
loop, hypercorn's per-connection HTTP/1.1 and HTTP/2 handling, at most `max_connections` at a time.

Why not hypercorn's own `serve`: it accepts without limit, and a connection whose request it refuses
(431 for a head over 16 KiB, 400 for one it cannot parse) is closed but stays in memory for hypercorn's
keep-alive timeout (5 s) after, its idle timer the last task of its group, with what it had received (up
to 64 KiB read at once, plus h11's buffer): an unauthenticated client sending 1 MB heads as fast as it
could grew the broker by some 60 KB a request for as long as it kept on (a tester, session 36). And
every connection it accepted took a descriptor from the few the broker keeps beside max_connections.

Here a connection's task ends when its reading does (`_Connection`), and a socket accepted while
`max_connections` are open is answered `503` at once, without a task, and closed (`refuse_now`), so
the port costs at most max_connections times one connection's buffers, whatever a client sends. The
accept loop backs off and logs as the broker port's does (broker/accept.py).

hypercorn's connection class (`hypercorn.trio.tcp_server.TCPServer`) is not its documented API:
pyproject.toml pins hypercorn's minor version, and tests/e2e/test_e2e_admin_limits.py drives real
sockets through it.
"""

from __future__ import annotations

import importlib
import logging
import math
import socket
from typing import Any

import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app
from starlette.types import ASGIApp

from flowbroker.broker.accept import RateLimitedLog, accept_forever
from flowbroker.broker.streamio import peer_name, refuse_now

# anyio's trio backend is imported here, at start, not by the first streamed answer (starlette's
# StreamingResponse loads it lazily): a first /metrics while the process had no descriptor left failed that
# import (EMFILE) with a bare 500 and a 40-line traceback in the log (a tester). A private module: if a
# later anyio moves it, it is loaded lazily as before.
try:
    importlib.import_module("anyio._backends._trio")
except ImportError:
    pass

__all__ = ["HttpServer"]

LOGGER = logging.getLogger("flowbroker.broker.httpserve")


class _HeadLimit(h11.Connection):
    """h11 with its bound on an incomplete request head (`max_incomplete_event_size`) kept for a whole
    one too. h11 checks only a head whose end it has not yet seen, and hypercorn reads up to 64 KiB at
    once: a 17-65 KB head sent in one write was answered 200, though 431 is documented for headers over
    16 KiB (a tester). A whole head over the bound is refused as h11 refuses an incomplete one: hypercorn
    answers 431 and ends the connection."""

    def __init__(self, max_head: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head = max_head

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        event = super().next_event()
        if isinstance(event, h11.Request) and _head_size(event) > self.max_head:
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


def _head_size(request: h11.Request) -> int:
    """The bytes of a request's line and headers as sent (less any spaces h11 dropped around a value)."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/\r\n") + len(request.http_version)
    return line + sum(len(name) + len(value) + len(b": \r\n") for name, value in request.headers.raw_items()) + 2


class _Connection(TCPServer):
    """hypercorn's connection, whose task ends when its reading does, and whose reading ends when it is
    closed. hypercorn stops a connection's idle timer only once a request's head has arrived, so one it
    closed for a bad head (or that closed before sending one) waited out keep_alive_timeout with its
    buffers. And its reader waits, with no deadline, for an answer to go out before it parses a pipelined
    request (h11's PAUSED): when that answer could not be written (the client gone, or cut off for not
    reading by TCP_USER_TIMEOUT), the connection was closed and its reader waited for ever, holding a
    max_connections slot and a descriptor: 64 pipelined GET /metrics left unread kept the admin port at
    503 until a restart (a tester). A failed write or a close now ends the reading.

    Once the reading has ended, the keep-alive timer is not started again: an answer finished after it
    (one whose write found the client gone) made hypercorn ready the connection for its next request and
    start the timer, and the task waited out keep_alive_timeout (5 s) for a client that had gone. One
    process sending two pipelined requests on each connection and closing it at once held every
    max_connections slot with no connection open, and the admin port refused all others 503 (a tester).

    The close that ends an answer (HTTP/1.0, `Connection: close`) is shielded: hypercorn makes it in the
    answer's task, and Starlette cancels a streamed answer's task (GET /metrics) once hypercorn, its end
    sent, tells the app the request is over (`http.disconnect`). That cancel cut hypercorn's close short
    before the socket was closed: a client waited out the read timeout (41 s) after the whole body for the
    close that ends it (HTTP/1.0: nothing else does), holding a place all that while (a tester)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._reading = trio.CancelScope()
        self._read_over = False

    async def _read_data(self) -> None:
        protocol = self.protocol.protocol
        if isinstance(protocol, H11Protocol):  # (nothing read yet: it has not been upgraded to HTTP/2)
            protocol.connection = _HeadLimit(self.config.h11_max_incomplete_size)
        with self._reading:
            await super()._read_data()
        self._read_over = True
        await self.idle_task.stop()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            async with self.send_lock:
                try:
                    with trio.CancelScope(shield=True):
                        await self.stream.send_all(event.data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    try:  # (the protocol tells its request streams first, then the reading ends)
                        await self.protocol.handle(Closed())
                    finally:
                        self._reading.cancel()
            return
        if isinstance(event, Updated) and event.idle and self._read_over:
            return  # no next request can come: the connection ends with its answer's task
        if isinstance(event, Closed):
            # (the request is told of the close before the reading is cut: this runs in the reading task
            # when the client's end came mid-body, and cut first, the request waited for the rest of its
            # body until the API's 10 s deadline, holding its place: 64 of them, 503 for 10 s, a tester)
            with trio.CancelScope(shield=True):
                await self._close()
                await self.protocol.handle(Closed())
            self._reading.cancel()
            return
        await super().protocol_send(event)


class HttpServer:
    """Serves `app` on the listening socket `fd` until `shutdown` is set; then answers the requests in
    flight for at most `drain_seconds` and returns.

    `read_timeout` (whole seconds, as hypercorn takes it) bounds every read of a connection; `errorlog` is
    where hypercorn's own error lines go; `what` names the port in the refusal's log line and answer."""

    def __init__(self, app: ASGIApp, fd: int, *, max_connections: int, read_timeout: float,
                 drain_seconds: float, errorlog: logging.Logger, what: str):
        self.max_connections = max_connections
        self.open = 0
        """Connections being served now."""
        self.refused = 0
        """Sockets answered 503 because max_connections were open."""
        self.what = what
        self._fd = fd
        config = HypercornConfig()
        config.accesslog = None
        config.errorlog = errorlog
        config.read_timeout = math.ceil(read_timeout)
        config.graceful_timeout = drain_seconds
        self._config = config
        self._app = wrap_app(app, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
        self._context = WorkerContext(None)
        self._log_refusal = RateLimitedLog(LOGGER, logging.WARNING)
        self._handlers: trio.Nursery | None = None
        self._streams: set[trio.SocketStream] = set()
        """The connections being served, closed at the drain's deadline (`_cut_at`)."""

    async def serve(self, shutdown: trio.Event) -> None:
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=self._fd)))
        try:
            async with trio.open_nursery() as handlers:
                self._handlers = handlers
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(accept_forever, listener, self._admit)
                    await shutdown.wait()
                    accepting.cancel_scope.cancel()
                await listener.aclose()  # new connections are refused by the kernel from here on
                # hypercorn's connections read this: an idle keep-alive connection closes, an answer in
                # flight says `connection: close`
                await self._context.terminated.set()
                deadline = trio.current_time() + self._config.graceful_timeout
                handlers.cancel_scope.deadline = deadline
                handlers.start_soon(self._cut_at, deadline)
        finally:
            self._handlers = None
            await listener.aclose()

    async def _cut_at(self, deadline: float) -> None:
        """At the drain's deadline, close every socket still served. hypercorn writes an answer inside a
        shielded scope, which the deadline's cancel does not reach: a client that read none of a large
        answer (a /metrics of many queues) kept the broker from exiting until TCP_USER_TIMEOUT, 10 s
        after a SIGTERM documented as a 2 s drain (a tester). Closing the socket wakes that write."""
        with trio.CancelScope(shield=True):
            while self._streams and trio.current_time() < deadline:  # (none left: the drain is over)
                await trio.sleep(min(0.05, max(0.0, deadline - trio.current_time())))
        for stream in list(self._streams):
            stream.socket.close()  # (trio's close wakes a task waiting to write on it)

    def _admit(self, stream: trio.SocketStream) -> None:
        if self.open >= self.max_connections:
            self.refused += 1
            self._log_refusal("%s: refusing connection from %s: %d connections open (max_connections)",
                              self.what, peer_name(stream), self.open)
            text = (f"{self.what} has {self.max_connections} connections open (its max_connections); "
                    "try again when one closes\n").encode()
            refuse_now(stream, b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\nretry-after: 1\r\n"
                       b"content-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
            return
        assert self._handlers is not None
        self._handlers.start_soon(self._serve_one, stream)
        self.open += 1

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        self._streams.add(stream)
        try:
            # (a plain socket stream: hypercorn's annotation says SSLStream, and it serves both)
            await _Connection(self._app, self._config, self._context, ConnectionState({}), stream)
        except Exception as exc:  # a bug serving one connection ends that connection, not the port
            LOGGER.error("%s: connection from %s: unhandled error; closed", self.what, peer_name(stream),
                         exc_info=exc)
        finally:
            self.open -= 1
            self._streams.discard(stream)
            # (hypercorn's own close sends EOF first, which a cancellation at shutdown interrupts)
            await trio.aclose_forcefully(stream)
