"""A queue with watermarks that delay completion (Qpid's QueueFlowLimit) and a hard limit.

Depth counts every message the queue still owns: ready ones and those delivered but not yet
settled, because both sit in the broker's memory. The queue is *saturated* when count OR size is
over its stop threshold and clears when BOTH are under their resume thresholds. The time thresholds
(drain time, oldest ready age: policies/drain.py) join them: the flow timer's `tick` keeps the estimate,
folds the drain-time limit into the count stop, and any of the four trips while all must clear. While saturated,
each enqueued message holds its producer's transfer (no completion, so no credit back) and the
producer is told, once, that it is flow-stopped on this queue. Clearing releases every held
transfer and tells those producers they may resume. A held message that is itself dequeued (acked,
rejected, dropped or purged) is released at once, as in Qpid.

The hard limit (max count/size with overflow `reject` or `drop-head`) protects the broker from
producers that do not do flow control; flow-controlled producers stop long before it.

The messages themselves live in the queue's `QueueStore` (broker/store.py), which keeps their order
and identity (the per-queue offset); the queue keeps the accounting and the flow rules.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from flowbroker.broker.memory import MemoryMeter
from flowbroker.broker.message import Message, release_all
from flowbroker.broker.store import MemoryStore, QueueStore
from flowbroker.broker.subscription import Subscription
from flowbroker.policies.drain import STALL_SECONDS, DrainEstimator, drain_limits, drain_reason, evaluate
from flowbroker.policies.overflow import (
    Admission,
    OverflowPolicy,
    Thresholds,
    Verdict,
    admit,
    is_over_stop,
    is_under_resume,
)
from flowbroker.protocol.names import THRESHOLD_FLOW_STOP_COUNT, THRESHOLD_FLOW_STOP_SIZE

if TYPE_CHECKING:
    from flowbroker.broker.session import Session

__all__ = ["Queue", "QueueFull", "QueueCounters", "QueueStatistics"]

_size = attrgetter("size")
_offset = attrgetter("offset")
STALL_NS = int(STALL_SECONDS * 1e9)


class QueueFull(Exception):
    """The hard limit refused a message (overflow policy `reject`, or larger than max_size)."""

    def __init__(self, queue: str, admission: Admission):
        limit = admission.limit.name.lower() if admission.limit.name else "limit"
        what = "message larger than max_size" if admission.oversized else f"max_{limit} reached"
        super().__init__(f"queue {queue!r} is full: {what}")
        self.queue = queue
        self.admission = admission


class HeldPastCredit(QueueFull):
    """A flow-controlled producer's message to a saturated queue that already holds, beyond what it held
    when it saturated, more than the live producers' credit could have sent (`MemoryMeter.held_room`):
    what connections that sent and left added. Refused (QUEUE_FULL) rather than held: a producer that
    reconnects gets a fresh grant each time, and each grant's messages stayed held after it left, so a
    queue with max_count 10 reached 2,400 messages, 200 more a round (a tester)."""

    def __init__(self, queue: str, size: int, message: int, room: int):
        Exception.__init__(self, f"queue {queue!r} is full: it holds {size} bytes, and this message's {message} "
                                 "would take it past its stop plus the "
                                 f"credit its live producers could have in flight ({room} bytes), and this "
                                 "connection opened after it saturated: messages of producers that sent past its "
                                 "stop and left; retry when it drains")
        self.queue = queue


class QueueCounters:
    """Counters for management and metrics: transitions and totals, not just sampled booleans. The
    messages ever enqueued are not counted here: the queue's offsets count them (`Queue.enqueued`)."""

    __slots__ = (
        "dequeued",
        "rejected",
        "consumer_rejected",
        "dropped",
        "purged",
        "flow_stopped_count",
        "held_total",
        "saturated_since_ns",
    )

    def __init__(self) -> None:
        self.dequeued = 0
        self.rejected = 0  # refused by the hard limit (overflow reject)
        self.consumer_rejected = 0  # settled by a consumer's REJECT (counted per SETTLE frame, by the core)
        self.dropped = 0
        self.purged = 0  # ready messages a purge removed (dequeued, but no consumer drained them)
        self.flow_stopped_count = 0  # times the queue became saturated
        self.held_total = 0  # transfers ever held
        self.saturated_since_ns = 0


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    """A snapshot of one queue, read from counters it keeps anyway (nothing is added per message).

    Ready messages wait in the store; unsettled ones were delivered and wait for their consumer's
    SETTLE; the queue owns both (its depth, which the watermarks compare). Their bytes are counted
    together only: splitting them would cost two more additions on every message (measured: 1.4 %
    of the broker's CPU per message). `dequeued` counts every message gone for good: settled (acked
    or rejected), dropped by the overflow policy, or purged.
    """

    name: str
    durable: bool
    messages: int  # the depth the watermarks compare: ready + unsettled
    bytes: int
    ready_messages: int
    unsettled_messages: int
    next_offset: int  # the offset the next enqueued message gets
    subscriptions: int
    saturated: bool
    saturated_since_ns: int  # 0 when not saturated
    stop_threshold: str  # the threshold that tripped while saturated ("" otherwise), its limit and value
    stop_limit: int
    stop_value: int
    thresholds: Thresholds
    overflow: OverflowPolicy
    held_transfers: int  # producer transfers this queue holds now
    flow_stopped_producers: int  # producers told FLOW_STOPPED for this queue and not yet resumed
    enqueued: int
    dequeued: int
    rejected: int
    dropped: int
    flow_stopped_count: int  # times the queue became saturated
    held_total: int  # transfers ever held
    consumer_rejected: int = 0  # messages consumers settled with REJECT
    drain_rate: float = 0.0  # settled messages/s, the flow timer's estimate (policies/drain.py)
    oldest_ready_age: float = 0.0  # seconds at the last flow tick, to one tick


