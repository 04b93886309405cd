"""The producer: sends paced by broker credit, with a deadline on every wait.

Two credits pace a flow-controlled producer, as in the architecture:

- the connection's **byte buffer** (`SenderWindow`, DCP semantics): messages may start while unacknowledged
  bytes are under the buffer size, so one message may overflow it; the broker frees space with BUFFER_ACK;
- the producer's **window** of uncompleted transfers (Qpid's capacity): a transfer routed to a saturated
  queue is not completed, so a stopped queue closes the window of exactly the producers that feed it.

`send` waits for both, never forever: `timeout` (default: the producer's `send_timeout`) ends in
`FlowControlTimeout`, naming the queues that are flow-stopped; `block=False` raises `FlowControlled` at
once. A message the broker refuses is still completed (credit keeps flowing); the refusal is kept and
raised by `flush`, typed (`QueueFull`, `MessageTooLarge`, `NotFound`) and naming the queue.

**No silent losses.** A refusal nobody flushed is not dropped: leaving the producer's `async with` (or
the connection's) waits for the outstanding transfers, at most the connection's `close_timeout`, and
raises `PublishFailures` with what was refused and what is still not completed. A message an exchange
routed to no queue is counted (`statistics().unroutable`: the SDK asks the broker to report them, see
protocol/capabilities.py) and, for a producer created with `mandatory=True`, is a refusal (`Unroutable`).

**Idempotent producers** (`idempotent=True`, `producer_id`) number their messages 0, 1, 2, ... and keep
each in a `ResendLedger` (protocol/resend.py) until it is completed, so that their connection, when lost,
can reconnect and send again what was not confirmed (client/connection.py); the broker takes each sequence
once (broker/idempotence.py). The plain path pays one `is None` test per message for it.

`send` refuses at once, before anything is sent, a message the broker could not take: more headers than
`MAX_HEADERS` (the broker would refuse the whole TRANSFER frame and close the connection), a routing key
over `MAX_KEY_BYTES`, or a whole message (body, routing key, exchange, header keys and values) over the
broker's `max_message_size` (a DELIVER carries all of these, so the broker checks the whole message too).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import trio

from flowbroker.client.connection import ENTRY_OVERHEAD, TRANSFER_BATCH
from flowbroker.client.errors import (
    FlowControlled,
    FlowControlTimeout,
    KeyTooLong,
    MessageTooLarge,
    PublishError,
    PublishFailures,
    TooManyHeaders,
    block_error_name,
    check_timeout,
    check_timeout_option,
    stopped_suffix,
)
from flowbroker.client.flow import FlowEvents, FlowState
from flowbroker.protocol import ErrorCode, Headers, message_size
from flowbroker.protocol.credit import MESSAGE_OVERHEAD
from flowbroker.protocol.limits import MAX_HEADERS, MAX_KEY_BYTES, message_wire_size, utf8_len
from flowbroker.protocol.resend import ResendLedger

if TYPE_CHECKING:
    from flowbroker.client.connection import Connection, QueuedEntry

MAX_PRODUCER_ID_LENGTH = 255
"""The broker's limit (broker/idempotence.py): a producer id is a name."""

__all__ = ["Producer", "ProducerStatistics", "ProducerStats", "MAX_KEPT_ERRORS"]

log = logging.getLogger("flowbroker.client")

MAX_KEPT_ERRORS = 100
"""Refusals a producer keeps between two reports (`flush`, the end of its block); beyond them it counts.
A producer that sends a million messages to a missing queue must not keep a million exceptions."""

_HEADER_TYPES = frozenset({str, bytes, int, float, bool, type(None)})
"""What a header value may be (protocol/frames.py); anything else would make the connection's writer refuse
the whole TRANSFER frame (`Connection.send` checks every frame), so `send` refuses it first."""

_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
"""Bound once: `send` calls it per message (two module attribute lookups less each time)."""

