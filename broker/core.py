"""The broker's state and the rules that act on it, without sockets: `BrokerCore.handle()` takes one
frame from one session and changes queues, exchanges and sessions; answers go to session outboxes.

Keeping the core free of I/O lets the hypothesis state-machine test drive thousands of random
send/consume/ack/threshold sequences in memory, and leaves the trio shell (server.py) to read, write
and keep time. The core never blocks and never stops reading a connection: flow control acts by
holding completions and credit, not by back-pressuring TCP.
"""

from __future__ import annotations

import logging
import re
import sys
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import replace
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from flowbroker.broker.config import BrokerConfig
from flowbroker.broker.exchange import Exchange, ExchangeKind, RouteCache
from flowbroker.broker.idempotence import DUPLICATE, MemoryProducerStates, ProducerSequences, Refusal, Refused, scoped
from flowbroker.broker.memory import MemoryMeter
from flowbroker.broker.logsafe import RateLimitedLog, logsafe
from flowbroker.broker.message import HeldTransfer, Message, SequenceKey
from flowbroker.broker.outbox import refusal
from flowbroker.broker.paging import SortedKeyDict
from flowbroker.broker.permissions import DEFAULT_EXCHANGE_NAME
from flowbroker.broker.queue import Queue, QueueFull
from flowbroker.broker.session import Session, SessionFault
from flowbroker.broker.store import StoreFactory, memory_store
from flowbroker.broker.subscription import Subscription
from flowbroker.broker.topic import TopicIndexFull
from flowbroker.policies.credit import (CreditAllocator, CreditPolicy, CreditPolicyConfig, PolicyConfigError,
                                        PoolExhaustedError)
from flowbroker.policies.overflow import OverflowPolicy, Thresholds
from flowbroker.policies.drain import DrainEstimator
from flowbroker.protocol.capabilities import CAPABILITY_DELIVER_BATCH, CAPABILITY_MANDATORY
from flowbroker.protocol.credit import MESSAGE_OVERHEAD, CreditError
from flowbroker.protocol.errors import ErrorCode, RemoteProtocolError
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME, MAX_KEY_BYTES, message_wire_size, utf8_len
from flowbroker.protocol.names import (
    ALL_DESTINATIONS,
    BUILTIN_EXCHANGES as _BUILTIN,
    OVERFLOW,
    QUEUE_ARGUMENTS,
    THRESHOLD_ADMIN,
    THRESHOLD_MEMORY,
)
from flowbroker.protocol.frames import (
    Bind,
    BufferAck,
    BufferControl,
    BufferLimit,
    Cancel,
    Close,
    ClosePublication,
    DeclareExchange,
    DeclareQueue,
    DeleteExchange,
    DeleteQueue,
    Error,
    FlowStopped,
    Frame,
    Headers,
    Noop,
    Ok,
    Outcome,
    PurgeQueue,
    RegisterPublication,
    Settle,
    Subscribe,
    SubscribeUdp,
    JoinGroup,
    Transfer,
    TransferEntry,
    Unbind,
)

if TYPE_CHECKING:
    from flowbroker.broker.auth import LoginThrottle
    from flowbroker.broker.journal import Journal
    from flowbroker.broker.udp.datapath import DataPath

__all__ = ["BrokerCore", "RequestError", "QUEUE_ARGUMENTS", "BUILTIN_EXCHANGES"]

LOGGER = logging.getLogger("flowbroker.broker")

BUILTIN_EXCHANGES = frozenset(name for name, _ in _BUILTIN)
"""Declared at start and never deleted (AMQP's rule), as the default exchange "" is not."""


_owner, _item = itemgetter(0), itemgetter(1)  # of a settled delivery (subscription, message)
_new_message = object.__new__  # (a Message built field by field on the router's hot path: BrokerCore.route)
SHRINK_ANSWER_NS = 10 * 1_000_000_000
"""How long a producer may leave a shrink of its buffer unanswered (no BUFFER_LIMIT, no sending that
drains it) while other producers wait for a share of the pool (`BrokerCore._close_unanswered_shrinks`)."""

SHRINK_HEARD_GRACE_NS = 2 * 1_000_000_000
"""How long after it is first heard from past SHRINK_ANSWER_NS a producer that answered shrinks before
still has to answer this one: a process woken from a pause answers within milliseconds, but may send a
frame first (`_close_unanswered_shrinks`)."""
_THRESHOLD_FIELDS = ("max_count", "max_size", "flow_stop_count", "flow_resume_count", "flow_stop_size",
                     "flow_resume_size", "flow_stop_drain_time", "flow_resume_drain_time", "flow_stop_age",
                     "flow_resume_age")
"""A queue's thresholds as declared and shown (what a redeclare's ALREADY_EXISTS names when they differ)."""
_SHORT_KEY = MAX_KEY_BYTES // 4  # characters: a key this short is within MAX_KEY_BYTES in any encoding
PACE_MAX_NS = 100_000_000
"""The longest a paced producer's completions wait for its queue to catch up (checked by the flow timer, so
100-200 ms): a queue whose consumers have stopped paces no one for long, and its watermarks take over."""
EXPIRE_PRODUCER_IDS_NS = 1_000_000_000
"""How often the flow timer forgets the idempotent producer ids idle for producer_id_ttl."""


class RequestError(Exception):
    """A request the broker refuses without closing the connection (unknown queue, bad argument)."""

    def __init__(self, code: ErrorCode, text: str, destination: str | None = None):
        super().__init__(text)
        self.code = code
        self.destination = destination


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_declared_name(name: str, kind: str) -> None:
    """Refuses a queue or exchange name with a control character (C0 or DEL) where it is declared:
    `orders\\n` passed a permission `^orders$` (Python's `$` also matches before a final newline; users.py's
    patterns no longer do), and a NUL or an ESC in a name serves no one. Declares only, not the decoder:
    a queue recovered from an older journal under such a name is still reached by it (to drain and
    delete it); it just cannot be declared anew."""
    if _CONTROL.search(name) is not None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{kind} name {name!r} must not contain control "
                           "characters (U+0000-U+001F, U+007F)", name)


FANOUT_BUDGET = 1024
"""Copies of messages routed to several queues that one call of `route` makes before it returns the rest
of the TRANSFER to the shell (`Session.routing_rest`), which lets other connections run before it goes on:
about 2 ms. One frame of 50 messages to a fanout of 10,000 queues was 0.5 s of routing in one step, and
every other connection waited (a tester); a frame of 1,024 would have been 10 s. One message whose own
fan-out is more than that is copied a slice at a time too (`Fanning`). A topic match not cached counts its cost as copies
too (`Exchange.route_cost`)."""


class RoutingRest(NamedTuple):
    """What is left of a TRANSFER to route: its next transfer id, entries and charged sizes, and the credit
    violation its receipt found (raised once everything before it is routed)."""

    tid: int
    entries: list[TransferEntry]
    sizes: list[int]
    violation: RemoteProtocolError | None


class Fanning:
    """One message whose own fan-out is more than a slice (`route`'s budget, FANOUT_BUDGET): its copies are
    made a slice at a time, in `route`'s later calls, as a TRANSFER's messages are (`Session.fanning`), and
    it completes (or is held, or refused) once every queue has its copy. Made in one step, one message to
    10,000 bound queues held every connection 26-120 ms (a tester), to max_bindings' 100,000 ten times that."""

    __slots__ = ("tid", "size", "exchange", "routing_key", "body", "headers", "producer_id", "sequence",
                 "targets", "next", "held", "errors", "durable_queue")

    def __init__(self, tid: int, size: int, entry: TransferEntry, exchange: str, routing_key: str,
                 producer_id: str | None, targets: list[Queue]):
        self.tid = tid
        self.size = size
        self.exchange = exchange
        self.routing_key = routing_key
        self.body = entry[2]
        self.headers = entry[3]
        self.producer_id = producer_id
        self.sequence = entry[5]
        self.targets = targets
        self.next = 0  # the next target to copy it to
        self.held: list[Message] = []
        self.errors: list[Refusal] = []
        self.durable_queue: Queue | None = None


def _disk_alarm_refusal(reason: str, queue: str) -> Refusal:
    """A durable queue's refusal of a producer without flow control while the disk alarm is on."""
    return (ErrorCode.RESOURCE_EXHAUSTED, f"the disk alarm is on ({reason}); a producer without flow control is "
            "refused: retry later or use flow control", queue)


MAX_CLIENT_NAME = 255
"""Characters of a HELLO's client_name the broker keeps (free text, as long as a frame allowed): 3,000
connections named with 64,000 characters each made one GET /api/policy 192 MB of JSON, and six of them
took the broker to 1.5 GiB (a tester)."""

MAX_ANSWERS_WAITING_PER_CONNECTION = 100
MAX_ANSWERS_WAITING = 10_000
"""Requests' answers waiting for the journal's commit, per connection and in all: past either, a request
that would journal something is refused RESOURCE_EXHAUSTED (nothing changed). Unbounded, clients that
pipelined durable BIND/UNBIND pairs without reading took the broker to 725 MiB while a slow disk's commit
took 3 s (a tester): each waiting answer and its record is some 800 bytes, so these bound them at about
8 MiB."""

_ANSWERED_AT_ONCE: frozenset[type[Any]] = frozenset(
    {Subscribe, Cancel, SubscribeUdp, JoinGroup, RegisterPublication, ClosePublication})
"""Requests whose OK promises nothing durable: what they journal is the deliveries and returns they cause
(a subscription to a durable queue with messages), which a restart may lose as documented. Answered only
after the commit, a new consumer of such a queue got no answer while the journal's writes failed and
timed out, its subscription made and holding messages (a tester, disk full)."""


class AnswerAfterCommit:
    """A request's answer that waits for the journal's next commit (a `CommitWaiter`), counted while it
    waits (`BrokerCore.answers_waiting`, `Session.answers_waiting`)."""

    __slots__ = ("core", "session", "answer")

    def __init__(self, core: BrokerCore, session: Session, answer: Frame):
        self.core = core
        self.session = session
        self.answer = answer
        core.answers_waiting += 1
        session.answers_waiting += 1

    def release(self) -> None:
        self.core.answers_waiting -= 1
        self.session.answers_waiting -= 1
        if self.session.open:
            self.session.send(self.answer)


