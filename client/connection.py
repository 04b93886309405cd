"""The trio connection: one byte stream, three tasks, every queue bounded.

Why it is shaped this way:

- **Sans-IO underneath.** Framing, validation and the state machine are `flowbroker.protocol.Connection`;
  the producer half (transfer ids, producer byte credit, the transfers in flight, COMPLETE validation) is
  `ProducerLedger`, and consumer buffer acks are `ReceiverWindow`. This module only moves bytes and wakes tasks.
- **One writer task** owns the socket's send side. Producers, settlements, buffer acks, requests and noop
  replies put work in small queues and wake it; it writes control traffic first (acks, settlements, noops:
  never stuck behind data) and then up to `TRANSFER_BATCH` messages per TRANSFER frame, several frames per
  write. Batching is what makes Python fast here: one msgpack call and one `send_all` per batch.
- **One reader task** never stops reading and never waits for the application, so completions, credit
  and flow notices always get through: deliveries go to the consumer's buffer, which the consumer credit
  the broker honours bounds (see consumer.py).
- **One timer task** sends noops when we have been quiet for a third of the idle timeout, declares the
  broker dead after a whole idle timeout of silence, and re-advertises buffer acks every 5 s.
- **Structured concurrency.** The tasks live in a nursery opened by `async with conn`; leaving the block
  sends CLOSE after the queued data (bounded by `close_timeout`) and cancels them. Nothing outlives it,
  and nothing escapes from them: a bug in one closes the connection with ConnectionClosed(INTERNAL_ERROR),
  which the application's calls raise, instead of cancelling its block from inside.
- **Reconnecting, for idempotent producers only.** A connection opened from a URL whose producers with
  messages in flight are all idempotent (and that has no consumers) survives a lost stream: `_lost` ends
  that stream's three tasks (they run in a scope of their own, `_run_stream`), `_reconnect` reopens it with
  backoff until `reconnect_timeout`, and `_resend` sends every kept message again in sequence order
  before producers may send anything new (protocol/resend.py; docs/client.md, "Idempotent producers").
  Any other lost connection closes, as it always did: its unconfirmed messages could not be resent
  without duplicating them.
- **Any trio stream.** Bytes go through `trio.abc.Stream`'s `send_all`/`receive_some` only; the stream and
  the handshake come from client/handshake.py (`connect` opens TCP, `connect_stream` takes a stream the
  caller opened: a `trio.SSLStream`, an in-memory pair in tests).
- **Bounded.** Transfers waiting for the writer are bounded by the producers' windows; settlements by the
  unsettled deliveries; buffer acks coalesce to one per buffer (they are absolute); noop replies keep the
  newest 16; requests are one per awaiting task; deliveries wait in each consumer's buffer, bounded by its
  prefetch (checked on arrival).

Request ids are drawn from 2**62 upward so that an ERROR's `ref_id` is never ambiguous between a request
and a transfer id (transfer ids count messages from 1 and cannot get there).
"""

from __future__ import annotations

import collections
import logging
import weakref
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from itertools import accumulate
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import trio

from flowbroker.client.errors import (
    AuthenticationError,
    BrokerConnectionError,
    ConnectionClosed,
    FlowbrokerError,
    HandshakeError,
    ProtocolViolation,
    PublishFailures,
    RequestError,
    RequestTimeout,
    block_error_name,
    check_key,
    check_timeout,
    check_timeout_option,
    publish_error,
)
from flowbroker.client.flow import FlowEvents, FlowState, FlowTracker
from flowbroker.protocol import (
    ReceiverWindow,
    Bind,
    BufferAck,
    BufferControl,
    Cancel,
    Close,
    Complete,
    DeclareExchange,
    DeclareQueue,
    DeleteExchange,
    DeleteQueue,
    Deliver,
    Error,
    ErrorCode,
    FlowResumed,
    FlowStopped,
    Frame,
    Headers,
    LocalProtocolError,
    Noop,
    Ok,
    Outcome,
    PurgeQueue,
    RemoteProtocolError,
    Settle,
    Transfer,
    TransferEntry,
    Unbind,
    Welcome,
    message_size,
    SenderWindow,
)
from flowbroker.protocol import Connection as ProtocolConnection
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME, MAX_RANGES_PER_FRAME, utf8_len
from flowbroker.protocol.names import EXCHANGE_KINDS, OVERFLOW_POLICIES
from flowbroker.protocol.frames import Range, check_frame
from flowbroker.protocol.producer import ProducerLedger

if TYPE_CHECKING:
    from flowbroker.client.consumer import Consumer
    from flowbroker.client.producer import Producer
    from flowbroker.client.udpproducer import UdpProducer

__all__ = ["Connection", "ConnectionStatistics", "TRANSFER_BATCH", "REQUEST_ID_BASE", "RECEIVE_SIZE"]

log = logging.getLogger("flowbroker.client")

TRANSFER_BATCH = 256
"""Most messages in one TRANSFER frame (the protocol allows MAX_ENTRIES_PER_FRAME)."""
assert TRANSFER_BATCH <= MAX_ENTRIES_PER_FRAME
WRITE_FRAMES = 8
"""Most TRANSFER frames in one socket write, so control traffic never waits long behind data."""
CLOSED_WITHOUT_CLOSE = ("the connection ended without a CLOSE from the broker (it stopped, crashed or was killed, "
                        "or the network failed)")
RECEIVE_SIZE = 256 * 1024
SETTLE_HOLD_MAX = 1024
"""Most settlements the writer lets wait while the application keeps settling (`_settlements_may_wait`),
lowered to a quarter of the smallest prefetch in force of the connection's subscriptions (`_settle_hold`)."""
WRITE_CHUNK = 1024 * 1024
"""A write larger than this goes out a chunk at a time, so that the timer can tell a broker that reads
slowly (each chunk goes through) from one that reads nothing (see `_timer`)."""
REQUEST_ID_BASE = 2**62
NOOP_REPLIES_KEPT = 16
REQUESTS_IN_FLIGHT = 64
"""Requests one connection has waiting for their answers at most (declare, bind, purge, ...); more wait
for one to be answered, within their timeout. The broker answers a request that journals something only
once it is on disk, and refuses one past 100 such answers waiting on a connection (docs/storage.md):
150 concurrent `bind()`s of a durable exchange on a fast disk had 50 refused (a tester). 64 leaves room
for the requests made without waiting (subscriptions, CLOSE_PUBLICATION)."""
ENTRY_OVERHEAD = 24
"""Estimated msgpack bytes per transfer entry beyond body, names and headers (for the frame-size budget)."""

QueuedEntry = tuple[str, str, bytes, Headers | None, str | None, int | None]
"""A message waiting for the writer: the fields of a `TransferEntry` (exchange, routing key, body, headers,
producer id, sequence) in a plain tuple, a fraction of the cost of building the NamedTuple per message.
msgpack writes both alike."""

Reopen = Callable[[], Awaitable[tuple[trio.abc.Stream, ProtocolConnection, Welcome]]]
"""Opens a new stream to the same broker and does the handshake on it (client/handshake.py): how a
connection with idempotent producers reconnects."""
RECONNECT_FIRST_DELAY = 0.05
RECONNECT_MAX_DELAY = 2.0
"""Seconds between reconnect attempts: doubling from the first to the most, until `reconnect_timeout`."""


def _blocked_window() -> SenderWindow:
    """A producer byte window that lets nothing start: what producers see while the connection reconnects
    and resends, so a new message cannot overtake the ones sent again."""
    window = SenderWindow(1)
    window.position = 1
    return window


def _now_ns() -> int:
    return int(trio.current_time() * 1e9)


@dataclass(frozen=True, slots=True)
class ConnectionStatistics:
    """A snapshot of a connection: its producers' transfers and byte credit (`SenderWindow`: position,
    acked_position, window, limit), the connection-level consumer buffer it grants the broker
    (`ReceiverWindow`, fields `consumer_*`), and its frames. Bytes are `message_size` bytes since connect."""

    transfers_sent: int
    transfers_completed: int
    transfers_in_flight: int
    producers_active: int
    """Producers with uncompleted transfers or unreported refusals."""
    position: int
    """Producer bytes sent."""
    acked_position: int
    """Producer bytes the broker acknowledged."""
    window: int
    """The producer buffer the broker grants (`producer_buffer_size`; 0: not paced)."""
    limit: int
    """The position below which a message may start (acked_position + window)."""
    flow_stopped: int
    """Destinations flow-stopped now."""
    consumers: int
    """Subscriptions registered on the connection."""
    consumer_window: int
    """The connection-level consumer buffer (`consumer_buffer_size`; 0: off)."""
    consumer_consumed_position: int
    """Delivered bytes processed, over all subscriptions."""
    consumer_acked_position: int
    """Of those, acknowledged to the broker at the connection level."""
    frames_sent: int
    frames_received: int


