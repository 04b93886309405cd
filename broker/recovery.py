"""Rebuilding durable state from the journal at start, and the snapshot each new segment opens with.

`read_journal` (blocking: the shell runs it on a worker thread) scans every segment in order, cuts a
torn or corrupt tail off where the scan stopped (logged, never a refusal to start) and replays the
records into `Recovered`: queues in declaration order with their unsettled messages in offset order,
exchanges, bindings, and each producer id's highest sequence. `restore` (trio thread) puts that into
the core: each queue over a `JournalStore` already holding its messages, its depth counted so its
watermarks apply at once. A message whose DELIVERED record is on disk comes back flagged redelivered.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowbroker.broker.exchange import Exchange, ExchangeKind
from flowbroker.broker.idempotence import ProducerIdsExhausted
from flowbroker.broker.journal import Journal, queue_arguments, segment_name
from flowbroker.broker.journalrecord import (
    BIND,
    DELIVERED,
    EXCHANGE,
    EXCHANGE_DELETED,
    MESSAGE,
    MESSAGE_MOVED,
    PRODUCER_FORGOTTEN,
    PRODUCERS,
    QUEUE,
    QUEUE_DELETED,
    SETTLED,
    SETTLED_MANY,
    UNBIND,
    scan,
)
from flowbroker.broker.journalstore import JournalStore
from flowbroker.protocol.frames import check_delivery_entry
from flowbroker.broker.message import Message
from flowbroker.broker.queue import Queue
from flowbroker.broker.topic import TopicIndexFull

if TYPE_CHECKING:
    from flowbroker.broker.core import BrokerCore

__all__ = ["Recovered", "read_journal", "restore", "topology_records"]

LOGGER = logging.getLogger("flowbroker.journal")


@dataclass
class RecoveredQueue:
    name: str
    arguments: dict[str, Any]
    next_offset: int
    messages: dict[int, tuple[list[Any], int, bool]] = field(default_factory=dict)  # offset -> record, seg, delivered
    owner: str | None = None  # the identity that declared it


@dataclass
class Recovered:
    queues: dict[int, RecoveredQueue] = field(default_factory=dict)  # by queue id, in declaration order
    exchanges: dict[str, str] = field(default_factory=dict)
    bindings: dict[tuple[str, int, str], None] = field(default_factory=dict)
    producers: dict[str, int] = field(default_factory=dict)
    segments: dict[int, int] = field(default_factory=dict)  # segment -> bytes
    cut: list[str] = field(default_factory=list)  # what was cut off, for the log and the tests
    records: int = 0
    max_qid: int = 0  # the highest queue id in any record read, deleted queues' too: ids are not reused
    # When each binding was last bound, and each queue and exchange deleted (record numbers): a deletion's
    # bindings are dropped once, at the end (`_drop_deleted_bindings`), not by a walk over every binding at
    # each deletion record: 5,000 deleted durable queues beside 5,000 bound ones took 0.9 s to recover,
    # growing with the square (20,000: over 10 s).
    bound_at: dict[tuple[str, int, str], int] = field(default_factory=dict)
    queue_deleted_at: dict[int, int] = field(default_factory=dict)
    exchange_deleted_at: dict[str, int] = field(default_factory=dict)


def read_journal(journal: Journal) -> Recovered:
    """Scan and replay every segment (worker thread); cuts bad tails in place."""
    out = Recovered()
    directory = journal.dir
    if not directory.is_dir():
        return out
    numbers = sorted(int(p.name[:-4]) for p in directory.iterdir()
                     if p.name.endswith(".seg") and p.name[:-4].isdigit())
    for before, after in zip(numbers, numbers[1:]):
        if after != before + 1:
            # Compaction deletes the oldest segments only: a gap was made by something else (a file
            # deleted or lost), and the messages journalled there are lost. Said as a cut is (it was only
            # counted in the INFO line, 1,116 confirmed messages gone: a tester).
            missing = (segment_name(before + 1) if after == before + 2
                       else f"{segment_name(before + 1)} to {segment_name(after - 1)}")
            text = (f"{missing}: missing between {segment_name(before)} and {segment_name(after)} (compaction "
                    "removes only the oldest segments): what was journalled there is lost")
            LOGGER.error("journal: %s", text)
            out.cut.append(text)
    for number in numbers:
        path = directory / segment_name(number)
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO's read waited for ever, SIGTERM or not (a tester)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        data = path.read_bytes()
        result = scan(data)
        if result.error is not None:
            text = f"{path.name}: {result.error}; cut at byte {result.good_length} of {len(data)}"
            LOGGER.error("journal: %s", text)
            out.cut.append(text)
            with open(path, "r+b") as f:
                f.truncate(result.good_length)
                f.flush()
                os.fsync(f.fileno())
        elif not data:
            # No record to cut at: the file was emptied (truncated to 0 bytes), or created by a roll and
            # never written (a crash right after the roll: nothing completed was in it). Which one cannot be
            # told, so it is said once, and the empty file removed: it was said at every restart until
            # compaction reached it, for a kill -9 that lost nothing (a tester).
            text = (f"{path.name}: the segment is empty (0 bytes): if the broker stopped right after creating it, "
                    "nothing was in it; if it was emptied, its snapshot and its messages are lost; removed")
            LOGGER.error("journal: %s", text)
            out.cut.append(text)
            path.unlink(missing_ok=True)
            continue
        out.segments[number] = result.good_length
        snapshot: Snapshot | None = Snapshot()  # until the segment's opening snapshot has been read
        for record in result.records:
            try:
                if snapshot is not None:
                    snapshot = snapshot.read(out, record)
                _replay(out, record, number)
            except (IndexError, TypeError, ValueError, KeyError) as exc:  # intact but not ours: skip it
                LOGGER.error("journal: %s: skipped a malformed record (%s)", path.name, exc)
            out.records += 1
    _drop_deleted_bindings(out)
    return out


def _drop_deleted_bindings(out: Recovered) -> None:
    """The bindings of queues and exchanges deleted after they were bound (a binding made later, to an id
    or name used again, stays)."""
    queue_at, exchange_at, bound_at = out.queue_deleted_at, out.exchange_deleted_at, out.bound_at
    if not queue_at and not exchange_at:
        return
    for key in list(out.bindings):
        at = bound_at.get(key, -1)
        if queue_at.get(key[1], -2) > at or exchange_at.get(key[0], -2) > at:
            del out.bindings[key]


@dataclass
class Snapshot:
    """The declarations a segment opens with (every exchange, durable queue and binding there was), up
    to the PRODUCERS record that ends them. Read whole, it is the truth at that point: what it leaves out
    was deleted, though the deletion's record may be lost to a cut in an older segment (a deleted queue
    would come back with its messages). A snapshot without its end (cut, or from before the end was
    always written) only adds."""

    queues: set[int] = field(default_factory=set)
    exchanges: set[str] = field(default_factory=set)
    bindings: set[tuple[str, int, str]] = field(default_factory=set)

    def read(self, out: Recovered, r: list[Any]) -> Snapshot | None:
        """Note `r` if it belongs to the snapshot; returns None once the snapshot is over."""
        kind = r[0]
        if kind == QUEUE:
            self.queues.add(r[1])
        elif kind == EXCHANGE:
            self.exchanges.add(str(r[1]))
        elif kind == BIND:
            self.bindings.add((str(r[1]), int(r[2]), str(r[3])))
        else:
            if kind == PRODUCERS:
                self.apply(out)
            return None
        return self

    def apply(self, out: Recovered) -> None:
        for qid in [q for q in out.queues if q not in self.queues]:
            LOGGER.warning("journal: queue %r is not in a later segment's snapshot: it was deleted "
                           "(its deletion record was cut away); not recovered", out.queues[qid].name)
            del out.queues[qid]
        for name in [e for e in out.exchanges if e not in self.exchanges]:
            del out.exchanges[name]
        for key in [k for k in out.bindings if (str(k[0]), int(k[1]), str(k[2])) not in self.bindings]:
            del out.bindings[key]


def _owner(r: list[Any]) -> str | None:
    """A QUEUE record's owner: the identity that declared it, for its user's max_queues (None in
    records from before owners were journalled)."""
    return str(r[5]) if len(r) > 5 and r[5] is not None else None


def _int(value: Any, what: str) -> int:
    """`value` if it is a non-negative int (a queue id, an offset): else ValueError, so the record is
    skipped. An intact record with a string there stopped the broker at start with a TypeError (a
    tester); storage.md promises it never refuses to start over a bad record."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} {value!r} is not a non-negative integer")
    return value