class BrokerCore:
    def __init__(self, config: BrokerConfig, clock_ns: Callable[[], int]):
        self.config = config
        self.clock_ns = clock_ns
        # Sorted beside the dict, so the admin API pages them in O(log n + page) (broker/paging.py).
        self.queues: SortedKeyDict[str, Queue] = SortedKeyDict()
        self.timed_queues: dict[str, Queue] = {}  # those with a time threshold: what the flow timer ticks
        self._timed_round: list[Queue] = []  # the flow timer's round through them, in steps (tick_timed_queues)
        self._timed_at = 0  # how far the round has come
        self.routes = RouteCache()  # routing results of every exchange, bounded
        self.exchanges: SortedKeyDict[str, Exchange] = SortedKeyDict(
            (name, Exchange(name, kind, self.routes))
            for name, kind in ((name, ExchangeKind(kind)) for name, kind in _BUILTIN)
        )
        self.sessions: SortedKeyDict[int, Session] = SortedKeyDict()
        # Queues that exist per identity that declared them (a user's max_queues); entries at 0 are
        # dropped, so it holds at most one per live queue.
        self.queues_by_owner: Counter[str] = Counter()
        # floor: a share holds at least one maximum message (message_size of a max_message_size body)
        self.credit = CreditAllocator[int](
            config.credit_policy(),
            floor=config.server.max_message_size + MESSAGE_OVERHEAD,
            slots=config.server.max_connections,
        )
        self.producers_stopped = False  # an operator's stop-all
        # Broker-wide stops (destination `*`): "admin" (stop-all) and "memory" (the memory alarm), with
        # the FLOW_STOPPED that announces each. Transfers from flow-controlled producers that arrive
        # while any is in force are held once, in `_broker_held`, until none is.
        self._broker_stops: dict[str, FlowStopped] = {}
        self._broker_held: list[HeldTransfer] = []
        # Connections with transfers parked under the memory alarm (broker/parking.py): their writers are
        # woken to route them when it clears. `parking_stop`: the last `route` stopped at a message to park.
        self._parked_sessions: dict[Session, None] = {}
        # ERRORs clients send: a WARNING at most once per 10 s (`_log_reported_error`), on the core's clock
        self._log_reported_error_once = RateLimitedLog(LOGGER, logging.WARNING, clock=lambda: self.clock_ns() / 1e9)
        self.parking_stop = False
        server = config.server
        watermark = server.memory_watermark or server.memory_quota
        self.memory = MemoryMeter(watermark, watermark * server.memory_resume_percent // 100, self._memory_cleared)
        self._set_held_room()
        self._next_conn_id = 1
        self.unroutable = 0
        # Counted where a connection starts, ends or breaks a rule, never per message (broker/metrics.py):
        self.connections_opened = 0  # sessions opened (a UDP publication's included)...
        self.connections_closed = 0  # ...and closed
        self.credit_violations = 0  # connections ended for sending past their credit
        self.answers_waiting = 0  # requests' answers waiting for the journal's commit (AnswerAfterCommit)
        self.errors_sent: Counter[ErrorCode] = Counter()  # ERROR frames sent, by code (Session.send, the shell)
        # Where each declared queue keeps its messages (broker/store.py): in memory, unless the server
        # keeps a journal (broker/journalshell.py sets a factory giving durable queues a JournalStore).
        self.store_factory: StoreFactory = memory_store
        # The durable journal (broker/journal.py), when the server keeps one: durable queues, their
        # messages, exchanges and bindings are journalled, and a transfer to a durable queue completes
        # when the commit that covers it returns. `recovered_producers` is each producer id's highest
        # sequence found in it at start, also accepted into `producer_sequences` (broker/recovery.py).
        self.journal: Journal | None = None
        self.route_runs = True  # False: every message through route's per-message path (tests compare the two)
        self.pace_producers = config.queues.pace_producers
        """[queues] pace_producers: `route` paces a producer on a queue it routed to that has more ready than
        twice its consumers' combined prefetch (Queue.pace_limit): its completions and credit wait until
        the queue is down to that prefetch (Queue.pace_clear, Queue.paced), or PACE_MAX_NS."""
        self.paced_queues: dict[Queue, None] = {}  # queues with paced producers: what `tick` looks at
        self._orphans: dict[SequenceKey, HeldTransfer] = {}
        """Idempotent producers' messages held by saturated queues whose connection has closed (at most one
        entry per held transfer: bounded as they are), by (producer key, sequence): `_adopt_orphan`."""
        self._cap_warned: set[str] = set()  # users told their credit share caps them below one message
        self.over_grant: dict[Session, int] = {}  # producers whose window is above their grant, since when
        self._heard_past_answer: dict[Session, int] = {}  # of those, heard from after SHRINK_ANSWER_NS: since when
        self.recovered_producers: dict[str, int] = {}
        # The UDP data path (broker/udp/), when the server runs one: REGISTER_PUBLICATION, CLOSE_PUBLICATION
        # and SUBSCRIBE_UDP go to it; without one they are refused.
        self.udp: DataPath | None = None
        # The failed-login throttle per source address (broker/auth.py), when a server authenticates: its
        # counts are in the metrics and the broker view.
        self.login_throttle: LoginThrottle | None = None
        # Idempotent producers (broker/idempotence.py): the highest sequence taken per producer id. It is
        # in memory; what a durable queue took is journalled with its message and accepted back at start.
        states = MemoryProducerStates(server.max_producer_ids, int(server.producer_id_ttl * 1e9),
                                      server.max_producer_ids_per_user)
        states.forget = self._forget_producer_id
        self.producer_sequences = ProducerSequences(states)
        self._producer_ids_expired_ns = 0  # when `tick` last forgot the producer ids idle for producer_id_ttl

    # -- sessions ----------------------------------------------------------------------------

    def open_session(
        self,
        client_name: str,
        identity: str,
        flow_control: bool,
        wake: Callable[[], None],
        capabilities: Collection[str] = (),
        credit_share_percent: float = 0,
    ) -> Session:
        """A connection logged in as `identity`; `credit_share_percent` (its user's, 0: no cap) caps what
        the producers of that identity hold of the credit pool together (policies/credit.py). Its
        `client_name` is kept to MAX_CLIENT_NAME characters."""
        client_name = client_name[:MAX_CLIENT_NAME]
        conn_id = self._next_conn_id
        self._next_conn_id += 1
        self.memory.newest_conn = conn_id
        session = Session(
            conn_id,
            client_name,
            identity,
            flow_control,
            0,
            wake,
            # Every message is charged at least MESSAGE_OVERHEAD, so a frame sealed at this many bytes
            # also holds at most MAX_ENTRIES_PER_FRAME messages: one comparison a delivery seals both.
            max_delivery_frame_bytes=min(self.config.server.max_frame_size // 4, MAX_ENTRIES_PER_FRAME * MESSAGE_OVERHEAD),
        )
        session.transfers.max_message = self.config.server.max_message_size  # (what a mid-stream answer may claim)
        self.sessions[conn_id] = session
        self.connections_opened += 1
        self._set_held_room()
        session.errors_sent = self.errors_sent
        session.report_unroutable = CAPABILITY_MANDATORY in capabilities
        session.deliver_batches = CAPABILITY_DELIVER_BATCH in capabilities
        if flow_control:
            # Every flow-controlled connection holds a grant from connect on: WAIT_GRANT (1 byte, one
            # message) until its first TRANSFER registers it as a producer, so a connection that only
            # consumes never shrinks the producers' shares, and idle ones never hold more than a byte.
            try:
                size = self.credit.connect(conn_id, identity, credit_share_percent)[conn_id]
            except PoolExhaustedError as exc:
                # Only when the pool is smaller than two bytes per connection slot: refuse this one
                # (its first frame, or the timer, closes it with this error); no one else is touched.
                session.fault = SessionFault(ErrorCode.RESOURCE_EXHAUSTED, str(exc))
                return session
            session.resize_buffer(size, self.clock_ns())
            if credit_share_percent:
                self._warn_cap_below_floor(identity)
            if self._broker_stops:
                session.now_ns = self.clock_ns()
                session.broker_stopped(self._broker_stop(), tuple(self._broker_stops))
        return session

    def _register_producer(self, session: Session) -> None:
        """First TRANSFER from a flow-controlled connection: it now shares the pool as a producer
        (or waits for a share: then its BUFFER_ACKs are withheld, see Session.credit_waiting)."""
        self._apply_buffer_sizes(self.credit.register_producer(session.conn_id))
        session.credit_waiting = self.credit.is_waiting(session.conn_id)

    def force_close(self, conn_id: int, reason: str) -> Session:
        """An operator ends connection `conn_id` (DELETE /api/connections/ID): its shell sees the fault at
        its next timer tick (within a second) and sends ERROR + CLOSE CONNECTION_FORCED. The remedy for a
        client that holds what others need (credit it will not give back, a queue it stalls)."""
        session = self.sessions.get(conn_id)
        if session is None or not session.open:
            raise RequestError(ErrorCode.NOT_FOUND, f"no connection {conn_id}")
        if session.fences_itself:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"connection {conn_id} is a UDP publication: close the TCP connection that registered it")
        if session.fault is None:
            session.fault = SessionFault(ErrorCode.CONNECTION_FORCED, f"closed by an operator: {reason}")
        return session

    def _set_held_room(self) -> None:
        """`MemoryMeter.held_room`: the credit pool plus one maximum message per live connection (each
        may start one message below its limit), what live producers can have in flight at most; no
        bound under the `none` policy, where credit bounds nothing."""
        if self.credit.config.policy is CreditPolicy.NONE:
            self.memory.held_room = 1 << 62
        else:
            # the pool, or what was promised under a larger one until it drains (a quota lowered while the
            # alarm was on refused connected producers' transfers, a tester)
            committed = max(self.credit.pool, self.credit.total_committed())
            self.memory.held_room = committed + len(self.sessions) * self.credit.floor

    def close_session(self, session: Session, unsent: dict[int, bool] | None = None) -> None:
        """The connection ended. `unsent`: the tags of its deliveries the shell never wrote, with their
        redelivered flags (they go back as they were: the client never saw them)."""
        if self.sessions.pop(session.conn_id, None) is None:
            return
        self.connections_closed += 1
        fanning, session.fanning = session.fanning, None
        if fanning is not None:  # a message in all its queues or in none: its last copies are made now
            touched: dict[Queue, None] = {}
            self._fan_out(session, fanning, self.clock_ns(), touched, len(fanning.targets))
            self._end_message(session, fanning.tid, fanning.size, len(fanning.targets), fanning.held, fanning.errors,
                              fanning.durable_queue, fanning.producer_id, fanning.sequence, bool(self._broker_stops)
                              and session.flow_control)
            for queue in touched:
                queue.dispatch()
        session.ref.session = None  # what it left held keeps no more of it (broker/message.py SessionRef)...
        if session.ref.ids_taken:  # its idempotent producer ids: kept a TTL from now
            self.producer_sequences.store.closed(session.ref, self.clock_ns())
        session.transfers_held_now = 0  # ...and is nobody's transfer now
        if session.parked:  # what it parked was never completed: it goes with it (broker/parking.py)
            self._parked_sessions.pop(session, None)
            session.parked.clear()
        self._set_held_room()
        if session.held_sequences:  # its idempotent messages still held: its next connection's resends adopt them
            orphans = self._orphans
            for key, transfer in session.held_sequences.items():
                transfer.registry = orphans
                orphans[key] = transfer
            session.held_sequences = {}
        session.detach(unsent or {})
        self._watch_window(session, False)
        if session.paced_on is not None:  # a queue that never catches up must not keep it
            session.paced_on.forget_paced(session)
        if self.udp is not None:  # its UDP publications and subscriptions end with it
            self.udp.close_owner(session.conn_id, self.clock_ns())
        if session.conn_id in self.credit:
            self._apply_buffer_sizes(self.credit.disconnect(session.conn_id))

    def set_credit_share(self, identity: str, share_percent: float) -> None:
        """The users file gave `identity` another credit share: its live producers' grants follow."""
        self._apply_buffer_sizes(self.credit.set_owner_share(identity, share_percent))
        self._cap_warned.discard(identity)
        self._warn_cap_below_floor(identity)

    def _warn_cap_below_floor(self, identity: str) -> None:
        """A user whose credit_share_percent caps it below one maximum message: every producer of its waits
        for ever (documented, but nothing said so: a tester's waited with a consumer on an empty queue).
        Logged once per user and share, when its connection or the new share comes."""
        cap = self.credit.owner_cap(identity)
        if cap is None or cap >= self.credit.floor or identity in self._cap_warned:
            return
        self._cap_warned.add(identity)  # (bounded by the users file's users)
        LOGGER.warning("user %r: its credit_share_percent caps its producers at %d bytes of the credit pool, "
                       "below one maximum message (%d bytes: [server] max_message_size + 512): every producer "
                       "of it waits for credit for good; raise its share (flowbroker user set "
                       "--credit-share-percent) or the memory quota", identity, cap, self.credit.floor)

    def _apply_buffer_sizes(self, sizes: dict[int, int]) -> None:
        """Push changed producer grants to live connections (BUFFER_CONTROL), start or stop withholding
        the acknowledgements of waiting ones, and watch the windows a shrink left above the grant."""
        credit = self.credit
        for conn_id, size in sizes.items():
            s = self.sessions.get(conn_id)
            if s is None:
                continue
            was_waiting = s.credit_waiting
            s.credit_waiting = credit.is_waiting(conn_id)
            drained: dict[int, int] = {}
            announced = size != s.buffer_size
            if announced:
                s.announce_buffer(size)
                if s.fences_itself and s.transfers.fence(s.transfers.controls, size, s.transfers.window.position):
                    # A UDP publication: nothing beyond what it sent is promised (its status messages follow
                    # the new grant); an idle one held its first grant for as long as it stayed registered.
                    drained = credit.set_window(conn_id, s.transfers.promised)
            if was_waiting and not s.credit_waiting:
                s.release_withheld(self.clock_ns())
            # a shrink does not lower the limit (the client may not have seen it yet), so what it may
            # still have unacknowledged stays charged to the pool until acknowledgements overtake it
            # or the client's BUFFER_LIMIT answer lowers the limit (on_buffer_limit).
            over = s.transfers.promised > size
            self._watch_window(s, over)
            if over and announced:
                self.over_grant[s] = self.clock_ns()  # its answer is due from the latest shrink on
                self._heard_past_answer.pop(s, None)  # (heard past an earlier one's: that counts no more)
            if drained:
                self._apply_buffer_sizes(drained)

    def _window_moved(self, session: Session) -> None:
        """An acknowledgement went to a producer whose window was above its grant: the promise it
        spent or drained goes back to the pool (and to whoever waits for it)."""
        if not session.open or session.conn_id not in self.credit:
            self._watch_window(session, False)
            return
        window = session.transfers.promised
        if window <= session.buffer_size:
            self._watch_window(session, False)
        self._apply_buffer_sizes(self.credit.set_window(session.conn_id, window))

    def _log_reported_error(self, session: Session, frame: Error) -> None:
        """An ERROR a client sent: a WARNING at most once per 10 s (LOG_INTERVAL) broker-wide, with
        the count left out, the others at DEBUG. Each was a WARNING, and the connection stays open: one
        client sending ERRORs wrote 160,100 lines (50 MB) in 10 s (a tester)."""
        args = (session.conn_id, frame.code.name, logsafe(frame.text))
        if not self._log_reported_error_once("connection %d reported error %s: %s", *args):
            LOGGER.debug("connection %d reported error %s: %s", *args)

    def _watch_window(self, session: Session, over: bool) -> None:
        """A producer's window is above its grant (a shrink it has not answered yet: acknowledgements
        then report what drains, `_window_moved`), or no longer. `over_grant` keeps since when, for the
        flow timer (`tick`): one that leaves it so for SHRINK_ANSWER_NS while producers wait is closed."""
        if over:
            session.window_listener = self._window_moved
            self.over_grant.setdefault(session, self.clock_ns())
        else:
            session.window_listener = None
            self.over_grant.pop(session, None)
            self._heard_past_answer.pop(session, None)

    def set_credit_policy(self, **settings: Any) -> CreditPolicyConfig:
        """Change the producer credit policy while running; every live grant is recomputed and pushed.
        Nothing changes if the settings are invalid or the new pool cannot hold the live connections."""
        merged = {"quota": self.config.server.memory_quota, **self.config.credit, **settings}
        policy = CreditPolicyConfig.from_mapping(merged)
        changed = self.credit.reconfigure(policy)
        self.config = replace(self.config, credit={**self.config.credit, **settings})
        self._apply_buffer_sizes(changed)
        # Windows granted before a switch to `none` are not known to the allocator: report them.
        for s in list(self.sessions.values()):
            if s.flow_control and s.conn_id in self.credit and s.buffer_size:
                window = s.transfers.promised
                if window > self.credit.window_of(s.conn_id):
                    self._apply_buffer_sizes(self.credit.set_window(s.conn_id, window))
                    if window > s.buffer_size:
                        self._watch_window(s, True)
        for s in self.sessions.values():
            if s.conn_id in self.credit:
                s.credit_waiting = self.credit.is_waiting(s.conn_id)
        self._set_held_room()  # after the old windows are charged: they may still arrive
        return policy

    # -- frames ------------------------------------------------------------------------------

    def handle(self, session: Session, frame: Frame) -> None:
        """Act on one frame from a client. Raises SessionFault when the connection must end."""
        fault = session.outbox.fault
        if fault is not None:
            raise fault
        if type(frame) is Transfer:
            self.on_transfer(session, frame)
            return
        if type(frame) is Settle:
            self.on_settle(session, frame)
            return
        if type(frame) is BufferAck:
            self.on_buffer_ack(session, frame)
            return
        if type(frame) is Noop:
            if not frame.reply:
                session.send(Noop(frame.nonce, True))
            return
        handler = self._requests.get(type(frame))
        if handler is None:
            if type(frame) is BufferControl:
                self.on_buffer_control(session, frame)
            elif type(frame) is BufferLimit:
                self.on_buffer_limit(session, frame)
            elif type(frame) is Error:
                self._log_reported_error(session, frame)
            elif type(frame) is Close:
                pass  # the shell ends the connection
            return
        request_id: int = frame.request_id  # type: ignore[union-attr]
        if session.access is not None and (denied := session.access.check_request(frame)) is not None:
            session.send(Error(ErrorCode.UNAUTHORIZED, denied.text, None, request_id, denied.resource))
            return
        journal = self.journal
        journalled = journal.records_appended if journal is not None else 0
        if (journal is not None and (session.answers_waiting >= MAX_ANSWERS_WAITING_PER_CONNECTION
                                     or self.answers_waiting >= MAX_ANSWERS_WAITING)
                and (name := self._journalling(frame)) is not None):
            session.send(Error(ErrorCode.RESOURCE_EXHAUSTED,
                               f"{session.answers_waiting} requests of this connection ({self.answers_waiting} in "
                               "all) wait for the journal to write what they changed (a slow disk?): nothing was "
                               "changed; retry when they are answered", None, request_id, name))
            return
        if journal is not None and journal.write_failing and (name := self._journalling(frame)) is not None:
            # Its record cannot be written, so its OK would wait until the disk takes writes again, and the
            # client saw only a request timeout suggesting the broker was down (a tester): refused, nothing
            # done. Only while writes fail: under the quota or free-space alarms the journal still writes,
            # and a purge or delete is what frees the space (refused then, the alarm never cleared).
            # (the alarm's reason says "the journal cannot write under ...: why"; said once, a tester)
            reason = journal.alarm.reason if journal.alarm is not None else "the journal's last write failed"
            session.send(Error(ErrorCode.RESOURCE_EXHAUSTED,
                               f"{reason}. A change to what the journal keeps (durable queues, their bindings, "
                               "exchanges) cannot be made durable now: nothing was changed; retry when the disk "
                               "takes writes again", None, request_id, name))
            return
        try:
            result = handler(self, session, frame)
        except RequestError as exc:
            session.send(Error(exc.code, str(exc), None, request_id, exc.destination))
        except PolicyConfigError as exc:
            session.send(Error(ErrorCode.INVALID_ARGUMENT, str(exc), None, request_id, None))
        else:
            if journal is not None and journal.records_appended != journalled and type(frame) not in _ANSWERED_AT_ONCE:
                # It changed something durable (a durable queue declared, deleted or purged, a binding of
                # one): OK once that is on disk, as a transfer to a durable queue completes. Answered at
                # once, a kill -9 right after undid it: deleted queues came back with their messages,
                # declared ones were gone (a tester).
                journal.after_commit(AnswerAfterCommit(self, session, Ok(request_id, result)))
            else:
                session.send(Ok(request_id, result))

    # -- producing ---------------------------------------------------------------------------

    def on_transfer(self, session: Session, frame: Transfer) -> None:
        """Route one TRANSFER. The session rules (ids, credit, completions) are the TransferReceiver's
        (protocol/session.py); routing, holding and refusing are the core's."""
        receiver = session.transfers
        tid = frame.first_id
        # Checked against the grant the client had when it sent this frame: on a first transfer that is
        # the provisional one, not the share that registering below grants.
        try:
            sizes, violation = receiver.receive(tid, frame.entries)
        except RemoteProtocolError as exc:  # a transfer id gap: nothing was received
            raise SessionFault(exc.code, str(exc)) from None
        if session.flow_control and session.conn_id not in self.credit.producer_ids:
            self._register_producer(session)
        if session.parked:  # behind what it parked, in order (broker/parking.py)
            self._park(session, RoutingRest(tid, frame.entries[:len(sizes)], sizes, violation))
            return
        self.route_in_slices(session, tid, frame.entries, sizes, violation)

    def route_in_slices(self, session: Session, tid: int, entries: list[TransferEntry], sizes: list[int],
                        violation: RemoteProtocolError | None = None) -> None:
        """`route` of at most FANOUT_BUDGET copies of fan-out; what is left waits in `session.routing_rest`
        for `route_rest` (a TCP frame's, and a UDP publication's poll: broker/udp/ingress.py)."""
        self._route_slice(session, RoutingRest(tid, entries, sizes, violation))

    def route_rest(self, session: Session) -> None:
        """Route the next slice of a TRANSFER whose fan-out `on_transfer` left unfinished
        (`session.routing_rest`): the shell calls it, yielding between slices, before the connection's
        next frame."""
        rest = session.routing_rest
        if rest is not None:
            session.routing_rest = None
            self._route_slice(session, rest)

    def _route_slice(self, session: Session, rest: RoutingRest) -> None:
        """Route what `rest` holds up to FANOUT_BUDGET copies; keep what is left in `session.routing_rest`.
        The credit violation found on receipt, if any, ends the connection once the messages before it
        are routed."""
        self.parking_stop = False
        done = self.route(session, rest.tid, rest.entries, rest.sizes, FANOUT_BUDGET)
        if done < len(rest.sizes):
            left = RoutingRest(rest.tid + done, rest.entries[done:], rest.sizes[done:], rest.violation)
            if self.parking_stop:
                self._park(session, left)
            else:
                session.routing_rest = left
            return
        if rest.violation is not None:
            self.credit_violations += 1
            raise SessionFault(rest.violation.code, str(rest.violation))

    def _park(self, session: Session, rest: RoutingRest) -> None:
        """Keep `rest` unrouted behind what the session parked (broker/parking.py); its writer routes it
        once the memory alarm is off. A credit violation ends the connection now (its parked messages,
        never completed, go with it)."""
        # Its names, one copy each while parked, as routed messages keep theirs (decoded, each message kept
        # its own, uncharged: a 255-emoji exchange took 2.5 times the bound's growth, a tester).
        intern = sys.intern
        entries = [TransferEntry(intern(exchange), intern(key), body, headers, producer_id and intern(producer_id),
                                 sequence) for exchange, key, body, headers, producer_id, sequence in rest.entries]
        session.parked.add(RoutingRest(rest.tid, entries, rest.sizes, None))
        self._parked_sessions[session] = None
        if rest.violation is not None:
            self.credit_violations += 1
            raise SessionFault(rest.violation.code, str(rest.violation))
        if not self.memory.alarm:
            session.outbox.wake()

    def _fans_out(self, exchange: str, routing_key: str) -> bool:
        """A message to `exchange` with `routing_key` would be routed to more than one queue now."""
        ex = self.exchanges.get(exchange)
        return ex is not None and len(ex.route(routing_key)) > 1

    def parked_due(self, session: Session) -> bool:
        """The session has parked transfers and the memory alarm is off: its writer routes them."""
        return bool(session.parked) and not self.memory.alarm

    def route_parked(self, session: Session) -> None:
        """Route the next slice (FANOUT_BUDGET copies) of what the session parked; a message that fans out
        while the alarm is on again stays parked with what follows it. The shell's writer calls it while
        `parked_due`, yielding between slices (a UDP publication's: the data path's cycles)."""
        parked = session.parked
        if not parked or not session.open:
            return
        rest = parked.first()
        self.parking_stop = False
        done = self.route(session, rest.tid, rest.entries, rest.sizes, FANOUT_BUDGET)
        parked.routed(done)
        if not parked:
            self._parked_sessions.pop(session, None)

    def route(self, session: Session, tid: int, entries: list[TransferEntry], sizes: list[int],
              budget: int = 1 << 62) -> int:
        """Route received messages, transfer ids `tid`, `tid` + 1, ... charged `sizes`: enqueue, hold or
        refuse each and complete what is not held. One path for a TCP TRANSFER's entries and for the
        messages of a UDP publication's image (broker/udp/ingress.py), so both obey the same watermarks,
        hard limits, stop-all and memory alarm. Stops after the message whose fan-out (messages routed to
        several queues, counted in copies) reaches `budget`; returns how many messages it routed."""
        first_tid = tid
        fanned = 0  # copies made by messages routed to several queues
        receiver = session.transfers
        now = self.clock_ns()
        session.now_ns = now
        consumed = receiver.window.consumed_position
        max_message = self.config.server.max_message_size
        # A body this short, with a short key and no headers, is within max_message_size whatever its
        # exchange (a name of at most 255 characters) and key: at most 4 UTF-8 bytes a character.
        fast_body = max_message - 4 * (_SHORT_KEY + 255)
        broker_hold = session.flow_control and bool(self._broker_stops)
        memory = self.memory
        memory_refusal = memory.alarm and not session.flow_control
        # A message that fans out under the alarm is parked, with everything after it (broker/parking.py)
        park = memory.alarm and session.flow_control
        # Past the alarm by more than live producers can have in flight: what producers that sent and left
        # added (each new connection's grant, or its one message over its first byte). Refused, or the
        # alarm bounded nothing against a client reconnecting (a tester: 600 MiB over a 256 MiB quota).
        past_room = (broker_hold and memory.alarm and session.conn_id > memory.alarm_newest_conn
                     and memory.held > memory.watermark + memory.held_room)
        queues_by_name = self.queues
        # Permissions (broker/permissions.py): one dict lookup per message, the decision cached per exchange.
        may_write = session.access.write_cache if session.access is not None else None
        journal = self.journal
        # The disk alarm holds flow-controlled producers of durable queues (Journal.hold); nothing paces
        # the others, so their messages to durable queues are refused while it is on, never journalled.
        disk_alarm = journal.alarm if journal is not None and not session.flow_control else None
        # Queues enqueued to in this frame: each dispatches once, after the frame (Queue.add), so a
        # consumer gets the frame's messages as one run (Subscription.deliver_ready).
        touched: dict[Queue, None] = {}
        last: Queue | None = None
        # The common message (below) of a flow-controlled producer completes nothing but itself (its
        # queue's hard limit, whose drop-head releases other transfers, is for the others): such
        # messages completed as routed are told to the receiver as runs of consecutive ids
        # (complete_run), and a run is told before anything else in the frame may complete a transfer.
        fast = session.flow_control and not past_room
        run_first = run_end = -1
        run_size = 0
        try:
            fanning = session.fanning
            if fanning is not None and entries and fanning.tid == tid:  # a message's fan-out, sliced: on with it
                fanned += self._fan_out(session, fanning, now, touched, budget)
                if fanning.next < len(fanning.targets):
                    entries, sizes = [], []  # not done: nothing after it in this call
                else:
                    session.fanning = None
                    if self._end_message(session, tid, fanning.size, len(fanning.targets), fanning.held,
                                         fanning.errors, fanning.durable_queue, fanning.producer_id,
                                         fanning.sequence, broker_hold):
                        memory_refusal = not session.flow_control
                        broker_hold = park = session.flow_control
                    tid += 1
                    entries, sizes = entries[1:], sizes[1:]
                    if fanned >= budget:
                        entries, sizes = [], []  # the rest in another call
            # The common frame: every message to one memory-only queue that takes them all without
            # saturating (Queue.takes_run) from a flow-controlled producer, none held by a broker-wide stop.
            # Its leading run of common messages (below) to that queue is built in one loop and added
            # with one `add_run`, its ids completed as one run; the rest, if any, goes through the loop
            # below. tests/broker/test_runs.py checks it against the per-message path (`route_runs` off).
            if fast and not broker_hold and self.route_runs and entries:
                key = entries[0][1]
                queue = queues_by_name.get(key) if len(key) <= _SHORT_KEY else None
                if (
                    queue is not None
                    and not (journal is not None and queue.durable)
                    and (may_write is None or may_write.get(""))
                    and ((held_run := queue.saturated and queue.takes_held_run()) or queue.takes_run(len(sizes), sum(sizes)))
                ):
                    msgs: list[Message] = []
                    offset = queue.next_offset
                    run_size = 0
                    for (exchange, routing_key, body, headers, producer_id, sequence), size in zip(entries, sizes):
                        if exchange != "" or routing_key != key or producer_id is not None or headers or len(body) > fast_body:
                            break
                        # Message's fields set here: a class call with its __init__ costs half as much again.
                        msg = _new_message(Message)
                        msg.exchange = exchange
                        msg.routing_key = queue.name  # (equal to the key: one copy, not one a message)
                        msg.body = body
                        msg.headers = headers
                        msg.size = size
                        msg.producer_id = None
                        msg.sequence = sequence
                        msg.redelivered = False
                        msg.held = None
                        msg.offset = offset
                        offset += 1
                        msgs.append(msg)
                        run_size += size
                    if msgs and held_run:  # a saturated queue: each held, completed when it clears
                        queue.add_held_run(msgs, run_size, session)
                        for msg in msgs:
                            msg.held = HeldTransfer(session, tid, msg.size, 1)
                            tid += 1
                        session.transfers_held_total += len(msgs)
                        run_size = 0
                    elif msgs:
                        queue.add_run(msgs, run_size)
                        run_first, run_end = tid, tid + len(msgs)
                        tid = run_end
                    if msgs:
                        touched[queue] = None
                        last = queue
                        if len(msgs) < len(sizes):
                            entries, sizes = entries[len(msgs):], sizes[len(msgs):]
                        else:
                            entries, sizes = [], []
                    else:
                        run_size = 0
            # Only the messages received: up to a credit violation, raised once they are routed.
            for entry, size in zip(entries, sizes):
                exchange, routing_key, body, headers, producer_id, sequence = entry  # (one op, not six lookups)
                if (
                    fast
                    and exchange == ""
                    and producer_id is None
                    and not headers
                    and len(body) <= fast_body
                    and len(routing_key) <= _SHORT_KEY
                    and (may_write is None or may_write.get(exchange))
                    and (queue := queues_by_name.get(routing_key)) is not None
                ):
                    # One queue, within every limit: no list of targets nor of held messages. (The key is the
                    # queue's own name object: each message kept a decoded copy, uncharged, a tester.)
                    msg = Message(exchange, queue.name, body, headers, size, None, sequence)
                    try:
                        held_one = queue.add(msg, session, now)
                    except QueueFull as exc:  # a queue without a stop threshold: its hard limit holds everyone
                        if run_end != run_first:  # the run is told before this refusal completes its transfer
                            receiver.complete_run(run_first, run_end - run_first, run_size)
                            run_first = run_end = -1
                            run_size = 0
                        self._refuse(session, tid, size, ErrorCode.QUEUE_FULL, str(exc), queue.name)
                        tid += 1
                        continue
                    if queue is not last:
                        touched[queue] = None
                        last = queue
                    durable = journal is not None and queue.durable
                    if held_one or broker_hold or durable:
                        self._hold(session, tid, size, [msg] if held_one else [], broker_hold, queue if durable else None)
                    elif tid == run_end:
                        run_end += 1
                        run_size += size
                    else:
                        if run_end != run_first:
                            receiver.complete_run(run_first, run_end - run_first, run_size)
                        run_first, run_end, run_size = tid, tid + 1, size
                    tid += 1
                    continue
                if run_end != run_first:  # everything below may complete transfers: the run goes first
                    receiver.complete_run(run_first, run_end - run_first, run_size)
                    run_first = run_end = -1
                    run_size = 0
                if park and exchange != "" and self._fans_out(exchange, routing_key):
                    self.parking_stop = True  # this message and the rest: the caller parks them
                    break
                # An idempotent producer's duplicate or gap is answered here, before it can reach a queue.
                if producer_id is not None:
                    # the store's key, as the journal records it; interned, so that a producer's held messages
                    # share one copy (each kept its own, uncharged: a 255-emoji id took a 128 MiB-watermark
                    # broker to 1.9 times its bound, a tester)
                    producer_id = sys.intern(scoped(session.identity, producer_id))
                    if not self._sequence_taken(session, tid, size, entry, producer_id, now):
                        tid += 1
                        continue
                # Two comparisons for the common message; the exact check only when it could fail.
                if headers or len(body) > fast_body or len(routing_key) > _SHORT_KEY:
                    refused = self._check_entry(entry, max_message)
                    if refused is not None:
                        self._refuse(session, tid, size, *refused, producer_id, sequence)
                        tid += 1
                        continue
                if (may_write is not None and not may_write.get(exchange)
                        and self._publish_denied(session, tid, size, exchange, producer_id, sequence)):
                    tid += 1
                    continue
                if past_room:
                    self._refuse(session, tid, size, ErrorCode.RESOURCE_EXHAUSTED,
                                 f"the broker is over its memory watermark ({memory.held} of {memory.watermark} "
                                 f"bytes held) by more than its producers' credit ({memory.held_room} bytes), and "
                                 "this connection opened after the alarm came on: retry when it clears",
                                 ALL_DESTINATIONS, producer_id, sequence)
                    tid += 1
                    continue
                if memory_refusal:  # nothing paces a producer without flow control: refuse, never grow
                    self._refuse(session, tid, size, ErrorCode.RESOURCE_EXHAUSTED,
                                 f"the broker is over its memory watermark ({self.memory.held} of "
                                 f"{self.memory.watermark} bytes held); retry later or use flow control", ALL_DESTINATIONS,
                                 producer_id, sequence)
                    tid += 1
                    continue
                if exchange == "":
                    target = queues_by_name.get(routing_key)
                    if target is None:
                        self._refuse(session, tid, size, ErrorCode.NOT_FOUND,
                                     f"no queue named {routing_key!r}", routing_key, producer_id, sequence)
                        tid += 1
                        continue
                    targets: Collection[Queue] = (target,)
                    routing_key = target.name  # (kept by its messages: the queue's own object, not a copy each)
                else:
                    ex = self.exchanges.get(exchange)
                    if ex is None:
                        self._refuse(session, tid, size, ErrorCode.NOT_FOUND, f"no exchange named {exchange!r}", exchange,
                                     producer_id, sequence)
                        tid += 1
                        continue
                    # Its messages keep the exchange's own name object: each kept a decoded copy, uncharged
                    # (a tester's 255-character name took 1.6 times the memory bound's bytes, with emoji 3.1).
                    exchange = ex.name
                    # and one copy of each routing key while messages hold it (interned: a producer's messages
                    # with one key kept a decoded copy each, 332 bytes for 64 emoji, uncharged, a tester)
                    routing_key = sys.intern(routing_key)
                    targets = ex.route(routing_key)
                    if ex.route_cost:  # a topic match not cached: its cost counts as fan-out (Exchange.route)
                        fanned += ex.route_cost
                        ex.route_cost = 0
                    if not targets:
                        self.unroutable += 1
                        if session.report_unroutable:  # the client asked to hear of it (AMQP's mandatory)
                            self._refuse(session, tid, size, ErrorCode.UNROUTABLE,
                                         f"exchange {exchange!r} routed key {routing_key!r} to no queue", exchange,
                                         producer_id, sequence)
                            tid += 1
                            if fanned >= budget:
                                break
                            continue
                if len(targets) > budget:  # its own fan-out is more than a slice: copied a slice at a time
                    session.fanning = Fanning(tid, size, entry, exchange, routing_key, producer_id, list(targets))
                    break  # (from the next call on: the top of this method)
                held: list[Message] = []
                durable_queue: Queue | None = None  # a durable queue took it: completion waits for the journal
                errors: list[Refusal] = []  # the queues that refused it: an idempotent resend is told again
                # (`_copy`'s loop, inline: a call per message cost the path of idempotent producers and
                # exchanges 0.1-0.3 us a message, 4-10 %)
                for queue in targets:
                    if disk_alarm is not None and queue.durable:
                        errors.append(_disk_alarm_refusal(disk_alarm.reason, queue.name))
                        continue
                    msg = Message(exchange, routing_key, body, headers, size, producer_id, sequence)
                    touched[queue] = None
                    try:
                        if queue.add(msg, session, now):
                            held.append(msg)
                    except QueueFull as exc:
                        errors.append((ErrorCode.QUEUE_FULL, str(exc), queue.name))
                        continue
                    if journal is not None and queue.durable:
                        durable_queue = queue
                if len(targets) > 1:
                    fanned += len(targets)
                if not (held or errors or broker_hold or durable_queue is not None or len(targets) > 1):
                    receiver.complete(tid, size)  # (`_end_message`'s common case, without the call: 0.2 us)
                elif self._end_message(session, tid, size, len(targets), held, errors, durable_queue, producer_id,
                                       sequence, broker_hold):
                    memory_refusal = not session.flow_control  # its copies raised the memory alarm
                    broker_hold = park = session.flow_control
                last = None
                tid += 1
                if fanned >= budget:  # the rest in another call, after the shell has let others run
                    break
        finally:  # (whatever went wrong, what was routed is completed and delivered)
            if run_end != run_first:
                receiver.complete_run(run_first, run_end - run_first, run_size)
            # Pacing (docs/policies.md): a producer whose queue is behind gets its completions and
            # credit once the queue catches up (Session.collect holds them, the queue releases them).
            pace = self.pace_producers and session.paced_on is None
            for queue in touched:
                queue.dispatch()
                if pace and len(queue.store) > queue.pace_limit and not queue.deleted:
                    queue.pace(session, now)
                    self.paced_queues[queue] = None
                    pace = False
        if receiver.window.consumed_position != consumed:
            session.outbox.wake()  # COMPLETE and perhaps a BUFFER_ACK are due
        if self.memory.over():  # checked once a frame: the bound is exceeded by at most one frame
            self._memory_alarm()
        return tid - first_tid

    def _fan_out(self, session: Session, fanning: Fanning, now: int, touched: dict[Queue, None], budget: int) -> int:
        """Copy `fanning`'s message to its next `budget` queues (at least one); returns how many it copied
        to. A queue deleted since the slice before gets no copy (as it would had it been deleted first)."""
        f = fanning
        start = f.next
        end = min(len(f.targets), start + max(budget, 1))
        durable = self._copy(session, f.targets[start:end], now, touched, f.held, f.errors, f.exchange,
                             f.routing_key, f.body, f.headers, f.size, f.producer_id, f.sequence)
        if durable is not None:
            f.durable_queue = durable
        f.next = end
        return end - start

    def _copy(self, session: Session, queues: Collection[Queue], now: int, touched: dict[Queue, None],
              held: list[Message], errors: list[Refusal], exchange: str, routing_key: str, body: bytes,
              headers: Headers | None, size: int, producer_id: str | None, sequence: int | None) -> Queue | None:
        """Enqueue a copy of one message in each of `queues` (a queue deleted meanwhile gets none): the copies
        a saturated queue holds go to `held`, the queues' refusals to `errors`; returns the last durable queue
        that took one (its completion waits for the journal), if any."""
        journal = self.journal
        # The disk alarm holds flow-controlled producers of durable queues (Journal.hold); nothing paces
        # the others, so their messages to durable queues are refused while it is on, never journalled.
        disk_alarm = journal.alarm if journal is not None and not session.flow_control else None
        durable: Queue | None = None
        for queue in queues:
            if queue.deleted:
                continue
            if disk_alarm is not None and queue.durable:
                errors.append(_disk_alarm_refusal(disk_alarm.reason, queue.name))
                continue
            msg = Message(exchange, routing_key, body, headers, size, producer_id, sequence)
            touched[queue] = None
            try:
                if queue.add(msg, session, now):
                    held.append(msg)
            except QueueFull as exc:
                errors.append((ErrorCode.QUEUE_FULL, str(exc), queue.name))
                continue
            if journal is not None and queue.durable:
                durable = queue
        return durable

    def _end_message(self, session: Session, tid: int, size: int, copies: int, held: list[Message],
                     errors: list[Refusal], durable_queue: Queue | None, producer_id: str | None,
                     sequence: int | None, broker_hold: bool) -> bool:
        """A routed message's copies are made: refuse it if queues refused it, then complete or hold it.
        True if its copies raised the memory alarm (the rest of the frame is then held or refused)."""
        if errors:
            # One ERROR a message, the first queue's, counting the others: one per refusing queue
            # was 204,800 ERRORs for a frame of 1,024 messages to a fanout over 200 full queues, and
            # a client reading them as fast as it could was closed as not reading (a tester).
            code, text, dest = errors[0]
            if len(errors) > 1:
                text = f"{text} (and {len(errors) - 1} more queue(s) refused it, the next {errors[1][2]!r})"
            session.send(refusal(code, text, tid, dest))
            if producer_id is not None:  # the resend is told the same
                self.producer_sequences.was_refused(producer_id, sequence, ((code, text, dest),))  # type: ignore[arg-type]
        alarm = False
        if copies > 1 and self.memory.over():
            # A fan-out multiplies what one entry holds: checked per entry here, not once per
            # frame, so one frame of 1,024 messages to 4,000 bound queues cannot hold 33x the
            # watermark (a tester). The rest of the frame is refused (no flow control) or held.
            self._memory_alarm()
            alarm = True
            broker_hold = session.flow_control
        if held or broker_hold or durable_queue is not None:
            self._hold(session, tid, size, held, broker_hold, durable_queue,
                       None if producer_id is None else (producer_id, sequence))  # type: ignore[arg-type]
        else:
            session.transfers.complete(tid, size)
        return alarm

    def _hold(self, session: Session, tid: int, size: int, held: list[Message], broker_hold: bool,
              durable: Queue | None, sequence_key: SequenceKey | None = None) -> None:
        """Transfer `tid` completes later: when the saturated queues that hold `held` release them, a
        broker-wide stop ends (`broker_hold`) and the journal commits it (`durable`, a queue's name for
        the disk alarm), whichever comes last. An idempotent producer's (`sequence_key`) is kept where
        its resend on a later connection finds it (`_adopt_orphan`)."""
        transfer = HeldTransfer(session, tid, size, len(held) + broker_hold + (durable is not None))
        if sequence_key is not None:
            transfer.sequence_key = sequence_key
            transfer.registry = session.held_sequences
            session.held_sequences[sequence_key] = transfer
        for msg in held:
            msg.held = transfer
        if broker_hold:
            self._broker_held.append(transfer)
        if durable is not None and self.journal is not None:
            self.journal.hold(transfer, session, durable.name)
        session.transfers_held_total += 1

    def _sequence_taken(self, session: Session, tid: int, size: int, entry: TransferEntry, key: str,
                        now: int) -> bool:
        """True when this message of an idempotent producer is the next of its producer id (route it);
        otherwise it is answered now: a duplicate is completed (not enqueued), a gap or an id the broker
        cannot track is refused (completed with an ERROR naming why)."""
        verdict = self.producer_sequences.check(entry[4], entry[5], now, key, session.ref)  # type: ignore[arg-type]
        if verdict is None:
            return True
        if verdict is DUPLICATE and self._orphans:
            orphan = self._orphans.pop((key, entry[5]), None)  # type: ignore[arg-type]
            if orphan is not None:
                session.duplicates += 1
                self._adopt_orphan(orphan, session, tid, size)
                return False
        if verdict is DUPLICATE or isinstance(verdict, Refused):
            session.duplicates += 1
            if isinstance(verdict, Refused):  # its original was refused: so is it, the same way
                for code, text, dest in verdict.errors:
                    session.send(refusal(code, text, tid, dest))
            if self.journal is not None and not self.journal.dormant:
                # its original may still be in a commit: the duplicate's COMPLETE must not overtake it
                self.journal.after_commit(HeldTransfer(session, tid, size, 1))
            else:
                session.complete_transfer(tid, size)
        else:
            code, text = verdict  # type: ignore[misc]
            self._refuse(session, tid, size, code, text, None)
        return False

    @staticmethod
    def _adopt_orphan(orphan: HeldTransfer, session: Session, tid: int, size: int) -> None:
        """An idempotent producer resends, on a new connection, a message its closed connection left held
        by a saturated queue: the resend's transfer completes when that message leaves the queue, as the
        original would have, instead of at once. Completed at once, it gave the producer its credit back
        for messages still held, the producer sent as much again, and a reconnect held two windows: past
        what live producers' credit bounds, the queue refused most of the rest QUEUE_FULL (366 of 600
        messages, a tester)."""
        orphan.owner, orphan.transfer_id, orphan.size = session.ref, tid, size
        session.transfers_held_now += 1
        session.transfers_held_total += 1
        key = orphan.sequence_key
        assert key is not None
        orphan.registry = session.held_sequences
        session.held_sequences[key] = orphan

    @staticmethod
    def _check_entry(entry: TransferEntry, max_message: int) -> tuple[ErrorCode, str, str | None] | None:
        """Why a message cannot be routed (a key over MAX_KEY_BYTES, the whole message over
        max_message_size), or None. Checked at publish so that a message the broker takes can always
        be delivered: a DELIVER carries the same fields."""
        # (by index: the broker's reader keeps a TRANSFER's entries as decoded lists, `build_transfers`)
        exchange, routing_key, body, headers = entry[0], entry[1], entry[2], entry[3]
        key_bytes = utf8_len(routing_key)
        if key_bytes > MAX_KEY_BYTES:
            return (ErrorCode.KEY_TOO_LONG,
                    f"routing key of {key_bytes} bytes exceeds the limit of {MAX_KEY_BYTES} bytes", None)
        size = message_wire_size(exchange, routing_key, body, headers)
        if size > max_message:
            return (ErrorCode.MESSAGE_TOO_LARGE,
                    f"message of {size} bytes (body {len(body)}, with its routing key, exchange and "
                    f"headers) exceeds max_message_size {max_message}", None)
        return None

    def _publish_denied(self, session: Session, tid: int, size: int, exchange: str, key: str | None,
                        sequence: int | None) -> bool:
        """Decide (and cache) write on `exchange` for a message whose decision is not cached as allowed;
        refuse the message (UNAUTHORIZED, completed) if it is denied."""
        access = session.access
        assert access is not None
        if access.may_publish(exchange):
            return False
        denied = access.denied_publish(exchange)
        self._refuse(session, tid, size, ErrorCode.UNAUTHORIZED, denied.text, denied.resource, key, sequence)
        return True

    def _refuse(self, session: Session, tid: int, size: int, code: ErrorCode, text: str, dest: str | None,
                key: str | None = None, sequence: int | None = None) -> None:
        """A transfer the broker will not enqueue: say why, and complete it so window and credit flow.
        `key` and `sequence`: an idempotent producer's message whose sequence was taken, so that its
        resend is refused again (broker/idempotence.py `Refused`), not completed as a duplicate."""
        session.send(refusal(code, text, tid, dest))
        session.complete_transfer(tid, size)
        if key is not None and sequence is not None:
            self.producer_sequences.was_refused(key, sequence, ((code, text, dest),))

    def stop_all_producers(self) -> None:
        """Hold every new transfer from flow-controlled producers until start_all_producers()."""
        if self.producers_stopped:
            return
        self.producers_stopped = True
        self._set_broker_stop(THRESHOLD_ADMIN, FlowStopped(ALL_DESTINATIONS, THRESHOLD_ADMIN, 0, 0,
                                                           "an operator stopped all producers"))

    def start_all_producers(self) -> None:
        if not self.producers_stopped:
            return
        self.producers_stopped = False
        self._set_broker_stop(THRESHOLD_ADMIN, None)

    def admin_held(self) -> tuple[HeldTransfer, ...]:
        """Transfers held by a broker-wide stop (stop-all, the memory alarm) now, for the views."""
        return tuple(self._broker_held)

    def _memory_alarm(self) -> None:
        memory = self.memory
        memory.alarm = True
        memory.alarm_newest_conn = memory.newest_conn
        memory.alarms_total += 1
        LOGGER.warning("memory alarm: %d bytes of messages held, watermark %d: producers are flow-stopped "
                       "until under %d", memory.held, memory.watermark, memory.resume)
        self._set_broker_stop(THRESHOLD_MEMORY, FlowStopped(
            ALL_DESTINATIONS, THRESHOLD_MEMORY, memory.watermark, memory.held,
            f"the broker holds {memory.held} bytes of messages, over its memory watermark {memory.watermark}; "
            "transfers are held until consumers take messages",
        ))

    def _memory_cleared(self) -> None:
        LOGGER.warning("memory alarm cleared: %d bytes of messages held", self.memory.held)
        self._set_broker_stop(THRESHOLD_MEMORY, None)
        for session in self._parked_sessions:  # their writers route what they parked (broker/parking.py)
            session.outbox.wake()

    def _broker_stop(self) -> FlowStopped:
        """The FLOW_STOPPED on `*` that says why, the memory alarm first (an operator can see stop-all)."""
        stops = self._broker_stops
        return stops.get(THRESHOLD_MEMORY) or stops[THRESHOLD_ADMIN]

    def _set_broker_stop(self, reason: str, stop: FlowStopped | None) -> None:
        """Start (stop given) or end a broker-wide stop; producers hear of every change of reason."""
        stops = self._broker_stops
        if stop is not None:
            stops[reason] = stop
        elif stops.pop(reason, None) is None:
            return
        if not stops:
            held, self._broker_held = self._broker_held, []
            for transfer in held:
                transfer.release()
        now = self.clock_ns()
        current = self._broker_stop() if stops else None
        reasons = tuple(stops)
        for s in self.sessions.values():
            if s.flow_control:
                s.now_ns = now  # the flow state's "since" (otherwise the time of its last transfer)
                s.broker_stopped(current, reasons)

    # -- consuming ---------------------------------------------------------------------------

    def on_settle(self, session: Session, frame: Settle) -> None:
        """Settle by ranges: the session's DeliveryLedger (protocol/delivery.py) finds what each range
        settles by bisection, so the frame costs its own size plus what it settles; the core gives the
        messages to their queues (settled, or requeued in tag order) and resumes the subscriptions."""
        requeue = frame.outcome is Outcome.REQUEUE
        reject = frame.outcome is Outcome.REJECT
        settled, unknown = session.deliveries.settle(frame.ranges)
        subs: dict[Subscription, None] = {}
        touched: dict[Queue, list[Message]] = {}
        # In tag order, settlements come in runs of one subscription (all of them, with one consumer):
        # each run is one call to its queue, in the same order as one call per message.
        for sub, run in groupby(settled, _owner):
            msgs = list(map(_item, run))
            sub.unsettled -= len(msgs)
            subs[sub] = None
            queue = sub.queue
            if requeue:
                touched.setdefault(queue, []).extend(msgs)
            else:
                touched[queue] = msgs
                queue.settle_many(msgs)
                if reject:
                    queue.counters.consumer_rejected += len(msgs)
        for sub in subs:
            sub.queue.resume_subscription(sub)  # prefetch freed; dispatch follows below
        for queue, msgs in touched.items():
            if requeue:
                queue.requeue_many(msgs)  # in tag order, ahead of everything ready
            else:
                queue.settled()
        if unknown:
            session.send(
                Error(ErrorCode.UNKNOWN_DELIVERY, f"{unknown} delivery tag(s) in {frame.ranges[:4]} are not outstanding",
                      session.frame_seq)
            )

    def on_buffer_control(self, session: Session, frame: BufferControl) -> None:
        if frame.opaque == 0:
            session.sender_window.resize(frame.buffer_size)
            self._dispatch_session(session)
            return
        sub = session.subscriptions.get(frame.opaque)
        if sub is None:
            session.send(Error(ErrorCode.NOT_FOUND, f"no subscription {frame.opaque} for BUFFER_CONTROL", session.frame_seq))
            return
        sub.sender_window.resize(frame.buffer_size)
        sub.queue.resume_subscription(sub)
        sub.queue.dispatch()

    def on_buffer_limit(self, session: Session, frame: BufferLimit) -> None:
        """The producer answered a shrink: it starts nothing at or beyond `frame.limit`. The credit limit
        comes down (TransferReceiver.fence), and with it the window the pool charges, so a promise the
        shrink left drains now rather than when an idle producer would have sent it, and whoever waits
        for a share gets the bytes (the allocator hands them out while someone is short)."""
        if not session.flow_control or session.conn_id not in self.credit:
            return  # not paced: the broker checks no limit, so there is nothing to lower
        try:
            lowered = session.transfers.fence(frame.control, frame.size, frame.limit)
        except RemoteProtocolError as exc:
            raise SessionFault(exc.code, str(exc)) from None
        if lowered:
            window = session.transfers.promised
            # Still above the grant (the first answer after `none` -> paced names what the producer sent
            # unpaced and has in flight): acknowledgements report it as it drains. Charged and not
            # watched, it stayed charged for good: committed 36 MB over a 3.3 MB pool after a live PUT
            # from none to aggressive, and a newcomer producer waited (a tester).
            self._watch_window(session, window > session.buffer_size)
            self._apply_buffer_sizes(self.credit.set_window(session.conn_id, window))

    def on_buffer_ack(self, session: Session, frame: BufferAck) -> None:
        try:
            if frame.opaque == 0:
                session.sender_window.on_ack(frame.acked_position)
                self._dispatch_session(session)
                return
            sub = session.subscriptions.get(frame.opaque)
            if sub is None:
                return  # a late ack for a cancelled subscription
            sub.sender_window.on_ack(frame.acked_position)
            sub.queue.resume_subscription(sub)
            sub.queue.dispatch()
        except CreditError as exc:
            raise SessionFault(ErrorCode.CREDIT_VIOLATION, f"BUFFER_ACK for opaque {frame.opaque}: {exc}") from None

    def _dispatch_session(self, session: Session) -> None:
        """The connection's buffer may have room again: every subscription of the session rejoins its
        queue's rotation, and the room is shared one message per subscription per round, starting with
        a different subscription each time, so a slow subscription cannot take all of it (it used to
        go to the first subscription every time, and a slow one starved a fast one completely)."""
        subs = list(session.subscriptions.values())
        if not subs:
            return
        turn = session.dispatch_turn % len(subs)
        session.dispatch_turn = turn + 1
        subs = subs[turn:] + subs[:turn]
        for sub in subs:
            sub.queue.resume_subscription(sub)
        buffer = session.sender_window
        if buffer.window:
            sharing = subs
            while sharing and buffer.may_send():
                sharing = [sub for sub in sharing if sub.queue.store and sub.has_credit()]
                for sub in sharing:
                    if not buffer.may_send():
                        break
                    sub.queue.deliver_to(sub)
        for sub in subs:
            sub.queue.dispatch()

    # -- requests ----------------------------------------------------------------------------

    def queue_thresholds(self, arguments: dict[str, Any]) -> tuple[Thresholds, OverflowPolicy]:
        for key in arguments:
            if key not in QUEUE_ARGUMENTS:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"unknown queue argument {key!r}; known: {', '.join(QUEUE_ARGUMENTS)}")
        overflow = OverflowPolicy.parse(arguments.get(OVERFLOW, self.config.queues.overflow), OVERFLOW)
        numeric = {k: v for k, v in arguments.items() if k != OVERFLOW}
        thresholds = Thresholds(**numeric, defaults=self.config.queues.thresholds())
        return thresholds, overflow

    def declare_queue(self, name: str, arguments: dict[str, Any] | None = None, durable: bool = False,
                      owner: str | None = None, owner_limit: int = 0) -> Queue:
        """The queue `name`, declared now unless it exists (a redeclare that does not match it is refused:
        `_check_redeclare`). `owner` (the declaring identity) is charged for a new queue; `owner_limit`
        (its user's max_queues, 0: none) refuses one more over it."""
        if not name:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "queue name must not be empty")
        _check_declared_name(name, "queue")
        if durable and not self.config.storage.enabled:
            durable = False  # ([storage] enabled = false: ignored, as configuration.md says; the OK said durable
            # true of a queue a restart empties, a tester)
        thresholds, overflow = self.queue_thresholds(arguments or {})
        existing = self.queues.get(name)
        if existing is not None:
            self._check_redeclare(existing, durable, bool(arguments), thresholds, overflow)
            return existing
        limit = self.config.server.max_queues
        if len(self.queues) >= limit:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, f"too many queues (max_queues {limit})", name)
        if owner is not None and owner_limit and self.queues_by_owner[owner] >= owner_limit:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"user {owner!r} has its max_queues ({owner_limit}) declared", name)
        queue = self.queues[name] = Queue(name, thresholds, overflow, durable, self.memory, self.store_factory(name, durable))
        self.charge_owner(queue, owner)
        self.track_time_thresholds(queue)
        self._journal_queue(queue)
        return queue

    @staticmethod
    def _check_redeclare(queue: Queue, durable: bool, with_arguments: bool, thresholds: Thresholds,
                         overflow: OverflowPolicy) -> None:
        """An OK to a redeclare must not leave the client believing something false of the queue: a
        memory-only queue answered OK to `durable=True` would lose on a restart the messages its
        producers were told are on disk. A declare with arguments states the whole queue, so its
        durability (the wire's default, false, included) must match as well as its arguments. A bare
        declare (no arguments, not durable) takes the queue as it is: the wire cannot tell "not
        durable" from "not said", and it is what `flowbroker publish`, the Spark writer and multicast
        groups send to make sure a queue exists, durable or not."""
        name = queue.name
        if durable and not queue.durable:
            raise RequestError(ErrorCode.ALREADY_EXISTS,
                               f"queue {name!r} exists memory-only and cannot become durable: delete it first "
                               "(its messages go with it) and declare it durable=True, or declare it without "
                               "durable", name)
        if not with_arguments:
            return
        if queue.durable and not durable:
            raise RequestError(ErrorCode.ALREADY_EXISTS,
                               f"queue {name!r} exists durable: declare it durable=True, or with no arguments "
                               "to take it as it is, or delete it first to make it memory-only", name)
        if queue.thresholds != thresholds or queue.overflow is not overflow:
            differ = [f"{key} {getattr(queue.thresholds, key)!r} (declared {getattr(thresholds, key)!r})"
                      for key in _THRESHOLD_FIELDS if getattr(queue.thresholds, key) != getattr(thresholds, key)]
            if queue.overflow is not overflow:
                differ.append(f"overflow {queue.overflow.value!r} (declared {overflow.value!r})")
            raise RequestError(ErrorCode.ALREADY_EXISTS,
                               f"queue {name!r} exists with other arguments: {', '.join(differ)}; change them with "
                               "`flowbroker queue set` (or PATCH /api/queues/NAME), or declare it as it is",
                               name)

    def charge_owner(self, queue: Queue, owner: str | None) -> None:
        """`queue` counts toward `owner`'s queues (declared now, or recovered from the journal)."""
        queue.owner = owner
        if owner is not None:
            self.queues_by_owner[owner] += 1

    def _journal_queue(self, queue: Queue) -> None:
        """A durable queue's declaration (or changed thresholds) goes to the journal, if its store is one."""
        qid = getattr(queue.store, "qid", None)
        if self.journal is not None and qid is not None:
            self.journal.queue_declared(qid, queue)

    def get_queue(self, name: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no queue named {name!r}", name)
        return queue

    def set_queue_thresholds(self, name: str, changes: dict[str, Any]) -> Queue:
        """Change a queue's thresholds while running; saturation is re-evaluated at once."""
        queue = self.get_queue(name)
        t = queue.thresholds
        current: dict[str, Any] = {k: getattr(t, k) for k in QUEUE_ARGUMENTS if k != OVERFLOW}
        current[OVERFLOW] = queue.overflow.value
        # A changed stop threshold without its resume keeps the queue's resume/stop ratio (its
        # hysteresis; the [queues] percentages' when it had no stop), so `queue set --flow-stop-size`
        # does not silently turn resume = stop. A stop set to null (the default) derives both.
        for dim in ("count", "size"):
            stop_key, resume_key = f"flow_stop_{dim}", f"flow_resume_{dim}"
            if stop_key in changes and resume_key not in changes:
                current[resume_key] = self._kept_resume(current[stop_key], current[resume_key], changes[stop_key])
            new_max, old_max = changes.get(f"max_{dim}"), current[f"max_{dim}"]
            if f"max_{dim}" in changes and new_max is None:  # null: the default limit, followed as any new one
                new_max = getattr(self.queue_thresholds({})[0], f"max_{dim}")
            if (stop_key not in changes and isinstance(new_max, int) and not isinstance(new_max, bool)
                    and new_max != old_max and old_max > 0 and self._derived_from(dim, old_max, current)):
                # stop and resume were derived from the old limit: they follow the new one (or, with the
                # limit removed, go back to the defaults); they stayed, and a tester's `--max-count 0` after
                # `--max-count 5` left the queue stopping at 4 messages
                current[stop_key] = current[resume_key] = None
            elif (stop_key not in changes and isinstance(new_max, int) and not isinstance(new_max, bool)
                    and (0 < new_max < current[stop_key] or (new_max > 0 == current[stop_key] == current[f"max_{dim}"]))):
                # a hard limit lowered under the stop it had, or the first one of a queue with no stop and no
                # limit of that kind: both derived from the new limit, as for a queue declared with only its
                # max (else the change is refused, stop above max; or a flow-controlled producer was never
                # stopped by a max_count set later: 2,001 messages in a queue of max_count 5, a tester)
                current[stop_key] = current[resume_key] = None
        for dim in ("drain_time", "age"):  # seconds: the same ratio kept, unrounded (none when it was off)
            stop_key, resume_key = f"flow_stop_{dim}", f"flow_resume_{dim}"
            old_stop, new_stop = current[stop_key], changes.get(stop_key)
            if stop_key in changes and resume_key not in changes:
                keep = (isinstance(new_stop, (int, float)) and not isinstance(new_stop, bool) and new_stop > 0
                        and old_stop > 0)
                # (at most the stop: 0.3 x 0.1 / 0.3 is 0.10000000000000002, refused as a resume over it)
                current[resume_key] = min(new_stop, new_stop * current[resume_key] / old_stop) if keep else None
        current.update(changes)
        thresholds, overflow = self.queue_thresholds(current)
        queue.overflow = overflow
        self.track_time_thresholds(queue, thresholds)
        queue.set_thresholds(thresholds, self.clock_ns())
        self._journal_queue(queue)
        return queue

    def _derived_from(self, dim: str, limit: int, current: dict[str, Any]) -> bool:
        """Whether `current`'s stop and resume of `dim` are what a queue declared with only that limit gets."""
        derived, _ = self.queue_thresholds({f"max_{dim}": limit})
        return bool(getattr(derived, f"flow_stop_{dim}") == current[f"flow_stop_{dim}"]
                    and getattr(derived, f"flow_resume_{dim}") == current[f"flow_resume_{dim}"])

    def tick(self, now_ns: int, timed_limit: int = sys.maxsize) -> bool:
        """The broker's flow timer (the server calls it every policies.drain.TICK_SECONDS): queues with a
        time threshold update their drain-rate estimates and evaluate them (the first `timed_limit` of a
        round, `tick_timed_queues`), producers paced for over PACE_MAX_NS are released, idle producer ids
        are forgotten. Nothing per message. True while the round of timed queues has more: the shell goes
        on with `tick_timed_queues` in steps, yielding between them."""
        more = self.tick_timed_queues(now_ns, timed_limit)
        if now_ns - self._producer_ids_expired_ns >= EXPIRE_PRODUCER_IDS_NS:
            # producer ids idle for producer_id_ttl are forgotten (O(those), the oldest first): kept until
            # the bound needed their places, a job that reused its id the next day had every message taken
            # for a duplicate of the last run's (a tester)
            self._producer_ids_expired_ns = now_ns
            self.producer_sequences.store.expire(now_ns)
        if self.over_grant and self.credit.waiting():
            self._close_unanswered_shrinks(now_ns)
        if self.paced_queues:
            before = now_ns - PACE_MAX_NS
            for queue in list(self.paced_queues):
                queue.release_paced(before)
                if not queue.paced:
                    del self.paced_queues[queue]
        return more

    def tick_timed_queues(self, now_ns: int, limit: int) -> bool:
        """Tick the next `limit` queues with a time threshold in the round in progress (each timed queue
        once, as they were when the round began; one deleted or no longer timed since is passed over);
        True while the round has more. In one step, 99,000 such queues (any client may declare them, even
        empty) took 0.5 s every tick, and every connection waited (a tester: p50 161 ms, gaps of 500 ms)."""
        round_ = self._timed_round
        if self._timed_at >= len(round_):
            round_ = self._timed_round = list(self.timed_queues.values())
            self._timed_at = 0
        start = self._timed_at
        end = min(start + limit, len(round_))
        timed = self.timed_queues
        for queue in round_[start:end]:
            if timed.get(queue.name) is queue:
                queue.tick(now_ns)
        self._timed_at = end
        if end < len(round_):
            return True
        self._timed_round = []
        self._timed_at = 0
        return False

    def _forget_producer_id(self, key: str) -> None:
        """The store forgot an idempotent producer id (idle for producer_id_ttl): so does the journal (a
        PRODUCER_FORGOTTEN record), whose message records would otherwise bring it back at the next start."""
        if self.journal is not None:
            self.journal.producer_forgotten(key)

    def _close_unanswered_shrinks(self, now_ns: int) -> None:
        """Producers wait for a share while a producer's window stays above its shrunk grant: one that has
        never answered a BUFFER_CONTROL (BUFFER_LIMIT) nor drained the window by sending within
        SHRINK_ANSWER_NS of the shrink is closed CREDIT_VIOLATION. A client that ignores shrinks and stays
        idle held its old window for as long as it stayed connected, and 6 of them held the default pool:
        every other producer waited (a tester). An SDK producer paused for 15 s was closed when this
        looked at the latest shrink only (another tester): one that has answered before is not. Nor is one
        that answered the latest and sent all it promised, whose window stays above the grant only by the
        bytes a saturated queue holds (a third)."""
        horizon = now_ns - SHRINK_ANSWER_NS
        heard_past = self._heard_past_answer
        for session, since in list(self.over_grant.items()):
            transfers = session.transfers
            if since > horizon or not transfers.controls or session.fault is not None:
                continue
            # A client that has never answered a BUFFER_CONTROL: closed. One that has (the SDK answers each
            # at once) and is silent now is paused (a GC pause, a stopped process), and is left to
            # idle_timeout; but one that keeps talking (answering NOOPs) past SHRINK_ANSWER_NS and still
            # leaves the shrink unanswered SHRINK_HEARD_GRACE_NS after is ignoring it: a raw client that
            # answered its first grant and no shrink after held its window while four SDK producers sent one
            # message each in 20 s (a tester).
            window = transfers.window
            if (transfers.answered == transfers.controls
                    and window.limit <= max(window.position, window.acked_position + window.window)):
                # It answered the latest shrink and has sent all it promised: what stays above its grant
                # is bytes received, held by a saturated queue, that complete as the queue drains. An SDK
                # producer waiting so, answering NOOPs, was closed 20 s after the shrink (a tester).
                continue
            if transfers.answered:
                if session.heard_ns - since <= SHRINK_ANSWER_NS:
                    continue
                if now_ns - heard_past.setdefault(session, session.heard_ns) < SHRINK_HEARD_GRACE_NS:
                    continue
            if transfers.answered == transfers.controls:  # answered, with a limit beyond what it sent (a tester)
                why = (f"its BUFFER_LIMIT answer kept a limit {window.limit - window.position} bytes beyond the "
                       f"{window.position} bytes it has sent, which it has not sent since")
            else:
                why = "no BUFFER_LIMIT answered it"
            session.fault = SessionFault(
                ErrorCode.CREDIT_VIOLATION,
                f"BUFFER_CONTROL shrank the buffer to {session.buffer_size} bytes {(now_ns - since) / 1e9:.0f} s "
                f"ago and {why}, while producers wait for the credit it holds ({session.transfers.promised} bytes)")
            del self.over_grant[session]
            heard_past.pop(session, None)

    def track_time_thresholds(self, queue: Queue, thresholds: Thresholds | None = None) -> None:
        """Keep `timed_queues` to the queues with a time threshold: the flow timer ticks only those, so
        100,000 queues without one cost it nothing. A queue that gains one starts a fresh estimate."""
        if (thresholds or queue.thresholds).time.enabled:
            if queue.name not in self.timed_queues:
                queue.drain = DrainEstimator()
                self.timed_queues[queue.name] = queue
        else:
            self.timed_queues.pop(queue.name, None)

    def _kept_resume(self, old_stop: int, old_resume: int, new_stop: Any) -> int | None:
        """The resume threshold that keeps old_resume/old_stop for `new_stop` (None: derive it)."""
        if not isinstance(new_stop, int) or isinstance(new_stop, bool) or new_stop <= 0:
            return None
        if old_stop > 0 and old_resume > 0:
            return max(1, new_stop * old_resume // old_stop)
        q = self.config.queues
        if q.flow_stop_percent <= 0 or q.flow_resume_percent <= 0:
            return None
        return max(1, int(new_stop * q.flow_resume_percent / q.flow_stop_percent))

    def delete_queue(self, name: str) -> int:
        queue = self.get_queue(name)
        del self.queues[name]
        self.timed_queues.pop(name, None)
        if queue.owner is not None:
            self.queues_by_owner[queue.owner] -= 1
            if self.queues_by_owner[queue.owner] <= 0:
                del self.queues_by_owner[queue.owner]
        for ex in self.exchanges.values():
            ex.unbind_queue(queue)
        count = queue.count
        for sub in queue.delete():
            sub.queue_deleted(name)  # a multicast group's closes its group
        return count

    def _journalling(self, frame: Any) -> str | None:
        """The queue or exchange a request would change in the journal (so its answer waits for a commit),
        or None. Asked only while the journal's writes fail."""
        queues, kind = self.queues, type(frame)
        if kind is DeclareQueue:
            return frame.queue if frame.durable and frame.queue not in queues else None
        if kind in (DeleteQueue, PurgeQueue, Bind, Unbind):
            queue = queues.get(frame.queue)
            return frame.queue if queue is not None and queue.durable else None
        if kind is DeclareExchange:
            return frame.exchange if frame.exchange not in self.exchanges else None
        if kind is DeleteExchange:
            return frame.exchange if frame.exchange in self.exchanges else None
        return None

    def _req_declare_queue(self, session: Session, f: DeclareQueue) -> dict[str, Any]:
        access = session.access  # None: the loopback user, who has no limits and owns nothing
        limit = access.user.max_queues if access is not None and access.user is not None else 0
        owner = session.identity if access is not None else None
        queue = self.declare_queue(f.queue, f.arguments, f.durable, owner, limit)
        return {"queue": queue.name, "count": queue.count, "size": queue.size, "durable": queue.durable}

    def _req_declare_exchange(self, session: Session, f: DeclareExchange) -> dict[str, Any]:
        try:
            kind = ExchangeKind(f.kind)
        except ValueError:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"unknown exchange kind {f.kind!r}; known: direct, fanout, topic") from None
        if not f.exchange:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "the default exchange '' cannot be declared")
        if f.exchange == DEFAULT_EXCHANGE_NAME:  # (its permissions and refusals would be the default's, a tester)
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{DEFAULT_EXCHANGE_NAME!r} names the default exchange "
                               "(its permissions and refusals use it): declare another name", f.exchange)
        _check_declared_name(f.exchange, "exchange")
        existing = self.exchanges.get(f.exchange)
        if existing is not None and existing.kind is not kind:
            raise RequestError(ErrorCode.ALREADY_EXISTS, f"exchange {f.exchange!r} exists as {existing.kind}", f.exchange)
        if existing is None:
            limit = self.config.server.max_exchanges
            if len(self.exchanges) >= limit:
                raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, f"too many exchanges (max_exchanges {limit})", f.exchange)
            self.exchanges[f.exchange] = Exchange(f.exchange, kind, self.routes)
            if self.journal is not None:
                self.journal.exchange_declared(f.exchange, kind.value)
        return {"exchange": f.exchange, "kind": kind.value}

    def _exchange(self, name: str) -> Exchange:
        ex = self.exchanges.get(name)
        if ex is None:
            if name == "":  # (it exists, and routes by queue name: binding to it means nothing)
                raise RequestError(ErrorCode.NOT_FOUND, "the default exchange '' takes no bindings: it routes each "
                                   "message to the queue its routing key names; bind to a named exchange", name)
            raise RequestError(ErrorCode.NOT_FOUND, f"no exchange named {name!r}", name)
        return ex

    @staticmethod
    def _check_key(key: str, what: str = "binding key") -> None:
        key_bytes = utf8_len(key)
        if key_bytes > MAX_KEY_BYTES:
            raise RequestError(ErrorCode.KEY_TOO_LONG,
                               f"{what} of {key_bytes} bytes exceeds the limit of {MAX_KEY_BYTES} bytes")

    def _req_bind(self, session: Session, f: Bind) -> dict[str, Any]:
        self._check_key(f.binding_key)
        exchange, queue = self._exchange(f.exchange), self.get_queue(f.queue)
        limit = self.config.server.max_bindings
        if self.routes.bindings >= limit:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, f"too many bindings (max_bindings {limit})", f.exchange)
        try:
            created = exchange.bind(queue, f.binding_key)
        except TopicIndexFull as exc:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, str(exc), f.exchange) from None
        if created:
            self._journal_binding(exchange, queue, f.binding_key, True)
        return {"created": created}

    def _req_unbind(self, session: Session, f: Unbind) -> dict[str, Any]:
        self._check_key(f.binding_key)  # (no binding has such a key: said as for BIND, not "removed")
        exchange, queue = self._exchange(f.exchange), self.get_queue(f.queue)
        removed = exchange.unbind(queue, f.binding_key)
        if removed:
            self._journal_binding(exchange, queue, f.binding_key, False)
        return {"removed": removed}

    def _journal_binding(self, exchange: Exchange, queue: Queue, key: str, bound: bool) -> None:
        qid = getattr(queue.store, "qid", None)
        if self.journal is not None and qid is not None:
            self.journal.bound(exchange.name, qid, key, bound)

    def delete_exchange(self, name: str) -> int:
        """Delete exchange `name` and its bindings (the queues stay); returns how many bindings it had."""
        if name == "" or name in BUILTIN_EXCHANGES:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the built-in exchange {name!r} cannot be deleted", name)
        exchange = self._exchange(name)
        del self.exchanges[name]
        exchange.release()
        if self.journal is not None:
            self.journal.exchange_deleted(name)
        bindings = sum(len(queues) for queues in exchange.bindings.values())
        self.routes.bindings -= bindings
        self.routes.clear()
        return bindings

    def _req_delete_exchange(self, session: Session, f: DeleteExchange) -> dict[str, Any]:
        return {"exchange": f.exchange, "bindings": self.delete_exchange(f.exchange)}

    def _req_delete_queue(self, session: Session, f: DeleteQueue) -> dict[str, Any]:
        return {"deleted": self.delete_queue(f.queue)}

    def _req_purge_queue(self, session: Session, f: PurgeQueue) -> dict[str, Any]:
        return {"purged": self.get_queue(f.queue).purge()}

    def check_subscribe(self, session: Session, subscription_id: int, queue_name: str,
                        prefetch: int) -> tuple[Queue, int]:
        """What SUBSCRIBE and SUBSCRIBE_UDP check: the queue, and the prefetch in force (capped)."""
        if subscription_id == 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               "subscription id 0 is reserved for the connection's buffer (BUFFER_CONTROL/"
                               "BUFFER_ACK opaque 0); use 1 or more")
        queue = self.get_queue(queue_name)
        if self.udp is not None and queue_name in self.udp.groups.by_name:
            raise RequestError(ErrorCode.ALREADY_EXISTS,
                               f"queue {queue_name!r} is a multicast group's: join the group instead", queue_name)
        limit = self.config.server.max_subscriptions
        if len(session.subscriptions) >= limit:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"too many subscriptions on this connection (max_subscriptions {limit})")
        self.check_subscriptions_total()
        if subscription_id in session.subscriptions or (
                self.udp is not None and self.udp.groups.find_member(session.conn_id, subscription_id) is not None):
            raise RequestError(ErrorCode.ALREADY_EXISTS, f"subscription id {subscription_id} is in use")
        cap = self.config.queues.max_prefetch
        return queue, min(prefetch, cap) if prefetch else cap

    def check_subscriptions_total(self, destination: str | None = None) -> None:
        """Refuse one more subscription past `[server] max_subscriptions_total` (the queues count theirs on
        `memory`): SUBSCRIBE, SUBSCRIBE_UDP and a multicast group's own subscription to its queue."""
        total = self.config.server.max_subscriptions_total
        if self.memory.subscriptions >= total:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"too many subscriptions in the broker (max_subscriptions_total {total})", destination)

    def _req_subscribe(self, session: Session, f: Subscribe) -> dict[str, Any]:
        queue, prefetch = self.check_subscribe(session, f.subscription_id, f.queue, f.prefetch)
        sub = Subscription(session, f.subscription_id, queue, prefetch, f.buffer_size)
        session.subscriptions[f.subscription_id] = sub
        queue.add_subscription(sub)
        return {"queue": queue.name, "prefetch": prefetch}

    def revoke_reads(self, session: Session) -> int:
        """Its user's permissions changed (or the user was deleted): each subscription to a queue it may no
        longer read ends, as at CANCEL (unsettled deliveries requeued, in order), and the client is told
        ERROR UNAUTHORIZED naming the queue. Returns how many ended. (A revoked consumer kept receiving
        every later message of the queue: only new requests were checked, a tester.)"""
        access = session.access
        if access is None:
            return 0
        ended = 0
        for sub_id, sub in list(session.subscriptions.items()):
            name = sub.queue.name
            if access.allowed("read", name):
                continue
            self.end_subscription(session, sub, Error(
                ErrorCode.UNAUTHORIZED, f"access refused: user {session.identity!r} may no longer read queue "
                f"{name!r}: subscription {sub_id} is cancelled", None, None, name))
            ended += 1
        return ended

    def end_subscription(self, session: Session, sub: Subscription, error: Error) -> None:
        """The broker ends a subscription as a CANCEL would (its unsettled deliveries requeued, in order) and
        tells the client `error` (destination: the queue). Not from inside a dispatch of its queue."""
        if session.subscriptions.get(sub.sub_id) is not sub:
            return
        del session.subscriptions[sub.sub_id]
        self._end_subscription(session, sub)
        session.send(error)

    def _req_cancel(self, session: Session, f: Cancel) -> dict[str, Any]:
        sub = session.subscriptions.pop(f.subscription_id, None)
        if sub is None and self.udp is not None and self.udp.groups.leave(session.conn_id, f.subscription_id,
                                                                          self.clock_ns()):
            return {"requeued": 0}  # a multicast group's member left it
        if sub is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no subscription {f.subscription_id}")
        return {"requeued": self._end_subscription(session, sub)}

    def _end_subscription(self, session: Session, sub: Subscription) -> int:
        """A subscription ends while its connection stays: the deliveries the consumer never settled go
        back to the queue, in order, as when its connection closes (a cancelled subscription must not pin
        messages until disconnect); those its outbox still held are dropped, never sent, and go back
        flagged as they were: the consumer never saw them (`flowbroker consume -n 1` left the message its
        last acknowledgement let through flagged redelivered, a tester). Returns how many went back."""
        sub.queue.remove_subscription(sub)
        pairs = session.deliveries.cancel_tagged(sub, sub.first_tag) if sub.unsettled else []
        unsent, unsent_bytes = session.outbox.drop_subscription(sub.sub_id)  # (a UDP one's are in its term)
        # The client never sees those bytes, so it can never acknowledge them: the connection's byte
        # buffer lets go of them (kept, they filled it for good after a few consumer closes, a tester).
        session.deliveries.window.position -= unsent_bytes
        sub.unsettled = 0
        flags = [unsent.get(tag, True) for tag, _ in pairs] if unsent else None
        sub.queue.requeue_many([msg for _, msg in pairs], flags)
        return len(pairs)

    def _data_path(self, session: Session) -> tuple[DataPath, str]:
        """The UDP data path and the client's host, or the RequestError that says why there is none."""
        if self.udp is None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               "this broker has no UDP data path ([udp] enabled = false); use transport=\"tcp\"")
        if session.peer_host is None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               "UDP needs a TCP connection with a peer address (this connection has none)")
        return self.udp, session.peer_host

    def _req_register_publication(self, session: Session, f: RegisterPublication) -> dict[str, Any]:
        udp, host = self._data_path(session)
        self._check_key(f.routing_key, "routing key")  # (every message on it would be refused KEY_TOO_LONG)
        if f.exchange != "" and f.exchange not in self.exchanges:
            raise RequestError(ErrorCode.NOT_FOUND, f"no exchange named {f.exchange!r}", f.exchange)
        return udp.ingress.register(session, f.exchange, f.routing_key, f.stream_id, (host, f.source_port),
                                    self.clock_ns())

    def _req_close_publication(self, session: Session, f: ClosePublication) -> dict[str, Any]:
        udp, _ = self._data_path(session)
        return udp.ingress.close_publication(session, f.session_id, self.clock_ns())

    def _req_subscribe_udp(self, session: Session, f: SubscribeUdp) -> dict[str, Any]:
        udp, host = self._data_path(session)
        return udp.egress.subscribe(session, f.subscription_id, f.queue, f.prefetch, f.buffer_size,
                                    (host, f.port), f.stream_id, self.clock_ns())

    def _req_join_group(self, session: Session, f: JoinGroup) -> dict[str, Any]:
        udp, _ = self._data_path(session)
        return udp.groups.join(session, f.subscription_id, f.exchange, f.group, f.endpoint, f.fc, f.buffer_size,
                               f.receiver_id, f.stream_id, self.clock_ns())

    _requests: dict[type[Any], Callable[[BrokerCore, Session, Any], dict[str, Any]]] = {
        DeclareQueue: _req_declare_queue,
        DeclareExchange: _req_declare_exchange,
        Bind: _req_bind,
        Unbind: _req_unbind,
        DeleteQueue: _req_delete_queue,
        PurgeQueue: _req_purge_queue,
        DeleteExchange: _req_delete_exchange,
        Subscribe: _req_subscribe,
        Cancel: _req_cancel,
        RegisterPublication: _req_register_publication,
        ClosePublication: _req_close_publication,
        SubscribeUdp: _req_subscribe_udp,
        JoinGroup: _req_join_group,
    }
