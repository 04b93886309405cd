"""The blocking API: the trio SDK for plain Python (scripts, threads, Spark executors).

Why a thread rather than a second implementation: the flow-control semantics (credit, window,
deadlines, buffer acks, noops) live in one place. `connect()` starts a dedicated thread running
`trio.run`; the connection and its tasks live there; each blocking method calls in with
`trio.from_thread.run(..., trio_token=...)` and returns or raises what the trio method did. Closing
the connection (or leaving its `with` block) ends the thread, and raises what leaving the trio block
raises (`PublishFailures`). Every blocking call that can wait takes a deadline (`timeout`), with the same
defaults as the trio API; a thread hop waits only for the trio call it makes, which has its deadline.

    with flowbroker.client.blocking.connect("flowbroker://127.0.0.1:5680") as conn:
        producer = conn.producer(routing_key="orders")
        producer.send(b"hello", timeout=5)
        producer.flush(timeout=30)
        with conn.consumer("orders", prefetch=100) as consumer:
            msg = consumer.receive(timeout=5)
            msg.ack()

The methods must not be called from inside the connection's own trio thread.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import trio

from flowbroker.client.connection import Connection, ConnectionStatistics
from flowbroker.client.handshake import connect as trio_connect
from flowbroker.client.consumer import Consumer, ConsumerStatistics, Message
from flowbroker.client.errors import (
    AlreadySettled, BrokerConnectionError, ConnectionClosed, FlowControlTimeout, HandshakeError, PublishFailures,
    ReceiveTimeout, check_timeout,
    stopped_suffix,
)
from flowbroker.client.flow import FlowEvent, FlowEvents, FlowState
from flowbroker.client.interruptible import CANCEL_WAIT, Ended, run_interruptible
from flowbroker.client.producer import Producer, ProducerStatistics
from flowbroker.client.url import DEFAULT_URL
from flowbroker.protocol import Error, ErrorCode, Headers, Welcome

__all__ = ["connect", "BlockingConnection", "BlockingProducer", "BlockingConsumer", "BlockingMessage", "BlockingFlowEvents"]

log = logging.getLogger("flowbroker.client")

P = ParamSpec("P")
T = TypeVar("T")


class _BlockRaised(Exception):
    """Raised inside the trio thread's `async with` when the blocking `with` block raised, so that the
    trio connection closes as for a block that raised: nothing waited for, failures logged, not raised."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(repr(original))
        self.block_error_name = type(original).__name__


_open: weakref.WeakSet[BlockingConnection] = weakref.WeakSet()
"""Connections whose thread has not ended (their thread holds them: weak only so as to add no cycle)."""


@atexit.register
def _close_at_exit() -> None:
    """Close, as `close()` does, what the application left open when the interpreter exits. The connection's
    thread is a daemon (it must not keep a process alive), so a process that ended without `close()` lost
    what was queued and not yet written, without a word (a tester's). Failures are logged, not raised."""
    for conn in list(_open):
        try:
            conn.close()
        except Exception as exc:
            log.warning("flowbroker blocking connection %s, closed at exit: %s", conn._url, exc)


def connect(url: str = DEFAULT_URL, **options: Any) -> BlockingConnection:
    """Connect (TCP + handshake within `timeout`, default 10 s) and return a BlockingConnection.
    Takes the keyword arguments of `flowbroker.client.connect`."""
    return BlockingConnection(url, **options)


