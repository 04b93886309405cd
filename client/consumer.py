"""The consumer: a subscription as an async iterator of messages, with settlement and buffer acks.

Two separate things flow back to the broker, as in DCP:

- **Settlement** (`ack`, `reject`, `requeue`) dequeues or returns a message; it is what frees `prefetch`
  slots and can clear a saturated queue upstream. The writer coalesces tags into SETTLE ranges.
- **Buffer acknowledgements** return *byte* credit when a message has been *processed*: settled, or the
  application moved on to the next message (its handler returned). The SDK sends them by itself, via
  `AckScheduler`: after 20 % of the buffer or 50 KiB, and from the timer every 5 s. Both the
  subscription's buffer (`buffer_size`) and the connection's (`conn.set_buffer_size`) are honoured.

Messages wait in a channel bounded by `prefetch` (or `max_buffered` when prefetch is 0), so a consumer
that does not keep up costs bounded memory.
"""

from __future__ import annotations

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
    """A delivered message. Settle it once with `ack()`, `reject()` or `requeue()`."""

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
    _processed: bool = field(default=False, repr=False)

    async def ack(self) -> None:
        """Processed: the broker dequeues it."""
        await self._settle(Outcome.ACK)

    async def reject(self) -> None:
        """Unprocessable: the broker dequeues and discards it."""
        await self._settle(Outcome.REJECT)

    async def requeue(self) -> None:
        """Give it back: ready again at the broker, marked redelivered."""
        await self._settle(Outcome.REQUEUE)

    def settle_nowait(self, outcome: Outcome) -> None:
        if self.settled is not None:
            raise AlreadySettled(f"delivery {self.delivery_tag} was already settled ({self.settled.name})")
        self._consumer._conn._settle_tag(outcome, self.delivery_tag)
        self.settled = outcome
        self._mark_processed()

    async def _settle(self, outcome: Outcome) -> None:
        # Yield only once per YIELD_EVERY settlements, like the iterator: yielding on every ack let
        # the writer send each settlement in its own SETTLE frame, which locked broker and consumer
        # into one-message round trips (measured: 45,000 SETTLE frames for 60,000 messages). Unsent
        # settlements still go out as soon as the consumer waits for its next message.
        await trio.lowlevel.checkpoint_if_cancelled()
        self.settle_nowait(outcome)
        consumer = self._consumer
        consumer._settles_since_yield += 1
        if consumer._settles_since_yield >= YIELD_EVERY:
            consumer._settles_since_yield = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    def _mark_processed(self) -> None:
        if not self._processed:
            self._processed = True
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
        from flowbroker.client.connection import _BufferAccount, _now_ns

        self._conn = conn
        self.queue = queue
        self.subscription_id = subscription_id
        self.prefetch = prefetch
        self.buffer_size = buffer_size
        self._buffer: _BufferAccount = _BufferAccount(
            AckScheduler(buffer_size, opaque=subscription_id, last_sent_ns=_now_ns()), epoch=1 if buffer_size else 0
        )
        bound = prefetch if prefetch else max_buffered
        self._send, self._receive = trio.open_memory_channel[Message](bound)
        self._current: Message | None = None
        self._since_yield = 0
        self._settles_since_yield = 0  # see Message._settle
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
        while True:
            try:
                msg = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if not self._conn.is_closed:
                msg.settle_nowait(Outcome.REQUEUE)
            else:
                msg._mark_processed()
        self._send.close()
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
        msg = await self._next()
        if msg is None:
            raise StopAsyncIteration
        return msg

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
        try:
            # Hand out buffered messages without yielding, and yield once per YIELD_EVERY: yielding per
            # message lets the writer run per message, so every settlement would travel in its own
            # SETTLE frame and the broker would answer with one-message DELIVER frames.
            self._since_yield += 1
            if self._since_yield < YIELD_EVERY:
                await trio.lowlevel.checkpoint_if_cancelled()
                try:
                    msg = self._receive.receive_nowait()
                except trio.WouldBlock:
                    self._since_yield = 0
                    msg = await self._receive.receive()
            else:
                self._since_yield = 0
                msg = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            if self._error is not None and not self._closed:
                raise self._error from None
            error = self._conn.close_error
            if error is not None and getattr(error, "code", None) not in (None, 0) and not self._closed:
                raise error from None
            return None
        self._current = msg
        return msg

    def _mark_current_processed(self) -> None:
        if self._current is not None:
            self._current._mark_processed()
            self._current = None

    # -------------------------------------------------------------- called by the connection's reader

    async def _on_deliver(self, entries: list[DeliveryEntry]) -> None:
        conn_epoch = self._conn._buffer.live_epoch
        sub_epoch = self._buffer.live_epoch
        for entry in entries:
            msg = Message(
                entry.body,
                entry.headers,
                entry.exchange,
                entry.routing_key,
                entry.redelivered,
                entry.delivery_tag,
                self,
                message_size(entry.body, entry.headers),
                conn_epoch,
                sub_epoch,
            )
            if self._closed:
                msg._mark_processed()  # never handed out; the broker's cancel requeues it
                continue
            try:
                # No yield per message (that would hand messages over one per scheduler round); wait
                # only when the bounded channel is full.
                try:
                    self._send.send_nowait(msg)
                except trio.WouldBlock:
                    await self._send.send(msg)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                msg._mark_processed()

    def _on_queue_deleted(self, error: PublishError) -> None:
        self._error = error
        self._send.close()

    def _on_connection_closed(self) -> None:
        self._send.close()