_SHORT_KEY = MAX_KEY_BYTES // 4
"""A key of at most this many characters is within MAX_KEY_BYTES whatever they are (UTF-8: 4 bytes at most)."""


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    """A snapshot for monitoring: counters, transitions and time (not a sampled "blocked" boolean), and the
    credit that paces the producer. Taking it reads counters the producer keeps anyway."""

    sent: int
    """Transfers sent (queued for the writer with a transfer id)."""
    completed: int
    """Of those, completed by the broker (enqueued, or refused: see `failed`)."""
    failed: int
    """Refusals (QUEUE_FULL, NOT_FOUND, ..., and UNROUTABLE for a `mandatory` producer)."""
    in_flight: int
    """Sent and not yet completed: what the producer's `transfer_window` bounds."""
    blocked_count: int
    """Sends that had to wait for credit (or were refused with block=False)."""
    blocked_seconds: float
    """Total time sends spent waiting for credit."""
    unroutable: int
    """Messages the exchange routed to no queue (completed, not enqueued anywhere). With `mandatory=True`
    they are refusals too, and counted in `failed` as well."""
    transfer_window: int
    """The producer's window of uncompleted transfers (`window`, Qpid's capacity)."""
    flow_stopped: int
    """Destinations flow-stopped on the connection now (`flow_state` has which, since when, why)."""
    position: int
    """The connection's producer byte credit, shared by its producers (`conn.sender_window`): bytes sent,"""
    acked_position: int
    """bytes the broker acknowledged,"""
    window: int
    """the buffer it grants (0: not paced)"""
    limit: int
    """and the position below which a message may start (acked_position + window)."""

    @property
    def outstanding(self) -> int:
        """`in_flight`, by its name in `ProducerStats` (kept for one release)."""
        return self.in_flight


ProducerStats = ProducerStatistics
"""The name of `ProducerStatistics` before issue 9, kept for one release (`producer.stats`)."""


