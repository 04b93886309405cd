"""The consumer: a subscription as an async iterator of messages, with settlement and buffer acks.

Two separate things flow back to the broker, as in DCP:

- **Settlement** (`ack`, `reject`, `requeue`) dequeues or returns a message; it is what frees `prefetch`
  slots and can clear a saturated queue upstream. The writer coalesces tags into SETTLE ranges.
- **Buffer acknowledgements** return *byte* credit when a message has been *processed*: settled, or the
  application moved on to the next message (its handler returned). The SDK sends them by itself, via
  `ReceiverWindow`: after 20 % of the buffer or 50 KiB, and from the timer every 5 s. Both the
  subscription's buffer (`buffer_size`) and the connection's (`conn.set_buffer_size`) are honoured.

**The reader never waits for the application.** The connection's reader appends each DELIVER frame to
the consumer's buffer and goes on at once: a reader that waited for a slow application would hold up
every COMPLETE, BUFFER_ACK and FLOW frame behind it, stalling the producers and other consumers on the
same connection. The buffer is still bounded, by the consumer credit the broker honours:

- every message in it is delivered and not settled, and the broker delivers on a subscription only
  while its unsettled deliveries are under the prefetch in force (the SUBSCRIBE's `prefetch`, lowered
  to the broker's `max_prefetch`, which is also what 0 means; the OK answer says which). So it holds at
  most `prefetch` messages, each at most `max_message_size`;
- with a byte buffer (the subscription's or the connection's), at most that buffer and one message more,
  because the broker starts a message only while its unacknowledged bytes are under the buffer size.

The first bound is checked here, not trusted: the SDK counts a subscription's unsettled deliveries
(`Consumer._unsettled`), which can only be fewer than the broker's count (a settlement counts here before
the broker hears of it, a delivery only once it has arrived), so a DELIVER that takes them over the
prefetch in force is the broker breaking its credit: `ProtocolViolation` (CREDIT_VIOLATION), and the
connection closes. (Between SUBSCRIBE and its OK, a subscription with prefetch 0 has no known bound;
the broker answers SUBSCRIBE before it delivers on it, so nothing arrives in that gap.)

**Byte positions count from the start, whatever the size.** Every processed delivery is counted on its
subscription's and the connection's `ReceiverWindow`, even while their buffer size is 0, because the
broker counts every delivered byte (`SenderWindow.position`) from the start. So turning a buffer on
mid-stream acknowledges at once everything processed so far, and nothing the broker counted is left
unacknowledged (that stalled a consumer for good when the SDK restarted its count at 0).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from types import TracebackType
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from flowbroker.client.errors import AlreadySettled, ConsumerClosed, PublishError, ReceiveTimeout, check_timeout
from flowbroker.protocol import DeliveryEntry, Frame, Headers, Outcome, ReceiverWindow, Subscribe, message_size
from flowbroker.protocol.credit import MESSAGE_OVERHEAD

if TYPE_CHECKING:
    from flowbroker.client.connection import Connection, _PendingRequest

__all__ = ["Consumer", "ConsumerStatistics", "ConsumerStats", "Message"]

YIELD_EVERY = 128

_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
"""Bound once: the iterator calls it per message."""

_ACK, _REJECT, _REQUEUE = Outcome.ACK, Outcome.REJECT, Outcome.REQUEUE
"""An enum member looked up on its class costs a Python-level attribute lookup (~75 ns): per message, once."""


@dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    """A subscription's counters, and the consumer credit it grants the broker: `prefetch_in_force`
    messages unsettled at most (`unsettled` are), and, with a byte `window`, at most that many bytes
    delivered and not acknowledged (`position - acked_position`; one message may overflow it).
    Bytes are `message_size(body, headers)`, as the broker counts them, since the subscription began."""

    received: int
    """Deliveries received on this subscription."""
    unsettled: int
    """Received and not yet acked, rejected or requeued: the count credit in use."""
    buffered: int
    """Received and not yet handed to the application."""
    prefetch_in_force: int | None
    """The bound on `unsettled` the broker applies (None until the OK for prefetch 0)."""
    window: int
    """This subscription's byte buffer, `buffer_size` (0: off; the connection's may still apply)."""
    position: int
    """Bytes received."""
    consumed_position: int
    """Bytes of messages processed: settled, or the application asked for the next message."""
    acked_position: int
    """Of those, acknowledged to the broker with BUFFER_ACK (due after 20 % of the buffer or 50 KiB, and
    every 5 s; counted whatever the buffer size, acknowledged only while it is not 0)."""

    # The names of `ConsumerStats` before issue 9, kept for one release.
    @property
    def buffer_size(self) -> int:
        """`window` (its name before issue 9)."""
        return self.window

    @property
    def received_bytes(self) -> int:
        """`position` (its name before issue 9)."""
        return self.position

    @property
    def processed_bytes(self) -> int:
        """`consumed_position` (its name before issue 9)."""
        return self.consumed_position

    @property
    def acked_bytes(self) -> int:
        """`acked_position` (its name before issue 9)."""
        return self.acked_position


ConsumerStats = ConsumerStatistics
"""The name of `ConsumerStatistics` before issue 9, kept for one release (`consumer.stats`)."""


RELEASE_NEVER = 1 << 62
"""`Consumer._release_at` when nothing is due: a position no subscription reaches (an int: comparing an int
with float('inf') costs several times an int comparison)."""


@dataclass(eq=False, slots=True)
class Message:
    """A delivered message. Settle it once with `ack()`, `reject()` or `requeue()`.

    Settling cannot block: those yield to other tasks only once per YIELD_EVERY settlements, and are
    not cancel points (in a cancelled scope they still settle; the next message raises Cancelled)."""

    body: bytes
    headers: Headers | None
    exchange: str
    routing_key: str
    redelivered: bool
    delivery_tag: int
    _consumer: Consumer = field(repr=False)
    _size: int = field(repr=False)
    """`message_size(body, headers)`, taken on arrival (the application may change `headers` later)."""
    settled: Outcome | None = None
    _unprocessed: bool = field(default=True, repr=False)
    """Not yet counted as processed on the consumer's and the connection's byte positions."""

    async def ack(self) -> None:
        """Processed: the broker dequeues it."""
        if self._settle_counted(_ACK):
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def reject(self) -> None:
        """Unprocessable: the broker dequeues and discards it."""
        if self._settle_counted(_REJECT):
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def requeue(self) -> None:
        """Give it back: ready again at the broker, marked redelivered."""
        if self._settle_counted(_REQUEUE):
            await trio.lowlevel.cancel_shielded_checkpoint()

    def settle_nowait(self, outcome: Outcome) -> None:
        self._settle_counted(outcome)

    def _settle_counted(self, outcome: Outcome) -> bool:
        """`settle_nowait`, counted towards the next yield: True when one is due (one level of call for
        `ack`, not two: settling is the consumer's per-message path).

        `ack`, `reject` and `requeue` yield only once per YIELD_EVERY settlements, like the iterator:
        yielding on every ack let the writer send each settlement in its own SETTLE frame, which locked
        broker and consumer into one-message round trips (measured: 45,000 SETTLE frames for 60,000
        messages). Unsent settlements still go out as soon as the consumer waits for its next message.
        Nor are they cancel points: settling is bookkeeping that cannot block, so it is done even in a
        cancelled scope; the iterator checks for cancellation at every message, once is enough.
        """
        if self.settled is not None:
            raise AlreadySettled(f"delivery {self.delivery_tag} was already settled ({self.settled.name})")
        consumer = self._consumer
        if consumer._settles_over_tcp:
            if consumer._requeued_by is not None:
                # On a closed connection ConnectionClosed, whichever closed first, as the blocking API
                # says (it raised AlreadySettled here when the consumer had closed before it, a tester).
                consumer._conn._check_open()
                raise AlreadySettled(f"delivery {self.delivery_tag} cannot be settled: its consumer of {consumer.queue!r} "
                                     f"{consumer._requeued_by}, and the broker requeued it (it may be delivered again, to "
                                     "any consumer): settle a message before its consumer closes")
            connection = consumer._conn
            tag = self.delivery_tag
            if tag == connection._run_next and outcome is connection._run_outcome:  # `_settle_tag`'s common case
                connection._run_next = tag + 1
            else:
                connection._settle_tag(outcome, tag)
        self.settled = outcome
        consumer._unsettled -= 1
        if self._unprocessed:  # `_mark_processed` inlined
            self._unprocessed = False
            sub = consumer._receiver_window
            conn = consumer._conn_receiver_window
            if sub.window or conn.window:
                consumer._conn._processed(self._size, sub)
            else:
                sub.consumed_position += self._size
                conn.consumed_position += self._size
            release = consumer._on_processed  # the UDP consumer's: its image may advance past it
            if release is not None and sub.consumed_position >= consumer._release_at:
                release()
        since = consumer._settles_since_yield + 1
        if since >= YIELD_EVERY:
            consumer._settles_since_yield = 0
            return True
        consumer._settles_since_yield = since
        return False

    def _mark_processed(self) -> None:
        """Count it processed, once. The common case (no byte buffer on) is two additions inline. The UDP
        consumer is told too (`_on_processed`, once `_release_at` is reached), as when it is settled first:
        a message settled only after the next one was taken was never released in the image, and an
        application that settles each message after taking the next stalled its UDP consumer for good once
        its window was used."""
        if self._unprocessed:
            self._unprocessed = False
            consumer = self._consumer
            sub = consumer._receiver_window
            conn = consumer._conn_receiver_window
            if sub.window or conn.window:
                consumer._conn._processed(self._size, sub)
            else:
                sub.consumed_position += self._size
                conn.consumed_position += self._size
            release = consumer._on_processed
            if release is not None and sub.consumed_position >= consumer._release_at:
                release()


class Consumer:
    """A subscription to `queue`. `async with conn.consumer(q) as c: async for msg in c: ...`.

    Entering the block subscribes; so does the first `receive()` or `async for` step of a consumer that
    was never entered (within that call's deadline), so a consumer used without `async with` still gets
    its messages (then close it with `aclose()`). Iteration ends when the consumer or the connection is
    closed normally; if the connection failed, its error (e.g. `ConnectionClosed`) is raised instead,
    and if the broker deleted the queue, `NotFound` naming it (after the messages already received).
    """

    _settles_over_tcp = True
    """False for a multicast group's member: its processing is its settlement (client/groupconsumer.py)."""
    transport = "tcp"
    """How its deliveries come: "tcp", or "udp" for a UdpConsumer (a multicast member's are "udp" too)."""

    def __init__(self, conn: Connection, queue: str, subscription_id: int, *, prefetch: int = 1000, buffer_size: int = 0) -> None:
        if prefetch < 0 or buffer_size < 0:
            raise ValueError("prefetch and buffer_size must be >= 0")
        from flowbroker.client.connection import _now_ns

        self._conn = conn
        self.queue = queue
        self.subscription_id = subscription_id
        self.prefetch = prefetch
        self.prefetch_in_force: int | None = prefetch or None
        """The bound on unsettled deliveries the broker applies: `prefetch`, or lower if the broker's OK
        says so; None until the OK for prefetch 0 (the broker's cap)."""
        self.buffer_size = buffer_size
        self._receiver_window = ReceiverWindow(buffer_size, opaque=subscription_id, last_sent_ns=_now_ns())
        """This subscription's byte positions (counted whatever the size: see the module docstring)."""
        self._conn_receiver_window = conn._receiver_window
        # The hand-off from the connection's reader: whole DELIVER frames are appended, never waited
        # for; bounded by the prefetch in force (see the module docstring). `_ended`: no message will
        # be added (closed, or the connection or the queue went away); what is buffered can still be taken.
        self._buffered: collections.deque[Message] = collections.deque()
        self._unsettled = 0
        """Deliveries received and not settled (those in `_buffered` among them): at most the prefetch."""
        self._received = 0
        self._received_bytes = 0
        self._ended = False
        self._readable = trio.lowlevel.ParkingLot()  # receivers waiting for a message
        self._current: Message | None = None
        self._since_yield = 0
        self._settles_since_yield = 0  # see Message._settle_counted
        self._subscribed = False
        """The broker's OK to SUBSCRIBE has arrived (set by the reader)."""
        self._subscribing: tuple[int, _PendingRequest] | None = None
        """The SUBSCRIBE sent and not yet answered: its request id and pending answer."""
        self._closed = False
        self._error: PublishError | None = None  # the queue was deleted
        self._requeued_by: str | None = None
        """Why the broker's subscription ended and it requeued what was handed out and not settled ("is
        closed"): settling one of those now would settle nothing, so it raises `AlreadySettled`. (Only a
        warning from the broker said so; the application believed it acked a message another consumer got.)"""
        self._release_at = RELEASE_NEVER
        """The subscription's processed position (`consumed_position`) at which `_on_processed` is due:
        client/udpconsumer.py sets it to the end of the oldest payload its image holds, so a processed
        message costs one comparison here, not a call."""
        self._on_processed: Callable[[], None] | None = None
        """What `_release_at` calls (client/udpconsumer.py); None for a TCP consumer, which checks nothing more."""

    @property
    def buffered(self) -> int:
        """Messages received and not yet handed to the application."""
        return len(self._buffered)

    def statistics(self) -> ConsumerStatistics:
        """A snapshot of the subscription's counters and the credit it grants the broker."""
        positions = self._receiver_window
        return ConsumerStatistics(
            self._received,
            self._unsettled,
            len(self._buffered),
            self.prefetch_in_force,
            self.buffer_size,
            self._received_bytes,
            positions.consumed_position,
            positions.acked_position,
        )

    @property
    def stats(self) -> ConsumerStatistics:
        """`statistics()`, by its name before issue 9 (kept for one release)."""
        return self.statistics()

    # -------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Consumer:
        try:
            await self.subscribe()
        except BaseException:
            # The block never starts, so its exit never closes the consumer: a refused UDP consumer kept
            # its socket open (a ResourceWarning in the tests).
            with trio.CancelScope(shield=True):
                await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()

    def _subscribe_frame(self, request_id: int) -> Frame:
        """The request that subscribes (SUBSCRIBE; the UDP consumer's is SUBSCRIBE_UDP)."""
        return Subscribe(request_id, self.subscription_id, self.queue, self.prefetch, self.buffer_size)

    async def subscribe(self, timeout: float | None = None) -> None:
        """SUBSCRIBE and wait for the broker's OK, at most `timeout` (None: the connection's
        `request_timeout`) -> `RequestTimeout`. `async with` does this, and so does the first `receive()`
        or iteration step; once subscribed it returns at once. A SUBSCRIBE not answered in time is not
        abandoned: the subscription is taken when its OK comes, and the next call waits for it again.
        Raises `RequestError` (e.g. `NOT_FOUND` for a missing queue) if the broker refused it, and
        RuntimeError for a closed consumer."""
        if self._subscribed:
            await trio.lowlevel.checkpoint()
            return
        if self._closed:
            raise RuntimeError(f"the consumer of {self.queue!r} is closed")
        conn = self._conn
        if self._subscribing is None:
            self._subscribing = conn._send_subscribe(self)
        request_id, pending = self._subscribing
        await conn._await_answer(request_id, pending, timeout, keep=True)

    async def aclose(self, timeout: float | None = None) -> None:
        """Cancel the subscription. Messages received but never handed to the application are requeued
        first; messages handed out and not settled are left to the broker's cancel (it requeues them).
        Waits at most `timeout` (None: the connection's `close_timeout`) for the broker's answers."""
        check_timeout("consumer close", timeout, "close_timeout")  # (the cancel's errors are not raised)
        if self._closed:
            return
        self._closed = True
        self._mark_current_processed()
        pending = self._buffered
        requeue = not self._conn.is_closed
        while pending:
            msg = pending.popleft()
            if requeue:
                msg.settle_nowait(Outcome.REQUEUE)
            else:
                msg._mark_processed()
        if requeue:  # (on a closed connection, settling raises ConnectionClosed)
            self._requeued_by = "is closed"
        self._end()
        # A SUBSCRIBE still unanswered is left to the reader: its OK cancels the subscription at once
        # (`_on_subscribed`), its ERROR forgets the consumer (`_on_subscribe_refused`).
        if self._subscribed:
            limit = self._conn.close_timeout if timeout is None else timeout
            try:
                await self._conn._cancel(self, limit)
            except Exception:  # the broker may be gone; the subscription is over on our side regardless
                pass
        else:
            await trio.lowlevel.checkpoint()

    async def set_buffer_size(self, size: int) -> None:
        """Change this subscription's byte buffer mid-stream (DCP `stream_buffer_size`; 0 = off). Turning
        it on acknowledges at once every byte processed so far (positions count from the start)."""
        if size < 0:
            raise ValueError("buffer size must be >= 0")
        self._conn._check_open()
        self.buffer_size = size
        self._conn._set_buffer(self._receiver_window, size)
        await trio.lowlevel.checkpoint()

    # -------------------------------------------------------------- receiving

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        # The common case of `_next` inlined (iteration is the hot path: one coroutine level less).
        current = self._current
        if current is not None:
            self._current = None
            if current._unprocessed:
                current._mark_processed()
        since = self._since_yield + 1
        buffered = self._buffered
        if since < YIELD_EVERY and buffered:
            self._since_yield = since
            await _checkpoint_if_cancelled()
            msg = buffered.popleft()
            self._current = msg
            return msg
        next_msg = await self._next()
        if next_msg is None:
            raise StopAsyncIteration
        return next_msg

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message, waiting at most `timeout` seconds (None: no deadline) -> ReceiveTimeout.
        Subscribes first if the consumer was never entered (within the same deadline; with none, the
        connection's `request_timeout` bounds the SUBSCRIBE -> `RequestTimeout`). Raises
        `ConsumerClosed` (a trio.EndOfChannel) when the consumer or its connection was closed by the
        application, the connection's error if it failed. A message
        already buffered is handed out whatever the deadline, so `receive(0)` polls."""
        check_timeout("receive", timeout, "no deadline")
        if timeout is not None and timeout <= 0:
            # A deadline already passed is 0; it would cancel even a buffered message's checkpoint, and an
            # ended consumer's answer (ConsumerClosed, or its connection's error), which does not wait:
            # a polling loop catching ReceiveTimeout never learned that its consumer was closed (a tester).
            timeout = None if self._buffered or self._ended else 0.0
        if not self._subscribed and self._subscribing is None and not self._closed and not self._ended:
            # Never entered: the SUBSCRIBE goes out now, whatever the deadline, so that polling with
            # receive(0) subscribes (a passed deadline would cancel subscribe() before it sent it) and a
            # later call finds the subscription made.
            self._conn._check_open()
            self._subscribing = self._conn._send_subscribe(self)
        with trio.move_on_after(timeout if timeout is not None else float("inf")):
            msg = await self._next()
            if msg is None:
                why = "it was closed" if self._closed else "its connection was closed by the application"
                raise ConsumerClosed(f"consumer of {self.queue!r} has no more messages: {why}")
            return msg
        raise ReceiveTimeout(f"no message from {self.queue!r} within {timeout:g} s")

    async def _next(self) -> Message | None:
        # Asking for the next message means the previous one was handled: count it as processed.
        self._mark_current_processed()
        # Hand out buffered messages without yielding, and yield once per YIELD_EVERY: yielding per
        # message lets the writer run per message, so every settlement would travel in its own
        # SETTLE frame and the broker would answer with one-message DELIVER frames.
        self._since_yield += 1
        await trio.lowlevel.checkpoint_if_cancelled()
        buffered = self._buffered
        if buffered:
            msg = buffered.popleft()
            if self._since_yield >= YIELD_EVERY:
                self._since_yield = 0
                await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            self._since_yield = 0
            while not buffered:
                if self._ended:
                    if self._error is not None and not self._closed:
                        raise self._error from None
                    error = self._conn.close_error
                    if error is not None and getattr(error, "code", None) not in (None, 0) and not self._closed:
                        raise error from None
                    return None
                if not self._subscribed:  # never entered: subscribe on first use (see the class docstring)
                    await self.subscribe()
                    continue
                await self._readable.park()
            msg = buffered.popleft()
        self._current = msg
        return msg

    def _give_back(self, messages: list[Message]) -> None:
        """Messages a blocking call took for a caller that stopped waiting (Ctrl-C; client/interruptible.py):
        first in line again, unless the consumer was closed meanwhile (the broker's cancel requeues them)."""
        if self._closed:
            return
        if self._current is not None and any(m is self._current for m in messages):
            self._current = None
        self._buffered.extendleft(reversed(messages))
        self._readable.unpark_all()

    def _mark_current_processed(self) -> None:
        if self._current is not None:
            self._current._mark_processed()
            self._current = None

    def _end(self) -> None:
        """No more messages will be added; wake whoever waits (what is buffered can still be taken)."""
        self._ended = True
        self._readable.unpark_all()

    # -------------------------------------------------------------- called by the connection's reader

    def _on_subscribed(self, result: dict[str, Any]) -> None:
        """The broker's OK to SUBSCRIBE, taken by the reader before any later frame: the prefetch in
        force. Whoever waited for it may have given up, or closed the consumer: then cancel."""
        in_force = result.get("prefetch")
        if type(in_force) is int and in_force > 0:
            self.prefetch_in_force = min(in_force, self.prefetch) if self.prefetch else in_force
        if self.prefetch_in_force is not None:  # the writer never holds back much of this credit
            conn = self._conn
            conn._settle_hold = max(1, min(conn._settle_hold, self.prefetch_in_force // 4))
        self._subscribing = None
        if self._closed:  # nobody will use it: cancel it at once (`aclose` then has nothing to cancel)
            self._conn._cancel_nowait(self)
        else:
            self._subscribed = True

    def _on_subscribe_refused(self) -> None:
        """The broker's ERROR to SUBSCRIBE (taken by the reader): nothing to cancel; a later `subscribe()`
        (or receive) sends a new SUBSCRIBE, which may succeed (e.g. once the queue is declared)."""
        self._subscribing = None
        self._conn._consumers.pop(self.subscription_id, None)

    def _on_deliver(self, entries: list[DeliveryEntry]) -> None:
        """Take a DELIVER frame's messages. Never waits: the buffer is bounded by the prefetch in force,
        which is checked here (see the module docstring). An entry is any sequence of a `DeliveryEntry`'s
        six fields: the reader passes the decoded lists (`build_deliveries`), the UDP consumer NamedTuples."""
        if self._ended:  # never handed out; the broker's cancel requeues them. Processed, for the positions.
            self._conn._processed(sum(message_size(e[3], e[4]) for e in entries), self._receiver_window)
            return
        unsettled = self._unsettled + len(entries)
        limit = self.prefetch_in_force
        if limit is not None and unsettled > limit:
            self._conn._broker_violated_credit(
                f"DELIVER for subscription {self.subscription_id} (queue {self.queue!r}) makes {unsettled} "
                f"deliveries unsettled, above its prefetch {limit}"
            )
            return
        self._unsettled = unsettled
        self._received += len(entries)
        # The size is taken here, inline for the common message without headers: every delivery is
        # counted on the byte positions, whatever the buffer sizes (see the module docstring).
        messages = [
            Message(body, headers, exchange, key, redelivered, tag, self,
                    len(body) + MESSAGE_OVERHEAD if not headers else message_size(body, headers))
            for tag, exchange, key, body, headers, redelivered in entries
        ]
        self._received_bytes += sum([msg._size for msg in messages])
        self._buffered.extend(messages)
        if self._readable:
            self._readable.unpark_all()

    def _on_queue_deleted(self, error: PublishError) -> None:
        self._error = error
        self._end()

    def _on_revoked(self, error: PublishError, why: str = "may no longer read the queue") -> None:
        """The user may no longer read the queue: the broker ended the subscription and requeued what it had
        delivered, so what is buffered here is not handed out (another consumer gets it; acking it here
        would settle nothing), and the next receive raises `error`. Their bytes count as processed on the
        connection's positions, as `Connection._drop_deliveries` counts a late delivery's: the broker counted
        them in the connection's buffer, and left unacknowledged they stalled its other consumers for good.
        (Not on the subscription's: it is gone.)"""
        dropped = [msg for msg in self._buffered if msg._unprocessed]
        for msg in dropped:
            msg._unprocessed = False
        self._buffered.clear()
        self._conn._processed(sum(msg._size for msg in dropped), None)
        self._requeued_by = why
        self._error = error
        self._end()

    def _on_connection_closed(self) -> None:
        self._end()