def _name(value: Any, what: str) -> str:
    if type(value) is not str or not value:
        raise ValueError(f"{what} {value!r} is not a non-empty string")
    return value


def _check(r: list[Any]) -> None:
    """The field types `_replay` and `restore` rely on, per kind (ValueError: skip the record)."""
    kind = r[0]
    if kind in (MESSAGE, MESSAGE_MOVED, SETTLED, DELIVERED):
        _int(r[1], "queue id"), _int(r[2], "offset")
    elif kind == QUEUE:
        _int(r[1], "queue id"), _name(r[2], "queue name"), _int(r[4], "next offset")
        if type(r[3]) is not dict:
            raise ValueError(f"queue arguments {r[3]!r} are not a map")
    elif kind == QUEUE_DELETED:
        _int(r[1], "queue id")
    elif kind == EXCHANGE:
        _name(r[1], "exchange name")
        ExchangeKind(r[2])  # ValueError names an unknown kind
    elif kind in (BIND, UNBIND):
        _name(r[1], "exchange name"), _int(r[2], "queue id")
        if type(r[3]) is not str:
            raise ValueError(f"binding key {r[3]!r} is not a string")
    elif kind == SETTLED_MANY:
        _int(r[1], "queue id")
        if type(r[2]) is not list or not all(type(offset) is int and offset >= 0 for offset in r[2]):
            raise ValueError("settled offsets are not a list of non-negative integers")
    elif kind == PRODUCERS:
        if type(r[1]) is not dict or not all(type(k) is str and type(v) is int for k, v in r[1].items()):
            raise ValueError("producers record is not a map of producer id to sequence")
    elif kind == PRODUCER_FORGOTTEN:
        _name(r[1], "producer id")