class Producer:
    """Publishes to one exchange (default "" routes by queue name) with a default routing key.

    Use it as `async with conn.producer(...) as producer:` to have its refusals raised when the block ends
    (`PublishFailures`), or call `flush()`; either way the connection's block raises what is left."""

    def __init__(
        self,
        conn: Connection,
        exchange: str,
        routing_key: str,
        *,
        window: int = 1000,
        send_timeout: float = 60.0,
        mandatory: bool = False,
        producer_id: str | None = None,
        idempotent: bool = False,
    ) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        if producer_id is not None and not idempotent:
            raise ValueError("producer_id names an idempotent producer's stream: give idempotent=True too")
        if producer_id is not None and not 0 < len(producer_id) <= MAX_PRODUCER_ID_LENGTH:
            raise ValueError(f"producer_id must be 1 to {MAX_PRODUCER_ID_LENGTH} characters")
        # A negative one is a deadline already passed, as 0 (client.md, "Every wait and its deadline"), as
        # for connect's timeouts; it was refused here alone (a tester).
        check_timeout_option("send_timeout", send_timeout)
        self._conn = conn
        self.exchange = exchange
        self.routing_key = routing_key
        self.window = window
        self.send_timeout = send_timeout
        self.mandatory = mandatory
        """A message the exchange routes to no queue is a refusal (`Unroutable`), not only counted."""
        self._outstanding = 0
        self._completed = 0
        self._failed = 0
        self._unroutable = 0
        self._blocked_count = 0
        self._blocked_seconds = 0.0
        self._errors: list[PublishError] = []
        """Refusals not yet reported, oldest first, at most MAX_KEPT_ERRORS."""
        self._unreported = 0
        """Refusals not yet reported (also those beyond MAX_KEPT_ERRORS)."""
        self._forgotten: tuple[list[PublishError], int] = ([], 0)
        """What `_forget_errors` took last (the two above), for `_restore_errors`."""
        self._unconfirmed_reported = False
        """The producer's block ended and said which transfers were not completed: the connection's end
        neither waits for them again nor reports them twice (a later send starts afresh)."""
        self._completions_ended: str | None = None
        """Why the completions of the messages outstanding now will never come (a UDP producer's `aclose`:
        the broker forgot the publication), or None. The ends of the blocks do not wait for them; they are
        reported as unconfirmed at once, with this reason, naming `_held_by`."""
        self._held_by: tuple[str, ...] = ()
        """The flow-stopped destinations when the completions ended: what held the messages outstanding then."""
        self._sequences: ResendLedger[QueuedEntry] | None = None
        """An idempotent producer's sequences and the messages it would send again after a lost connection."""
        if idempotent:
            self._sequences = ResendLedger(producer_id or uuid.uuid4().hex)
            conn._add_idempotent(self)

    @property
    def producer_id(self) -> str | None:
        """The producer id an idempotent producer numbers its messages under (None: not idempotent)."""
        return None if self._sequences is None else self._sequences.producer_id

    @property
    def idempotent(self) -> bool:
        return self._sequences is not None

    # -------------------------------------------------------------- state

    @property
    def outstanding(self) -> int:
        """Messages sent and not yet completed by the broker."""
        return self._outstanding

    @property
    def flow_state(self) -> FlowState:
        """Which destinations are flow-stopped on this connection, since when, by which threshold.

        Flow stops arrive per connection: with fanout or topic exchanges the client cannot know which
        queues a producer's messages reach, so every producer of a connection sees the same state."""
        return self._conn.flow_state

    def flow_events(self, max_buffered: int = 256) -> FlowEvents:
        """`async with producer.flow_events() as events: async for event in events: ...`"""
        return self._conn.flow_events(max_buffered)

    def statistics(self) -> ProducerStatistics:
        """A snapshot of the producer's counters and of the connection's producer byte credit."""
        conn = self._conn
        credit = conn.sender_window
        return ProducerStatistics(
            self._completed + self._outstanding,  # every message sent is outstanding until completed
            self._completed,
            self._failed,
            self._outstanding,
            self._blocked_count,
            self._blocked_seconds,
            self._unroutable,
            self.window,
            len(conn._flow.stopped),
            credit.position,
            credit.acked_position,
            credit.window,
            credit.limit,
        )

    @property
    def stats(self) -> ProducerStatistics:
        """`statistics()`, by its name before issue 9 (kept for one release)."""
        return self.statistics()

    def has_credit(self) -> bool:
        """True when a send would not wait."""
        return self._outstanding < self.window and self._conn.sender_window.may_send()

    # -------------------------------------------------------------- sending

    async def send(
        self,
        body: bytes,
        headers: Headers | None = None,
        routing_key: str | None = None,
        *,
        timeout: float | None = None,
        block: bool = True,
    ) -> int:
        """Queue one message for the writer once credit allows; returns its transfer id.

        Waits at most `timeout` seconds (None: `send_timeout`; math.inf: no deadline) and then raises
        `FlowControlTimeout`; with `block=False` raises `FlowControlled` at once instead of waiting.
        Returns without yielding to other tasks unless the messages waiting for the writer reach another
        full batch (see the comment below), so the writer can batch a burst of sends into one frame.
        Raises, before anything is sent, `TypeError` for a body that is not bytes, a routing key that is
        not str, or headers that are not
        a dict of str to str, bytes, int, float, bool or None, `TooManyHeaders` (over `MAX_HEADERS`), `KeyTooLong` (a routing key
        over `MAX_KEY_BYTES` in UTF-8) or `MessageTooLarge` (the whole message over the broker's
        `max_message_size`), and `ConnectionClosed` if the connection is or becomes closed.
        """
        conn = self._conn
        await _checkpoint_if_cancelled()
        if conn._closed is not None or conn._nursery is None:
            conn._check_open()
        if timeout is not None and timeout != timeout:  # NaN: refused whether or not the send would wait
            check_timeout("send", timeout, "send_timeout")
        key = self.routing_key if routing_key is None else routing_key
        exchange = self.exchange
        # One comparison for the common message (bytes, no headers, a short key): the exact checks otherwise.
        # The writer sends these fields without checking them again (`fields_checked`): what passes here
        # must be what a TRANSFER entry may hold.
        if type(body) is not bytes or headers or type(key) is not str or type(exchange) is not str:
            check_message(exchange, key, body, headers, conn.welcome.max_message_size)
            # (their bytes, for the writer's frame budget: counted in characters, non-ASCII headers and
            # names made frames over max_frame_size, and the broker closed the connection, a tester)
            names = utf8_len(key) + utf8_len(exchange)
        else:  # (a short key's characters are within the frame budget's slack, an exchange's may not be)
            names = len(key) + (len(exchange) if exchange.isascii() else utf8_len(exchange))
            if len(key) > _SHORT_KEY or len(body) + 4 * names > conn.welcome.max_message_size:
                check_message(exchange, key, body, headers, conn.welcome.max_message_size)
        # message_size inlined for the common message without headers (as the consumer does on arrival)
        size = len(body) + MESSAGE_OVERHEAD if not headers else message_size(body, headers)
        credit = conn.sender_window
        # not self.has_credit(), inlined (SenderWindow.may_send too): the per-message path
        if self._outstanding >= self.window or (credit.window and credit.position >= credit.acked_position + credit.window):
            if not block:
                self._blocked_count += 1
                destinations = conn.flow_state.destinations
                raise FlowControlled(
                    f"no credit ({self._describe_wait()}{stopped_suffix(destinations)})", destinations,
                    self._limit_name(),
                )
            await self._wait_for(self.has_credit, self.send_timeout if timeout is None else timeout, "send")
        sequences = self._sequences
        transfers = conn._transfers
        if sequences is None:
            # Connection._enqueue_transfer, inlined: the per-message path.
            transfer_id = conn._ledger.on_sent(self, size)
            if not transfers:  # the writer waits only once every queue is empty (see _enqueue_transfer)
                conn._wake.set()
            transfers.append((exchange, key, body, headers, None, None))
            conn._transfer_costs.append(size + names + ENTRY_OVERHEAD)
        else:  # numbered, and kept until completed so that a reconnect can send it again
            sequence = sequences.take_sequence()
            entry = (exchange, key, body, headers, sequences.producer_id, sequence)
            transfer_id = conn._enqueue_transfer(self, entry, size)
            sequences.sent(sequence, transfer_id, entry, size)
        outstanding = self._outstanding = self._outstanding + 1
        if outstanding == 1:
            conn._active_producers[self] = None  # something to wait for when a block ends
            self._unconfirmed_reported = False
        if len(transfers) % TRANSFER_BATCH == 0:
            # Yield only when a batch is ready: yielding after every message would let the writer run
            # after every message and send one-entry frames. Nor after every message while more than a
            # batch waits: then the writer is still writing earlier ones (the socket is full), and a
            # scheduler pass per message cost more than the send itself (paced benchmark: half the
            # sends yielded). A send loop still yields at least once per batch (between its yields the
            # queue grows by one per send), and whenever it waits for credit.
            await trio.lowlevel.cancel_shielded_checkpoint()
        return transfer_id

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every message sent so far is complete, then raise the first publish error since the
        last flush, if any, typed (`NotFound`, `QueueFull`, `Unroutable`, ...), and forget the refusals
        (`statistics().failed` counts them all). Raises `FlowControlTimeout` naming the flow-stopped queues if
        completions do not arrive in time: a saturated queue holds them."""
        check_timeout("flush", timeout, "send_timeout")  # (NaN too when nothing is outstanding)
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._outstanding:
            self._conn._check_open()
            await self._wait_for(lambda: self._outstanding == 0, self.send_timeout if timeout is None else timeout, "flush")
        error = self._errors[0] if self._errors else None
        self._forget_errors()
        await trio.lowlevel.cancel_shielded_checkpoint()
        if error is not None:
            raise error
        closed = self._conn._closed
        if closed is not None:  # nothing outstanding: it returned normally on a connection given up (a tester)
            raise closed

    # -------------------------------------------------------------- the end of a block

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Wait for the outstanding transfers (at most the connection's `close_timeout`) and raise
        `PublishFailures` for what was refused or is still not completed. If the block raised, that
        exception goes on untouched: nothing is waited for, and the failures are logged."""
        if exc is not None:
            self._log_unreported(f"producer block ended by {block_error_name(exc)}")
            self._unconfirmed_reported = True
            return
        with trio.CancelScope(shield=True):
            await self._conn._wait_outstanding([self], trio.current_time() + self._conn.close_timeout)
        failures = self._take_failures(f"within close_timeout {self._conn.close_timeout:g} s")
        self._unconfirmed_reported = True
        if failures is not None:
            raise failures

    def _take_failures(self, why_unconfirmed: str) -> PublishFailures | None:
        """What is unreported, as a `PublishFailures` (None if nothing is), and forget the refusals."""
        unconfirmed = 0 if self._unconfirmed_reported else self._outstanding
        if not self._unreported and not unconfirmed:
            return None
        conn = self._conn
        destinations = conn.flow_state.destinations if unconfirmed else ()
        if unconfirmed and self._completions_ended is not None:
            why_unconfirmed = self._completions_ended
            destinations = tuple(dict.fromkeys(self._held_by + destinations))
        elif unconfirmed and conn.is_closed:
            why_unconfirmed = f"before the connection closed ({conn.close_error})"
        failures = PublishFailures(self._errors, self._unreported, unconfirmed, destinations, why_unconfirmed)
        self._forget_errors()
        return failures

    def _log_unreported(self, why: str) -> None:
        if self._unreported or self._outstanding:
            log.warning("flowbroker producer to %r: %s with %s", self.exchange or self.routing_key, why,
                        self._take_failures("yet"))

    def _forget_errors(self) -> None:
        self._forgotten = (self._errors, self._unreported)
        self._errors = []
        self._unreported = 0
        if not self._outstanding:
            self._conn._active_producers.pop(self, None)

    def _restore_errors(self, error: BaseException) -> None:
        """The refusals the last `flush()` or block end reported (`error`) never reached their caller (a
        blocking call interrupted by Ctrl-C as it returned, client/interruptible.py): they are reported
        again, by the next flush or block end, ahead of any since. Lost, a retried flush returned normally
        and the refused message passed for delivered (a tester: 6 % of interrupted flushes)."""
        errors, unreported = self._forgotten
        self._forgotten = ([], 0)
        if not unreported and not isinstance(error, PublishFailures):
            return
        self._errors = (errors + self._errors)[:MAX_KEPT_ERRORS]
        self._unreported += unreported
        if isinstance(error, PublishFailures):
            self._unconfirmed_reported = False  # its unconfirmed count is told again too
        self._conn._active_producers[self] = None

    async def _wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        check_timeout(what, timeout, "the default")
        timeout = max(timeout, 0.0)  # a deadline already passed (`deadline - now` < 0): no wait at all
        conn = self._conn
        start = trio.current_time()
        if what == "send":
            self._blocked_count += 1
        try:
            with trio.move_on_after(timeout):
                while not ready():
                    conn._check_open()
                    await conn._wait_credit()
                conn._check_open()
                return
        finally:
            if what == "send":
                self._blocked_seconds += trio.current_time() - start
        destinations = conn.flow_state.destinations
        raise FlowControlTimeout(
            f"{what} timed out after {timeout:g} s ({self._describe_wait()}{stopped_suffix(destinations)})",
            destinations,
            "completions" if what == "flush" and not conn.is_closed else self._limit_name(),
            timeout,
        )

    def _limit_name(self) -> str:
        if self._conn.is_closed:
            return "closed"
        return "window" if self._outstanding >= self.window else "buffer"

    def _describe_wait(self) -> str:
        conn = self._conn
        credit = conn.sender_window
        why = ""
        if conn.reconnecting:
            why = "; the connection is reconnecting (an idempotent producer's resend comes first)"
        elif credit.window == 1 and credit.outstanding:
            # WAIT_GRANT: the broker's credit pool has no share for this connection yet (docs/policies.md)
            why = ("; the broker has granted this connection no buffer yet: its first message makes it a producer "
                   "and its share follows a round trip later, unless other producers hold the credit pool or "
                   "its user's credit_share_percent cap is spent or below one maximum message "
                   "(docs/policies.md, 'Who holds what'; docs/security.md), or its first message is larger than "
                   "64 KiB and the broker has not read it yet: other connections' partial large frames hold its "
                   "[server] max_partial_frame_bytes budget (docs/configuration.md)")
        return (
            f"{self._outstanding}/{self.window} transfers outstanding, "
            f"{credit.outstanding}/{credit.window} bytes unacknowledged{why}"
        )

    # -------------------------------------------------------------- called by the connection

    def _on_completed(self, count: int) -> None:
        """`count` of this producer's transfers are complete (the connection counts them per run)."""
        self._outstanding -= count
        self._completed += count
        if not self._outstanding and not self._unreported:
            self._conn._active_producers.pop(self, None)

    def _resending(self, count: int) -> None:
        """A reconnect sends `count` kept messages again: they are outstanding until the new connection
        completes them. Those among them already completed out of order (docs: ResendLedger) will be
        counted again when the broker completes their duplicates, so they leave `completed` now."""
        self._completed -= count - self._outstanding
        self._outstanding = count
        if count:
            self._conn._active_producers[self] = None

    def _on_error(self, error: PublishError) -> None:
        if error.code is ErrorCode.UNROUTABLE:
            self._unroutable += 1
            if not self.mandatory:
                return
        self._failed += 1
        self._unreported += 1
        if len(self._errors) < MAX_KEPT_ERRORS:
            self._errors.append(error)
        self._conn._active_producers[self] = None