class Queue:
    def __init__(
        self,
        name: str,
        thresholds: Thresholds,
        overflow: OverflowPolicy = OverflowPolicy.REJECT,
        durable: bool = False,
        meter: MemoryMeter | None = None,
        store: QueueStore | None = None,
    ):
        self.name = name
        self.thresholds = thresholds
        self.overflow = overflow
        self.durable = durable
        # the broker-wide memory watermark's count (a queue made alone, in tests, gets its own)
        self.meter = meter if meter is not None else MemoryMeter(1 << 62, 1 << 62)
        # the messages, in offset order (a queue made alone, in tests, keeps them in memory)
        self.store: QueueStore = store if store is not None else MemoryStore()
        self.next_offset = self.store.start_offset  # the offset of the next enqueued message
        self.count = 0
        self.size = 0
        self.saturated = False
        self.stop_reason: tuple[str, int, int] = ("", 0, 0)  # threshold, limit, value when it tripped
        self.held: dict[Message, None] = {}
        # No message below this offset is in `held`: the offset of the first message held since `held`
        # was last empty (offsets only grow, so later ones are above it; one taken out early keeps it low,
        # which is only cautious). `settle_many` keeps its one-step path for settlements below it.
        self._held_floor = 0
        self._saturated_size = 0  # its bytes when it saturated: what it holds beyond is bounded (HeldPastCredit)
        self._saturated_newest = 0  # the newest connection then: only newer ones meet that bound
        self.stopped_producers: dict[Session, None] = {}
        self.subscriptions: dict[Subscription, None] = {}  # every live subscription, in subscribe order
        self._prefetch_total = 0
        self.pace_clear = sys.maxsize
        """Ready messages at or below which its consumers have caught up (a paced producer is released):
        their combined prefetch, as many again as they may hold in flight; none subscribed: never behind."""
        self.pace_limit = sys.maxsize
        """Ready messages beyond which a producer routing here is paced (`Session.paced_on`): twice
        `pace_clear`, so that a producer woken at `pace_clear` sends a prefetch's worth before it waits again."""
        self.paced: dict[Session, int] = {}
        """The producers paced on it (since when, ns), released once its ready messages are down to
        `pace_clear` (`_check_pace`, after each dispatch), it is purged or deleted, or by the flow timer
        (`release_paced`)."""
        self._active: deque[Subscription] = deque()  # the rotation: those that may have credit
        self.deleted = False
        self.counters = QueueCounters()
        # Latency-bounded flow control (policies/drain.py), kept up by the flow timer (`tick`), never
        # per message. The drain-time thresholds become counts at each tick: the stop is folded into the
        # count watermark's (checked on every enqueue), the resume is checked on every settlement
        # (`_check_resume`). `age_hold`: the age is not under its resume mark (re-read on the tick only).
        self.drain = DrainEstimator()
        self.consumer_changes = 0  # a subscription joined, left, stalled or settled again: the rate afresh
        self.age_hold = False
        self._stop_count = thresholds._stop_count  # min(count stop, drain-time stop as a count)
        self._drain_resume_count = sys.maxsize  # the drain-time resume as a count (maxsize: off)
        # What stalled subscriptions hold (policies.drain.STALL_SECONDS): left out of the depth drain time
        # is computed over. `_progress`: per subscription, its settled-or-requeued count and since when.
        self.stalled_held = 0
        self._stalled_subs = 0  # how many subscriptions were stalled at the last tick
        self._progress: dict[Subscription, tuple[int, int]] = {}
        self.owner: str | None = None  # the identity that declared it: what its user's max_queues counts

    def __repr__(self) -> str:
        return f"<Queue {self.name!r} count={self.count} size={self.size} saturated={self.saturated}>"

    @property
    def enqueued(self) -> int:
        """Messages ever enqueued (since the store's start): each took one offset."""
        return self.next_offset - self.store.start_offset

    def statistics(self) -> QueueStatistics:
        store, counters = self.store, self.counters
        ready = len(store)
        threshold, limit, value = self.stop_reason if self.saturated else ("", 0, 0)
        return QueueStatistics(
            name=self.name,
            durable=self.durable,
            messages=self.count,
            bytes=self.size,
            ready_messages=ready,
            unsettled_messages=self.count - ready,
            next_offset=self.next_offset,
            subscriptions=len(self.subscriptions),
            saturated=self.saturated,
            saturated_since_ns=counters.saturated_since_ns,
            stop_threshold=threshold,
            stop_limit=limit,
            stop_value=value,
            thresholds=self.thresholds,
            overflow=self.overflow,
            held_transfers=len(self.held),
            flow_stopped_producers=len(self.stopped_producers),
            enqueued=self.enqueued,
            dequeued=counters.dequeued,
            rejected=counters.rejected,
            dropped=counters.dropped,
            flow_stopped_count=counters.flow_stopped_count,
            held_total=counters.held_total,
            consumer_rejected=counters.consumer_rejected,
            drain_rate=self.drain.rate,
            oldest_ready_age=(self.drain.oldest_age(self.drain.last_ns, self._head_offset())
                              if self.thresholds.time.enabled else 0.0),  # (only those are ticked)
        )

    # -- enqueue -----------------------------------------------------------------------------

    def enqueue(self, msg: Message, producer: Session | None, now_ns: int) -> bool:
        """Add a message and deliver what can be; True when this queue holds the producer's completion.

        Raises QueueFull when the hard limit refuses it (nothing is enqueued then).
        """
        try:
            return self.add(msg, producer, now_ns)
        finally:
            self.dispatch()

    def add(self, msg: Message, producer: Session | None, now_ns: int) -> bool:
        """`enqueue` without the delivery: the caller calls `dispatch()` once after a run of adds (the
        router, once per frame). Nothing here depends on what was delivered (depth counts delivered
        messages too), except the hard limit's drop-head, which dispatches first so it drops exactly
        what it did when every add dispatched."""
        t = self.thresholds
        limits = t.limits
        # The hard limit is for producers that do not do flow control (nothing else paces them).
        # A flow-controlled producer is bounded by its credit: its transfers past the stop threshold
        # are held, never refused, even while a policy resize leaves more bytes in flight than the
        # queue's headroom. On a queue with no stop threshold (flow control off on it) nothing holds
        # them, and the hard limit is for every producer. The overflow policy is consulted only at
        # the limit (hot path).
        if (
            (limits.max_count and self.count >= limits.max_count)
            or (limits.max_size and self.size + msg.size > limits.max_size)
        ) and (producer is None or not producer.flow_control or not t.flow_control):
            self.dispatch()
            self._apply_overflow(msg)
        elif (self.saturated and producer is not None and producer.conn_id > self._saturated_newest
              and self.size + msg.size > self._saturated_size + self.meter.held_room):  # past all live credit
            raise HeldPastCredit(self.name, self.size, msg.size, self._saturated_size + self.meter.held_room)
        offset = self.next_offset
        msg.offset = offset
        self.next_offset = offset + 1
        self.store.append(msg)
        self.count += 1
        self.size += msg.size
        self.meter.held += msg.size
        # (the count watermark's stop, lowered by the flow timer to a drain-time limit when there is one)
        if not self.saturated and (self.count > self._stop_count or self.size > t._stop_size):
            self._saturate(now_ns)
        # Only flow-controlled producers are held: a legacy producer (HELLO flow_control false) is
        # never paced (as with stop-all); the hard limit and overflow policy protect the queue from it.
        if self.saturated and (producer is None or producer.flow_control):
            held = self.held
            if not held:
                self._held_floor = msg.offset
            held[msg] = None
            self.counters.held_total += 1
            if producer is not None:
                self._stop(producer)
            return True  # (dispatch, which follows, never releases: only settling does)
        return False

    def takes_run(self, count: int, size: int) -> bool:
        """True when `count` more messages of `size` bytes in all, from a flow-controlled producer, can
        be added with `add_run`: the queue is not saturated and stays under its stop thresholds (the
        count one lowered to a drain-time limit, as in `add`) after the last of them, so `add` would
        neither saturate nor hold on any of them (depth and bytes only grow), and its store is the
        memory store. The hard limit is not for flow-controlled producers (`add`), except on a queue
        without a stop threshold: there `add` checks it for each message."""
        t = self.thresholds
        return (
            not self.saturated
            and self.count + count <= self._stop_count
            and self.size + size <= t._stop_size
            and type(self.store) is MemoryStore
            and (t.flow_control or not (t.limits.max_count or t.limits.max_size))
        )

    def takes_held_run(self) -> bool:
        """True when a run of messages of a flow-controlled producer may be added with `add_held_run`:
        the queue is saturated already, so `add` would hold every one of them and nothing else (the hard
        limit is not for flow-controlled producers), and its store is the memory store."""
        return (self.saturated and type(self.store) is MemoryStore
                and self.size <= self._saturated_size + self.meter.held_room)

    def add_held_run(self, msgs: list[Message], size: int, producer: Session) -> None:
        """`add` for a run that `takes_held_run` allowed, offsets set as for `add_run`: each message is
        appended and held, and the producer told FLOW_STOPPED if it was not yet stopped by this queue.
        The caller holds each message's transfer (`msg.held`), as it does for a message `add` held. A
        queue at its stop watermark takes its producers' windows this way until it clears."""
        self.add_run(msgs, size)
        held = self.held
        if not held:
            self._held_floor = msgs[0].offset
        held.update(dict.fromkeys(msgs))
        self.counters.held_total += len(msgs)
        self._stop(producer)

    def _stop(self, producer: Session) -> None:
        """`producer` sent to this saturated queue: FLOW_STOPPED, once until the queue clears."""
        if producer not in self.stopped_producers:
            self.stopped_producers[producer] = None
            producer.flow_stopped(self)

    def add_run(self, msgs: list[Message], size: int) -> None:
        """`add` for a run of messages of a flow-controlled producer that `takes_run` allowed, `size`
        bytes in all, whose offsets the caller set from `next_offset` up, in order (the router, which
        builds them in one loop). What `add` does per message, once: the offsets taken, the messages
        appended (the deque's `extend`, in C), depth and bytes counted. Nothing is held here
        (`add_held_run` holds them after)."""
        self.next_offset += len(msgs)
        self.store.extend(msgs)  # type: ignore[attr-defined]  # (a MemoryStore: takes_run, takes_held_run)
        self.count += len(msgs)
        self.size += size
        self.meter.held += size

    def recovered(self, now_ns: int) -> None:
        """Count the messages a journal's store came back with (broker/recovery.py): they are the queue's
        depth like any other, so its watermarks (and the broker's memory watermark) apply at once."""
        size = sum(msg.size for msg in self.store)
        self.count += len(self.store)
        self.size += size
        self.meter.held += size
        if not self.saturated and is_over_stop(self.count, self.size, self.thresholds):
            self._saturate(now_ns)

    def _apply_overflow(self, msg: Message) -> None:
        """At the hard limit: reject (raise QueueFull) or drop the oldest ready messages to make room."""
        admission = admit(
            self.overflow, self.count, self.size, self.thresholds.limits, msg.size, (m.size for m in self.store)
        )
        if admission.verdict is Verdict.REJECT:
            self.counters.rejected += 1
            raise QueueFull(self.name, admission)
        if admission.verdict is Verdict.DROP_HEAD:
            store = self.store
            for _ in range(admission.drop_count):
                dropped = store.take()
                store.settle(dropped)
                self._remove(dropped)
            self.counters.dropped += admission.drop_count
            self._check_resume()  # dropping is a dequeue: it may take the queue under resume

    def _saturate(self, now_ns: int) -> None:
        t = self.thresholds
        if t.flow_stop_count and self.count > t.flow_stop_count:
            self.stop_reason = (THRESHOLD_FLOW_STOP_COUNT, t.flow_stop_count, self.count)
        elif self.size > t._stop_size or self.count <= self._stop_count:
            self.stop_reason = (THRESHOLD_FLOW_STOP_SIZE, t.flow_stop_size, self.size)
        else:  # over the drain-time limit (drain_limits): held until under its resume count
            self.stop_reason = drain_reason(t.time, self.drain, self._drain_depth)
        self.saturated = True
        self.meter.saturated_queues[self.name] = self
        self._saturated_size = self.size
        self._saturated_newest = self.meter.newest_conn
        self.counters.flow_stopped_count += 1
        self.counters.saturated_since_ns = now_ns

    # -- removal and release -----------------------------------------------------------------

    def _remove(self, msg: Message) -> None:
        """Account for a message leaving the queue for good; releases its hold if any."""
        self.count -= 1
        self.size -= msg.size
        meter = self.meter
        meter.held -= msg.size
        self.counters.dequeued += 1
        if msg.held is not None:
            self.held.pop(msg, None)
            msg.release()
        if meter.alarm:
            meter.released()

    def _check_resume(self) -> None:
        """Clear when every dimension is under its resume: count and size, drain time (as a count: an
        empty queue drains in no time whatever the rate), and the age as the last tick found it."""
        if not self.saturated or self.age_hold:
            return
        count = self.count
        if ((count < self._drain_resume_count or count <= self.stalled_held)  # (nothing to drain but theirs)
                and is_under_resume(count, self.size, self.thresholds)):
            self._clear()

    def _clear(self) -> None:
        """Leave saturation: complete every held transfer, tell each stopped producer to resume."""
        self.saturated = False
        self.meter.saturated_queues.pop(self.name, None)
        self.counters.saturated_since_ns = 0
        held, self.held = self.held, {}
        release_all(held)
        stopped, self.stopped_producers = self.stopped_producers, {}
        for producer in stopped:
            producer.flow_resumed(self)

    def settle(self, msg: Message) -> None:
        """A delivery was acked or rejected: it leaves the queue for good, releasing its hold.

        Settlements come in batches (SETTLE carries ranges): call `settled()` once after the batch.
        Requeued deliveries go back through `requeue_many()`.
        """
        if not self.deleted:
            self.store.settle(msg)
            self._remove(msg)

    def settle_many(self, msgs: list[Message]) -> None:
        """`settle` for each of `msgs`, in order. A queue that holds no transfer, over the memory store
        (whose `settle` does nothing), counts them out in one step: the per-message work is one sum in C."""
        if self.deleted:
            return
        if type(self.store) is not MemoryStore or (self.held and max(map(_offset, msgs), default=-1) >= self._held_floor):
            for msg in msgs:
                self.settle(msg)
            return
        # No message here holds a transfer (all are below `held`'s floor), so `_remove` has nothing to
        # release. A saturated queue holds its newest messages while its consumers settle its oldest.
        self._count_out(len(msgs), sum(map(_size, msgs)))

    def _count_out(self, count: int, size: int) -> None:
        """`_remove`'s accounting for `count` messages of `size` bytes together, their holds aside."""
        self.count -= count
        self.size -= size
        meter = self.meter
        meter.held -= size
        self.counters.dequeued += count
        if meter.alarm:
            meter.released()

    def settled(self) -> None:
        """After a batch of settlements: leave saturation if under resume, deliver what is ready."""
        self._check_resume()
        self.dispatch()

    def requeue_many(self, msgs: list[Message], redelivered: list[bool] | None = None) -> None:
        """Give back deliveries (requeue, or a consumer went away): each returns to its original place
        in the queue's order (its offset), ahead of every message never delivered, flagged redelivered
        (or as `redelivered` says, message by message: those never sent keep the flag they had)."""
        if self.deleted or not msgs:
            return
        if redelivered is None:
            for msg in msgs:
                msg.redelivered = True
        else:
            for msg, flag in zip(msgs, redelivered):
                msg.redelivered = flag
        self.store.requeue(msgs)
        self.dispatch()

    def purge(self) -> int:
        """Drop every ready message (unsettled deliveries stay); releases what they held."""
        purged = self.store.purge()
        # `_remove` for all of them at once: one sum, the holds released only where there are some
        # (400,000 messages: 73 ms one by one, every connection waiting)
        if self.held:
            held = self.held
            for msg in purged:
                if msg.held is not None:
                    held.pop(msg, None)
                    msg.release()
        self._count_out(len(purged), sum(map(_size, purged)))
        self.counters.purged += len(purged)
        self._check_resume()
        self._check_pace()
        return len(purged)

    def delete(self) -> list[Subscription]:
        """Release everything and detach; returns the subscriptions the caller must cancel."""
        self.deleted = True
        self.store.delete()
        self.meter.held -= self.size
        self.meter.released()
        if self.saturated or self.held or self.stopped_producers:
            self._clear()
        self.count = self.size = 0
        subs, self.subscriptions = list(self.subscriptions), {}
        self.meter.subscriptions -= len(subs)
        for sub in subs:
            sub.closed = True
        self._active.clear()
        self._update_pace_limit(-self._prefetch_total)  # none subscribed now: its paced producers go on
        return subs

    def set_thresholds(self, thresholds: Thresholds, now_ns: int) -> None:
        """Apply new watermarks at once: a raised threshold can release producers, a lowered one stops
        the next transfers (Broker-J re-checks in bulkChangeEnd; RabbitMQ #12206 is the bug to avoid)."""
        self.thresholds = thresholds
        if not thresholds.time.flow_stop_drain_time:  # (the flow timer no longer looks at stalled consumers)
            self.stalled_held = self._stalled_subs = 0
            self._progress.clear()
        self._evaluate_time(now_ns)
        if self.saturated:
            self._check_resume()
        elif is_over_stop(self.count, self.size, thresholds) or self.count > self._stop_count:
            self._saturate(now_ns)

    # -- time thresholds (the flow timer) ------------------------------------------------------

    def _head_offset(self) -> int | None:
        head = self.store.page(None, 1) if self.store else ()
        return head[0].offset if head else None

    def tick(self, now_ns: int) -> None:
        """The flow timer (every policies.drain.TICK_SECONDS): update the drain-rate estimate from the
        `dequeued` counter and evaluate the time thresholds; the per-message paths do none of this."""
        head = self._head_offset()
        if self.thresholds.time.flow_stop_drain_time:
            self._find_stalled(now_ns)
        # The rate is the consumers' pace: messages a purge or the overflow policy removed were not
        # drained by anyone (a purge of 20,000 counted as settlements read 15,000 msgs/s for a consumer
        # settling 20, and a 0.5 s drain-time stop let in minutes of backlog: a tester).
        counters = self.counters
        settled = counters.dequeued - counters.dropped - counters.purged
        self.drain.update(now_ns, settled, self._drain_depth, bool(self.subscriptions),
                          self.next_offset, head, self.consumer_changes)
        if self.thresholds.time.enabled:
            self._evaluate_time(now_ns, head)

    @property
    def _drain_depth(self) -> int:
        """The depth drain time is computed over: the queue's messages less what stalled consumers hold."""
        return self.count - self.stalled_held

    def _find_stalled(self, now_ns: int) -> None:
        """`stalled_held`: the unsettled messages of subscriptions that have settled (or requeued) none for
        STALL_SECONDS while holding some. On the tick only: O(subscriptions), nothing per message (a
        subscription's settled-or-requeued count is `delivered_total - unsettled`, both kept anyway).

        When a subscription stalls or settles again the consumers that drain the queue have changed, as
        when one subscribes or leaves: the rate is measured afresh (`consumer_changes`). The samples of
        the second before a hoarder counted as stalled say what it did, not what the others can: one that
        took every message left the others none, the rate measured 0, and the drain-time stop and resume
        at 0 past what it held kept the queue stopped for as long as it stayed (a tester: 5 s, 4 of 4)."""
        progress = self._progress
        held = stalled = 0
        for sub in self.subscriptions:
            mark = sub.delivered_total - sub.unsettled
            seen = progress.get(sub)
            if seen is None or seen[0] != mark or not sub.unsettled:
                progress[sub] = (mark, now_ns)  # settling, or holding nothing: not stalled
            elif now_ns - seen[1] >= STALL_NS:
                held += sub.unsettled
                stalled += 1
        if len(progress) > len(self.subscriptions):
            for sub in [s for s in progress if s not in self.subscriptions]:
                del progress[sub]
        if stalled != self._stalled_subs:
            self._stalled_subs = stalled
            self.consumer_changes += 1
        self.stalled_held = held

    def _evaluate_time(self, now_ns: int, head: int | None = None) -> None:
        """Re-derive the drain-time stop as a count (checked on every enqueue); saturate on a time
        threshold over its stop; clear when every threshold is under its resume (count and size too:
        `_check_resume`)."""
        t = self.thresholds
        self._derive_drain_counts()
        if head is None:
            head = self._head_offset()
        verdict = evaluate(t.time, self.drain, now_ns, self._drain_depth, head, bool(self.subscriptions))
        self.age_hold = not verdict.age_under_resume
        if verdict.over_stop and not self.saturated:
            self._saturate(now_ns)
            self.stop_reason = (verdict.threshold, verdict.limit_ms, verdict.value_ms)
        elif self.saturated:
            self._check_resume()

    # -- delivery ----------------------------------------------------------------------------

    def add_subscription(self, sub: Subscription) -> None:
        self.subscriptions[sub] = None
        self.meter.subscriptions += 1
        self.consumer_changes += 1
        self._update_pace_limit(sub.prefetch)
        if len(self.subscriptions) == 1:
            self._derive_drain_counts()
        self.resume_subscription(sub)
        self.dispatch()

    def remove_subscription(self, sub: Subscription) -> None:
        """O(1): a closed subscription leaves the rotation when dispatch reaches it, and the rotation is
        compacted when closed ones could outnumber live ones (subscribe/cancel loops with nothing ready)."""
        sub.closed = True
        if sub not in self.subscriptions:
            return
        del self.subscriptions[sub]
        self.meter.subscriptions -= 1
        self.consumer_changes += 1
        self._update_pace_limit(-sub.prefetch)
        if not self.subscriptions:
            self._derive_drain_counts()
            self._active = deque()  # (a closed subscription keeps its session: none wait here for dispatch)
        elif len(self._active) > 2 * len(self.subscriptions) + 8:
            self._active = deque(s for s in self._active if not s.closed)

    def _derive_drain_counts(self) -> None:
        """The drain-time stop and resume as counts (`drain_limits`: off without a drain-time threshold or
        without consumers, MIN_BACKLOG until the rate is measured): at every tick (`_evaluate_time`), and
        when the queue gains its first consumer or loses its last, without waiting for the flow timer: a producer that started within the tick after the first SUBSCRIBE
        was not held at all (3,000 messages in a queue whose 0.5 s bound allowed about 200)."""
        t = self.thresholds
        stop, resume = drain_limits(t.time, self.drain, bool(self.subscriptions))
        stalled = self.stalled_held  # the depth counts them; drain time does not
        self._stop_count = min(t._stop_count, stop + stalled)
        self._drain_resume_count = resume + stalled

    def _update_pace_limit(self, change: int) -> None:
        """A subscription came (+ its prefetch) or went (-): O(1), as subscribing and cancelling are."""
        self._prefetch_total += change
        self.pace_clear = self._prefetch_total if self.subscriptions else sys.maxsize
        self.pace_limit = 2 * self.pace_clear if self.subscriptions else sys.maxsize
        self._check_pace()

    def _check_pace(self) -> None:
        """Release the producers paced on this queue once it holds no more ready than `pace_clear`."""
        if self.paced and (len(self.store) <= self.pace_clear or self.deleted):
            paced, self.paced = self.paced, {}
            _release(paced)

    def pace(self, session: Session, now_ns: int) -> None:
        """`session` routed here while its consumers are behind: its completions and credit wait
        (`Session.collect`) until this queue releases it."""
        session.paced_on = self
        session.paced_total += 1
        self.paced[session] = now_ns

    def forget_paced(self, session: Session) -> None:
        """`session` is closing: it is no longer paced here (nothing is sent to it)."""
        self.paced.pop(session, None)
        session.paced_on = None

    def release_paced(self, before_ns: int) -> None:
        """The flow timer: release the producers paced on it since before `before_ns`, caught up or not,
        so that a queue whose consumers stopped paces no one for long (its watermarks take over)."""
        expired = [session for session, since in self.paced.items() if since < before_ns]
        for session in expired:
            del self.paced[session]
        _release(expired)

    def resume_subscription(self, sub: Subscription) -> None:
        """Credit may have returned to `sub`: put it back in the rotation (call dispatch() after)."""
        if not sub.active and not sub.closed and sub.has_credit():
            sub.active = True
            self._active.append(sub)

    def dispatch(self) -> None:
        """Hand ready messages to subscriptions with credit, round robin, until none has any. A
        subscription found without credit leaves the rotation until resume_subscription(). Then the
        producers paced here go on if the consumers have caught up."""
        self._dispatch()
        if self.paced:
            self._check_pace()

    def _dispatch(self) -> None:
        store = self.store
        active = self._active
        while store and active:
            sub = active[0]
            if len(active) == 1 and sub.takes_runs:  # alone: all its credit allows, in one run
                if not sub.closed:
                    sub.deliver_ready(store)
                    if not store:
                        return  # it may have credit left: it stays (as after a last message below)
                active.popleft()
                sub.active = False
                return
            if not sub.closed and sub.has_credit():
                sub.deliver(store.take())
                active.rotate(-1)
            else:
                active.popleft()
                sub.active = False

    def deliver_to(self, sub: Subscription) -> None:
        """One ready message to `sub` (the caller checked ready and credit): sharing a connection's buffer."""
        sub.deliver(self.store.take())


def _release(sessions: Iterable[Session]) -> None:
    """Paced producers go on: their completions and credit are due (Session.collect sends them)."""
    for session in sessions:
        session.paced_on = None
        session.outbox.wake()