def _replay(out: Recovered, r: list[Any], seg: int) -> None:
    _check(r)
    kind = r[0]
    queues = out.queues
    if kind == MESSAGE or kind == MESSAGE_MOVED:
        # The fields a DELIVER carries, checked as a received TRANSFER's are: the broker encodes its
        # DELIVER frames without re-checking them (BrokerServer._encode), so nothing unchecked may
        # enter a queue. Raises ValueError naming the field: the record is skipped as malformed.
        check_delivery_entry((1, r[3], r[4], r[5], r[6], False))
        if type(r[7]) is not int or r[7] < 0:
            raise ValueError(f"message size {r[7]!r} is not a non-negative integer")
        q = queues.get(r[1])
        if q is not None:
            # A moved message repeats one an older segment may still hold (a crash before its deletion):
            # one message, delivered if either said so.
            earlier = q.messages.get(r[2])
            delivered = (kind == MESSAGE_MOVED and r[10] is True) or (earlier is not None and earlier[2])
            q.messages[r[2]] = (r, seg, delivered)
            if r[2] >= q.next_offset:  # (settled since, it still took its offset: never reused)
                q.next_offset = r[2] + 1
        # (a moved message's sequence is old news: the producer's highest is in the records since)
        if kind == MESSAGE and r[8] is not None and r[9] is not None:
            out.producers[r[8]] = r[9]
    elif kind == SETTLED:
        q = queues.get(r[1])
        if q is not None:
            q.messages.pop(r[2], None)
    elif kind == SETTLED_MANY:
        q = queues.get(r[1])
        if q is not None:
            pop = q.messages.pop
            for offset in r[2]:
                pop(offset, None)
    elif kind == DELIVERED:
        q = queues.get(r[1])
        if q is not None and r[2] in q.messages:
            rec, mseg, _ = q.messages[r[2]]
            q.messages[r[2]] = (rec, mseg, True)
    elif kind == QUEUE:
        out.max_qid = max(out.max_qid, int(r[1]))
        existing = queues.get(r[1])
        if existing is None:
            queues[r[1]] = RecoveredQueue(str(r[2]), dict(r[3]), int(r[4]), owner=_owner(r))
        else:
            existing.arguments = dict(r[3])
            existing.owner = _owner(r)
            existing.next_offset = max(existing.next_offset, int(r[4]))
    elif kind == QUEUE_DELETED:
        out.max_qid = max(out.max_qid, int(r[1]))
        queues.pop(r[1], None)
        out.queue_deleted_at[int(r[1])] = out.records
    elif kind == EXCHANGE:
        out.exchanges[str(r[1])] = str(r[2])
    elif kind == EXCHANGE_DELETED:
        out.exchanges.pop(r[1], None)
        out.exchange_deleted_at[str(r[1])] = out.records
    elif kind == BIND:
        key = (str(r[1]), int(r[2]), str(r[3]))
        out.bindings[key] = None
        out.bound_at[key] = out.records
    elif kind == UNBIND:
        out.bindings.pop((r[1], r[2], r[3]), None)
    elif kind == PRODUCERS:
        out.producers.update(r[1])
    elif kind == PRODUCER_FORGOTTEN:
        out.producers.pop(r[1], None)