def check_message(exchange: str, key: str, body: bytes, headers: Headers | None, max_size: int) -> None:
    """Raise, before anything is sent, what the broker would refuse (see the module's docstring): TypeError
    for a body that is not bytes, a routing key or exchange that is not str, or headers of the wrong types,
    else the typed refusal. Callers skip it for
    the common message (bytes, no headers, a short key, a body far under the limit: one comparison in
    `send`). Shared by the TCP and the UDP producer (client/udpproducer.py)."""
    if type(body) is not bytes:  # exactly bytes, as a TRANSFER entry's body must be (protocol/frames.py)
        raise TypeError(f"body must be bytes, not {type(body).__name__}")
    if type(key) is not str or type(exchange) is not str:
        raise TypeError(f"routing_key and exchange must be str, not {type(key).__name__} and {type(exchange).__name__}")
    if headers or len(key) > _SHORT_KEY or len(body) + 4 * (len(key) + len(exchange)) > max_size:
        if headers and (
            type(headers) is not dict
            or not all(type(k) is str and type(v) in _HEADER_TYPES for k, v in headers.items())
        ):
            raise TypeError("headers must be a dict of str keys to str, bytes, int, float, bool or None values")
        refusal = _refusal(exchange, key, body, headers, max_size)
        if refusal is not None:
            raise refusal


def _refusal(exchange: str, key: str, body: bytes, headers: Headers | None, max_size: int) -> PublishError | None:
    """Why the broker could not take this message (over a limit of the protocol or of the broker), or None."""
    destination = key if exchange == "" else None
    if headers is not None and len(headers) > MAX_HEADERS:
        return TooManyHeaders(
            ErrorCode.LIMIT_EXCEEDED, f"{len(headers)} headers exceed the limit of {MAX_HEADERS} (MAX_HEADERS)", destination
        )
    key_bytes = utf8_len(key)
    if key_bytes > MAX_KEY_BYTES:
        return KeyTooLong(
            ErrorCode.KEY_TOO_LONG,
            f"routing key of {key_bytes} bytes exceeds the limit of {MAX_KEY_BYTES} bytes (MAX_KEY_BYTES)",
            destination,
        )
    size = message_wire_size(exchange, key, body, headers)
    if max_size and size > max_size:
        return MessageTooLarge(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"message of {size} bytes (body {len(body)}, with its routing key, exchange and headers) exceeds "
            f"max_message_size {max_size}",
            destination,
        )
    return None
