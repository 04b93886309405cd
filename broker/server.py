"""The trio shell around `BrokerCore`: TCP listeners and one handler per connection.

Each connection runs three tasks in its own nursery: a reader that decodes frames and hands them to
the core (it never stops reading: flow control is done with credit and held completions, not TCP
back-pressure, so acks, settlements and noops always get through), a writer that drains the
session's outbox whenever the core wakes it, and a timer for noops, the idle timeout, credit
re-advertisement and stuck-consumer detection. A connection at fault gets an ERROR naming what was
wrong and a CLOSE; no other connection is touched.

Writing first, then queueing (as asyncio's selector transports do): when a reader has handed a chunk
of frames to the core, it flushes the outbox of every session the core woke (the producer's
completions, the consumers' deliveries) with one non-blocking write each, instead of waiting a
scheduler round for their writer tasks. Measured at 5,000 msgs/s that round was p50 0.13 ms and p90
0.35 ms of a message's way through the broker. What the kernel does not take at once (its send
buffer is full: a slow consumer) goes to that connection's writer task, which sends it before
anything newer, so frames stay in order and a slow socket never blocks the reader.

Any trio stream serves: a connection is read and written through broker/streamio.py, so a TLS stream
over the accepted socket (or an in-memory stream in a test) drops in where the socket was
(`serve_connection`). The write without waiting, and the reads and writes that know exactly where they
stopped, are for a plain TCP socket only; on another stream the writer task sends everything.

What one connection can cost the others is bounded here (docs/architecture.md, "Bounded everything"):

- Every exception raised while serving a connection (in the core's handle(), in encoding, in the
  writer, the timer or the handshake; a broker bug such as a RecursionError) ends that connection
  alone, with ERROR INTERNAL_ERROR and a logged traceback. Nothing reaches the accept loop.
- A reader hands frames to the core for at most READER_TURN_SECONDS before it yields, so a burst of
  frames from one peer holds the event loop for a few milliseconds, not for as long as it lasts; the
  readers busy at once share ROUND_BUDGET_SECONDS a scheduler round (down to READER_TURN_FLOOR_SECONDS
  each), so bursts from many peers together hold it about that plus their turns' fixed costs; and a reader
  hands UNREAD_TURN_FRAMES frames only while its client leaves its answers unread (UNREAD_ANSWERS_BYTES).
- Every accepted socket counts toward max_connections, HELLO or not, and sockets over it are refused
  at accept (broker/accept.py accepts, with backoff when out of descriptors).
- A frame must complete within frame_timeout, and the bytes held for partial frames are bounded
  across connections (broker/framebudget.py): a reader reads no more than the budget grants.
- A connection is closed by shutting down its sending side (a FIN after the last frame) and reading
  and discarding what the peer still sends, briefly, before closing the socket: closing with unread
  bytes makes the kernel reset the connection, and the peer could lose the ERROR saying why.

A person who points an HTTP client (curl, the admin CLI) at this port gets an HTTP 400 saying where
the admin API is, not a binary ERROR; connections open and close at DEBUG, and INFO gets a summary of
them once a minute (a close for an error is also a WARNING, at most one per 10 s for each error code).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import secrets
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from flowbroker.broker.accept import RateLimitedLog, accept_forever, raise_descriptor_limit
from flowbroker.broker.admin import HTTP_DRAIN_SECONDS, AdminServer, publish_token, resolve_token, url_host
from flowbroker.broker.adminusers import AdminUsers
from flowbroker.broker.listen_hints import listen_hint
from flowbroker.broker.auth import PLAIN, SCRAM, Accepted, Authenticator, Challenge, PasswordCheck, Peer, Refused
from flowbroker.broker.passwords import PasswordChecksBusy, checked
from flowbroker.broker.permissions import Access
from flowbroker.broker.tls import certificate_identity, server_context
from flowbroker.broker.config import BrokerConfig
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.framebudget import STALL_SECONDS, PartialFrameBudget
from flowbroker.broker.journal import Journal
from flowbroker.broker.journalshell import FINAL_COMMIT_SECONDS, open_journal, run_committer
from flowbroker.broker.logsafe import logsafe
from flowbroker.broker.metrics import broker_metrics
from flowbroker.broker.httpturns import HttpTurns
from flowbroker.broker.metricshttp import MetricsServer, metrics_route
from flowbroker.broker.session import Session, SessionFault
from flowbroker.broker.udp.shell import UdpShell, open_data_path
from flowbroker.broker.streamio import SocketIO, StreamIO, peer_host, peer_name, refuse_now, stream_io
from flowbroker.policies.drain import TICK_SECONDS
from flowbroker.protocol.codec import encode_frames
from flowbroker.transport.udp.tasks import now_ns
from flowbroker.protocol.connection import Connection, Role, State
from flowbroker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from flowbroker.protocol.frames import (
    PROTOCOL_VERSION,
    AuthChallenge,
    AuthResponse,
    Close,
    Deliver,
    Error,
    Frame,
    Hello,
    Noop,
    Welcome,
)
from flowbroker.protocol.names import LOGIN_THROTTLED
from flowbroker.protocol.scram import claimed_username

__all__ = ["BrokerServer", "now_ns"]

LOGGER = logging.getLogger("flowbroker.broker.server")
RECEIVE_SIZE = 64 * 1024  # per read; 256 KiB reads from 200 busy connections fragmented the heap by tens of MiB
LARGE_READ = 1024 * 1024
"""The most one read asks for the rest of a frame larger than RECEIVE_SIZE whose length is in: the SDK's
TRANSFER frames are about 256 KiB, read 64 KiB at a time they cost four reads (and four scheduler rounds:
a read yields) where one or two do. What is read beyond the allowance is charged to the partial-frame
budget before it is read (`grant_read`), as before, so the bound on bytes held is the same."""
FINAL_FLUSH_SECONDS = 2.0  # closing: how long to send what is still due (`_send_and_close`)
CLOSE_PIECE_BYTES = 64 * 1024
"""Closing: what is still due is encoded this much at a time (about 1 ms of ERRORs), each piece sent before
the next is encoded (`_send_and_close`)."""
UDP_STATUS_GRACE_SECONDS = 0.05  # at shutdown, between UDP producers' last status messages and the CLOSE
READER_TURN_SECONDS = 0.002  # a reader yields after handing frames to the core for this long...
ROUND_BUDGET_SECONDS = 0.010
"""...or for this shared among the readers busy at once (`BrokerServer.busy_readers`), if that is less. trio runs
every ready task once before it looks at the sockets again, so a connection that sends one request waits a turn
of every busy reader for its answer: 100 readers with frames to spare (pipelined requests, a fresh connection's
first answers) at 2 ms each held it 200-300 ms a round; their turns now add up to about this much."""
READER_TURN_FLOOR_SECONDS = 0.0002
"""The shortest turn however many readers are busy (and a turn hands at least one frame to the core): below it
the turn's fixed costs (the step, the flush's write, the read) would outweigh its frames."""
UNREAD_ANSWERS_BYTES = 64 * 1024
"""Answers (control frames: ERRORs, OKs, completions, by `control_cost`) waiting in a connection's outbox while
its socket takes nothing more (its writer is waiting to write, or holds bytes the kernel refused): past this the
client sends requests faster than it reads their answers, and its reader's turn is UNREAD_TURN_FRAMES frames
instead of READER_TURN_SECONDS of them. One turn of a client that reads leaves its answers well under it (2 ms
of refused requests is about 40 KiB of ERRORs), and the writer takes them at the turn's end."""
UNREAD_TURN_FRAMES = 4
"""Frames a reader hands to the core in one turn while its client does not read its answers (past
UNREAD_ANSWERS_BYTES). It is still read and its frames are all handled, in order (the broker never stops reading
a connection: a client whose reader waits for its writer, as the SDK's resending after a reconnect, must not wait
for the broker, nor the broker for it), but a few a turn: 100 connections pipelining 3,000 refused DECLAREs each
and never reading took a full 2 ms turn each (2-3 ms of CPU with their answers and the step around it), and a
bystander producer and consumer waited 100 such turns for each of theirs (p50 9.9-10.3 s, max 12.6-17.7 s on a
loaded machine, a tester)."""
TIMED_QUEUES_PER_STEP = 200  # queues with a time threshold the flow timer ticks between yields (~1 ms)
TIMED_TICK_SECONDS = 0.02  # the most one flow-timer tick spends on them (a fifth of TICK_SECONDS)
DRAIN_SECONDS = 0.5  # closing: how long to read and discard what the peer still sends...
DRAIN_BYTES = 1024 * 1024  # ...and how much of it
DESCRIPTOR_RESERVE = 64  # descriptors beyond max_connections: listeners, the admin API, logs
PIECE_DELIVERS = 4
"""DELIVER frames encoded at once (each about 512 KiB at most, plus one message): the rest of what was
collected waits, unencoded, until the piece is written. A consumer that does not read its socket held a
second, encoded copy of everything delivered to it (a tester: RSS about twice the watermark)."""
USERS_CHECK_SECONDS = 1.0  # how often the users file is looked at (a stat) for changed permissions
CONNECTION_SUMMARY_SECONDS = 60.0  # connections open and close at DEBUG; INFO gets a summary this often
HTTP_METHODS = (b"GET ", b"HEAD", b"POST", b"PUT ", b"DELE", b"PATC", b"OPTI", b"CONN", b"TRAC")
"""First bytes of an HTTP request. As a length prefix each is over 1 GiB, more than any max_frame_size,
so a peer that sends one is never a broker client: it is told in HTTP where the admin API is."""