def restore(core: BrokerCore, journal: Journal, rec: Recovered) -> None:
    """Put what was recovered into the core and the journal (trio thread, before any connection)."""
    now = core.clock_ns()
    journal.sizes.update(rec.segments)
    journal.bytes_on_disk = sum(rec.segments.values())
    for seg in rec.segments:  # (their messages are counted as the queues' stores adopt them, below)
        journal.live.setdefault(seg, 0)
        journal.live_bytes.setdefault(seg, 0)
        journal.residents.setdefault(seg, {})
    journal.oldest_seg = min(rec.segments, default=1)
    journal.active_seg = max(rec.segments, default=0)
    journal._active_residents = journal.residents.setdefault(journal.active_seg, {})  # (appends go on there)
    journal.producers.update(rec.producers)
    core.recovered_producers = dict(rec.producers)
    states = core.producer_sequences.store
    left_out = 0
    for producer_id, sequence in rec.producers.items():  # idempotent producers: their resends are duplicates
        try:
            states.accept(producer_id, sequence, now)
        except ProducerIdsExhausted as exc:
            if not left_out:
                LOGGER.error("journal: a recovered producer id is left out (%s); its resends, and those of "
                             "the ids left out after it, are not deduplicated against what was journalled", exc)
            left_out += 1
    if left_out:
        LOGGER.error("journal: %d recovered producer ids left out: raise [server] max_producer_ids (or "
                     "max_producer_ids_per_user)", left_out)
    for name, kind in rec.exchanges.items():
        if name not in core.exchanges:
            core.exchanges[name] = Exchange(name, ExchangeKind(kind), core.routes)
    by_qid: dict[int, Queue] = {}
    messages = 0
    # past every id on disk, a deleted queue's too: the highest was handed out again after a restart when
    # it had been deleted, and the journal held QUEUE records of two queues under one id (a tester)
    journal.next_qid = max(journal.next_qid, rec.max_qid + 1)
    for qid, rq in rec.queues.items():
        journal.next_qid = max(journal.next_qid, qid + 1)
        recovered: list[tuple[Message, int]] = []
        for offset in sorted(rq.messages):
            r, seg, delivered = rq.messages[offset]
            msg = Message(r[3], r[4], r[5], r[6], r[7], r[8], r[9])
            msg.offset = offset
            msg.redelivered = delivered
            recovered.append((msg, seg))
        start = max(rq.next_offset, recovered[-1][0].offset + 1 if recovered else 0)
        try:
            thresholds, overflow = core.queue_thresholds(rq.arguments)
        except Exception as exc:  # arguments this broker's version refuses: the defaults, never a refusal to start
            LOGGER.error("journal: queue %r: recorded arguments %r refused (%s); recovered with the defaults",
                         rq.name, rq.arguments, exc)
            thresholds, overflow = core.queue_thresholds({})
        queue = Queue(rq.name, thresholds, overflow, True, core.memory, JournalStore(journal, qid, start, recovered))
        core.queues[rq.name] = queue
        core.charge_owner(queue, rq.owner)  # counts toward its user's max_queues again
        core.track_time_thresholds(queue)  # a recorded drain-time or age threshold: the flow timer ticks it
        queue.recovered(now)
        by_qid[qid] = queue
        messages += len(recovered)
    for exchange, qid, key in rec.bindings:
        ex = core.exchanges.get(exchange)
        bound = by_qid.get(qid)
        if ex is not None and bound is not None:
            try:
                ex.bind(bound, key)
            except TopicIndexFull as exc:  # (a journal written before the bound): the rest still recovers
                LOGGER.error("journal: binding of queue %r to %r left out: %s", bound.name, exchange, exc)
    if rec.queues or rec.exchanges:
        journal.dormant = False
        journal._roll()  # a fresh segment opening with the snapshot of what was just restored
    if core.memory.over():
        core._memory_alarm()
    if rec.records:
        LOGGER.info("journal: recovered %d queue(s), %d exchange(s), %d binding(s), %d message(s) from %d "
                    "segment(s)%s", len(rec.queues), len(rec.exchanges), len(rec.bindings), messages,
                    len(rec.segments), f"; {len(rec.cut)} cut" if rec.cut else "")


def topology_records(core: BrokerCore) -> list[list[Any]]:
    """The snapshot a new segment opens with: every exchange declared (not the built-in ones), every
    durable queue with its next offset, their bindings (the journal adds the producers' sequences)."""
    from flowbroker.broker.core import BUILTIN_EXCHANGES

    records: list[list[Any]] = []
    for name, ex in core.exchanges.items():
        if name and name not in BUILTIN_EXCHANGES:
            records.append([EXCHANGE, name, ex.kind.value])
    durable: dict[Queue, int] = {}
    for queue in core.queues.values():
        store = queue.store
        if isinstance(store, JournalStore):
            durable[queue] = store.qid
            records.append([QUEUE, store.qid, queue.name, queue_arguments(queue), queue.next_offset, queue.owner])
    for ex in core.exchanges.values():
        for key, queues in ex.bindings.items():
            for queue in queues:
                qid = durable.get(queue)
                if qid is not None:
                    records.append([BIND, ex.name, qid, key])
    return records