class BlockingConnection:
    """A trio `Connection` running in its own thread; use as a context manager or call `close()`."""

    def __init__(self, url: str = DEFAULT_URL, **options: Any) -> None:
        self._url = url
        self._options = options
        # (an Ended, not a threading.Event: an interrupted Event.wait can leave its Condition's lock held,
        # and the thread's set() then blocked for good, with its connection open, a tester)
        self._ready = Ended()
        self._ended = Ended()
        """Set when the thread's run has ended: waited for instead of `Thread.join`, which on CPython 3.11,
        interrupted (Ctrl-C), marks the thread stopped while it runs on (bpo-45274): a close() interrupted
        so said is_closed, and the next close() returned at once without its PublishFailures (a tester)."""
        self._startup_error: BaseException | None = None
        self._conn: Connection | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._block_error: BaseException | None = None
        """The exception the `with` block raised, if any (see `_BlockRaised`)."""
        self._close_failures: PublishFailures | None = None
        """What leaving the trio block raised, for `close()` to raise in the caller's thread."""
        self._thread_error: BaseException | None = None
        """What ended the connection's thread unexpectedly after connecting (a bug): logged, and named by
        the ConnectionClosed every later call raises."""
        self._abandoned = False
        """`connect()` gave up (Ctrl-C, or the thread did not start in time): the thread is to stop."""
        self._early_token: trio.lowlevel.TrioToken | None = None
        self._connect_scope: trio.CancelScope | None = None
        timeout = float(options.get("timeout", 10.0))
        check_timeout("connect", timeout)
        timeout = max(timeout, 0.0)
        self._options["timeout"] = timeout
        self._thread = threading.Thread(target=self._thread_main, name=f"flowbroker {url}", daemon=True)
        try:
            # (start() inside: Thread.start waits on an Event that Ctrl-C may interrupt, with the thread
            # started and connecting; outside this try, nobody stopped it, and neither it nor its
            # connection was closed, a tester: 2-16 left in 100 interrupted connects)
            self._thread.start()
            started = self._ready.wait(timeout + 5.0)
            if started and self._startup_error is None:
                _open.add(self)
        except BaseException:  # Ctrl-C: no connection may be left behind, nor its thread
            _open.discard(self)
            self._abandon()
            raise
        if not started:
            self._abandon()
            raise HandshakeError(f"the connection thread did not start within {timeout + 5.0:g} s")
        if self._startup_error is not None:
            self._wait_ended(None)
            raise self._startup_error

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # anything that escaped trio: report it to connect() if still waiting
            if not self._ready.is_set():
                self._startup_error = exc
            else:  # never silently: every later call says the thread failed, and why
                self._thread_error = exc
                log.error("flowbroker blocking connection %s: its thread failed", self._url, exc_info=exc)
        finally:
            self._ready.set()
            self._ended.set()

    def _wait_ended(self, timeout: float | None) -> bool:
        """Wait for the thread's run to end (at most `timeout` seconds), then for the thread's exit, which
        follows at once; True if it ended."""
        if not self._ended.wait(timeout):
            return False
        self._thread.join(CANCEL_WAIT)  # interrupted, no harm: only `_ended` is relied on
        return True

    def _abandon(self) -> None:
        """Tell the thread to stop (cancel the connect, or close the connection it made) and wait for it,
        at most CANCEL_WAIT. (The thread reads `_abandoned` after publishing its token, and this reads the
        token after setting `_abandoned`: one of the two sees the other.)"""
        self._abandoned = True
        token = self._early_token
        if token is not None:
            try:
                token.run_sync_soon(self._stop_soon)
            except trio.RunFinishedError:
                return
        self._wait_ended(CANCEL_WAIT)

    def _stop_soon(self) -> None:
        """In the thread: end the connect, or the connection, that nobody will use."""
        if self._connect_scope is not None:
            self._connect_scope.cancel()
        if self._stop is not None:
            self._stop.set()

    async def _main(self) -> None:
        self._early_token = trio.lowlevel.current_trio_token()
        if self._abandoned:
            return
        conn: Connection | None = None
        with trio.CancelScope() as self._connect_scope:
            try:
                conn = await trio_connect(self._url, **self._options)
            except Exception as exc:
                self._startup_error = exc
                return
        self._connect_scope = None
        if conn is None:  # cancelled by `_abandon`
            return
        try:
            async with conn:
                self._conn = conn
                self._token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                if self._abandoned:
                    self._stop.set()
                self._ready.set()
                await self._stop.wait()
                if self._block_error is not None:
                    raise _BlockRaised(self._block_error)
        except _BlockRaised:
            pass
        except PublishFailures as exc:
            self._close_failures = exc

    # -------------------------------------------------------------- calling into the trio thread

    def _run(self, afn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        return self._call(functools.partial(afn, *args, **kwargs))

    def _call(self, call: Callable[[], Awaitable[T]], undo: Callable[[T], None] | None = None,
              restore: Callable[[BaseException], None] | None = None) -> T:
        """Run `call` in the connection's thread; an exception in this thread (Ctrl-C) cancels it there
        (client/interruptible.py), `undo` takes back what it returned too late to be cancelled, and
        `restore` what it raised that this thread, interrupted, never saw."""
        if self._token is None:
            raise ConnectionClosed(ErrorCode.NORMAL, "not connected")
        try:
            return run_interruptible(self._token, call, undo, restore)
        except trio.RunFinishedError:
            raise self._gone() from None

    def _run_sync(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self._token is None:
            raise ConnectionClosed(ErrorCode.NORMAL, "not connected")
        try:
            return trio.from_thread.run_sync(functools.partial(fn, *args, **kwargs), trio_token=self._token)
        except trio.RunFinishedError:
            raise self._gone() from None

    def _gone(self) -> ConnectionClosed:
        if self._thread_error is not None:
            failure = self._thread_error
            return ConnectionClosed(ErrorCode.INTERNAL_ERROR, f"the connection thread failed: {failure!r}")
        error = self._conn.close_error if self._conn is not None else None
        if isinstance(error, ConnectionClosed):
            return error
        return ConnectionClosed(ErrorCode.NORMAL, "the connection thread has ended")

    @property
    def connection(self) -> Connection:
        """The underlying trio connection (for reading attributes; call its methods only via this class)."""
        assert self._conn is not None
        return self._conn

    @property
    def is_closed(self) -> bool:
        return self._conn is None or self._conn.is_closed or self._ended.is_set()

    @property
    def close_error(self) -> BaseException | None:
        """Why the connection is closed (None while open): see `Connection.close_error`."""
        return self._conn.close_error if self._conn is not None else None

    @property
    def welcome(self) -> Welcome:
        """The broker's WELCOME (see `Connection.welcome`)."""
        return self.connection.welcome

    @property
    def connection_id(self) -> int:
        return self.connection.connection_id

    @property
    def server_name(self) -> str:
        return self.connection.server_name

    @property
    def broker_run(self) -> str | None:
        """`Connection.broker_run`: the broker process's run id, another after a restart."""
        return self.connection.broker_run

    @property
    def max_message_size(self) -> int:
        return self.connection.max_message_size

    @property
    def reconnecting(self) -> bool:
        """True while a lost connection is being reconnected (see `Connection.reconnecting`)."""
        return self.connection.reconnecting

    @property
    def reconnects(self) -> int:
        """How many times the connection was reconnected (see `Connection.reconnects`)."""
        return self.connection.reconnects

    @property
    def connection_errors(self) -> list[Error]:
        """The newest ERROR frames without a ref_id (at most 32), oldest first: a copy, taken in the
        connection's thread."""
        return self._run_sync(lambda: list(self.connection.connection_errors))

    @property
    def producer_buffer_size(self) -> int:
        """The producer byte buffer the broker grants now (see `Connection.producer_buffer_size`)."""
        return self._run_sync(lambda: self.connection.producer_buffer_size)

    @property
    def consumer_buffer_size(self) -> int:
        return self._run_sync(lambda: self.connection.consumer_buffer_size)

    # -------------------------------------------------------------- lifecycle

    def close(self, timeout: float | None = None) -> None:
        """Close the connection as leaving the trio `async with` block does: wait for the producers'
        outstanding transfers and write what is queued, then CLOSE (all within the connection's
        `close_timeout`), and end the thread. Raises `PublishFailures` for what was refused and not yet
        reported, or not completed in time; `BrokerConnectionError` if the thread has not ended within
        `timeout` (None: `close_timeout` + 5 s), saying what the close still waits for (a `timeout` under
        `close_timeout` ends only this wait: the close goes on, and the next `close()` waits for it and raises
        its `PublishFailures`); `ConnectionClosed` (INTERNAL_ERROR) if the thread failed."""
        check_timeout("close", timeout, "close_timeout + 5 s")  # before the close begins
        if not self._ended.is_set() and self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        limit = float(self._options.get("close_timeout", 5.0)) + 5.0 if timeout is None else max(timeout, 0.0)
        if not self._wait_ended(limit):
            waiting = self._still_closing()
            if not self._ended.is_set():
                raise BrokerConnectionError(f"the connection thread did not end within {limit:g} s{waiting}")
        _open.discard(self)
        failures, self._close_failures = self._close_failures, None
        if failures is not None:
            raise failures
        if self._thread_error is not None:  # raised once, as the failures are
            error = self._gone()
            self._thread_error = None
            raise error

    def _still_closing(self) -> str:
        """What a close that has not ended waits for, for its error's text: a tester's close(timeout=0) said
        only that the thread had not ended, and the messages not completed came out of a second close."""
        try:
            in_flight, stopped = self._run_sync(
                lambda: (self.connection.statistics().transfers_in_flight, self.connection.flow_state.destinations))
        except ConnectionClosed:  # it has just ended
            return ""
        close_timeout = float(self._options.get("close_timeout", 5.0))
        if not in_flight:
            return f": it is still closing (the final write, at most close_timeout {close_timeout:g} s); close() again waits for it"
        return (f": it is still closing, waiting at most close_timeout {close_timeout:g} s for {in_flight} "
                f"message{'s' * (in_flight != 1)} sent and not completed{stopped_suffix(stopped)}; close() again "
                "waits for it and raises PublishFailures for those not completed then")

    def __enter__(self) -> BlockingConnection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close; if the block raised, that exception goes on (failures are logged, not raised)."""
        if exc is not None:
            self._block_error = exc
            try:
                self.close()
            except BrokerConnectionError:
                pass
        else:
            self.close()

    # -------------------------------------------------------------- requests

    def declare_queue(self, name: str, **arguments: Any) -> dict[str, Any]:
        return self._run(self.connection.declare_queue, name, **arguments)

    def declare_exchange(self, name: str, kind: str = "direct", *, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self.connection.declare_exchange, name, kind, timeout=timeout)

    def bind(self, queue: str, exchange: str, binding_key: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self.connection.bind, queue, exchange, binding_key, timeout=timeout)

    def unbind(self, queue: str, exchange: str, binding_key: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self.connection.unbind, queue, exchange, binding_key, timeout=timeout)

    def delete_queue(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self.connection.delete_queue, name, timeout=timeout)

    def purge_queue(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self.connection.purge_queue, name, timeout=timeout)

    def delete_exchange(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self.connection.delete_exchange, name, timeout=timeout)

    def set_buffer_size(self, size: int) -> None:
        self._run(self.connection.set_buffer_size, size)

    @property
    def flow_state(self) -> FlowState:
        return self._run_sync(lambda: self.connection.flow_state)

    def statistics(self) -> ConnectionStatistics:
        """`Connection.statistics()`, taken in the connection's thread."""
        return self._run_sync(self.connection.statistics)

    # -------------------------------------------------------------- producers and consumers

    def producer(
        self,
        exchange: str = "",
        routing_key: str = "",
        *,
        window: int = 1000,
        send_timeout: float = 60.0,
        mandatory: bool = False,
        transport: str = "tcp",
        stream_id: int | None = None,
        udp_endpoint: str | None = None,
        producer_id: str | None = None,
        idempotent: bool = False,
    ) -> BlockingProducer:
        """`Connection.producer`; `transport="udp"` sends over the broker's UDP data path; `idempotent=True`
        numbers the messages under `producer_id` and survives a lost connection (docs/client.md)."""
        producer = self._run_sync(
            self.connection.producer, exchange, routing_key, window=window, send_timeout=send_timeout,
            mandatory=mandatory, transport=transport, stream_id=stream_id, udp_endpoint=udp_endpoint,
            producer_id=producer_id, idempotent=idempotent,
        )
        return BlockingProducer(self, producer)

    def consumer(self, queue: str = "", *, prefetch: int = 1000, buffer_size: int = 0, transport: str = "tcp",
                 stream_id: int | None = None, exchange: str | None = None, group: str | None = None,
                 multicast: str = "", fc: str = "min", interface: str | None = None) -> BlockingConsumer:
        """`Connection.consumer`; `transport="udp"` receives over the broker's UDP data path, and with
        `exchange=..., group=..., multicast=...` as a member of a multicast group."""
        consumer = self._run_sync(self.connection.consumer, queue, prefetch=prefetch, buffer_size=buffer_size,
                                  transport=transport, stream_id=stream_id, exchange=exchange, group=group,
                                  multicast=multicast, fc=fc, interface=interface)
        return BlockingConsumer(self, consumer)


class BlockingProducer:
    """`Producer` with blocking methods; same deadlines and errors. As a context manager, leaving the
    `with` block waits for its outstanding transfers and raises `PublishFailures` as the trio one does."""

    def __init__(self, conn: BlockingConnection, producer: Producer) -> None:
        self._conn = conn
        self._producer = producer

    def __enter__(self) -> BlockingProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        producer = self._producer
        self._conn._call(functools.partial(producer.__aexit__, exc_type, exc, tb), restore=producer._restore_errors)

    def send(
        self,
        body: bytes,
        headers: Headers | None = None,
        routing_key: str | None = None,
        *,
        timeout: float | None = None,
        block: bool = True,
    ) -> int:
        return self._conn._run(self._producer.send, body, headers, routing_key, timeout=timeout, block=block)

    def send_many(
        self, bodies: Iterable[bytes], headers: Headers | None = None, routing_key: str | None = None, *,
        timeout: float | None = None,
    ) -> int:
        """Send several messages in one call into the trio thread (one thread hop instead of one per
        message: use it for throughput). `timeout` bounds the whole call. Returns how many were sent;
        on an error, the messages before it were sent (see `statistics().sent`)."""
        items = list(bodies)
        producer = self._producer
        check_timeout("send", timeout, "send_timeout")  # (NaN made a deadline no wait could reach: 0 s)
        limit = producer.send_timeout if timeout is None else timeout

        async def send_all() -> int:
            deadline = trio.current_time() + limit
            for body in items:
                try:
                    await producer.send(body, headers, routing_key, timeout=max(0.0, deadline - trio.current_time()))
                except FlowControlTimeout as exc:  # said the time left for the last message, not the call's
                    raise FlowControlTimeout(str(exc).replace(f"after {exc.timeout:g} s", f"after {limit:g} s", 1),
                                             exc.destinations, exc.limit, limit) from None
            return len(items)

        return self._conn._run(send_all)

    def send_batch(
        self, messages: Iterable[tuple[bytes, Headers | None, str | None]], *, timeout: float | None = None,
    ) -> int:
        """Send `(body, headers, routing_key)` messages in one call into the trio thread, each with its own
        headers and routing key (None: the producer's). Unlike `send_many`, `timeout` bounds each message's
        wait for credit, as `send`'s does (None: `send_timeout`), not the whole call: a batch paced by a
        slow consumer takes as long as it must, and only a broker that grants nothing for `timeout`
        seconds raises `FlowControlTimeout`. Returns how many were sent; on an error, the messages before
        it were sent. (The Spark data source sends each partition's rows through it.)"""
        items = list(messages)
        producer = self._producer

        async def send_all() -> int:
            for body, headers, routing_key in items:
                await producer.send(body, headers, routing_key, timeout=timeout)
            return len(items)

        return self._conn._run(send_all)

    def flush(self, timeout: float | None = None) -> None:
        producer = self._producer
        self._conn._call(functools.partial(producer.flush, timeout), restore=producer._restore_errors)

    @property
    def flow_state(self) -> FlowState:
        return self._conn._run_sync(lambda: self._producer.flow_state)

    def statistics(self) -> ProducerStatistics:
        """`Producer.statistics()`, taken in the connection's thread."""
        return self._conn._run_sync(self._producer.statistics)

    @property
    def stats(self) -> ProducerStatistics:
        """`statistics()`, by its name before issue 9 (kept for one release)."""
        return self.statistics()

    @property
    def outstanding(self) -> int:
        return self._producer.outstanding

    def flow_events(self, max_buffered: int = 256) -> BlockingFlowEvents:
        return BlockingFlowEvents(self._conn, self._conn._run_sync(self._producer.flow_events, max_buffered))


class BlockingFlowEvents:
    """Flow events for blocking code: `get(timeout)` returns the next event, or None on timeout or close."""

    def __init__(self, conn: BlockingConnection, events: FlowEvents) -> None:
        self._conn = conn
        self._events = events

    @property
    def dropped(self) -> int:
        """Events dropped because this watcher fell behind (the oldest go first; see `FlowEvents.dropped`)."""
        return self._events.dropped

    def get(self, timeout: float | None = None) -> FlowEvent | None:
        """The next event, waiting at most `timeout` seconds (None: no deadline; negative: as 0)."""
        check_timeout("flow events get", timeout, "no deadline")
        events = self._events

        async def get() -> FlowEvent | None:
            with trio.move_on_after(float("inf") if timeout is None else max(timeout, 0.0)):
                return await events.get()
            return None

        return self._conn._run(get)

    def close(self) -> None:
        try:
            self._conn._run_sync(self._events.aclose_nowait)
        except ConnectionClosed:
            pass

    def __enter__(self) -> BlockingFlowEvents:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class BlockingMessage:
    """A delivered message; `ack()`, `reject()`, `requeue()` block only for the thread hop."""

    def __init__(self, conn: BlockingConnection, message: Message) -> None:
        self._conn = conn
        self._message = message
        self.body = message.body
        self.headers = message.headers
        self.exchange = message.exchange
        self.routing_key = message.routing_key
        self.redelivered = message.redelivered
        self.delivery_tag = message.delivery_tag

    def ack(self) -> None:
        self._conn._run(self._message.ack)

    def reject(self) -> None:
        self._conn._run(self._message.reject)

    def requeue(self) -> None:
        self._conn._run(self._message.requeue)

    def __repr__(self) -> str:
        return f"BlockingMessage(delivery_tag={self.delivery_tag}, routing_key={self.routing_key!r}, body={self.body[:32]!r})"


class BlockingConsumer:
    """A subscription: `with conn.consumer(q) as c:` then `c.receive(timeout=...)` or `for msg in c`."""

    def __init__(self, conn: BlockingConnection, consumer: Consumer) -> None:
        self._conn = conn
        self._consumer = consumer

    def __enter__(self) -> BlockingConsumer:
        self.subscribe()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def subscribe(self, timeout: float | None = None) -> None:
        self._conn._run(self._consumer.subscribe, timeout)

    def close(self, timeout: float | None = None) -> None:
        try:
            self._conn._run(self._consumer.aclose, timeout)
        except ConnectionClosed:
            pass

    def receive(self, timeout: float | None = None) -> BlockingMessage:
        """The next message; raises ReceiveTimeout after `timeout` seconds (None: no deadline),
        `ConsumerClosed` (a trio.EndOfChannel) once the consumer or its connection is closed by the
        application, the connection's error if it failed. Subscribes
        first if the consumer was never entered, within the same deadline. Interrupted (Ctrl-C), it takes
        no message: one it took too late to be cancelled goes back to the front of the buffer. (The
        BlockingMessage is made in the trio call: made here, after it, an interrupt landing in its making lost
        the message to the application and to the buffer both, a tester's t3b_ki_lost_receive.py.)"""
        consumer = self._consumer
        conn = self._conn

        async def take() -> BlockingMessage:
            return BlockingMessage(conn, await consumer.receive(timeout))

        return conn._call(take, lambda m: consumer._give_back([m._message]))

    def receive_many(self, limit: int, timeout: float) -> list[BlockingMessage]:
        """Up to `limit` messages in one thread hop: waits at most `timeout` seconds for the first (0: only
        takes what is buffered), then takes only those already buffered (never waits for more). Returns [] when none came in time, and
        once the consumer is closed. Subscribes first if the consumer was never entered."""
        consumer = self._consumer
        conn = self._conn

        async def take() -> list[BlockingMessage]:
            taken: list[BlockingMessage] = []
            if limit <= 0:
                return taken
            try:
                taken.append(BlockingMessage(conn, await consumer.receive(timeout)))  # a buffered one: at once
            except (ReceiveTimeout, trio.EndOfChannel):
                return taken
            with trio.CancelScope(shield=True):  # buffered: no wait, and none lost to a cancel midway
                while len(taken) < limit and consumer.buffered:
                    taken.append(BlockingMessage(conn, await consumer.receive(None)))
            return taken

        return self._conn._call(take, lambda taken: consumer._give_back([m._message for m in taken]))

    def ack_many(self, messages: Iterable[BlockingMessage]) -> None:
        """Acknowledge several messages in one thread hop (settled together, in SETTLE ranges). Every one
        that can be is acked; then the first AlreadySettled, if any was settled already, is raised, naming
        how many of them: it stopped at the first, leaving the rest unsettled and not saying which (a tester)."""
        targets = [m._message for m in messages]

        async def ack_all() -> None:
            refused: list[AlreadySettled] = []
            for message in targets:
                try:
                    await message.ack()
                except AlreadySettled as exc:
                    refused.append(exc)
            if refused:
                rest = "the others are acked" if len(refused) < len(targets) else "none was acked"
                raise AlreadySettled(f"{refused[0]} ({len(refused)} of the {len(targets)} messages were settled "
                                     f"already or their consumer closed; {rest})")

        self._conn._run(ack_all)

    def statistics(self) -> ConsumerStatistics:
        """`Consumer.statistics()`, taken in the connection's thread."""
        return self._conn._run_sync(self._consumer.statistics)

    @property
    def stats(self) -> ConsumerStatistics:
        """`statistics()`, by its name before issue 9 (kept for one release)."""
        return self.statistics()

    def set_buffer_size(self, size: int) -> None:
        self._conn._run(self._consumer.set_buffer_size, size)

    def __iter__(self) -> Iterator[BlockingMessage]:
        while True:
            try:
                yield self.receive()
            except trio.EndOfChannel:
                return