@dataclass
class _PendingRequest:
    event: trio.Event = field(default_factory=trio.Event)
    result: dict[str, Any] | None = None
    error: FlowbrokerError | None = None
    on_ok: Callable[[dict[str, Any]], None] | None = None
    """Called by the reader with the OK's result, before it handles the next frame (SUBSCRIBE: the
    prefetch in force must be known before that subscription's first DELIVER)."""
    on_error: Callable[[], None] | None = None
    """Called by the reader when the broker answers with ERROR."""


class Connection:
    """A client connection to a flowbroker broker. Create it with `await connect(...)`, use it with
    `async with`. All methods are trio methods of the task that runs the `async with` block or its
    children."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        proto: ProtocolConnection,
        welcome: Welcome,
        *,
        request_timeout: float = 30.0,
        close_timeout: float = 5.0,
        reopen: Reopen | None = None,
        reconnect_timeout: float = 30.0,
    ) -> None:
        self._stream = stream
        self._proto = proto
        proto.build_deliveries = False  # DELIVER entries as decoded lists: `Consumer._on_deliver` only unpacks them
        self.welcome = welcome
        self.request_timeout = request_timeout
        self.close_timeout = max(0.0, close_timeout)  # (negative: a deadline already passed; trio refuses it)
        self._ledger: ProducerLedger[Producer] = ProducerLedger(welcome.buffer_size)
        """Transfer ids, producer byte credit and the transfers in flight, per run of one producer's transfers."""
        self.sender_window = self._ledger.window
        """Producer byte credit for this connection, shared by its producers (DCP: one buffer per connection)."""
        self._flow = FlowTracker()
        self._closed: BrokerConnectionError | ProtocolViolation | None = None
        self._graceful = False
        self._entered = False
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        # writer queues
        self._wake = trio.Event()
        self._transfers: list[QueuedEntry] = []
        """Messages waiting for the writer: the newest transfer ids, in order, up to `_ledger.next_id - 1`
        (ids are assigned and queued in one step, and the writer takes the oldest)."""
        self._transfer_costs: list[int] = []
        """Their estimated bytes in a TRANSFER frame, for the writer's frame-size budget."""
        self._control: collections.deque[Frame] = collections.deque()
        self._settle: dict[Outcome, list[Range]] = {}
        """Settlements waiting for the writer, as runs of consecutive tags (closed runs; the open one is
        `_run_*`), per outcome. Bounded by the unsettled deliveries."""
        self._settle_count = 0
        """Tags in the closed runs of `_settle`."""
        self._settle_hold = SETTLE_HOLD_MAX
        """Most settlements the writer lets wait (`_settlements_may_wait`): SETTLE_HOLD_MAX, lowered to a
        quarter of each subscription's prefetch in force as its OK arrives, so that what is held back
        is never much of the broker's credit."""
        self._settle_seen = 0
        self._settle_still = 0
        """Settlements pending when the writer last let them wait (0: it sent them since), and the passes
        since then that found no more."""
        self._run_outcome: Outcome | None = None
        self._run_first = 0
        self._run_next = -1
        """The open run of settlements: `_run_outcome` for tags `_run_first` .. `_run_next - 1` (none:
        `_run_outcome` None, `_run_next` -1, which no tag equals). A settlement of tag `_run_next` with
        the same outcome (an application acking in order) only moves `_run_next`: no list, no lookup,
        and the writer sends the run as one range without a pass over its tags (`to_ranges` took min,
        max and a set of every tag, each int object cold in the cache by then: 4-7 % of the consumer's
        time at saturation)."""
        self._acks: dict[int, BufferAck] = {}
        self._noop_replies: collections.deque[int] = collections.deque(maxlen=NOOP_REPLIES_KEPT)
        self._writer_done = trio.Event()
        self._close_deadline: float | None = None  # the first close's: a later one waits no longer
        self._writer_scope = trio.CancelScope()
        self._writing = False
        self._write_seq = 0
        """Counts chunks written: the timer declares the broker dead when one stays in progress for a
        whole idle timeout (it reads nothing from us, so it cannot be hearing our noops either)."""
        self._stuck_seq = -1
        self._stuck_since = 0.0
        self._final_frames: list[Frame] = []
        # producer side
        self._credit_lot = trio.lowlevel.ParkingLot()
        self._active_producers: dict[Producer, None] = {}
        """Producers with uncompleted transfers or unreported refusals, in order: what the end of the
        `async with` block waits for and reports. A producer leaves it once it has neither, so it holds
        no more producers than have something to report."""
        # requests and consumers
        self._next_request_id = REQUEST_ID_BASE
        self._requests: dict[int, _PendingRequest] = {}
        self._request_slots = trio.Semaphore(REQUESTS_IN_FLIGHT)
        self._consumers: dict[int, Consumer] = {}
        self._next_subscription_id = 1
        self._udp_producers: dict[int, UdpProducer] = {}  # by the session id of their UDP publication
        self.udp_endpoint: str | None = None
        """The broker's UDP endpoint (host:port) for this connection's UDP producers, from the URL's `udp`
        query; None: the one the broker announces when a publication registers."""
        now = trio.current_time()
        self._receiver_window = ReceiverWindow(0, opaque=0, last_sent_ns=int(now * 1e9))
        """The connection-level consumer byte positions (counted whatever the size: see consumer.py)."""
        self._last_received = now
        self._last_sent = now
        self._noop_nonce = 0
        self.connection_errors: collections.deque[Error] = collections.deque(maxlen=32)
        """Connection-level ERROR frames the broker sent without closing (newest 32)."""
        # reconnecting (idempotent producers only: see `_lost`)
        self._reopen = reopen
        self.reconnect_timeout = reconnect_timeout
        """How long a lost connection with idempotent producers tries to reconnect before it is closed."""
        self.reconnects = 0
        """Times this connection was lost and reopened (its `connection_id` is the newest one's)."""
        self._reconnecting = False
        self._generation = 0
        """Counts the streams this connection has had: a task of an older one can no longer end it."""
        self._lost_generation = -1
        self._stream_scope: trio.CancelScope | None = None
        self._idempotent: weakref.WeakSet[Producer] = weakref.WeakSet()
        """Idempotent producers alive on this connection: whose unconfirmed messages a reconnect sends again."""
        self._had_idempotent = False
        """Set with the first idempotent producer: until then a COMPLETE costs nothing more than it did."""

    # ------------------------------------------------------------------ properties

    @property
    def connection_id(self) -> int:
        return self.welcome.connection_id

    @property
    def server_name(self) -> str:
        return self.welcome.server_name

    @property
    def broker_run(self) -> str | None:
        """The broker process's run id (WELCOME's `run_id`): another after a reconnect means the broker
        restarted, and its memory-only queues lost what they held. None from a broker that sends none."""
        return self.welcome.run_id

    @property
    def max_message_size(self) -> int:
        return self.welcome.max_message_size

    @property
    def producer_buffer_size(self) -> int:
        """The producer byte buffer the broker grants this connection now, shared by its producers:
        WELCOME's `buffer_size`, then each BUFFER_CONTROL's (0: not paced). `credit` has the positions:
        `sender_window.outstanding` bytes sent and not yet acknowledged, `sender_window.position`, `sender_window.acked_position`."""
        return self.sender_window.window

    @property
    def consumer_buffer_size(self) -> int:
        """The connection-level consumer byte buffer this side grants the broker (`set_buffer_size`; 0: off)."""
        return self._receiver_window.window

    def statistics(self) -> ConnectionStatistics:
        """A snapshot of the connection's producer and consumer side (see `ConnectionStatistics`)."""
        ledger = self._ledger
        credit = ledger.window
        receiver = self._receiver_window
        return ConnectionStatistics(
            ledger.highest_sent,
            ledger.completed,
            ledger.in_flight,
            len(self._active_producers),
            credit.position,
            credit.acked_position,
            credit.window,
            credit.limit,
            len(self._flow.stopped),
            len(self._consumers),
            receiver.window,
            receiver.consumed_position,
            receiver.acked_position,
            self._proto.frames_sent,
            self._proto.frames_received,
        )

    @property
    def is_closed(self) -> bool:
        """True once the connection is closed, by either side or by a failure (`close_error` says why)."""
        return self._closed is not None

    @property
    def reconnecting(self) -> bool:
        """True from the loss of the stream until the messages to send again are all queued on the new
        one (idempotent producers: docs/client.md); producers' sends wait meanwhile."""
        return self._reconnecting

    @property
    def close_error(self) -> BrokerConnectionError | ProtocolViolation | None:
        """Why the connection is closed (None while open)."""
        return self._closed

    @property
    def flow_state(self) -> FlowState:
        return self._flow.snapshot(trio.current_time())

    def flow_events(self, max_buffered: int = 256) -> FlowEvents:
        """Watch flow-stopped/resumed events for the whole connection (see `Producer.flow_events`)."""
        watcher = self._flow.watch(max_buffered)
        if self._closed is not None:
            watcher._close()
        return watcher

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Connection:
        if self._entered:
            raise RuntimeError("a Connection can be entered once")
        self._entered = True
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nursery.start_soon(self._run_stream)
        return self

    @trio.lowlevel.enable_ki_protection
    async def _run_stream(self) -> None:
        """The tasks of one stream: reader, writer, timer. They run in a scope of their own, so that a
        reconnect can end them (`_lost`) and start the next stream's, in the connection's nursery."""
        with trio.CancelScope() as scope:
            self._stream_scope = scope
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._contained, self._reader, "reader")
                nursery.start_soon(self._writer)  # contains its own failures: it still says why it ends
                nursery.start_soon(self._contained, self._timer, "timer")

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Wait for every producer's outstanding transfers, then close (all within `close_timeout`), and
        raise `PublishFailures` for what was refused and not yet reported by a `flush()` or a producer's
        block, or is still not completed. Errors of the block pass through untouched (the nursery sees
        none: our tasks never raise); then nothing is waited for and the failures are logged."""
        assert self._nursery is not None
        failures: PublishFailures | None = None
        try:
            try:
                with trio.CancelScope(shield=True):
                    deadline = trio.current_time() + self.close_timeout
                    if exc is None:
                        # (a producer whose block ended has said what it had not completed)
                        await self._wait_outstanding(
                            [p for p in self._active_producers if not p._unconfirmed_reported], deadline)
                        failures = self._take_failures()
                    else:
                        for producer in list(self._active_producers):
                            producer._log_unreported(f"connection block ended by {block_error_name(exc)}")
                    await self._close_by(deadline)
            finally:  # whatever happened above: a nursery left open would corrupt trio's state
                self._nursery.cancel_scope.cancel()
                # The nursery must be exited in the scope it was entered in, not inside the shield.
                await self._nursery_cm.__aexit__(None, None, None)
        finally:
            # Bounded: a TLS stream's aclose sends close_notify, which a peer that reads nothing would hold up.
            with trio.move_on_after(self.close_timeout, shield=True):
                await self._stream.aclose()
        if failures is not None:
            raise failures

    def _take_failures(self) -> PublishFailures | None:
        """Every active producer's unreported refusals and uncompleted transfers, as one error."""
        why = f"within close_timeout {self.close_timeout:g} s"
        taken = [p._take_failures(why) for p in list(self._active_producers)]
        found = [f for f in taken if f is not None]
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        closed = self.is_closed  # as each producer says it: the close, not the timeout, ended the wait
        return PublishFailures(
            [e for f in found for e in f.errors],
            sum(f.failed for f in found),
            sum(f.unconfirmed for f in found),
            # and what held a closed UDP producer's messages when it closed (`Producer._held_by`)
            tuple(dict.fromkeys([*self.flow_state.destinations, *(d for f in found for d in f.destinations)])),
            f"before the connection closed ({self.close_error})" if closed else why,
        )

    async def aclose(self) -> None:
        """Close in order: queued messages and settlements are written, then CLOSE(NORMAL). Waits at most
        `close_timeout`. Completions not yet received are not waited for, nor refusals raised: leaving the
        `async with` block does both (call `producer.flush()` first when closing this way)."""
        await self._close_by(trio.current_time() + self.close_timeout)

    async def _close_by(self, deadline: float) -> None:
        # aclose() and then the block's end: one close_timeout in all, not one each (the writer that did
        # not finish by the first deadline is not waited for again)
        if self._close_deadline is None:
            self._close_deadline = deadline
        else:
            deadline = min(deadline, self._close_deadline)
        if self._closed is None:
            self._shutdown(ConnectionClosed(ErrorCode.NORMAL, "closed by the application"), graceful=True)
            self._final_frames.append(Close(ErrorCode.NORMAL, "client closing"))
        if self._nursery is not None:
            with trio.move_on_at(deadline):
                await self._writer_done.wait()
        elif not self._entered and self._final_frames:  # never entered: no writer to send CLOSE, so here
            # (it marked the connection closed and sent nothing: the socket stayed open, a tester)
            final, self._final_frames = self._final_frames, []
            with trio.move_on_at(deadline):
                try:
                    await self._stream.send_all(b"".join([self._proto.send(frame) for frame in final]))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, LocalProtocolError):
                    pass  # the broker went away first: nothing to tell it
            with trio.move_on_at(deadline, shield=True):
                await self._stream.aclose()
        await trio.lowlevel.checkpoint()

    def _shutdown(self, error: BrokerConnectionError | ProtocolViolation, *, graceful: bool = False) -> None:
        """Mark closed and wake everyone who waits on the connection. The writer sends what `_final_frames`
        holds (after the queued data only if `graceful`) and exits."""
        if self._closed is not None:
            return
        self._closed = error
        self._graceful = graceful
        for pending in self._requests.values():
            pending.error = error
            pending.event.set()
        for consumer in list(self._consumers.values()):
            consumer._on_connection_closed()
        self._flow.close()
        self._credit_lot.unpark_all()
        if self._run_outcome is not None:  # the open run goes out with a graceful close's frames
            self._close_run()
        self._run_next = -1  # a settlement from now on takes `_settle_tag`'s slow path, which raises
        self._wake.set()

    # ------------------------------------------------------------------ reconnecting

    def _lost(self, error: ConnectionClosed, generation: int, final: Frame | None = None) -> None:
        """The stream of `generation` failed (a read or write failed, the broker went away without CLOSE,
        or fell silent for the idle timeout). A connection that may reconnect (`_may_reconnect`) ends that
        stream's tasks and reconnects in the background; any other closes with `error` (and `final`)."""
        if generation != self._generation or self._closed is not None or generation == self._lost_generation:
            return  # a task of an older stream, or this loss is handled already
        self._lost_generation = generation
        if not self._may_reconnect():
            if final is not None:
                self._final_frames.append(final)
            self._shutdown(error)
            return
        log.warning("flowbroker connection %s: %s; reconnecting to resend what its idempotent producers have "
                    "not seen completed", self.connection_id, error.reason)
        self._reconnecting = True
        self.sender_window = _blocked_window()
        self._fail_requests(ConnectionClosed(error.code, f"{error.reason} before the request was answered "
                                                         "(the connection is reconnecting)"))
        if self._stream_scope is not None:
            self._stream_scope.cancel()
        self._credit_lot.unpark_all()  # a resend waiting for the lost stream's credit starts over
        assert self._nursery is not None
        self._nursery.start_soon(self._contained, lambda: self._reconnect(error), "reconnect")

    def _may_reconnect(self) -> bool:
        """Only a connection whose unconfirmed messages can all be sent again without duplicates: opened
        from a URL, with idempotent producers, every producer with messages in flight idempotent, and no
        consumers or UDP producers (their subscriptions and publications are not re-made)."""
        return (
            self._reopen is not None
            and self._nursery is not None
            and len(self._idempotent) > 0
            and not self._consumers
            and not self._udp_producers
            and all(p._sequences is not None for p in self._active_producers if p._outstanding)
        )

    async def _reconnect(self, error: ConnectionClosed) -> None:
        """Reopen the stream (`_reopen`: TCP and the handshake) with backoff until `reconnect_timeout`,
        then resend; if no attempt succeeds in time, close with `error` and the last failure. An attempt
        whose login is refused (AuthenticationError) ends it at once: the connection closes with that."""
        assert self._reopen is not None and self._nursery is not None
        await trio.aclose_forcefully(self._stream)
        deadline = trio.current_time() + self.reconnect_timeout
        delay = RECONNECT_FIRST_DELAY
        attempts = 0
        last = "none"
        while self._closed is None:
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                break
            attempts += 1
            try:
                with trio.fail_after(remaining):
                    stream, proto, welcome = await self._reopen()
            except AuthenticationError as exc:
                # The same credentials again cannot succeed: retrying until reconnect_timeout would only
                # hide a changed password or a deleted user. The application gets the refusal itself.
                log.error("flowbroker connection %s: reconnecting was refused: %s; not retrying",
                          self.connection_id, exc)
                if self._closed is None:
                    self._reconnecting = False
                    self._shutdown(exc)
                return
            except (HandshakeError, trio.TooSlowError) as exc:
                # (an attempt cut off by the deadline is one the broker accepted and never answered)
                last = ("no WELCOME before reconnect_timeout ran out" if isinstance(exc, trio.TooSlowError)
                        else str(exc) or type(exc).__name__)
                await trio.sleep(max(0.0, min(delay, deadline - trio.current_time())))
                delay = min(delay * 2, RECONNECT_MAX_DELAY)
                continue
            if self._closed is not None:  # the application closed the connection meanwhile
                await trio.aclose_forcefully(stream)
                return
            self._adopt(stream, proto, welcome)
            log.warning("flowbroker connection reconnected as %s after %d attempt(s)", self.connection_id, attempts)
            self._nursery.start_soon(self._run_stream)
            await self._resend(self._generation)
            return
        if self._closed is None:
            self._reconnecting = False
            self._shutdown(ConnectionClosed(
                error.code,
                f"{error.reason}; not reconnected within reconnect_timeout {self.reconnect_timeout:g} s "
                f"({attempts} attempt{'s' * (attempts != 1)}, last: {last})",
            ))

    def _adopt(self, stream: trio.abc.Stream, proto: ProtocolConnection, welcome: Welcome) -> None:
        """Take a new stream: a new protocol state, transfer ids from 1, the broker's new grant; what was
        queued for the old stream is dropped (the resend queues the messages again), flow stops end."""
        self._generation += 1
        self.reconnects += 1
        self._stream, self._proto, self.welcome = stream, proto, welcome
        proto.build_deliveries = False
        self._ledger = ProducerLedger(welcome.buffer_size)
        # requests made while reconnecting were queued for no stream: their frames are dropped below
        self._fail_requests(ConnectionClosed(ErrorCode.INTERNAL_ERROR, "request made while the connection was "
                                                                        "reconnecting; repeat it"))
        self._transfers.clear()
        self._transfer_costs.clear()
        self._control.clear()
        self._settle.clear()
        self._settle_count = self._settle_seen = self._settle_still = 0
        self._run_outcome, self._run_next = None, -1
        self._acks.clear()
        self._noop_replies.clear()
        self._final_frames = []
        self._wake = trio.Event()
        self._writer_done = trio.Event()
        self._writer_scope = trio.CancelScope()
        self._writing = False
        now = trio.current_time()
        self._last_received = self._last_sent = now
        for destination in list(self._flow.stopped):
            self._flow.on_resumed(destination, now)

    def _fail_requests(self, error: ConnectionClosed) -> None:
        """Every request waiting for an answer raises `error`: none can come on this stream."""
        for pending in self._requests.values():
            pending.error = error
            if pending.on_error is not None:
                pending.on_error()
            pending.event.set()
        self._requests.clear()

    async def _resend(self, generation: int) -> None:
        """Send again, per idempotent producer and in sequence order, every message not seen completed,
        paced by the new connection's credit; then let the producers' new messages go. Another loss on
        the way starts over (`lost()` marks every kept message unsent again)."""
        ledger = self._ledger
        for producer in list(self._idempotent):
            if generation != self._generation:
                return
            sequences = producer._sequences
            assert sequences is not None
            again = sequences.lost()
            producer._resending(len(again))
            for sequence, entry, size in again:
                while generation == self._generation and self._closed is None and not ledger.window.may_send():
                    await self._credit_lot.park()
                if generation != self._generation or self._closed is not None:
                    return
                sequences.resent(sequence, self._enqueue_transfer(producer, entry, size))
        if generation == self._generation and self._closed is None:
            self.sender_window = ledger.window
            self._reconnecting = False
            self._credit_lot.unpark_all()

    @trio.lowlevel.enable_ki_protection
    async def _contained(self, task: Callable[[], Awaitable[None]], what: str) -> None:
        """Run one of the connection's tasks so that a bug in it closes this connection with a typed
        error instead of escaping into the nursery, where it would cancel the application's block and
        come out of it as a bare exception (and from the blocking API's thread, not at all)."""
        try:
            await task()
        except Exception as exc:
            self._internal_error(exc, what)

    def _internal_error(self, exc: Exception, what: str) -> None:
        """An exception nobody expected in one of the connection's tasks: log it with its traceback, tell
        the broker (ERROR + CLOSE INTERNAL_ERROR, if the writer still can) and close: every waiting call
        wakes, and every later one raises ConnectionClosed(INTERNAL_ERROR) naming the task and the error."""
        detail = str(exc)[:200]
        log.error("flowbroker connection %s: internal error in the SDK's %s; closing the connection",
                  self.connection_id, what, exc_info=exc)
        if self._closed is not None:  # already closing: the error is logged, the close goes on
            return
        text = f"internal error in the client's {what} ({type(exc).__name__})"
        self._final_frames += [Error(ErrorCode.INTERNAL_ERROR, text), Close(ErrorCode.INTERNAL_ERROR, text)]
        self._shutdown(ConnectionClosed(ErrorCode.INTERNAL_ERROR, f"{text}: {detail}"))

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed
        if self._nursery is None:
            raise RuntimeError("use the connection as `async with await connect(...) as conn:`")

    # ------------------------------------------------------------------ requests

    async def _request(self, make: Callable[[int], Frame], timeout: float | None) -> dict[str, Any]:
        """Send a request and wait for its answer, in `timeout` (None: `request_timeout`) in all: the wait
        for one of the REQUESTS_IN_FLIGHT slots included."""
        limit = self.request_timeout if timeout is None else timeout
        check_timeout("request", limit, "request_timeout")
        self._check_open()
        deadline = trio.current_time() + max(limit, 0.0)
        try:
            self._request_slots.acquire_nowait()
        except trio.WouldBlock:
            acquired = False
            with trio.move_on_at(deadline):
                await self._request_slots.acquire()
                acquired = True
            # A slot taken just as the deadline passed is given back: sent then, the request reached the
            # broker after its caller had been told it timed out (a tester: 9 of 100).
            if acquired and trio.current_time() >= deadline:
                self._request_slots.release()
                acquired = False
            if not acquired:
                raise RequestTimeout(
                    ErrorCode.IDLE_TIMEOUT,
                    f"{REQUESTS_IN_FLIGHT} requests of this connection were waiting for the broker's answers "
                    f"for {max(limit, 0.0):g} s (stopped, overloaded or far away?); this one was not sent") from None
        try:
            request_id, pending = self._send_request(make)
            return await self._await_answer(request_id, pending, max(0.0, deadline - trio.current_time()),
                                            told=limit)
        finally:
            self._request_slots.release()

    def _send_request(
        self,
        make: Callable[[int], Frame],
        on_ok: Callable[[dict[str, Any]], None] | None = None,
        on_error: Callable[[], None] | None = None,
    ) -> tuple[int, _PendingRequest]:
        """Queue a request; the reader sets the answer on the returned `_PendingRequest` and drops it.

        A request the broker would refuse as malformed (a queue name over 255 characters, a negative
        prefetch) raises RequestError here, with the code the broker would answer, and the connection
        stays open: the frame is checked before it is queued, not in the writer, where a bad frame can
        only end the connection."""
        self._check_open()
        request_id = self._next_request_id
        self._next_request_id += 1
        frame = make(request_id)
        try:
            check_frame(frame)
        except LocalProtocolError as exc:
            raise RequestError(exc.code, str(exc), request_id) from None
        pending = _PendingRequest(on_ok=on_ok, on_error=on_error)
        self._requests[request_id] = pending
        self._queue_control(frame)
        return request_id, pending

    async def _await_answer(
        self, request_id: int, pending: _PendingRequest, timeout: float | None, *, keep: bool = False,
        told: float | None = None,
    ) -> dict[str, Any]:
        """Wait for the answer at most `timeout` (None: `request_timeout`) -> RequestTimeout. Unless
        `keep`, a request not answered in time is forgotten (its late answer is ignored); a kept one
        still gets its answer (and its `on_ok` runs), which a later call can wait for again. `told`: the
        timeout the caller gave, which the error names (`timeout` is what is left of it)."""
        limit = self.request_timeout if timeout is None else timeout
        try:
            check_timeout("request", limit, "request_timeout")  # (a kept request's answer is still taken)
            with trio.move_on_after(max(limit, 0.0)):  # (a deadline already passed: no wait)
                await pending.event.wait()
        finally:
            if not keep:
                self._requests.pop(request_id, None)
        if pending.error is not None:
            raise pending.error
        if pending.result is None:
            raise RequestTimeout(ErrorCode.IDLE_TIMEOUT,
                                 f"the broker did not answer request {request_id} within "
                                 f"{max(limit if told is None else told, 0.0):g} s (stopped, "
                                 "overloaded or far away?); it may still take effect", request_id)
        return pending.result

    async def declare_queue(
        self,
        name: str,
        *,
        durable: bool = False,
        flow_stop_count: int | None = None,
        flow_resume_count: int | None = None,
        flow_stop_size: int | None = None,
        flow_resume_size: int | None = None,
        flow_stop_drain_time: float | None = None,
        flow_resume_drain_time: float | None = None,
        flow_stop_age: float | None = None,
        flow_resume_age: float | None = None,
        max_count: int | None = None,
        max_size: int | None = None,
        overflow: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Declare a queue; arguments left as None take the broker's defaults (Qpid's: max size 100 MiB,
        stop at 80 %, resume at 70 %, overflow "reject"; the time thresholds, in seconds, off). Returns
        the broker's OK result."""
        given = {
            "flow_stop_drain_time": flow_stop_drain_time,
            "flow_resume_drain_time": flow_resume_drain_time,
            "flow_stop_age": flow_stop_age,
            "flow_resume_age": flow_resume_age,
            "flow_stop_count": flow_stop_count,
            "flow_resume_count": flow_resume_count,
            "flow_stop_size": flow_stop_size,
            "flow_resume_size": flow_resume_size,
            "max_count": max_count,
            "max_size": max_size,
            "overflow": overflow,
        }
        if overflow is not None and overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be 'reject' or 'drop-head', not {overflow!r}")
        arguments = {k: v for k, v in given.items() if v is not None} or None
        return await self._request(lambda rid: DeclareQueue(rid, name, durable, arguments), timeout)

    async def declare_exchange(self, name: str, kind: str = "direct", *, timeout: float | None = None) -> dict[str, Any]:
        if kind not in EXCHANGE_KINDS:
            raise ValueError(f"exchange kind must be direct, fanout or topic, not {kind!r}")
        return await self._request(lambda rid: DeclareExchange(rid, name, kind), timeout)

    async def bind(self, queue: str, exchange: str, binding_key: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        """Bind `queue` to `exchange`. A binding key over MAX_KEY_BYTES (UTF-8) raises RequestError
        (KEY_TOO_LONG) before anything is sent, as the broker would refuse it."""
        check_key(binding_key)
        return await self._request(lambda rid: Bind(rid, queue, exchange, binding_key), timeout)

    async def unbind(
        self, queue: str, exchange: str, binding_key: str = "", *, timeout: float | None = None
    ) -> dict[str, Any]:
        check_key(binding_key)
        return await self._request(lambda rid: Unbind(rid, queue, exchange, binding_key), timeout)

    async def delete_queue(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._request(lambda rid: DeleteQueue(rid, name), timeout)

    async def purge_queue(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._request(lambda rid: PurgeQueue(rid, name), timeout)

    async def delete_exchange(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Delete exchange `name` and its bindings; the queues stay. Answers `{"exchange", "bindings"}`."""
        return await self._request(lambda rid: DeleteExchange(rid, name), timeout)

    # ------------------------------------------------------------------ producers

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
    ) -> Producer:
        """A producer on this connection. `window` bounds its uncompleted transfers (Qpid's capacity);
        `send_timeout` is the deadline `send`/`flush` use when not given one (math.inf to wait forever);
        `mandatory`: a message the exchange routes to no queue is a refusal (`Unroutable`), raised like
        the others, instead of only counted in `statistics().unroutable`.

        `transport="udp"`: the messages go over the broker's UDP data path (an Aeron publication on
        `stream_id`, default 1001, registered over this connection; `udp_endpoint` "host:port" overrides
        the broker's UDP endpoint). The producer behaves the same (client/udpproducer.py).

        `idempotent=True`: the producer numbers its messages 0, 1, 2, ... under `producer_id` (default: a
        random one), the broker takes each sequence once (docs/protocol.md, "Idempotent producers"), and
        if the connection is lost it reconnects and sends again, in order, what was not completed
        (docs/client.md, "Idempotent producers"). At most one live producer per producer id on a connection."""
        check_timeout_option("send_timeout", send_timeout)  # NaN: refused here, not at the first send that waits
        if transport == "udp":
            if idempotent or producer_id is not None:
                raise ValueError("idempotent producers are TCP producers: the UDP data path does not carry sequences")
            from flowbroker.client.udpproducer import DEFAULT_PUBLICATION_STREAM, UdpProducer

            return UdpProducer(self, exchange, routing_key, window=window, send_timeout=send_timeout,
                               mandatory=mandatory, stream_id=DEFAULT_PUBLICATION_STREAM if stream_id is None
                               else stream_id, udp_endpoint=udp_endpoint)
        if transport != "tcp":
            raise ValueError(f"transport must be \"tcp\" or \"udp\", not {transport!r}")
        from flowbroker.client.producer import Producer

        return Producer(self, exchange, routing_key, window=window, send_timeout=send_timeout, mandatory=mandatory,
                        producer_id=producer_id, idempotent=idempotent)

    def _add_idempotent(self, producer: Producer) -> None:
        """Register an idempotent producer, refusing a second live one with the same producer id: both
        would number from 0, and the broker would take the second one's messages for duplicates."""
        for other in self._idempotent:
            if other.producer_id == producer.producer_id:
                raise ValueError(f"producer id {producer.producer_id!r} is in use by another producer on this connection")
        self._idempotent.add(producer)
        self._had_idempotent = True

    def _local_host(self) -> str:
        """The address of this end of the TCP connection: where a UDP socket of ours binds, so the broker
        sees our datagrams come from the host it knows us by."""
        return self._socket_address(getpeer=False) or "127.0.0.1"

    def _peer_host(self) -> str | None:
        return self._socket_address(getpeer=True)

    def _socket_address(self, *, getpeer: bool) -> str | None:
        stream: Any = self._stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if isinstance(stream, trio.SocketStream):
            try:
                address = stream.socket.getpeername() if getpeer else stream.socket.getsockname()
            except OSError:
                return None
            return str(address[0])
        return None

    async def _wait_outstanding(self, producers: Collection[Producer], deadline: float) -> None:
        """Wait until none of `producers` has an uncompleted transfer whose completion may still come (not
        a closed UDP producer's: `Producer._completions_ended`), the connection is closed (they will never
        complete), or `deadline` (trio's clock) passes. Never raises."""
        with trio.move_on_at(deadline):
            while self._closed is None and any(p._outstanding and p._completions_ended is None for p in producers):
                await self._credit_lot.park()

    def _enqueue_transfer(self, producer: Producer, entry: QueuedEntry, size: int) -> int:
        """Reserve credit and queue one message; the caller has checked credit. Returns its transfer id.
        (`Producer.send` does the same inline.) The writer is woken only when the queue was empty: it
        waits only once every queue is empty, so a non-empty one means it is already due to run."""
        transfer_id = self._ledger.on_sent(producer, size)
        transfers = self._transfers
        if not transfers:
            self._wake.set()
        transfers.append(entry)
        self._transfer_costs.append(size + utf8_len(entry[0]) + utf8_len(entry[1]) + ENTRY_OVERHEAD)
        return transfer_id

    async def _wait_credit(self) -> None:
        await self._credit_lot.park()

    def _on_complete(self, frame: Complete) -> None:
        """Count a COMPLETE to the producers it completes (one call per run of a producer's transfers) and
        wake whoever waits for their window; one that cannot be right is the broker's protocol violation."""
        try:
            done = self._ledger.on_complete(frame)
        except RemoteProtocolError as exc:
            self._protocol_violation(str(exc), exc.code, self._proto.frames_received)
            return
        for producer, count in done:
            producer._on_completed(count)
        if done:
            if self._had_idempotent:  # a plain flag: even len() of a WeakSet is a Python call per frame
                for idempotent in self._idempotent:
                    sequences = idempotent._sequences
                    if sequences:  # has kept messages (never None: only idempotent producers are in the set)
                        sequences.retire(frame.cumulative_id)
            self._credit_lot.unpark_all()

    def _producer_of(self, transfer_id: int) -> Producer | None:
        """The producer of an uncompleted transfer (None if the id is completed or was never sent)."""
        return self._ledger.owner_of(transfer_id)

    # ------------------------------------------------------------------ consumers

    def consumer(self, queue: str = "", *, prefetch: int = 1000, buffer_size: int = 0, transport: str = "tcp",
                 stream_id: int | None = None, exchange: str | None = None, group: str | None = None,
                 multicast: str = "", fc: str = "min", interface: str | None = None) -> Consumer:
        """A consumer of `queue`; use it as `async with conn.consumer(...) as c: async for msg in c`.
        `prefetch` bounds unsettled deliveries (0 = unbounded); `buffer_size` is the subscription's byte
        buffer (0 = off); the SDK returns its buffer acknowledgements by itself.

        `transport="udp"`: the deliveries come over the broker's UDP data path (an Aeron publication of the
        broker's on `stream_id`, default 1002); `buffer_size` is then the window of its status messages
        (0: 1 MiB), and settlement stays on this connection (client/udpconsumer.py).

        `exchange=..., transport="udp", group=..., multicast="239.x.y.z:port"`: a member of the multicast
        group `group` of fanout exchange `exchange` (client/groupconsumer.py): the group's messages come
        once, on one broker publication to that multicast address (odd, IPv4; stream `stream_id`, default
        1003), and every member gets every message. `fc="min"` (or `"tagged"`): the slowest member paces the
        group. `buffer_size` is this member's window (0: 1 MiB); processing a message settles it for this
        member (ack, reject and requeue only say so; `prefetch` does not apply, the window bounds what is
        unprocessed); `interface` is the local address to join on (None: this connection's)."""
        subscription_id = self._next_subscription_id
        if group is not None:
            if transport != "udp" or not exchange or queue:
                raise ValueError("a multicast group member is conn.consumer(exchange=..., transport=\"udp\", "
                                 "group=..., multicast=\"239.x.y.z:port\") (no queue: the group is its queue)")
            from flowbroker.client.groupconsumer import DEFAULT_GROUP_STREAM, GroupConsumer

            self._check_open()
            consumer = GroupConsumer(self, group, subscription_id, exchange=exchange, multicast=multicast, fc=fc,
                                     buffer_size=buffer_size, interface=interface,
                                     stream_id=DEFAULT_GROUP_STREAM if stream_id is None else stream_id)
            self._next_subscription_id += 1
            return consumer
        if exchange is not None or multicast:
            raise ValueError("exchange= and multicast= are for a multicast group member (group=...)")
        if not queue:
            raise ValueError("conn.consumer needs a queue")
        if transport == "udp":
            from flowbroker.client.udpconsumer import DEFAULT_SUBSCRIPTION_STREAM, UdpConsumer

            self._check_open()
            self._next_subscription_id += 1
            return UdpConsumer(self, queue, subscription_id, prefetch=prefetch, buffer_size=buffer_size,
                               stream_id=DEFAULT_SUBSCRIPTION_STREAM if stream_id is None else stream_id)
        if transport != "tcp":
            raise ValueError(f"transport must be \"tcp\" or \"udp\", not {transport!r}")
        from flowbroker.client.consumer import Consumer

        self._next_subscription_id += 1
        return Consumer(self, queue, subscription_id, prefetch=prefetch, buffer_size=buffer_size)

    def _send_subscribe(self, consumer: Consumer) -> tuple[int, _PendingRequest]:
        """Register `consumer` and queue its SUBSCRIBE. The reader calls `consumer._on_subscribed` with
        the OK before it handles the next frame (which may be a DELIVER for it), whether or not anyone
        still waits for the answer: a subscription the broker made is never left unknown to us."""
        self._consumers[consumer.subscription_id] = consumer
        try:
            return self._send_request(
                consumer._subscribe_frame,
                consumer._on_subscribed,
                consumer._on_subscribe_refused,
            )
        except BaseException:
            self._consumers.pop(consumer.subscription_id, None)
            raise

    async def _cancel(self, consumer: Consumer, timeout: float | None) -> None:
        try:
            if self._closed is None:
                await self._request(lambda rid: Cancel(rid, consumer.subscription_id), timeout)
        finally:
            self._consumers.pop(consumer.subscription_id, None)

    def _cancel_nowait(self, consumer: Consumer) -> None:
        """CANCEL a subscription whose consumer was closed before the broker's OK to its SUBSCRIBE came:
        called by the reader with that OK. Nobody waits for the answer (it is ignored); deliveries
        until then are dropped, and the broker requeues them with the cancel."""
        self._consumers.pop(consumer.subscription_id, None)
        if self._closed is None:
            self._queue_control(Cancel(self._next_request_id, consumer.subscription_id))
            self._next_request_id += 1

    async def set_buffer_size(self, size: int) -> None:
        """Set the connection-level consumer byte buffer (DCP `connection_buffer_size`; 0 = off), at any
        time: turning it on acknowledges at once every byte processed so far (positions count from the
        start of the connection, whatever the size)."""
        if size < 0:
            raise ValueError("buffer size must be >= 0")
        self._check_open()
        self._set_buffer(self._receiver_window, size)
        await trio.lowlevel.checkpoint()

    def _set_buffer(self, positions: ReceiverWindow, size: int) -> None:
        """Resize a consumer buffer. The scheduler has counted every processed byte whatever the size,
        as the broker has counted every delivered one, so the ack due now (if any) covers all of them:
        after a 0 -> n change, the broker's position and ours agree at once."""
        if size:
            positions.window = size
        ack = positions.flush(_now_ns())  # at the new size; when turning off, at the old one
        positions.window = size
        if ack is not None:
            self._queue_ack(ack)
        self._queue_control(BufferControl(positions.opaque, size))

    def _processed(self, nbytes: int, sub: ReceiverWindow | None) -> None:
        """Deliveries of `nbytes` were processed (settled, or their handler returned): count them on the
        connection's positions and, unless the subscription is gone, on the subscription's, and queue
        the acknowledgements that are due."""
        for positions in (self._receiver_window, sub):
            if positions is None:
                continue
            if positions.window:
                ack = positions.on_consumed(nbytes, _now_ns())
                if ack is not None:
                    self._queue_ack(ack)
            else:
                positions.consumed_position += nbytes

    def _broker_violated_credit(self, text: str) -> None:
        """The broker delivered beyond a consumer's credit (its prefetch): a protocol violation."""
        self._protocol_violation(text, ErrorCode.CREDIT_VIOLATION, self._proto.frames_received)

    def _settle_tag(self, outcome: Outcome, tag: int) -> None:
        """Queue a settlement for the writer. The common one extends the open run (see `_run_next`); the
        connection was open when the run began, and closing it ends the run (`_shutdown`), so the check
        is made only here on the slow path."""
        if tag == self._run_next and outcome is self._run_outcome:
            self._run_next = tag + 1
            return
        if self._closed is not None or self._nursery is None:
            self._check_open()
        if self._run_outcome is not None:
            self._close_run()
        self._run_outcome, self._run_first, self._run_next = outcome, tag, tag + 1
        # The writer takes the open run and every closed one each time it wakes, and checks for them
        # again before it waits: waking it at a new run is enough.
        self._wake.set()

    def _close_run(self) -> None:
        """Move the open run to `_settle` (there is one: `_run_outcome` is not None)."""
        outcome = cast(Outcome, self._run_outcome)
        runs = self._settle.get(outcome)
        if runs is None:
            runs = self._settle[outcome] = []
        runs.append((self._run_first, self._run_next - 1))
        self._settle_count += self._run_next - self._run_first
        self._run_outcome, self._run_next = None, -1

    # ------------------------------------------------------------------ writer

    def _queue_control(self, frame: Frame) -> None:
        self._control.append(frame)
        self._wake.set()

    def _queue_ack(self, ack: BufferAck) -> None:
        self._acks[ack.opaque] = ack  # absolute: a newer ack supersedes an unsent older one
        self._wake.set()

    def _encode_control(self, out: list[bytes]) -> None:
        send = self._proto.send
        if self._acks:
            acks, self._acks = self._acks, {}
            out.extend(send(ack) for ack in acks.values())
        if self._run_outcome is not None:
            self._close_run()
        if self._settle:
            settle, self._settle = self._settle, {}
            self._settle_count = 0
            for outcome, runs in settle.items():
                ranges = runs if len(runs) == 1 else merge_ranges(runs)
                # Split, so that no frame asks the broker for more than the protocol allows.
                for start in range(0, len(ranges), MAX_RANGES_PER_FRAME):
                    out.append(send(Settle(outcome, ranges[start : start + MAX_RANGES_PER_FRAME])))
        while self._noop_replies:
            out.append(send(Noop(self._noop_replies.popleft(), True)))
        while self._control:
            out.append(send(self._control.popleft()))

    def _encode_transfers(self, out: list[bytes]) -> None:
        """Up to WRITE_FRAMES TRANSFER frames of the oldest queued messages, each of at most TRANSFER_BATCH
        messages and, unless one message alone is larger, of the frame size. Slices and sums rather than
        a Python loop step per message: that loop was most of the writer's own cost per message."""
        transfers = self._transfers
        costs = self._transfer_costs
        budget = self._proto.max_frame_size - 64
        queued = len(transfers)
        taken = 0
        try:
            for _ in range(WRITE_FRAMES):
                if taken == queued:
                    return
                stop = min(queued, taken + TRANSFER_BATCH)
                frame_costs = costs[taken:stop]
                if sum(frame_costs) > budget:  # the most that fit the budget, at least one
                    stop = taken + max(1, bisect_right(list(accumulate(frame_costs)), budget))
                first_id = self._ledger.next_id - (queued - taken)
                entries = cast(list[TransferEntry], transfers[taken:stop])  # QueuedEntry: encoded alike
                taken = stop
                # Every entry was checked by `Producer.send` (check_message), so the frame's fields are not
                # checked again here: that was one more pass over every message.
                out.append(self._proto.send(Transfer(first_id, entries), fields_checked=True))
        finally:
            del transfers[:taken], costs[:taken]

    @trio.lowlevel.enable_ki_protection
    async def _writer(self) -> None:
        """Waits only for work (`_wake`) and for the broker to take our bytes (`_write`), which the timer
        bounds by the idle timeout: a write stalled for that long ends the connection and this task.
        A bug while encoding still lets it send ERROR + CLOSE INTERNAL_ERROR; one inside a write (the
        stream may be cut inside a frame) or while sending the last frames ends it without more."""
        generation = self._generation
        try:
            with self._writer_scope:
                try:
                    await self._write_queued()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, LocalProtocolError):
                    raise
                except Exception as exc:
                    if self._writing:
                        raise
                    self._internal_error(exc, "writer")
                await self._write_final()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._lost(ConnectionClosed(ErrorCode.INTERNAL_ERROR, f"write failed: {exc!r}"), generation)
        except LocalProtocolError as exc:  # a bug in the SDK or a frame the caller built wrongly
            log.error("flowbroker connection %s: cannot send: %s", self.connection_id, exc)
            self._shutdown(ConnectionClosed(ErrorCode.INTERNAL_ERROR, f"cannot send: {exc}"))
        except Exception as exc:
            self._internal_error(exc, "writer")
        finally:
            self._writing = False
            self._writer_done.set()

    async def _write_queued(self) -> None:
        """Until the connection closes: write what is queued whenever woken."""
        while self._closed is None:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._closed is None and (
                self._transfers or self._control or self._settle or self._run_outcome is not None or self._acks
                or self._noop_replies
            ):
                if self._settlements_may_wait():
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    continue
                self._settle_seen = self._settle_still = 0
                out: list[bytes] = []
                self._encode_control(out)
                self._encode_transfers(out)
                await self._write(b"".join(out))
                self._last_sent = trio.current_time()

    def _settlements_may_wait(self) -> bool:
        """Whether the writer, woken with nothing but settlements to send, lets them wait for one more pass
        of the scheduler (it yields and looks again): only while the application is still settling (more
        were settled since the last pass), and at most `_settle_hold` settlements. A consumer iterating a full buffer yields once per YIELD_EVERY messages, and the
        writer used to send a SETTLE frame at each of those yields: one frame per ~85 messages at
        saturation, each a write here and a read, a wake-up and a dispatch at the broker. Waiting while
        the application settles on makes them a frame per several hundred messages. Nothing waits once
        the application stops settling: when it waits for its next message (its buffer is empty) or does
        anything else, the next pass finds nothing new and sends; anything else to write (transfers,
        buffer acks, requests) takes the settlements along at once; a close sends them."""
        if self._transfers or self._control or self._acks or self._noop_replies:
            return False
        pending = self._settle_count + (self._run_next - self._run_first if self._run_outcome is not None else 0)
        if pending >= self._settle_hold:
            return False
        if pending == self._settle_seen:
            # Nothing new since the last pass. Once may be the order of one scheduler batch (the writer ran
            # before the consumer's task in it); twice, the application is doing something else.
            self._settle_still += 1
            return self._settle_still < 2
        self._settle_seen, self._settle_still = pending, 0
        return True

    async def _write_final(self) -> None:
        """Closed: write what a graceful close still sends, then `_final_frames` (CLOSE, and why)."""
        out: list[bytes] = []
        if self._graceful:
            self._encode_control(out)
            while self._transfers:
                self._encode_transfers(out)
        if not self._proto.closed_by_us:
            # Also after a remote protocol error (State.ERROR): the state machine still lets us
            # say why (ERROR + CLOSE), and answer a broker's CLOSE with ours.
            out.extend(self._proto.send(frame) for frame in self._final_frames)
        if out:
            # Bounded by `aclose`'s close_timeout, then by the end of the `async with` block.
            await self._write(b"".join(out))

    async def _write(self, data: bytes) -> None:
        """Send `data`, at most WRITE_CHUNK bytes per `send_all`, counting chunks for the timer."""
        self._writing = True
        if len(data) <= WRITE_CHUNK:
            self._write_seq += 1
            await self._stream.send_all(data)
        else:
            view = memoryview(data)
            for start in range(0, len(data), WRITE_CHUNK):
                self._write_seq += 1
                await self._stream.send_all(view[start : start + WRITE_CHUNK])
        self._writing = False

    # ------------------------------------------------------------------ reader

    async def _reader(self) -> None:
        proto = self._proto
        generation = self._generation
        try:
            while self._closed is None:
                # Frames first, then a read: bytes that came in the handshake's read after WELCOME (a
                # FLOW_STOPPED the broker sends a new connection during a stop-all) are handled at once,
                # not when the broker next writes.
                while (frame := proto.next_frame()) is not None:
                    self._dispatch(frame)
                    if self._closed is not None:
                        return
                data = await self._stream.receive_some(RECEIVE_SIZE)
                self._last_received = trio.current_time()
                if not data:
                    # (no CLOSE came: "the broker closed the connection" read as a broker-side error, a tester)
                    self._lost(ConnectionClosed(ErrorCode.INTERNAL_ERROR, CLOSED_WITHOUT_CLOSE), generation)
                    return
                proto.receive_data(bytes(data))
        except RemoteProtocolError as exc:
            self._protocol_violation(str(exc), exc.code, exc.frame_seq)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # a reset (a broker killed with data unread) says what an end without CLOSE says, and the error
            # (a bare "read failed: ... reset by peer" did not say the broker went away, a tester)
            cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
            reason = (f"{CLOSED_WITHOUT_CLOSE}: read failed: {exc!r}" if isinstance(cause, ConnectionResetError)
                      else f"read failed: {exc!r}")
            self._lost(ConnectionClosed(ErrorCode.INTERNAL_ERROR, reason), generation)

    def _protocol_violation(self, text: str, code: ErrorCode, frame_seq: int | None = None) -> None:
        log.warning("flowbroker connection %s: protocol violation by the broker: %s", self.connection_id, text)
        self._final_frames += [Error(code, text, frame_seq), Close(code, text)]
        self._shutdown(ProtocolViolation(text, code))

    def _dispatch(self, frame: Frame) -> None:
        """Handle one frame from the broker. Never waits: nothing here depends on the application."""
        if isinstance(frame, Complete):
            self._on_complete(frame)
        elif isinstance(frame, BufferAck):
            self._on_buffer_ack(frame)
        elif isinstance(frame, Deliver):
            consumer = self._consumers.get(frame.subscription_id)
            if consumer is not None:
                consumer._on_deliver(frame.entries)
            else:
                self._drop_deliveries(frame)
        elif isinstance(frame, Ok):
            pending = self._requests.pop(frame.request_id, None)
            if pending is not None:
                pending.result = frame.result
                if pending.on_ok is not None:
                    pending.on_ok(frame.result)
                pending.event.set()
        elif isinstance(frame, FlowStopped):
            self._flow.on_stopped(frame, trio.current_time())
        elif isinstance(frame, FlowResumed):
            self._flow.on_resumed(frame.destination, trio.current_time())
        elif isinstance(frame, BufferControl):
            if self._ledger.on_buffer_control(frame):
                fence = self._ledger.buffer_limit()
                if fence is not None:  # lets the broker lower its limit (and the pool's charge) after a shrink
                    self._queue_control(fence)
                self._credit_lot.unpark_all()
        elif isinstance(frame, Noop):
            if not frame.reply:
                self._noop_replies.append(frame.nonce)
                self._wake.set()
        elif isinstance(frame, Error):
            self._on_error(frame)
        elif isinstance(frame, Close):
            self._final_frames.append(Close(ErrorCode.NORMAL, "closing in answer to the broker's CLOSE"))
            self._shutdown(ConnectionClosed(frame.code, frame.reason))
        else:  # the state machine lets only broker frames through; anything else is a bug here
            raise AssertionError(f"unhandled frame {frame!r}")

    def _on_buffer_ack(self, frame: BufferAck) -> None:
        try:
            freed = self._ledger.on_buffer_ack(frame)
        except RemoteProtocolError as exc:
            self._protocol_violation(str(exc), exc.code, self._proto.frames_received)
            return
        if freed:
            self._credit_lot.unpark_all()

    def _on_error(self, frame: Error) -> None:
        ref = frame.ref_id
        if ref is not None and ref >= REQUEST_ID_BASE:
            pending = self._requests.pop(ref, None)
            if pending is not None:
                pending.error = RequestError(frame.code, frame.text, ref, frame.destination)
                if pending.on_error is not None:
                    pending.on_error()
                pending.event.set()
                return
        elif frame.session_id is not None:
            udp_producer = self._udp_producers.get(frame.session_id)
            if udp_producer is not None:  # a refusal of a message that came over UDP
                udp_producer._on_error(publish_error(frame.code, frame.text, frame.destination))
                return
        elif ref is not None:
            producer = self._producer_of(ref)
            if producer is not None:
                producer._on_error(publish_error(frame.code, frame.text, frame.destination, ref))
                return
        elif frame.code in (ErrorCode.NOT_FOUND, ErrorCode.UNAUTHORIZED) and frame.destination is not None:
            # A subscribed queue was deleted, or the user may no longer read it: end its consumers with
            # the reason instead of leaving them waiting forever for messages that cannot come.
            for consumer in list(self._consumers.values()):
                if consumer.queue == frame.destination:
                    error = publish_error(frame.code, frame.text, frame.destination)
                    if frame.code is ErrorCode.UNAUTHORIZED:
                        consumer._on_revoked(error)
                    else:
                        consumer._on_queue_deleted(error)
        elif frame.code is ErrorCode.MESSAGE_TOO_LARGE and frame.destination is not None:
            # A message in a queue is over what the UDP data path carries: the broker ended the UDP
            # subscriptions to it, requeued what they had, and kept the message (consume it over TCP).
            for consumer in list(self._consumers.values()):
                if consumer.queue == frame.destination and consumer.transport == "udp" and consumer._settles_over_tcp:
                    consumer._on_revoked(publish_error(frame.code, frame.text, frame.destination),
                                         "could not carry a message of the queue over UDP")
        log.warning(
            "flowbroker connection %s: broker error %s: %s (ref %s, destination %s)",
            self.connection_id,
            frame.code.name,
            frame.text,
            ref,
            frame.destination,
        )
        self.connection_errors.append(frame)

    def _drop_deliveries(self, frame: Deliver) -> None:
        """Deliveries for a subscription we no longer have: count them as processed on the connection's
        positions (they will never be processed), and leave settlement to the broker's cancel."""
        # Entries are the decoded lists (`build_deliveries`): index 3 is the body, 4 the headers.
        self._processed(sum(message_size(entry[3], entry[4]) for entry in frame.entries), None)

    # ------------------------------------------------------------------ timer

    async def _timer(self) -> None:
        """Liveness both ways, with the broker's idle timeout (0: none, and then nothing here bounds the
        reader's or the writer's waits on the socket but the end of the `async with` block)."""
        idle = self.welcome.idle_timeout_ms / 1000
        tick = min(1.0, max(0.01, idle / 6)) if idle else 1.0
        generation = self._generation
        while self._closed is None:
            await trio.sleep(tick)
            now = trio.current_time()
            if idle:
                if now - self._last_received >= idle:
                    text = f"no frame from the broker for {idle:g} s"
                    self._lost(ConnectionClosed(ErrorCode.IDLE_TIMEOUT, text), generation,
                               Close(ErrorCode.IDLE_TIMEOUT, text))
                    if self._writing:  # stuck in the middle of a frame to a broker that takes nothing: the
                        # CLOSE cannot follow it, and the block's end waited close_timeout for it (a tester)
                        self._writer_scope.cancel()
                    return
                if self._write_stalled(now, idle):
                    # The stream is in the middle of a frame: nothing more can be written on it.
                    text = f"the broker took none of our bytes for {idle:g} s"
                    log.warning("flowbroker connection %s: %s", self.connection_id, text)
                    self._lost(ConnectionClosed(ErrorCode.IDLE_TIMEOUT, text), generation)
                    self._writer_scope.cancel()
                    return
                if now - self._last_sent >= idle / 3 and not self._control:
                    self._noop_nonce += 1
                    self._queue_control(Noop(self._noop_nonce, False))
            now_ns = int(now * 1e9)
            for positions in [self._receiver_window] + [c._receiver_window for c in self._consumers.values()]:
                ack = positions.poll(now_ns)
                if ack is not None:
                    self._queue_ack(ack)


    def _write_stalled(self, now: float, idle: float) -> bool:
        """True when the same chunk has been in `send_all` for a whole idle timeout (seen at two ticks)."""
        if not self._writing:
            return False
        if self._write_seq != self._stuck_seq:
            self._stuck_seq, self._stuck_since = self._write_seq, now
            return False
        return now - self._stuck_since >= idle


def merge_ranges(runs: list[Range]) -> list[Range]:
    """Disjoint inclusive ranges (the runs of settled tags, in the order they were settled) sorted, those
    that touch or overlap merged: [(7, 9), (1, 3), (4, 5)] -> [(1, 5), (7, 9)]. What `to_ranges` gives
    for the same tags, from a pass over the runs instead of over every tag."""
    out: list[Range] = []
    for first, last in sorted(runs):
        if out and first <= out[-1][1] + 1:
            if last > out[-1][1]:
                out[-1] = (out[-1][0], last)
        else:
            out.append((first, last))
    return out