_F = TypeVar("_F", Hello, AuthResponse)


@dataclass
class _Closing:
    code: ErrorCode
    text: str
    frame_seq: int | None = None
    error: bool = True  # send an ERROR frame before CLOSE


class UdpStartError(Exception):
    """The UDP data path's endpoint cannot be bound; the broker does not start."""


class TlsStartError(Exception):
    """The TLS port cannot be listened on; the broker does not start."""


class _FrameTimeout(Exception):
    """The frame being received did not complete within [server] frame_timeout."""


_NO_DEADLINE = contextlib.nullcontext()  # most reads: no partial frame, so no cancel scope to enter


class BrokerServer:
    """Serves the broker protocol. `await nursery.start(server.serve)` returns the bound port."""

    def __init__(self, config: BrokerConfig, core: BrokerCore | None = None):
        self.config = config
        self.core = core or BrokerCore(config, now_ns)
        self.shutdown_requested = trio.Event()
        # Set when the shutdown begins: a connection that arrives or finishes its handshake after it is
        # refused SHUTDOWN before it can send a transfer (the last commit would not wait for it, and it
        # would be told "not completed" about messages the journal keeps).
        self.stopping = False
        self.connections: dict[int, ConnectionHandler] = {}
        self.port: int | None = None
        self.tls_port: int | None = None  # the TLS client port ([tls]), when enabled
        self.admin: AdminServer | None = None
        self.admin_port: int | None = None
        self.udp: UdpShell | None = None  # the UDP data path (broker/udp/), when [udp] enabled
        self.udp_port: int | None = None
        self.metrics: MetricsServer | None = None  # /metrics on a port of its own ([metrics] endpoint)
        self.metrics_port: int | None = None  # where /metrics is served: that port, or the admin port
        self.journal: Journal | None = None  # durable queues' journal ([storage] enabled), opened by serve()
        self._woken: dict[ConnectionHandler, None] = {}  # to flush at the end of the current reader chunk
        self.in_chunk = False  # a reader is handing frames to the core; it flushes what they wake
        self.busy_readers = 0
        """Readers that ended their turn with frames still to hand to the core, waiting for their next turn: they
        share ROUND_BUDGET_SECONDS a scheduler round (`ConnectionHandler._handle_buffered`)."""
        self.open_sockets = 0  # accepted and not closed yet, HELLO or not: what max_connections counts
        self.peak_sockets = 0
        self.refused = 0  # sockets refused at accept: open_sockets at max_connections, or the shutdown begun
        self.frame_budget = PartialFrameBudget(config.server.max_partial_frame_bytes, RECEIVE_SIZE)
        self.run_id = secrets.token_hex(8)
        """This process's run, in every WELCOME: a client that reconnects to a broker with another one knows it
        restarted, and that its memory-only queues lost what they held (the Spark writer fails the job)."""
        self._handlers: trio.Nursery | None = None
        self._log_refusal = RateLimitedLog(LOGGER, logging.WARNING)
        # logins refused unchecked because their address is throttled: one guesser wrote 1,168 lines a
        # minute at WARNING (a tester); the checked refusals are still logged each
        self.log_throttled = RateLimitedLog(LOGGER, logging.WARNING)
        self.authenticator = Authenticator(config.auth)  # who may connect (broker/auth.py)
        self._users_error = self.authenticator.store.error  # the users file's error last logged
        self.core.login_throttle = self.authenticator.throttle
        self.opened = 0  # connections that completed the handshake since the last summary...
        self.closed = 0  # ...and that closed since then
        self.unshaken = 0  # ...and sockets that ended before completing it (no HELLO, refused, ...)
        self._log_unshaken: dict[str, RateLimitedLog] = {}  # one per kind of early end: at most 1 line / 10 s
        self._log_closed: dict[ErrorCode, RateLimitedLog] = {}  # one per error code: at most 1 WARNING / 10 s
        # "connection N is stuck", at most once per 10 s broker-wide (each stuck consumer said so every
        # stuck_timeout: a thousand of them, a thousand lines; the metrics count them all)
        self.log_stuck = RateLimitedLog(LOGGER, logging.WARNING)
        # One connection's writer at a time routes a slice of what it parked under the memory alarm
        # (broker/parking.py), others running between turns: the alarm's clearing wakes every writer with
        # messages parked at once, and 100 of them each routing a slice in one scheduler pass held a
        # bystander 116-434 ms (a tester).
        self.parked_turn = trio.Lock()

    def _begin_udp_pass(self) -> None:
        self.in_chunk = True

    def _end_udp_pass(self) -> None:
        """A pass of the UDP data path is over: write what it woke, as at the end of a reader's chunk."""
        self.in_chunk = False
        self.flush_woken()

    def flush_woken(self) -> None:
        """Write out, without waiting, what the frames just handled made due on every connection."""
        woken, self._woken = self._woken, {}
        for handler in woken:
            handler.flush_now()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until shutdown() is called or the task is cancelled; then close every connection
        with a reason (SHUTDOWN), after flushing the completions and credit already due."""
        cfg = self.config.server
        limits = raise_descriptor_limit()
        if limits is not None:
            LOGGER.info("descriptor limit %d (hard limit %d), max_connections %d", *limits, cfg.max_connections)
            if limits[0] < cfg.max_connections + DESCRIPTOR_RESERVE:
                LOGGER.warning("descriptor limit %d is below max_connections %d + %d: accepts will fail (and back "
                               "off) before max_connections is reached", limits[0], cfg.max_connections,
                               DESCRIPTOR_RESERVE)
        tls_context = server_context(self.config.tls) if self.config.tls.enabled else None
        if self.config.storage.enabled and self.core.journal is None:  # durable queues come back first
            self.journal = await open_journal(self.config.storage, self.core)
        elif not self.config.storage.enabled:
            LOGGER.info("storage off ([storage] enabled = false): every queue is in memory, a declare's "
                        "durable=True is ignored (its answer says durable false)")
        listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        tls_listeners: list[trio.SocketListener] = []
        if tls_context is not None:
            try:
                tls_listeners = await trio.open_tcp_listeners(self.config.tls.port, host=cfg.host)
            except BaseException as exc:
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
                if isinstance(exc, OSError):
                    hint = listen_hint(exc, cfg.host, "--host or [server] host", "[tls] port")
                    raise TlsStartError(f"[tls] cannot listen on {cfg.host}:{self.config.tls.port}: "
                                        f"{exc.strerror or exc} ({hint})") from None
                raise
            self.tls_port = tls_listeners[0].socket.getsockname()[1]
            listeners = listeners + tls_listeners
        if self.config.udp.enabled:
            try:
                self.udp = open_data_path(self.config.udp, self.core)
            except OSError as exc:
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
                option = "--udp-endpoint HOST:PORT or [udp] endpoint"
                hint = listen_hint(exc, self.config.udp.address()[0], option, option)
                raise UdpStartError(f"[udp] cannot bind the UDP endpoint {self.config.udp.endpoint}: "
                                    f"{exc.strerror or exc} ({hint}; --no-udp to run without it)") from None
            self.udp_port = self.udp.port
            self.udp.begin_pass, self.udp.end_pass = self._begin_udp_pass, self._end_udp_pass
        metrics = self.config.metrics
        served = broker_metrics(self.core, metrics.max_producer_series) if metrics.enabled else None
        turns = HttpTurns()  # pages and scrapes take turns on the broker's thread, wherever served
        try:
            if self.config.admin.enabled:  # the management HTTP API (broker/admin.py)
                on_admin = served is not None and not metrics.endpoint
                self.admin = AdminServer(self.config.admin, self.core, self.peer_of, lambda: self.port,
                                         metrics_route(served, turns) if on_admin and served is not None else None,
                                         metrics.require_token, self.authenticator.store,
                                         self.config.auth.failed_login_delay, self.authenticator.throttle, turns)
                self.admin_port = self.admin.bind()
                if on_admin:
                    self.metrics_port = self.admin_port
            if served is not None and metrics.endpoint:  # /metrics on a port of its own
                token = None
                if metrics.require_token:
                    token = self.admin.token if self.admin is not None else self._scrape_token()
                users = (AdminUsers(self.authenticator.store, self.config.auth.failed_login_delay,
                                    self.authenticator.throttle, self.core.clock_ns)
                         if token is not None and self.authenticator.store is not None else None)
                self.metrics = MetricsServer(metrics, served, token, users, turns)
                self.metrics_port = self.metrics.bind()
        except BaseException:
            for listener in listeners:
                await trio.aclose_forcefully(listener)
            if self.udp is not None:
                self.udp.endpoint.close()
            raise
        self.port = listeners[0].socket.getsockname()[1]
        LOGGER.info("flowbroker listening on %s:%d", cfg.host, self.port)
        if self.tls_port is not None:
            LOGGER.info("flowbroker listening for TLS on %s:%d (client certificates: %s)", cfg.host, self.tls_port,
                        self.config.tls.verify_client)
        self._log_auth()
        if self.udp is not None:
            LOGGER.info("flowbroker UDP data path on %s", self.udp.datapath.endpoint_text)
        if self.metrics_port is not None and self.metrics is None:  # (on its own port, MetricsServer says so)
            LOGGER.info("metrics on http://%s:%d/metrics (%s)", self.config.admin.host, self.metrics_port,
                        "admin token required" if metrics.require_token else "no token required")
        async with trio.open_nursery() as nursery:
            self._handlers = nursery  # connections run here, beside the accept loops
            for listener in listeners:
                nursery.start_soon(self._accept, listener, tls_context if listener in tls_listeners else None)
            if self.admin is not None:
                await nursery.start(self.admin.serve)
            if self.metrics is not None:
                await nursery.start(self.metrics.serve)
            nursery.start_soon(self._summarise_connections)
            nursery.start_soon(self._watch_users)
            nursery.start_soon(self._flow_timer)
            if self.journal is not None:
                nursery.start_soon(run_committer, self.journal)
            if self.udp is not None:
                nursery.start_soon(self.udp.run)
            task_status.started(self.port)
            await self.shutdown_requested.wait()
            self.stopping = True
            if self.admin is not None:
                self.admin.shutdown()
            if self.metrics is not None:
                self.metrics.shutdown()
            await self._complete_the_last_commit()
            LOGGER.info("shutting down: closing %d connection(s)", len(self.connections))
            for handler in list(self.connections.values()):
                handler.close(_Closing(ErrorCode.SHUTDOWN, "broker is shutting down", error=False))
            with trio.move_on_after(FINAL_FLUSH_SECONDS + 1):
                while self.connections:
                    await trio.sleep(0.01)
            # and the HTTP requests in flight (a scrape of many queues takes a while): answered, not cut
            with trio.move_on_after(HTTP_DRAIN_SECONDS + 0.5):
                for http in (self.admin, self.metrics):
                    if http is not None:
                        await http.stopped.wait()
            nursery.cancel_scope.cancel()

    def shutdown(self) -> None:
        self.shutdown_requested.set()

    async def _complete_the_last_commit(self) -> None:
        """Shutdown, before CLOSE: what producers sent before the signal is committed and completed before
        they are told SHUTDOWN, else a producer hears "not completed" about messages the journal then
        keeps, and resending them duplicates them. Nothing to do without a journal awake."""
        journal = self.journal
        if journal is None or journal.dormant:
            return
        for handler in list(self.connections.values()):
            handler.stop_reading()
        if self.udp is not None:
            self.udp.pause()  # UDP producers' datagrams too; what the images hold is routed now
            self.udp.status_now()
        with trio.move_on_after(FINAL_COMMIT_SECONDS):
            while journal.pending or journal.in_flight:
                await trio.sleep(0.005)
        if self.udp is not None:
            # A UDP producer learns completions from status messages, on another socket than the CLOSE:
            # they go out first, with a moment to arrive before it.
            self.udp.status_now()
            await trio.sleep(UDP_STATUS_GRACE_SECONDS)

    def _log_auth(self) -> None:
        """Say at start who may connect, so nobody runs an open broker without knowing it."""
        auth = self.config.auth
        store = self.authenticator.store
        LOGGER.info("authentication: %d user(s) in %s; PLAIN %s", len(store.users), store.path, auth.plain)
        if auth.loopback_user:
            LOGGER.info("loopback user %r: a client on a loopback address that sends no credentials is this user "
                        "(may do anything); from other addresses it is refused ([auth] loopback_user)",
                        auth.loopback_user)
        else:
            LOGGER.info("no loopback user ([auth] loopback_user = \"\"): every client must log in")
        if store.error:
            LOGGER.error("users file: %s (no user can log in until it is fixed)", store.error)
        self._log_loopback_clash()

    def _log_loopback_clash(self) -> None:
        """A users-file user named as the loopback user cannot log in (broker/auth.py): said at ERROR at
        start and at each change of the file while it is there, as the users file's other errors are."""
        clash = self.authenticator.loopback_clash()
        if clash is not None:
            LOGGER.error("users file: %s", clash)

    async def _flow_timer(self) -> None:
        """The broker's flow timer: every TICK_SECONDS (0.1 s) each queue with a time threshold updates its
        drain-rate estimate from counters it keeps anyway and evaluates them (policies/drain.py); a queue
        saturating or clearing here wakes the producers' writers like an admin change does. The timed
        queues are ticked TIMED_QUEUES_PER_STEP at a time with a yield between steps, and a tick spends at
        most TIMED_TICK_SECONDS on them: a round that does not fit goes on at the next tick, so with very
        many timed queues each is evaluated less often, and other connections never wait for the round."""
        core = self.core
        while True:
            await trio.sleep(TICK_SECONDS)
            started = time.perf_counter()
            more = core.tick(now_ns(), TIMED_QUEUES_PER_STEP)
            while more and time.perf_counter() - started < TIMED_TICK_SECONDS:
                await trio.lowlevel.checkpoint()
                more = core.tick_timed_queues(now_ns(), TIMED_QUEUES_PER_STEP)

    async def _summarise_connections(self) -> None:
        """One INFO line per CONNECTION_SUMMARY_SECONDS when connections came or went, instead of a line
        for each (they are logged at DEBUG): a busy broker's log stays readable."""
        while True:
            await trio.sleep(CONNECTION_SUMMARY_SECONDS)
            if self.opened or self.closed or self.unshaken:
                early = (f"; {self.unshaken} socket(s) ended before completing the handshake"
                         if self.unshaken else "")
                LOGGER.info("connections in the last %g s: %d opened, %d closed; %d open now%s",
                            CONNECTION_SUMMARY_SECONDS, self.opened, self.closed, len(self.connections), early)
                self.opened = self.closed = self.unshaken = 0

    def log_unshaken(self, kind: str, message: str, *args: object) -> None:
        """A socket that ended before completing its handshake (no HELLO in time, HTTP, a bad first frame):
        each at DEBUG when that is on; at INFO a line per `kind` at most once per 10 s, with the count left
        out (10,000 silent sockets are not 10,000 lines). The minute's summary counts them all."""
        if LOGGER.isEnabledFor(logging.DEBUG):
            LOGGER.debug(message, *args)
            return
        log = self._log_unshaken.get(kind)
        if log is None:
            log = self._log_unshaken[kind] = RateLimitedLog(LOGGER, logging.INFO)
        log(message, *args)

    def log_closed(self, conn_id: int, code: ErrorCode, text: str) -> None:
        """A connection that completed its handshake closed. An orderly close is a DEBUG line; one for an
        error is a WARNING at most once per 10 s for each error code, with the count left out, and the
        others at DEBUG: any client may send a HELLO and then a bad frame, and one that did so in a loop
        wrote 6,523 WARNING lines (1 MB) in 10 s (a tester)."""
        message, args = "connection %d closed: %s (%s)", (conn_id, logsafe(text), code.name)
        if code in (ErrorCode.NORMAL, ErrorCode.SHUTDOWN):
            LOGGER.debug(message, *args)
            return
        log = self._log_closed.get(code)
        if log is None:
            log = self._log_closed[code] = RateLimitedLog(LOGGER, logging.WARNING)
        if not log(message, *args):
            LOGGER.debug(message, *args)

    async def _watch_users(self) -> None:
        """Apply a changed users file to the connections open: new permissions (their cached decisions
        dropped), and a deleted user's connections may do nothing more (each refusal says so)."""
        while True:
            await trio.sleep(USERS_CHECK_SECONDS)
            changed = self.authenticator.users_changed()
            store = self.authenticator.store
            if store.error != self._users_error:  # said once per change, not once a second
                self._users_error = store.error
                if store.error:
                    LOGGER.error("users file: %s (the %d user(s) read before stay in force until it is fixed)",
                                 store.error, len(store.users))
            if changed:
                LOGGER.info("users file changed: %d user(s); permissions of open connections updated",
                            len(store.users))
                self._log_loopback_clash()
                shares: dict[str, float] = {}
                for session in self.core.sessions.values():
                    if session.access is not None:
                        user = store.get(session.identity)
                        session.access.update(user)
                        self.core.revoke_reads(session)  # what it may no longer read stops coming
                        shares[session.identity] = user.credit_share_percent if user is not None else 0
                for identity, share in shares.items():  # a changed share moves the user's grants at once
                    self.core.set_credit_share(identity, share)

    def _scrape_token(self) -> str:
        """The admin credential for a token-protected /metrics when the admin API is off: the configured
        token, or the token file's, or a fresh one written to the token file of the configured admin
        port, where the scraper's operator finds it."""
        admin = self.config.admin
        token, unwritten = resolve_token(admin, admin.port)
        if unwritten:
            publish_token(admin, admin.port, token)
        # where to find it: the file is named after an admin port nothing listens on (a tester looked)
        LOGGER.info("[admin] is off: /metrics takes the admin token %s", "of [admin] token" if admin.token else
                    f"in {admin.token_path(admin.port)}")
        return token

    def http_answer(self) -> bytes:
        """What an HTTP client that reached the broker port is told (a 400 naming the admin API)."""
        admin = self.config.admin
        where = (f"The admin (HTTP) API is at http://{url_host(admin.host)}:{self.admin_port}/api/"
                 if self.admin_port is not None else "The admin (HTTP) API is off on this broker.")
        body = (f"This is the flowbroker broker port ({self.config.server.host}:{self.port}): it speaks the "
                f"flowbroker protocol (URL flowbroker://...), not HTTP. {where}\n").encode()
        head = (f"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        return head + body

    def peer_of(self, conn_id: int) -> str | None:
        handler = self.connections.get(conn_id)
        return handler.peer if handler is not None else None

    async def _accept(self, listener: trio.SocketListener, tls: ssl.SSLContext | None = None) -> None:
        try:
            await accept_forever(listener, lambda stream: self._admit(stream, tls))
        finally:
            await trio.aclose_forcefully(listener)

    def _admit(self, stream: trio.SocketStream, tls: ssl.SSLContext | None = None) -> None:
        """Count the socket, or refuse it at once if max_connections sockets are open. A TLS port's
        socket is wrapped in an SSLStream; its handshake runs at the first read (handshake_timeout).
        (Refused at once over TLS, it gets no frames: a TCP close, which the SDK reports as refused.)"""
        limit = self.config.server.max_connections
        if self.stopping:
            if tls is not None:
                stream.socket.close()
            else:
                self._refuse(stream, "broker is shutting down", ErrorCode.SHUTDOWN)
            return
        if self.open_sockets >= limit:
            if tls is not None:
                self.refused += 1
                self._log_refusal("refusing TLS connection from %s: too many connections", peer_name(stream))
                stream.socket.close()
                return
            self._refuse(stream, f"too many connections (max_connections {limit})")
            return
        assert self._handlers is not None
        served: trio.abc.Stream = stream if tls is None else trio.SSLStream(stream, tls, server_side=True)
        self._handlers.start_soon(self._serve_one, served)  # first: if this fails, the socket was not counted
        self.open_sockets += 1
        self.peak_sockets = max(self.peak_sockets, self.open_sockets)

    def _refuse(self, stream: trio.SocketStream, text: str, code: ErrorCode = ErrorCode.RESOURCE_EXHAUSTED) -> None:
        """ERROR + CLOSE `code` and close, without a task or a wait: a new socket's send
        buffer is empty, so the kernel takes the two frames at once (a client reads them as the
        answer to its HELLO). What already arrived (a HELLO) is read first, so the close is a FIN."""
        self.refused += 1
        self._log_refusal("refusing connection from %s: %s", peer_name(stream), text)
        self.core.errors_sent[code] += 1
        refuse_now(stream, encode_frames([Error(code, text), Close(code, text)]))

    async def _serve_one(self, stream: trio.abc.Stream) -> None:
        try:
            await self.serve_connection(stream)
        finally:
            self.open_sockets -= 1

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one client over `stream` until it ends: the accept loop's TCP sockets, or any other
        trio stream (a TLS stream over one, an in-memory stream in a test). Never raises for what goes
        wrong with this connection: that ends it alone (a cancellation still goes through)."""
        handler: ConnectionHandler | None = None
        try:
            handler = ConnectionHandler(self, stream)
            await handler.run()
        except Exception as exc:  # a bug in the handler's own error handling: still this connection's alone
            LOGGER.error("connection from %s: unhandled error; closed", peer_name(stream), exc_info=exc)
            await trio.aclose_forcefully(stream)
        finally:
            if handler is None or handler.session is None:
                self.unshaken += 1
            if handler is not None:
                handler.frame_bytes.release()
                handler.conn.discard_input()  # not left to the garbage collector (FrameDecoder.discard)
                # Nor what its writer had encoded and not sent (a consumer that never read: up to four
                # DELIVER frames of large messages, 8 MB each): the handler lives on in reference cycles
                # until a full collection, and 100 such connections one after another held 900 MiB (a tester).
                handler._unsent = b""
                handler._rest = []


def _claimed_name(auth: dict[str, Any]) -> str | None:
    """The user name a login attempt names, for the log only (unchecked): PLAIN's `username`, or the `n=`
    of SCRAM's client-first message (a throttled SCRAM guess was logged without it, a tester)."""
    name, data = auth.get("username"), auth.get("data")
    if auth.get("mechanism") == PLAIN:
        return name[:255] if isinstance(name, str) else None
    return claimed_username(data) if auth.get("mechanism") == SCRAM and isinstance(data, bytes) else None


async def _send_and_close(io: StreamIO, conn: Connection, frames: list[Frame], unsent: bytes = b"") -> None:
    """Send `unsent` (the rest of a frame already begun) and then `frames`, with a deadline; then shut
    down our sending side and drain what the peer still sends before closing (see the module's doc).
    A stream a write was cut off on is closed without writing more: it may be inside a frame.

    `frames` are encoded CLOSE_PIECE_BYTES at a time, each piece sent before the next is encoded. A send is
    a checkpoint, so other connections run between pieces, and the first one fails for a peer that has
    gone (reset, closed): what it can never get is not encoded. Encoded at once, 3,541 pending ERRORs took
    42-84 ms, and 100 such connections reset together stalled every other client 8.9-10.2 s, each
    holding an encoded copy of its backlog (a tester)."""
    stream = io.stream
    with trio.move_on_after(FINAL_FLUSH_SECONDS) as scope:
        scope.shield = True
        try:
            if not io.torn:
                if unsent:
                    await stream.send_all(unsent)
                piece: list[bytes] = []
                size = 0
                for frame in frames:
                    data = conn.send(frame)
                    piece.append(data)
                    size += len(data)
                    if size >= CLOSE_PIECE_BYTES:
                        await stream.send_all(b"".join(piece))
                        piece, size = [], 0
                if piece:
                    await stream.send_all(b"".join(piece))
                await io.send_eof()
                await _drain(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, LocalProtocolError, OSError):
            pass
    await io.close()


async def _drain(stream: trio.abc.Stream) -> None:
    """Read and discard until the peer ends its stream, for DRAIN_SECONDS and DRAIN_BYTES at most."""
    left = DRAIN_BYTES
    with trio.move_on_after(DRAIN_SECONDS):
        while left > 0:
            data = await stream.receive_some(min(left, RECEIVE_SIZE))
            if not data:
                return
            left -= len(data)


class ConnectionHandler:
    def __init__(self, server: BrokerServer, stream: trio.abc.Stream):
        self.server = server
        self.core = server.core
        self.stream = stream
        self.io = stream_io(stream)
        cfg = server.config.server
        self.conn = Connection(Role.BROKER, cfg.max_frame_size)
        # A TRANSFER's entries stay the checked lists msgpack decoded: the core unpacks or indexes them,
        # and a NamedTuple built and freed per message cost more than both (docs/performance.md).
        self.conn.build_transfers = False
        self.session: Session | None = None
        self._wakeup = trio.Event()
        self._writing = False  # the writer task is inside _write: nobody else may write
        self._unsent = b""  # what a direct write could not send; the writer sends it before anything newer
        self._rest: list[Frame] = []  # collected, not encoded yet (`_piece`): the writer sends it next
        self._closing: _Closing | None = None
        self._cancel = trio.CancelScope()
        self._reading = trio.CancelScope()  # the reader alone: cancelled by stop_reading() at shutdown
        self.last_received = trio.current_time()
        self.frame_bytes = server.frame_budget.connection(self._cut_stalled_frame)  # its share of the partial-frame budget
        self.frame_started: float | None = None  # when the first byte of the partial frame in hand arrived
        self._eof = False  # the peer ended its byte stream
        self._noop_nonce = 0
        self.peer = peer_name(stream)
        self.peer_info = Peer(peer_host(stream), tls=isinstance(stream, trio.SSLStream))
        self._deadline = 0.0  # of the handshake (HELLO, authentication), from handshake_timeout

    def stop_reading(self) -> None:
        """Shutdown's first step: take no more frames, while the writer goes on sending what becomes due
        (the completions of the journal's last commit) until close()."""
        self._reading.cancel()

    def close(self, reason: _Closing) -> None:
        """End this connection with `reason` (from any task); the first reason wins."""
        if self._closing is None:
            self._closing = reason
        self._cancel.cancel()

    def _internal_error(self, exc: BaseException, what: str, frame_seq: int | None = None) -> None:
        """A bug showed while serving this connection: log it with its traceback and end this
        connection alone with INTERNAL_ERROR (the broker's state for the others is not at fault)."""
        conn_id = self.session.conn_id if self.session is not None else "-"
        LOGGER.error("connection %s from %s: internal error in %s; closing it", conn_id, self.peer, what,
                     exc_info=exc)
        text = f"internal error in {what} ({type(exc).__name__}); the broker closed this connection"
        self.close(_Closing(ErrorCode.INTERNAL_ERROR, text, frame_seq))

    async def run(self) -> None:
        try:
            self._deadline = trio.current_time() + self.server.config.server.handshake_timeout
            hello = await self._handshake(Hello)
            if hello is not None:
                accepted = await self._authenticate(hello)
                if accepted is not None:
                    await self._serve(hello, accepted)
        except Exception as exc:
            self._internal_error(exc, "the handshake")
            reason = self._closing
            assert reason is not None
            self.core.errors_sent[reason.code] += 1
            await _send_and_close(
                self.io, self.conn, [Error(reason.code, reason.text), Close(reason.code, reason.text)]
            )
        finally:
            self.frame_bytes.release()

    async def _authenticate(self, hello: Hello) -> Accepted | None:
        """Who the client is (broker/auth.py), with the AUTH_CHALLENGE round SCRAM needs; None when it is
        refused (after `failed_login_delay`, so guessing passwords is slow) or gave up. Credentials from an
        address with recent failures first wait their turn (LoginThrottle), so one address cannot guess
        in parallel over many connections."""
        auth = self.server.authenticator
        if isinstance(self.stream, trio.SSLStream):  # the TLS handshake is done: HELLO came through it
            subject = certificate_identity(self.stream.getpeercert())
            self.peer_info = Peer(self.peer_info.host, True, subject)
        throttle, host = auth.throttle, self.peer_info.host
        if not hello.auth:
            return await self._login(hello)
        # credentials, which a guesser could be trying: its address may have to wait its turn
        admitted_ns = self.core.clock_ns()
        wait = throttle.admit(host, admitted_ns)
        if wait is None:
            await self._refuse_login(Refused(
                f"{LOGIN_THROTTLED} {host}: try again later", "throttled (too many failed logins "
                "from this address)", _claimed_name(hello.auth)), self.server.log_throttled)
            return None
        try:
            turn_ns = admitted_ns + wait
            # its turn, or sooner when the address's failures are forgotten (asked again on waking: a
            # failure meanwhile puts that off)
            while left := throttle.wait_ns(host, turn_ns, self.core.clock_ns()):
                self._deadline += left / 1e9  # the wait is not the client's slowness
                if await self._left_while_waiting(left / 1e9):
                    throttle.give_back(host, turn_ns)
                    LOGGER.info("connection from %s: closed by the client while its login waited its turn",
                                self.peer)
                    await self.io.close()
                    return None
            return await self._login(hello)
        finally:
            throttle.settle(host)

    async def _left_while_waiting(self, seconds: float) -> bool:
        """Sleep `seconds` (a throttled login's turn); True if the client closed its end meanwhile, so
        its turn can go to the next attempt. Only a plain TCP socket is watched (a peek, nothing read);
        bytes sent meanwhile stay for the handshake, and end the watch."""
        io = self.io
        if not isinstance(io, SocketIO):
            await trio.sleep(seconds)
            return False
        with trio.move_on_after(seconds):
            await trio.lowlevel.wait_readable(io.socket)
            try:
                peeked = await io.socket.recv(1, socket.MSG_PEEK)
            except OSError:  # reset: gone too
                return True
            if not peeked:
                return True
            await trio.sleep_forever()  # it sent more: wait out the turn as before
        return False

    async def _login(self, hello: Hello) -> Accepted | None:
        auth, throttle, host = self.server.authenticator, self.server.authenticator.throttle, self.peer_info.host
        outcome = auth.begin(hello.auth, self.peer_info)
        if isinstance(outcome, PasswordCheck):  # PBKDF2 off the event loop (auth.PasswordCheck)
            try:
                ok = await checked(outcome.user.credential, outcome.password, outcome.user.name)
            except PasswordChecksBusy as busy:  # not a failure of this address: refused unchecked
                LOGGER.warning("connection from %s: login refused for user %s: %s", self.peer,
                               logsafe(outcome.user.name), busy)
                await self._refuse_exhausted(str(busy))
                return None
            outcome = outcome.finish(ok)
        if isinstance(outcome, Challenge):
            await self.io.stream.send_all(self.conn.send(AuthChallenge(outcome.data)))
            response = await self._handshake(AuthResponse)
            if response is None:
                return None
            outcome = outcome.finish(response.data)
        if isinstance(outcome, Accepted) and (over := self._over_user_limit(outcome)) is not None:
            await self._refuse_exhausted(over)
            return None
        if isinstance(outcome, Refused):
            if hello.auth:
                throttle.failed(host, self.core.clock_ns())
            await self._refuse_login(outcome)
            return None
        return outcome

    async def _refuse_login(self, outcome: Refused, log: Callable[..., object] = LOGGER.warning) -> None:
        """Log (with `log`: the throttled ones at most once per 10 s, BrokerServer.log_throttled) and count a
        refused login, wait `failed_login_delay`, then ERROR UNAUTHORIZED + CLOSE."""
        log("connection from %s: login refused%s: %s", self.peer,
            f" for user {logsafe(outcome.username)}" if outcome.username is not None else "",
            logsafe(outcome.reason))
        self.core.errors_sent[ErrorCode.UNAUTHORIZED] += 1
        await trio.sleep(self.server.config.auth.failed_login_delay)
        text = outcome.text
        await _send_and_close(self.io, self.conn, [Error(ErrorCode.UNAUTHORIZED, text, 1),
                                                   Close(ErrorCode.UNAUTHORIZED, text)])

    def _over_user_limit(self, accepted: Accepted) -> str | None:
        """Why the user's own max_connections (users file) refuses this connection, or None. Counted over
        the open TCP connections at each login (logins are rare beside messages)."""
        limit = accepted.user.max_connections if accepted.user is not None else 0
        if not limit:
            return None
        open_now = sum(1 for h in self.server.connections.values()
                       if h.session is not None and h.session.identity == accepted.identity)
        if open_now < limit:
            return None
        text = f"user {accepted.identity!r} has its max_connections ({limit}) open"
        LOGGER.warning("connection from %s: refused: %s", self.peer, logsafe(text))
        return text

    async def _refuse_exhausted(self, text: str) -> None:
        """A login the broker will not serve now (a user over its limit, its password checks busy): ERROR
        + CLOSE RESOURCE_EXHAUSTED, counted."""
        code = ErrorCode.RESOURCE_EXHAUSTED
        self.core.errors_sent[code] += 1
        await _send_and_close(self.io, self.conn, [Error(code, text, 1), Close(code, text)])

    async def _serve(self, hello: Hello, accepted: Accepted) -> None:
        core = self.core
        session = core.open_session(
            hello.client_name, accepted.identity, hello.flow_control, self._wake, hello.capabilities,
            accepted.user.credit_share_percent if accepted.user is not None else 0,
        )
        if self.server.stopping:  # its handshake ended after the shutdown began: nothing more is taken
            core.close_session(session)
            core.errors_sent[ErrorCode.SHUTDOWN] += 1
            text = "broker is shutting down"
            await _send_and_close(self.io, self.conn, [Error(ErrorCode.SHUTDOWN, text, 1), Close(ErrorCode.SHUTDOWN, text)])
            return
        if session.fault is not None:
            # The credit pool has no byte left for one more connection (a pool under two bytes a connection
            # slot): refused in the handshake, so connect() raises, not WELCOME and a CLOSE a moment later.
            fault = session.fault
            core.close_session(session)
            LOGGER.warning("connection from %s: refused: %s", self.peer, logsafe(str(fault)))
            core.errors_sent[fault.code] += 1
            await _send_and_close(self.io, self.conn, [Error(fault.code, str(fault), 1), Close(fault.code, str(fault))])
            return
        session.peer_host = self.peer_info.host
        if accepted.user is not None:  # the loopback user may do anything: no checks at all
            session.access = Access(accepted.identity, accepted.user)
        self.session = session
        self.server.connections[session.conn_id] = self
        try:
            cfg = self.server.config.server
            welcome = Welcome(
                PROTOCOL_VERSION,
                session.conn_id,
                cfg.name,
                cfg.max_frame_size,
                cfg.max_message_size,
                int(cfg.idle_timeout * 1000),
                session.buffer_size,
                session.identity,
                accepted.server_final,
                self.server.run_id,
            )
            self.server.opened += 1
            LOGGER.debug("connection %d from %s (%s) as %s (%s), flow control %s, buffer %d bytes",
                         session.conn_id, self.peer, logsafe(hello.client_name), logsafe(session.identity),
                         accepted.mechanism, "on" if hello.flow_control else "off", session.buffer_size)
            with self._cancel:
                await self._write(self.conn.send(welcome))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._contained, self._writer, session, "the writer")
                    nursery.start_soon(self._contained, self._timer, session, "the timer")
                    with self._reading:
                        await self._contained(self._reader, session, "the reader")
                    if self._reading.cancelled_caught:  # shutting down: the writer runs until close()
                        await trio.sleep_forever()
                    nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # sending WELCOME
            self._closing = self._closing or _Closing(ErrorCode.NORMAL, "connection lost", error=False)
        except Exception as exc:
            self._internal_error(exc, "opening the session")
        finally:
            await self._finish(session)

    async def _contained(
        self, task: Callable[[Session], Awaitable[None]], session: Session, what: str
    ) -> None:
        """Run one of the connection's tasks so that whatever it raises ends this connection only
        (in a nursery, an exception would cancel its siblings and travel up to the accept loop)."""
        try:
            await task(session)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.close(_Closing(ErrorCode.NORMAL, "connection lost", error=False))
        except Exception as exc:
            self._internal_error(exc, what)

    async def _handshake(self, expect: type[_F]) -> _F | None:
        """The next frame, of type `expect` (HELLO, then AUTH_RESPONSE if authentication asks for one),
        by the handshake's deadline; None if the connection ended (closed here, with a reason if due)."""
        cfg = self.server.config.server
        conn = self.conn
        head = b""  # the first bytes, to recognise an HTTP client
        try:
            with trio.fail_at(self._deadline):
                while True:
                    frames_before = conn.frames_received
                    frame = conn.next_frame()
                    if frame is not None:
                        if isinstance(frame, expect):
                            # What follows HELLO in the buffer began in the last read; the reader
                            # hands it to the core before it reads again.
                            self.frame_started = None
                            return frame
                        await _send_and_close(self.io, conn, [])
                        return None
                    if conn.state is State.CLOSED:
                        await self.io.close()
                        return None
                    self._held(frames_before)
                    data = await self._receive()
                    if len(head) < 4:
                        head += data[: 4 - len(head)]
                    conn.receive_data(data)
        except trio.TooSlowError:
            self.server.log_unshaken("timeout", "connection from %s sent no %s within %.1fs", self.peer,
                                     "HELLO" if expect is Hello else "AUTH_RESPONSE", cfg.handshake_timeout)
            await self.io.close()
        except _FrameTimeout:
            self.server.log_unshaken("frame", "connection from %s: %s", self.peer, self._frame_timeout_text())
            await self.io.close()
        except RemoteProtocolError as exc:
            if head in HTTP_METHODS and expect is Hello:
                self.server.log_unshaken("http", "connection from %s: an HTTP request on the broker port; "
                                         "answered 400 naming the admin API", self.peer)
                await _send_and_close(self.io, self.conn, [], self.server.http_answer())
                return None
            self.server.log_unshaken("bad", "connection from %s: bad handshake: %s", self.peer, logsafe(exc))
            self.core.errors_sent[exc.code] += 1
            await _send_and_close(  # after a protocol error the state machine still allows ERROR + CLOSE
                self.io, self.conn, [Error(exc.code, str(exc), exc.frame_seq), Close(exc.code, str(exc))]
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.io.close()
        return None

    def _wake(self) -> None:
        server = self.server
        if server.in_chunk:  # the reader flushes it when the chunk is done (and wakes us if it cannot)
            server._woken[self] = None
        else:  # the timer, the admin API, shutdown: the writer task sends it
            self._wakeup.set()

    def flush_now(self) -> None:
        """Send the session's outbox with one non-blocking write, unless the writer task is busy or
        holds unsent bytes (then it is already woken, and order is kept by leaving it to it).
        Called by whichever reader woke this connection: what goes wrong here ends this connection."""
        try:
            self._flush_now()
        except Exception as exc:
            self._internal_error(exc, "writing")

    def _flush_now(self) -> None:
        session, io = self.session, self.io
        if (self._writing or self._unsent or self._rest or session is None or self._closing is not None
                or not io.direct or self.core.parked_due(session)):
            # the writer collects what is due (after its current write), or routes what it parked (a
            # slice at a time: not in another connection's turn)
            self._wakeup.set()
            return
        frames = session.collect(now_ns())
        if not frames:
            return
        frames = self._piece(frames)
        if self._rest:
            self._wakeup.set()
        data = self._encode(frames)
        if data is None:
            return
        sent = io.try_send(data)
        if sent < len(data):
            self._unsent = data[sent:]
            self._wakeup.set()

    async def _receive(self) -> bytes:
        """The next bytes from the peer (b"" once it ended its stream), no more than the partial-frame
        budget grants (waiting for it if need be); in the middle of a frame, before the frame's
        deadline, or _FrameTimeout. Yields once per read, as trio's own receive does."""
        conn, frame_bytes, io = self.conn, self.frame_bytes, self.io
        started = self.frame_started
        deadline = math.inf if started is None else started + self.server.config.server.frame_timeout
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.move_on_at(deadline) if started is not None else _NO_DEADLINE as scope:
            while True:
                want = RECEIVE_SIZE
                frame_size = conn.next_frame_size  # (None before a length prefix is in)
                if frame_size is not None and frame_size - conn.buffered > RECEIVE_SIZE:
                    want = min(frame_size - conn.buffered, LARGE_READ)  # the rest of a large frame
                size = frame_bytes.grant_read(conn.buffered, want, frame_size)
                if not size:  # in the middle of a large frame, and the budget is spent
                    wait_began = trio.current_time()
                    await self._wait_for_frame_budget()
                    if scope is not None:  # the broker's wait, not the peer's: off its frame_timeout
                        # (an honest producer queued behind attackers was closed for a frame the broker
                        # had not read, a tester)
                        waited = trio.current_time() - wait_began
                        scope.deadline += waited
                        if self.frame_started is not None:
                            self.frame_started += waited
                    continue
                data = await io.receive(size, self._hold_no_grant)
                if data is None:  # it waited for the peer: ask the budget again
                    continue
                self.last_received = trio.current_time()
                return data
        raise _FrameTimeout

    async def _wait_for_frame_budget(self) -> None:
        """Until some connection gives partial-frame bytes back; meanwhile a frame stalled for
        STALL_SECONDS is cut (PartialFrameBudget.reclaim), looked for again every STALL_SECONDS."""
        budget = self.frame_bytes.budget
        budget.reclaim(self.frame_bytes)
        with trio.move_on_after(STALL_SECONDS):
            await budget.wait_freed()

    def _cut_stalled_frame(self, stalled: float) -> None:
        """The partial-frame budget cut this connection's frame: it had not grown for `stalled` seconds
        while another connection waited for the budget."""
        conn = self.conn
        size = conn.next_frame_size
        got = f"{conn.buffered} of its {size} bytes" if size is not None else f"{conn.buffered} bytes"
        # (DEBUG: the close is logged as any error close is, at most once per 10 s a code: `log_closed`)
        LOGGER.debug("connection %s from %s: closed: its frame %d stalled %.1fs (%s received) while other "
                     "connections waited for the partial-frame budget", self.session and self.session.conn_id,
                    self.peer, conn.frames_received + 1, stalled, got)
        self.close(_Closing(ErrorCode.IDLE_TIMEOUT,
                            f"frame {conn.frames_received + 1} stalled: {got} received, under 256 KiB more in "
                            f"{stalled:.1f}s while other connections waited for the partial-frame budget ([server] "
                            "max_partial_frame_bytes)", conn.frames_received + 1))

    def _hold_no_grant(self) -> None:
        """Before waiting for the peer: give back what the budget granted for a read that found nothing."""
        self.frame_bytes.settle(self.conn.buffered, self.conn.next_frame_size)

    def _held(self, frames_before: int) -> None:
        """After decoding: charge what is left (part of a frame) to the budget and note since when."""
        conn = self.conn
        self.frame_bytes.settle(conn.buffered, conn.next_frame_size)
        if not conn.buffered:
            self.frame_started = None
        elif self.frame_started is None or conn.frames_received != frames_before:
            # It began in the last read: every byte before it belonged to frames decoded since then.
            self.frame_started = self.last_received

    def _frame_timeout_text(self) -> str:
        conn, timeout = self.conn, self.server.config.server.frame_timeout
        size = conn.next_frame_size
        got = f"{conn.buffered} of its {size} bytes" if size is not None else f"{conn.buffered} bytes"
        return f"frame {conn.frames_received + 1} not complete within frame_timeout {timeout:g}s ({got} received)"

    async def _reader(self, session: Session) -> None:
        conn = self.conn
        while True:
            if not await self._handle_buffered(session):
                return
            if self._eof:
                self.close(_Closing(ErrorCode.NORMAL, "client closed the connection", error=False))
                return
            try:
                data = await self._receive()
            except _FrameTimeout:
                self.close(_Closing(ErrorCode.IDLE_TIMEOUT, self._frame_timeout_text(), conn.frames_received + 1))
                return
            self._eof = not data
            conn.receive_data(data)

    async def _handle_buffered(self, session: Session) -> bool:
        """Hand every complete frame buffered to the core, yielding to other tasks whenever this has
        taken its turn (checked on a clock that costs no system call); False when the connection must
        end. Flushes what the frames made due at every yield and at the end.

        A turn is READER_TURN_SECONDS, or ROUND_BUDGET_SECONDS shared among the readers busy at once if that
        is less (never under READER_TURN_FLOOR_SECONDS): a reader counts among them (`server.busy_readers`)
        from the first time it yields with frames still to handle until it has handled all it has."""
        conn, core, server, outbox = self.conn, self.core, self.server, session.outbox
        frames_before = conn.frames_received
        session.heard_ns = core.clock_ns()
        busy = False  # this reader is counted in server.busy_readers
        try:
            while True:
                readers = server.busy_readers
                turn_ends = time.perf_counter() + (
                    READER_TURN_SECONDS if readers * READER_TURN_SECONDS <= ROUND_BUDGET_SECONDS
                    else max(ROUND_BUDGET_SECONDS / readers, READER_TURN_FLOOR_SECONDS))
                handled = 0  # frames this turn: a few only while the client leaves its answers unread
                more = False
                server.in_chunk = True
                try:
                    while True:
                        if session.routing_rest is not None:  # a fan-out's rest: routed before the next frame
                            # (its socket is not read meanwhile: what it sends waits there, so it is not idle)
                            self.last_received = trio.current_time()
                            core.route_rest(session)
                            if time.perf_counter() >= turn_ends:
                                more = True
                                break
                            continue
                        if (frame := conn.next_frame()) is None:
                            break
                        if isinstance(frame, Close):
                            self.close(_Closing(ErrorCode.NORMAL, "closed by client", error=False))
                            return False
                        session.frame_seq = conn.frames_received  # (decoded one at a time: this frame's)
                        core.handle(session, frame)
                        handled += 1
                        if time.perf_counter() >= turn_ends or (
                                handled >= UNREAD_TURN_FRAMES and (self._writing or self._unsent)
                                and outbox.control_bytes >= UNREAD_ANSWERS_BYTES):
                            more = True
                            break
                except RemoteProtocolError as exc:
                    self.close(_Closing(exc.code, str(exc), exc.frame_seq))
                    return False
                except SessionFault as exc:
                    self.close(_Closing(exc.code, str(exc), conn.frames_received))
                    return False
                except Exception as exc:  # a broker bug (or a RecursionError) while handling this frame
                    self._internal_error(exc, f"handling frame {conn.frames_received}", conn.frames_received)
                    return False
                finally:
                    server.in_chunk = False
                    server.flush_woken()
                if not more:
                    break
                if not busy:
                    busy = True
                    server.busy_readers += 1
                await trio.lowlevel.checkpoint()
        finally:
            if busy:  # (also when it ends, or is cancelled while it waits for its next turn)
                server.busy_readers -= 1
        self._held(frames_before)
        return True

    def _encode(self, frames: list[Frame]) -> bytes | None:
        """The frames' bytes; None (and this connection closing) if the state machine refuses one
        or encoding fails, which would be a broker bug: it must end this connection, not the task
        that found it (which may be another connection's reader, flushing)."""
        send = self.conn.send
        try:
            # A DELIVER's entries are built by the broker from messages whose fields were checked when
            # they entered it (TRANSFER decoding, the UDP envelope, journal recovery): re-checking each
            # entry here was about a quarter of encoding. Every other frame is checked as it is sent.
            return b"".join([send(f, fields_checked=type(f) is Deliver) for f in frames])
        except LocalProtocolError as exc:
            LOGGER.error("connection %s: cannot send: %s", self.session and self.session.conn_id, exc)
            self.close(_Closing(ErrorCode.INTERNAL_ERROR, f"broker cannot send: {exc}", error=False))
            return None
        except Exception as exc:
            self._internal_error(exc, "encoding")
            return None

    async def _writer(self, session: Session) -> None:
        core = self.core
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            while True:
                # What it parked under the memory alarm, once the alarm is off (broker/parking.py): a slice
                # of fan-out at a time, its completions written between slices, others run between them.
                # (Checked at every turn: the reader parks more behind it while this writes.)
                if core.parked_due(session):
                    async with self.server.parked_turn:  # (held across the yield: the next writer's turn comes
                        if core.parked_due(session):  # after the others have run; still due: the alarm may be on)
                            core.route_parked(session)
                        await trio.lowlevel.checkpoint()
                # What was collected and not yet written goes first, and nothing more is collected until
                # it is: a collect takes the outbox's deliveries and lets the subscriptions fill it again,
                # so a collect beside a previous one's unwritten rest held a third outbox's worth (a
                # tester; architecture.md's bound counts two: what the writer holds and the outbox).
                if self._rest or self._unsent:
                    frames, self._rest = self._rest, []
                else:
                    frames = session.collect(now_ns())
                    if not frames:
                        if core.parked_due(session):  # a slice whose messages are all held: the next one
                            continue
                        break
                encoded = self._encode(self._piece(frames))
                if encoded is None:
                    return
                data, self._unsent = self._unsent + encoded, b""
                await self._write(data)

    def _piece(self, frames: list[Frame]) -> list[Frame]:
        """The front of `frames` up to PIECE_DELIVERS DELIVER frames; the rest goes to `_rest`."""
        delivers = 0
        for i, frame in enumerate(frames):
            if type(frame) is Deliver:
                delivers += 1
                if delivers > PIECE_DELIVERS:
                    self._rest = frames[i:]
                    return frames[:i]
        return frames

    async def _write(self, data: bytes) -> None:
        """send_all that knows how far it got: cancelled (the connection is closing), what the peer
        has not been given stays in `_unsent`, so `_finish` can still end the stream on a frame
        boundary (on a plain socket; another stream is `torn` then, and gets nothing more)."""
        send_some = self.io.send_some
        view = memoryview(data)
        self._writing = True
        try:
            while view:
                view = view[await send_some(view):]
        finally:
            self._unsent = bytes(view)
            self._writing = False

    async def _timer(self, session: Session) -> None:
        cfg = self.server.config.server
        idle = cfg.idle_timeout
        tick = min(idle / 3, 1.0)
        stuck_ns = int(cfg.stuck_timeout * 1e9)
        reported_ns: int | None = None  # when it was last reported stuck
        # Each connection's ticks at a phase of its own: connections opened together (10,000 at once) would
        # otherwise all send their NOOPs in the same tick and stall the loop (100-500 ms, a tester).
        # The checks follow the phase at once, then come every tick: a fault set meanwhile (an operator's
        # close) is seen within one tick. (Sleeping the phase and then a tick first took up to two: 1.5 s
        # for a close documented as within a second, a tester.)
        await trio.sleep(tick * random.random())
        while True:
            now = trio.current_time()
            if session.fault is not None:  # e.g. the client stopped reading and its outbox overflowed
                self.close(_Closing(session.fault.code, str(session.fault)))
                return
            silent = now - self.last_received
            if silent >= idle:
                self.close(_Closing(ErrorCode.IDLE_TIMEOUT, f"no traffic for {silent:.1f}s (idle_timeout {idle}s)"))
                return
            if silent >= idle / 3:
                self._noop_nonce += 1
                session.send(Noop(self._noop_nonce, False))
            session.poll_credit(int(now * 1e9))
            # DCP's stuck detection: a consumer whose buffer is full and whose acknowledgements
            # have not moved is reported (every stuck_timeout while it lasts), and optionally
            # disconnected (MB-65403). The session keeps since when (the metrics count it too).
            now_int = int(now * 1e9)
            since = session.consumer_stalled(now_int)
            if since is None:
                reported_ns = None
            elif now_int - max(since, reported_ns or since) >= stuck_ns:
                self.server.log_stuck("connection %d is stuck: its consumer buffer or prefetch full, nothing "
                                      "acknowledged or settled for %.0fs", session.conn_id, (now_int - since) / 1e9)
                if cfg.disconnect_when_stuck:
                    self.close(_Closing(ErrorCode.IDLE_TIMEOUT, "consumer buffer or prefetch full with no progress"))
                    return
                reported_ns = now_int
            await trio.sleep(tick)

    async def _finish(self, session: Session) -> None:
        """Send what is due (completions, credit, errors; not deliveries, which are requeued), then
        ERROR/CLOSE with the reason, then close the socket. A failure of the core here is logged and
        does not stop the socket from closing or the connection from being forgotten.

        A client whose outbox overflowed (it did not read its answers) is sent only why: what it left
        unread is dropped, not encoded (up to MAX_CONTROL_BYTES of ERRORs it would not read now either).
        Its completions are dropped with them, as on a lost connection: dropping the ERRORs alone would let
        a refused transfer's COMPLETE read as accepted."""
        reason = self._closing or _Closing(ErrorCode.NORMAL, "connection ended", error=False)
        frames: list[Frame] = []
        unsent: dict[int, bool] = {}
        try:
            rest, self._rest = self._rest, []  # collected and never encoded: completions among them
            session.outbox.full = False  # (no subscription of a closing connection is to deliver again)
            collected = rest + session.collect(now_ns())
            frames = [] if session.outbox.overflowed else [f for f in collected if not isinstance(f, Deliver)]
            # Deliveries never sent go back as they were, not flagged redelivered: no one saw them.
            unsent = {entry[0]: entry[5] for f in collected if isinstance(f, Deliver) for entry in f.entries}
        except Exception as exc:
            LOGGER.error("connection %d: collecting its last frames failed", session.conn_id, exc_info=exc)
        try:
            self.core.close_session(session, unsent)
        except Exception as exc:
            LOGGER.error("connection %d: closing its session failed", session.conn_id, exc_info=exc)
        self.server.connections.pop(session.conn_id, None)
        if reason.error:
            frames.append(Error(reason.code, reason.text, reason.frame_seq))
            self.core.errors_sent[reason.code] += 1
        if not self.conn.closed_by_us:
            frames.append(Close(reason.code, reason.text))
            await _send_and_close(self.io, self.conn, frames, self._unsent)
        else:
            await self.io.close()
        self.server.closed += 1
        self.server.log_closed(session.conn_id, reason.code, reason.text)
