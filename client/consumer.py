"""The consumer: a subscription as an async iterator of messages, with settlement and buffer acks.

Two separate things flow back to the broker, as in DCP:

- **Settlement** (`ack`, `reject`, `requeue`) dequeues or returns a message; it is what frees `prefetch`
  slots and can clear a saturated queue upstream. The writer coalesces tags into SETTLE ranges.
- **Buffer acknowledgements** return *byte* credit when a message has been *processed*: settled, or the
  application moved on to the next message (its handler returned). The SDK sends them by itself, via
  `AckScheduler`: after 20 % of the buffer or 50 KiB, and from the timer every 5 s. Both the
  subscription's buffer (`buffer_size`) and the connection's (`conn.set_buffer_size`) are honoured.

Messages wait in a buffer bounded by `prefetch` (or `max_buffered` when prefetch is 0), so a consumer
that does not keep up costs bounded memory: when it is full, the connection's reader waits (and reads
nothing more) until the application has taken enough messages for the rest of its DELIVER frame.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

import trio

from flowbroker.client.errors import AlreadySettled, PublishError, ReceiveTimeout
from flowbroker.protocol import AckScheduler, DeliveryEntry, Headers, Outcome, message_size

if TYPE_CHECKING:
    from flowbroker.client.connection import Connection, _BufferAccount

__all__ = ["Consumer", "Message"]

DEFAULT_MAX_BUFFERED = 10_000
YIELD_EVERY = 128


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
    _conn_epoch: int = field(repr=False)
    _sub_epoch: int = field(repr=False)
    settled: Outcome | None = None
    _counted: bool = field(default=False, repr=False)
    """Counted against a consumer buffer and not yet reported processed (False when byte flow control
    was off on its arrival: then there is nothing to report, and `_size` is not computed)."""

    async def ack(self) -> None:
        """Processed: the broker dequeues it."""
        if self._settle_counted(Outcome.ACK):
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def reject(self) -> None:
        """Unprocessable: the broker dequeues and discards it."""
        if self._settle_counted(Outcome.REJECT):
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def requeue(self) -> None:
        """Give it back: ready again at the broker, marked redelivered."""
        if self._settle_counted(Outcome.REQUEUE):
            await trio.lowlevel.cancel_shielded_checkpoint()

    def settle_nowait(self, outcome: Outcome) -> None:
        if self.settled is not None:
            raise AlreadySettled(f"delivery {self.delivery_tag} was already settled ({self.settled.name})")
        self._consumer._conn._settle_tag(outcome, self.delivery_tag)
        self.settled = outcome
        if self._counted:
            self._mark_processed()

    def _settle_counted(self, outcome: Outcome) -> bool:
        """`settle_nowait`, counted towards the next yield: True when one is due.

        `ack`, `reject` and `requeue` yield only once per YIELD_EVERY settlements, like the iterator:
        yielding on every ack let the writer send each settlement in its own SETTLE frame, which locked
        broker and consumer into one-message round trips (measured: 45,000 SETTLE frames for 60,000
        messages). Unsent settlements still go out as soon as the consumer waits for its next message.
        Nor are they cancel points: settling is bookkeeping that cannot block, so it is done even in a
        cancelled scope; the iterator checks for cancellation at every message, once is enough.
        """
        self.settle_nowait(outcome)
        consumer = self._consumer
        since = consumer._settles_since_yield + 1
        if since >= YIELD_EVERY:
            consumer._settles_since_yield = 0
            return True
        consumer._settles_since_yield = since
        return False

    def _mark_processed(self) -> None:
        if self._counted:
            self._counted = False
            self._consumer._conn._processed(self._size, self._conn_epoch, self._consumer._buffer, self._sub_epoch)


class Consumer:
    """A subscription to `queue`. `async with conn.consumer(q) as c: async for msg in c: ...`.

    Iteration ends when the consumer or the connection is closed normally; if the connection failed,
    its error (e.g. `ConnectionClosed`) is raised instead, and if the broker deleted the queue,
    `NotFound` naming it (after the messages already received).
    """

    def __init__(
        self,
        conn: Connection,
        queue: str,
        subscription_id: int,
        *,
        prefetch: int = 1000,
        buffer_size: int = 0,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
    ) -> None:
        if prefetch < 0 or buffer_size < 0:
            raise ValueError("prefetch and buffer_size must be >= 0")
        if max_buffered < 0:
            raise ValueError("max_buffered must be >= 0")
        from flowbroker.client.connection import _BufferAccount, _now_ns

        self._conn = conn
        self.queue = queue
        self.subscription_id = subscription_id
        self.prefetch = prefetch
        self.buffer_size = buffer_size
        self._buffer: _BufferAccount = _BufferAccount(
            AckScheduler(buffer_size, opaque=subscription_id, last_sent_ns=_now_ns()), epoch=1 if buffer_size else 0
        )
        # The hand-off from the connection's reader: a deque the reader extends by a whole DELIVER
        # frame, at most `_bound` long. What does not fit waits in `_backlog` (one frame's rest, while
        # the reader waits for it to move in, as it waited on a full channel before); each message
        # taken moves one in. `_ended`: no message will be added (closed, or the connection or the
        # queue went away); what is buffered can still be taken.
        self._bound = prefetch if prefetch else max_buffered
        self._buffered: collections.deque[Message] = collections.deque()
        self._backlog: collections.deque[Message] = collections.deque()
        self._ended = False
        self._readable = trio.lowlevel.ParkingLot()  # receivers waiting for a message
        self._drained = trio.lowlevel.ParkingLot()  # the reader waiting for the backlog to move in
        self._current: Message | None = None
        self._since_yield = 0
        self._settles_since_yield = 0  # see Message._settle_counted
        self._subscribed = False
        self._closed = False
        self._error: PublishError | None = None  # the queue was deleted

    # -------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Consumer:
        await self.subscribe()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()

    async def subscribe(self, timeout: float | None = None) -> None:
        """SUBSCRIBE and wait for the broker's OK (`async with` does this)."""
        if self._subscribed:
            raise RuntimeError("already subscribed")
        await self._conn._subscribe(self, timeout)
        self._subscribed = True

    async def aclose(self, timeout: float | None = None) -> None:
        """Cancel the subscription. Messages received but never handed to the application are requeued
        first; messages handed out and not settled are left to the broker's cancel (it requeues them)."""
        if self._closed:
            return
        self._closed = True
        self._mark_current_processed()
        pending = self._buffered
        if self._backlog:
            # The reader is waiting with the rest of a frame: its first message is requeued with the
            # buffer, as a full channel handed it over to the receive that drained it; the others are
            # left to the broker's cancel, like everything that arrives from now on.
            pending.append(self._backlog.popleft())
        requeue = not self._conn.is_closed
        while pending:
            msg = pending.popleft()
            if requeue:
                msg.settle_nowait(Outcome.REQUEUE)
            else:
                msg._mark_processed()
        self._end()
        if self._subscribed:
            limit = self._conn.close_timeout if timeout is None else timeout
            try:
                await self._conn._cancel(self, limit)
            except Exception:  # the broker may be gone; the subscription is over on our side regardless
                pass

    async def set_buffer_size(self, size: int) -> None:
        """Change this subscription's byte buffer mid-stream (DCP `stream_buffer_size`; 0 = off)."""
        if size < 0:
            raise ValueError("buffer size must be >= 0")
        self._conn._check_open()
        self.buffer_size = size
        self._conn._set_buffer(self._buffer, size)
        await trio.lowlevel.checkpoint()

    # -------------------------------------------------------------- receiving

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        # The common case of `_next` inlined (iteration is the hot path: one coroutine level less).
        current = self._current
        if current is not None:
            self._current = None
            if current._counted:
                current._mark_processed()
        since = self._since_yield + 1
        buffered = self._buffered
        if since < YIELD_EVERY and buffered:
            self._since_yield = since
            await trio.lowlevel.checkpoint_if_cancelled()
            msg = buffered.popleft()
            if self._backlog:
                self._refill()
            self._current = msg
            return msg
        next_msg = await self._next()
        if next_msg is None:
            raise StopAsyncIteration
        return next_msg

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message, waiting at most `timeout` seconds (None: no deadline) -> ReceiveTimeout.
        Raises `trio.EndOfChannel` when the consumer was closed, the connection's error if it failed."""
        with trio.move_on_after(timeout if timeout is not None else float("inf")):
            msg = await self._next()
            if msg is None:
                raise trio.EndOfChannel
            return msg
        raise ReceiveTimeout(f"no message from {self.queue!r} within {timeout} s")

    async def _next(self) -> Message | None:
        # Asking for the next message means the previous one was handled: count it as processed.
        self._mark_current_processed()
        # Hand out buffered messages without yielding, and yield once per YIELD_EVERY: yielding per
        # message lets the writer run per message, so every settlement would travel in its own
        # SETTLE frame and the broker would answer with one-message DELIVER frames.
        self._since_yield += 1
        await trio.lowlevel.checkpoint_if_cancelled()
        msg = self._take()
        if msg is not None:
            if self._since_yield >= YIELD_EVERY:
                self._since_yield = 0
                await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            self._since_yield = 0
            while msg is None:
                if self._ended:
                    if self._error is not None and not self._closed:
                        raise self._error from None
                    error = self._conn.close_error
                    if error is not None and getattr(error, "code", None) not in (None, 0) and not self._closed:
                        raise error from None
                    return None
                await self._readable.park()
                msg = self._take()
        self._current = msg
        return msg

    def _take(self) -> Message | None:
        buffered = self._buffered
        if buffered:
            msg = buffered.popleft()
            if self._backlog:
                self._refill()
            return msg
        backlog = self._backlog
        if backlog:  # a bound of 0 (no buffer): taken straight from the waiting reader
            msg = backlog.popleft()
            if not backlog:
                self._drained.unpark_all()
            return msg
        return None

    def _refill(self) -> None:
        """Move the reader's waiting messages into the space there is; let it go on once all are in."""
        backlog = self._backlog
        buffered = self._buffered
        while backlog and len(buffered) < self._bound:
            buffered.append(backlog.popleft())
        if not backlog:
            self._drained.unpark_all()

    def _mark_current_processed(self) -> None:
        if self._current is not None:
            self._current._mark_processed()
            self._current = None

    def _end(self) -> None:
        """No more messages: those the reader still holds are never handed out (marked processed, so
        buffer acks still flow; the broker's cancel requeues them); wake whoever waits."""
        self._ended = True
        backlog = self._backlog
        while backlog:
            backlog.popleft()._mark_processed()
        self._drained.unpark_all()
        self._readable.unpark_all()

    # -------------------------------------------------------------- called by the connection's reader

    async def _on_deliver(self, entries: list[DeliveryEntry]) -> None:
        conn = self._conn
        conn_epoch = conn._buffer.live_epoch
        sub_epoch = self._buffer.live_epoch
        counted = conn_epoch >= 0 or sub_epoch >= 0
        if self._ended:
            if counted:  # never handed out; the broker's cancel requeues them
                for entry in entries:
                    conn._processed(message_size(entry.body, entry.headers), conn_epoch, self._buffer, sub_epoch)
            return
        if counted:
            msgs = [
                Message(body, headers, exchange, key, redelivered, tag, self,
                        message_size(body, headers), conn_epoch, sub_epoch, None, True)
                for tag, exchange, key, body, headers, redelivered in entries
            ]
        else:  # byte flow control off: nothing to count, so no size to compute
            msgs = [
                Message(body, headers, exchange, key, redelivered, tag, self, 0, -1, -1)
                for tag, exchange, key, body, headers, redelivered in entries
            ]
        buffered = self._buffered
        room = self._bound - len(buffered)
        if len(msgs) <= room:
            buffered.extend(msgs)
        else:
            buffered.extend(msgs[:room])
            self._backlog.extend(msgs[room:])
        if self._readable:
            self._readable.unpark_all()
        # No yield per message (that would hand messages over one per scheduler round); wait only
        # when the buffer is full, until the application has taken enough for the rest of the frame.
        while self._backlog:
            await self._drained.park()

    def _on_queue_deleted(self, error: PublishError) -> None:
        self._error = error
        self._end()

    def _on_connection_closed(self) -> None:
        self._end()
