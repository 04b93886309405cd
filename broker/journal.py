"""The durable journal: an append-only log of segment files, group commit, compaction, the disk alarm.

Records (broker/journalrecord.py) are appended to an in-memory buffer on the trio thread as the core
acts (a message enqueued on a durable queue, a delivery, a settlement, a declaration); nothing here
blocks. The shell (broker/journalshell.py) takes everything buffered as one `Batch` and hands it to
`write_batch` on a worker thread: one `write` per segment touched and one `fsync`, however many
transfers the batch covers (group commit: every transfer that arrived while the previous fsync ran
rides on the next). When that returns, `committed` releases the completions the batch covered; a
producer's credit comes back only then, so a slow disk paces producers through the credit machinery
that already exists, with nothing new on the wire.

Segments are files `<number>.seg`, number padded to 20 digits, in `<data_dir>/journal`. A segment
receives appends until it holds `segment_size` bytes beyond its snapshot; the next one opens with a *snapshot* of the
durable topology (queues with their next offset, exchanges, bindings, the producers' sequences), so
no segment depends on an older one for declarations. The snapshot is kept encoded as the declarations
change (`Snapshot`), so a roll copies bytes rather than encoding every queue and binding on the trio
thread. Compaction deletes the oldest segments while
every message in them is settled (their settlements were in the same or an earlier batch), oldest
first: a settlement record lives in a later segment than its message, so deleting out of order
could drop a settlement whose message is still on disk.

The journal is *dormant* until the first durable queue exists (or something was recovered): a
broker that never declares one writes nothing and creates no journal directory (the shell takes the data
directory's LOCK file at start, broker/journalshell.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flowbroker.broker.journalrecord import (
    BIND,
    DELIVERED,
    EXCHANGE,
    EXCHANGE_DELETED,
    HEADER,
    MESSAGE,
    MESSAGE_MOVED,
    PRODUCER_FORGOTTEN,
    PRODUCERS,
    QUEUE,
    QUEUE_DELETED,
    SETTLED,
    SETTLED_MANY,
    UNBIND,
    encode,
    encode_payload,
    pack,
    pack_array_header,
)
from flowbroker.protocol.credit import MESSAGE_OVERHEAD
from flowbroker.protocol.limits import text_bytes_bound
from flowbroker.protocol.frames import FlowResumed, FlowStopped
from flowbroker.protocol.names import OVERFLOW, QUEUE_ARGUMENTS, THRESHOLD_DISK

if TYPE_CHECKING:
    from flowbroker.broker.journalstore import JournalStore
    from flowbroker.broker.message import HeldTransfer, Message
    from flowbroker.broker.queue import Queue
    from flowbroker.broker.session import Session

__all__ = ["Journal", "Batch", "CommitWaiter", "Snapshot", "segment_name", "queue_arguments", "MAX_PRODUCER_IDS"]


class CommitWaiter(Protocol):
    """What waits for the next commit: a held transfer (completed), a request's answer (sent)."""

    def release(self) -> None: ...

LOGGER = logging.getLogger("flowbroker.journal")

SETTLED_PER_RECORD = 65_536
"""Offsets in one SETTLED_MANY record at most (about 320 KiB of record)."""
COPY_FORWARD_FRACTION = 4
"""Compaction copies the live messages of the oldest segments forward (MESSAGE_MOVED records in the segment
being appended to) when they are at most 1/COPY_FORWARD_FRACTION of the segments' bytes (the messages
counted by their records, estimated from above: `_record_bytes`): what is rewritten is at most a quarter
of what is freed, and the journal stays within about four times what is live. Without it one message a consumer
never settled kept its segment and every later one on disk: 870 MB in 20 s without a quota, and with one
every durable producer of the broker held for good (a tester)."""
COPY_FORWARD_BUDGET = 1
"""Segments' worth of messages (`segment_size` bytes) copied forward per batch at most."""
COPY_FORWARD_MESSAGES = 4096
"""Messages copied forward per batch at most (each is encoded on the trio thread: a backlog of 100,000
small ones copied in one batch held every connection 120 ms, a tester)."""
RECORD_OVERHEAD = 64
"""A MESSAGE record's bytes beyond its body, headers, names and producer id, at most: its framing (8), the
array's and kind's bytes (2), queue id, offset, size and sequence (9 each at most) and the heads of the
names, body and producer id (14). With `_record_bytes` it estimates a live message's record from
above, which the copy forward compares with the segments' bytes (counted as message_size, 512 bytes over
the body each, a backlog of small messages was never copied forward: a quota held another queue's
producer for good, a tester)."""


MAX_PRODUCER_IDS = 100_000
"""Producer ids whose highest journalled sequence is kept (the idempotent-producer seam): bounded, the
oldest forgotten first."""


def _record_bytes(msg: Message) -> int:
    """A live message's MESSAGE record, estimated from above (RECORD_OVERHEAD; a name's or producer id's
    UTF-8 bytes by 4 a character unless it is ASCII: len() of a non-ASCII name was below its bytes, up to
    4x, the producer id was not counted, and compaction then copied segments more live than a quarter)."""
    pid = msg.producer_id
    estimate = (msg.size - MESSAGE_OVERHEAD + RECORD_OVERHEAD
                + text_bytes_bound(msg.exchange) + text_bytes_bound(msg.routing_key))
    return estimate if pid is None else estimate + text_bytes_bound(pid)


def segment_name(number: int) -> str:
    return f"{number:020d}.seg"


def queue_arguments(queue: Queue) -> dict[str, Any]:
    """The queue's thresholds and overflow as DECLARE_QUEUE arguments (resolved values, so a queue
    recovered with them behaves as it did, `queue set` changes included)."""
    t = queue.thresholds
    args: dict[str, Any] = {k: getattr(t, k) for k in QUEUE_ARGUMENTS if k != OVERFLOW}
    args[OVERFLOW] = queue.overflow.value
    return args


class Snapshot:
    """The records a new segment opens with, kept encoded (trio thread, sans-IO): every exchange, durable
    queue and binding, each record updated when it is declared, changed, bound, unbound or deleted, and
    each of the three kinds joined once into one block of bytes until one of its records changes. A QUEUE
    record's next offset moves with every message: `Journal.message` notes the queue's new one (in
    `Journal.moved`), and `encoded` re-encodes only those queues' records and lists them again after the
    queues' block (QUEUE records are upserts, the higher next offset wins), until they are more than an
    eighth of the queues and the block is joined again. So a roll copies bytes and encodes the queues that took
    messages, never a pass over every queue and binding (it was 5 us per queue and binding, 160 ms
    per roll beside 31,000 of each)."""

    __slots__ = ("exchanges", "queues", "queue_parts", "bindings", "by_queue", "by_exchange", "blocks", "later")

    def __init__(self, records: list[list[Any]]):
        self.exchanges: dict[str, bytes] = {}  # name -> EXCHANGE record
        self.queues: dict[int, bytes] = {}  # qid -> QUEUE record, in declaration order
        # qid -> where the next offset's bytes begin and end in its QUEUE record (`queues`), and the next
        # offset: the record is re-encoded around them. (Keeping the bytes before and after it as well held
        # each durable queue's name encoded twice, 1.3 KiB more a queue with 255 emoji, a tester.)
        self.queue_parts: dict[int, tuple[int, int, int]] = {}
        self.bindings: dict[tuple[str, int, str], bytes] = {}  # (exchange, qid, key) -> BIND record
        self.by_queue: dict[int, dict[tuple[str, int, str], None]] = {}
        self.by_exchange: dict[str, dict[tuple[str, int, str], None]] = {}
        # the exchanges', queues' and bindings' records joined (None: to join again at the next roll)
        self.blocks: list[bytes | None] = [None, None, None]
        self.later: dict[int, bytes] = {}  # QUEUE records re-encoded since the queues' block was joined
        for r in records:
            kind = r[0]
            if kind == EXCHANGE:
                self.exchange(r[1], r[2])
            elif kind == QUEUE:
                self.queue(r)
            elif kind == BIND:
                self.bind(r[1], r[2], r[3], True)

    def exchange(self, name: str, kind: str) -> None:
        self.exchanges[name] = encode([EXCHANGE, name, kind])
        self.blocks[0] = None

    def exchange_deleted(self, name: str) -> None:
        if self.exchanges.pop(name, None) is not None:
            self.blocks[0] = None
        self._forget_bindings(self.by_exchange.pop(name, None), self.by_queue, 1)

    def _forget_bindings(self, bindings: dict[tuple[str, int, str], None] | None,
                         other: dict[Any, dict[tuple[str, int, str], None]], at: int) -> None:
        """A deleted queue's or exchange's `bindings` (taken out of its index), dropped here and from the
        `other` index, keyed by the binding's item `at` (1: its queue, 0: its exchange)."""
        if bindings:
            for key in bindings:
                del self.bindings[key]
                other[key[at]].pop(key, None)
            self.blocks[2] = None

    def queue(self, record: list[Any]) -> bytes:
        """A QUEUE record (next offset at index 4) declared or changed; returns its encoding."""
        qid, next_offset = record[1], record[4]
        before = pack_array_header(len(record)) + b"".join([pack(item) for item in record[:4]])
        packed = pack(next_offset)
        start = HEADER.size + len(before)
        self.queue_parts[qid] = (start, start + len(packed), next_offset)
        data = self.queues[qid] = encode_payload(before + packed + b"".join([pack(item) for item in record[5:]]))
        self.blocks[1] = None
        return data

    def queue_deleted(self, qid: int) -> None:
        if self.queues.pop(qid, None) is not None:
            del self.queue_parts[qid]
            self.blocks[1] = None
        self._forget_bindings(self.by_queue.pop(qid, None), self.by_exchange, 0)

    def bind(self, exchange: str, qid: int, key: str, bound: bool) -> None:
        binding = (exchange, qid, key)
        if bound:
            self.bindings[binding] = encode([BIND, exchange, qid, key])
            self.by_queue.setdefault(qid, {})[binding] = None
            self.by_exchange.setdefault(exchange, {})[binding] = None
        elif self.bindings.pop(binding, None) is not None:
            self.by_queue[qid].pop(binding, None)
            self.by_exchange[exchange].pop(binding, None)
        else:
            return
        self.blocks[2] = None

    def encoded(self, moved: dict[int, int]) -> tuple[bytearray, int]:
        """The snapshot's bytes (exchanges, queues, bindings) and how many records they are; `moved`:
        the next offsets of the queues that took messages since the last call (qid -> next offset)."""
        parts, queues, later, blocks = self.queue_parts, self.queues, self.later, self.blocks
        for qid, next_offset in moved.items():
            entry = parts.get(qid)  # (None: the queue was deleted since)
            if entry is not None and next_offset > entry[2]:
                start, end, _ = entry
                packed = pack(next_offset)
                with memoryview(queues[qid]) as record:  # (views: the record's bytes are copied once, as before)
                    payload = b"".join((record[HEADER.size:start], packed, record[end:]))
                parts[qid] = (start, start + len(packed), next_offset)
                queues[qid] = later[qid] = encode_payload(payload)
        exchanges, queued, bound = blocks
        if queued is None or len(later) * 8 > len(queues):
            queued = blocks[1] = b"".join(queues.values())
            later.clear()
        if exchanges is None:
            exchanges = blocks[0] = b"".join(self.exchanges.values())
        if bound is None:
            bound = blocks[2] = b"".join(self.bindings.values())
        data = bytearray().join((exchanges, queued, *later.values(), bound))
        return data, len(self.exchanges) + len(queues) + len(later) + len(self.bindings)


@dataclass(slots=True)
class Batch:
    """What one group commit writes: bytes per segment in order, the transfers it completes, the
    segments it deletes once they are on disk. `done` counts the chunks written and `written` says
    where each began: a failed write cuts every chunk of the batch back (a batch is all or nothing: a
    chunk left on disk from a batch that never completed would be replayed at recovery, a message its
    producer was told was not completed), and the retry writes them all again."""

    chunks: list[tuple[int, bytearray]]
    waiters: list[CommitWaiter]
    deletable: list[int]
    records: int
    waiting_on: dict[Session, str] = field(default_factory=dict)  # each waiter's session: a durable queue
    freed: int = 0  # the bytes of the segments it deletes
    done: int = 0
    unsynced: set[int] = field(default_factory=set)
    written: list[tuple[int, int]] = field(default_factory=list)  # (segment, offset its chunk began at)


class Journal:
    """One broker's journal. Appends (trio thread) and `write_batch` (worker thread) never run on the
    same objects at once: `take_batch` hands the buffer over whole."""

    def __init__(self, directory: Path, segment_size: int, fsync: bool, disk_free_limit: int, quota: int):
        self.dir = directory
        self.segment_size = segment_size
        self.fsync = fsync
        self.disk_free_limit = disk_free_limit
        self.quota = quota
        self.dormant = True
        self.active_seg = 0  # the segment appends go to (0: none yet)
        self.oldest_seg = 1  # the oldest segment that may still exist (where compaction has got to)
        self.seg_bytes = 0  # bytes of the active segment after its snapshot, written or buffered
        # segment -> bytes, written or buffered; oldest first (`_roll` adds each above the others, `restore`
        # the recovered ones in order). Compaction walks these, never the numbers between them: a stray
        # file numbered 10^10 beside segment 1 had it walk ten billion numbers, the broker spinning at
        # start for good (a tester)
        self.sizes: dict[int, int] = {}
        # the segment files' bytes: what commits wrote, less the segments they deleted (`sizes` counts what is
        # buffered and what a failing write cut back too: on a full disk the view said more than the file
        # system holds, a tester)
        self.bytes_on_disk = 0
        # segment -> its messages not yet settled: how many, their records' bytes (`_record_bytes`), and each
        # by its queue and offset (for a copy forward); `delivered_msgs`: those handed out at least once
        self.live: dict[int, int] = {}
        self.live_bytes: dict[int, int] = {}
        self.residents: dict[int, dict[int, dict[int, Message]]] = {}  # segment -> queue id -> offset -> message
        self.stores: dict[int, JournalStore] = {}  # queue id -> the store of that durable queue
        self._active_residents: dict[int, dict[int, Message]] = {}  # residents[active_seg]
        self.delivered_msgs: set[Message] = set()
        self.messages_moved = 0  # copied forward by compaction, since start
        # the copy forward stopped at its per-batch budget with more to copy: the committer takes another
        # batch at once, records or not (under a disk alarm nothing else commits, and a run copied in part
        # freed nothing: a producer stayed held for good, a tester)
        self.copy_left = False
        self._chunks: list[tuple[int, bytearray]] = []
        self._records = 0
        self._appended = 0
        self._waiters: list[CommitWaiter] = []
        self._waiting_on: dict[Session, str] = {}  # a durable queue each session's waiters were routed to
        self.in_flight = False  # a batch taken and not yet committed (being written, or retried)
        self.write_failing = False  # the last write failed (the committer retries): nothing new gets on disk
        self.next_qid = 1
        self.producers: dict[str, int] = {}  # producer id -> highest sequence journalled
        # the durable topology, read once when the first segment opens (the shell's: the core's queues,
        # exchanges and bindings); kept encoded in `snapshot` from then on, by the calls below
        self.topology: Callable[[], list[list[Any]]] = list
        self.snapshot: Snapshot | None = None  # the snapshot a new segment opens with
        self.moved: dict[int, int] = {}  # qid -> next offset, of queues that took messages since the last roll
        self.wake: Callable[[], None] = lambda: None  # the shell's committer: something is buffered
        # the disk alarm: why producers of durable queues are held, and who was told
        self.alarm: FlowStopped | None = None
        self._disk_held: list[HeldTransfer] = []
        self._stopped: dict[Session, str] = {}
        self.free_bytes = -1  # free space under data_dir at the last look (-1: not looked)
        # counters for the views and the benchmark
        self.commits = 0
        self.fsyncs = 0
        self.bytes_written = 0
        self.records_written = 0
        self.write_errors = 0
        self.segments_deleted = 0
        self._fd = -1
        self._fd_seg = 0
        self.lock_fd = -1  # the data directory's LOCK, held by the shell that opened this journal

    # -- appending (trio thread) -----------------------------------------------------------------

    def _start(self) -> None:
        """Leave dormancy: open a segment with the snapshot, so the directory is self-contained."""
        self.dormant = False
        self._roll()

    def _roll(self) -> None:
        self.active_seg = max(self.active_seg, max(self.sizes, default=0)) + 1
        self.sizes[self.active_seg] = 0
        self.live[self.active_seg] = 0
        self.live_bytes[self.active_seg] = 0
        self.residents[self.active_seg] = self._active_residents = {}
        if self.snapshot is None:
            self.snapshot = Snapshot(self.topology())
        data, records = self.snapshot.encoded(self.moved)
        self.moved = {}
        if records:  # the segment's first bytes: a chunk of its own, taken as it is
            chunks = self._chunks
            chunks.append((self.active_seg, data))
            if len(chunks) == 1:
                self.wake()
            self._records += records
            self.sizes[self.active_seg] += len(data)
        # Always written, empty or not: it ends the snapshot, so recovery knows the snapshot is whole and
        # that a queue or exchange it does not list was deleted (a cut in an older segment may have taken
        # the deletion's record).
        self._append(encode([PRODUCERS, dict(self.producers)]))
        # The segment's size counts the records after its snapshot: a snapshot over segment_size (many
        # durable queues with long names) made each new segment full as it opened, and every record
        # then opened another with another whole snapshot (a tester: 855 MB written for 2,000 messages).
        self.seg_bytes = 0

    def _append(self, data: bytes) -> None:
        seg = self.active_seg
        chunks = self._chunks
        if chunks and chunks[-1][0] == seg:
            chunks[-1][1].extend(data)
        else:
            chunks.append((seg, bytearray(data)))
            if len(chunks) == 1:
                self.wake()
        self._records += 1
        self._appended += 1
        n = len(data)
        self.seg_bytes += n
        self.sizes[seg] += n

    def record(self, record: list[Any]) -> None:
        """Append a record (a declaration, a settlement): written with the next commit."""
        if self.dormant:
            return
        if self.seg_bytes >= self.segment_size:
            self._roll()
        self._append(encode(record))

    def message(self, store: JournalStore, msg: Message) -> int:
        """Append a message of `store`'s durable queue; returns the segment it is in."""
        if self.seg_bytes >= self.segment_size:
            self._roll()
        pid = msg.producer_id
        if pid is not None and msg.sequence is not None:
            producers = self.producers
            producers[pid] = msg.sequence
            if len(producers) > MAX_PRODUCER_IDS:
                del producers[next(iter(producers))]
        offset = msg.offset
        qid = store.qid
        self._append(encode([MESSAGE, qid, offset, msg.exchange, msg.routing_key, msg.body, msg.headers,
                             msg.size, pid, msg.sequence]))
        self.moved[qid] = offset + 1  # the queue's next offset, for the next snapshot
        seg = self.active_seg
        # (`_resides`, inlined: this runs once per durable message)
        self.live[seg] += 1
        self.live_bytes[seg] += _record_bytes(msg)
        mine = self._active_residents.get(qid)
        if mine is None:
            mine = self._active_residents[qid] = {}
        mine[offset] = msg
        return seg

    def _resides(self, store: JournalStore, msg: Message, seg: int) -> None:
        """`msg` of `store` is live in segment `seg`."""
        self.live[seg] += 1
        self.live_bytes[seg] += _record_bytes(msg)
        mine = self.residents[seg].get(store.qid)
        if mine is None:
            mine = self.residents[seg][store.qid] = {}
        mine[msg.offset] = msg

    def adopt(self, store: JournalStore, msg: Message, seg: int) -> None:
        """A message recovered into `store`, in segment `seg` (restore); delivered if `msg.redelivered`."""
        if seg not in self.live:
            self.live[seg] = self.live_bytes[seg] = 0
            self.residents[seg] = {}
        self._resides(store, msg, seg)
        if msg.redelivered:
            self.delivered_msgs.add(msg)

    def _gone(self, store: JournalStore, msg: Message, seg: int) -> None:
        """`msg` no longer keeps segment `seg` (settled)."""
        self.live[seg] -= 1
        self.live_bytes[seg] -= _record_bytes(msg)
        del self.residents[seg][store.qid][msg.offset]
        self.delivered_msgs.discard(msg)

    def producer_forgotten(self, producer_id: str) -> None:
        """The core forgot an idempotent producer id (idle for producer_id_ttl): so does the next snapshot,
        and recovery drops what the records before this one said of it."""
        if self.producers.pop(producer_id, None) is not None and not self.dormant:
            self.record([PRODUCER_FORGOTTEN, producer_id])

    def delivered(self, qid: int, msg: Message) -> None:
        self.delivered_msgs.add(msg)
        self._append(encode([DELIVERED, qid, msg.offset]))

    def settled(self, store: JournalStore, msg: Message, seg: int) -> None:
        # (`_gone`, inlined: this runs once per durable message)
        self.live[seg] -= 1
        self.live_bytes[seg] -= _record_bytes(msg)
        del self.residents[seg][store.qid][msg.offset]
        self.delivered_msgs.discard(msg)
        if self.seg_bytes >= self.segment_size:
            self._roll()
        self._append(encode([SETTLED, store.qid, msg.offset]))

    def settled_many(self, store: JournalStore, msgs: list[Message], segs: list[int]) -> None:
        """`settled` for many messages of one queue (`msgs`, each in `segs`) in SETTLED_MANY records of at
        most SETTLED_PER_RECORD offsets: a purge of 300,000 messages wrote a record each on the trio
        thread, 0.3-0.5 s every connection waited (a tester)."""
        gone = self._gone
        for msg, seg in zip(msgs, segs):
            gone(store, msg, seg)
        offsets = [msg.offset for msg in msgs]
        qid = store.qid
        for start in range(0, len(offsets), SETTLED_PER_RECORD):
            if self.seg_bytes >= self.segment_size:
                self._roll()
            self._append(encode([SETTLED_MANY, qid, offsets[start:start + SETTLED_PER_RECORD]]))

    def forget(self, store: JournalStore, segs: set[int]) -> None:
        """A deleted queue's messages (in `segs`): they no longer keep their segments."""
        for seg in segs:
            mine = self.residents[seg].pop(store.qid, None)
            if mine:
                self.live[seg] -= len(mine)
                self.live_bytes[seg] -= sum(_record_bytes(msg) for msg in mine.values())
                self.delivered_msgs.difference_update(mine.values())

    def new_queue_id(self) -> int:
        qid = self.next_qid
        self.next_qid += 1
        return qid

    def queue_declared(self, qid: int, queue: Queue) -> None:
        """A durable queue was declared (or its thresholds changed): the first one wakes the journal."""
        if self.dormant:
            self._start()  # the snapshot already has it
            return
        record = [QUEUE, qid, queue.name, queue_arguments(queue), queue.next_offset, queue.owner]
        snapshot = self.snapshot
        if snapshot is None:
            self.record(record)
            return
        data = snapshot.queue(record)
        if self.seg_bytes >= self.segment_size:
            self._roll()
        self._append(data)

    def _roll_before_change(self) -> None:
        """A segment due to roll rolls before the kept snapshot changes: its snapshot is then the state
        before the record that follows it. Rolled after, a deletion's new segment opened without the
        queue and then said QUEUE_DELETED, which recovery reads as a deletion whose record was cut
        away, and warned so at every restart (a tester)."""
        if not self.dormant and self.seg_bytes >= self.segment_size:
            self._roll()

    def queue_deleted(self, qid: int) -> None:
        self._roll_before_change()
        if self.snapshot is not None:
            self.snapshot.queue_deleted(qid)
        self.record([QUEUE_DELETED, qid])

    def exchange_declared(self, name: str, kind: str) -> None:
        self._roll_before_change()
        if self.snapshot is not None:
            self.snapshot.exchange(name, kind)
        self.record([EXCHANGE, name, kind])

    def exchange_deleted(self, name: str) -> None:
        self._roll_before_change()
        if self.snapshot is not None:
            self.snapshot.exchange_deleted(name)
        self.record([EXCHANGE_DELETED, name])

    def bound(self, exchange: str, qid: int, key: str, bound: bool) -> None:
        self._roll_before_change()
        if self.snapshot is not None:
            self.snapshot.bind(exchange, qid, key, bound)
        self.record([BIND if bound else UNBIND, exchange, qid, key])

    # -- completions and the disk alarm (trio thread) -------------------------------------------

    def hold(self, transfer: HeldTransfer, session: Session, queue: str) -> None:
        """A transfer routed to durable queue `queue` completes when the commit covering its record
        returns (its `pending` counts that); while the disk alarm is on, also not before it clears."""
        self._waiters.append(transfer)
        self._waiting_on[session] = queue
        stop = self.alarm
        if stop is not None and session.flow_control:
            transfer.pending += 1
            self._disk_held.append(transfer)
            self._stop(session, queue, stop)

    @property
    def records_appended(self) -> int:
        """Records appended since the journal opened (never goes back): a request that moved it journalled
        something, and its answer waits for the commit (BrokerCore.handle, the admin API). Not the count
        since the last batch: a batch taken meanwhile resets that, and the admin API's request awaits."""
        return self._appended

    def after_commit(self, transfer: CommitWaiter) -> None:
        """Complete `transfer` with the next commit, whatever it writes: an idempotent producer's
        duplicate, whose original may be in the commit running now."""
        self._waiters.append(transfer)
        if not self._chunks:
            self.wake()

    def set_alarm(self, stop: FlowStopped | None) -> None:
        """Raise (stop given) or clear the disk alarm; clearing releases every transfer it held."""
        if stop is None and self.alarm is not None:
            # the figures now: the alarm's own reason is the last look that was over a limit
            LOGGER.warning("disk alarm cleared: the journal holds %d bytes (quota %d), %d bytes free under %s "
                           "(disk_free_limit %d); producers of durable queues resume",
                           self.bytes_on_disk, self.quota, self.free_bytes, self.dir, self.disk_free_limit)
            self.alarm = None
            held, self._disk_held = self._disk_held, []
            stopped, self._stopped = self._stopped, {}
            for session, queue in stopped.items():
                session.disk_stop = None
                if session.flow_stopped_on.pop(queue, None) is not None:
                    session.send(FlowResumed(queue))
            for transfer in held:
                transfer.release()
        elif stop is not None:
            if self.alarm is None:
                LOGGER.warning("disk alarm: %s; producers of durable queues are held", stop.reason)
            self.alarm = stop

    def tell_held(self, batch: Batch) -> None:
        """The alarm came up because `batch` could not be written: its producers wait for it, so they
        are told FLOW_STOPPED now (a queue of theirs, threshold `disk`), not only at their next transfer,
        and FLOW_RESUMED when the alarm clears."""
        stop = self.alarm
        if stop is None:
            return
        # and those whose transfers arrived while the failing write ran: they wait in the next batch, which
        # is not taken while this one is retried, and `hold` told nobody (the alarm was not on yet): a
        # producer's flush timed out naming no queue, its flow_state empty 20 s later (a tester)
        for waiting_on in (batch.waiting_on, self._waiting_on):
            for session, queue in waiting_on.items():
                if session.flow_control:
                    self._stop(session, queue, stop)

    def _stop(self, session: Session, queue: str, stop: FlowStopped) -> None:
        """Tell `session` FLOW_STOPPED on `queue` by the disk alarm, once until the alarm clears."""
        if session not in self._stopped:
            self._stopped[session] = queue
            session.flow_stops += 1
            session.flow_stopped_on[queue] = (None, session.now_ns)
            session.disk_stop = FlowStopped(queue, THRESHOLD_DISK, stop.limit, stop.value, stop.reason)
            session.send(session.disk_stop)

    def check_disk(self) -> FlowStopped | None:
        """What the disk alarm should be now: free space under the limit, or the journal over its quota."""
        used = self.bytes_on_disk
        if self.quota and used > self.quota:
            return FlowStopped("*", THRESHOLD_DISK, self.quota, used,
                               f"the journal holds {used} bytes, over its quota {self.quota}; transfers to "
                               "durable queues are held until consumers settle messages")
        free = self.free_bytes
        if free >= 0 and free < self.disk_free_limit:
            return FlowStopped("*", THRESHOLD_DISK, self.disk_free_limit, free,
                               f"{free} bytes free under {self.dir}, under disk_free_limit {self.disk_free_limit}; "
                               "transfers to durable queues are held until space frees")
        return None

    # -- group commit ----------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Something to commit: records, transfers waiting for the next commit, or messages to copy forward."""
        return bool(self._chunks or self._waiters or self.copy_left)

    def take_batch(self) -> Batch:
        """Everything buffered, and the segments this commit may delete (trio thread)."""
        chunks, self._chunks = self._chunks, []
        waiters, self._waiters = self._waiters, []
        waiting_on, self._waiting_on = self._waiting_on, {}
        self.in_flight = True
        records, self._records = self._records, 0
        self._copy_forward()
        if self._chunks:  # what the copy wrote: in this batch, before the segments it frees are deleted
            chunks += self._chunks
            records += self._records
            self._chunks, self._records = [], 0
        deletable: list[int] = []
        freed = 0
        live, sizes = self.live, self.sizes
        for seg in sizes:  # oldest first, up to the first one still holding a live message
            if seg >= self.active_seg or live.get(seg, 0):
                break
            deletable.append(seg)
        for seg in deletable:
            freed += sizes.pop(seg)
            live.pop(seg, None)
            self.live_bytes.pop(seg, None)
            self.residents.pop(seg, None)
        if deletable:
            self.oldest_seg = next(iter(sizes), self.active_seg)
        return Batch(chunks, waiters, deletable, records, waiting_on, freed)

    def _copy_forward(self) -> None:
        """Copy forward the live messages of the oldest segments when that is worth it: when some run of
        segments from the oldest holds live messages of at most 1/COPY_FORWARD_FRACTION of its bytes,
        the live messages of that run are written again (at most COPY_FORWARD_BUDGET segments' worth and
        COPY_FORWARD_MESSAGES messages per batch; `copy_left` asks for the next batch at once), each as a
        MESSAGE_MOVED record in the segment being appended to. That commit comes before the old segments'
        deletion (the same batch), so a crash between the two leaves both, and recovery takes either.
        Settlements of a moved message come after its new record, so deleting oldest first stays right.
        When no such run exists, every run from the oldest is more than a quarter live: the journal is
        within COPY_FORWARD_FRACTION times what is live, plus the segment being written."""
        self.copy_left = False
        if self.dormant:
            return
        live, live_bytes, sizes = self.live, self.live_bytes, self.sizes
        budget, moves = self.segment_size * COPY_FORWARD_BUDGET, COPY_FORWARD_MESSAGES
        delivered = self.delivered_msgs
        olds = [n for n in sizes if n < self.active_seg]  # oldest first, the segments there are (`sizes`)
        start = 0  # where in `olds` the next run begins
        while start < len(olds):
            if budget <= 0 or moves <= 0:
                self.copy_left = True  # the rest at the next batch, at once
                return
            held = total = 0
            worth = 0  # the end in `olds` of the shortest run from `start` worth copying (0: none)
            for i in range(start, len(olds)):
                held += live_bytes.get(olds[i], 0)
                total += sizes.get(olds[i], 0)
                if held and held * COPY_FORWARD_FRACTION <= total:
                    worth = i + 1
                    break
            if not worth:
                return
            for seg in olds[start:worth]:
                segment = self.residents.get(seg, {})
                while segment:  # (popitem: the order of the copies does not matter, recovery keys by offset)
                    if budget <= 0 or moves <= 0:
                        self.copy_left = True  # the rest at the next batch, at once
                        return
                    qid, mine = next(iter(segment.items()))
                    if not mine:  # (emptied by settlements, or its queue was deleted since)
                        del segment[qid]
                        continue
                    store = self.stores[qid]
                    while mine and budget > 0 and moves > 0:
                        offset, msg = mine.popitem()
                        live[seg] -= 1
                        record = _record_bytes(msg)
                        live_bytes[seg] -= record
                        if self.seg_bytes >= self.segment_size:
                            olds.append(self.active_seg)  # (a copy that rolls makes one more segment old)
                            self._roll()
                        new = self.active_seg
                        self._append(encode([MESSAGE_MOVED, qid, offset, msg.exchange, msg.routing_key,
                                             msg.body, msg.headers, msg.size, msg.producer_id, msg.sequence,
                                             msg in delivered]))
                        self._resides(store, msg, new)
                        store.segs[offset] = new
                        budget -= record
                        moves -= 1
                        self.messages_moved += 1
                    if not mine:
                        del segment[qid]
            start = worth

    def committed(self, batch: Batch) -> None:
        """The batch is on disk: complete what it covered (trio thread)."""
        self.in_flight = False
        self.write_failing = False
        self.commits += 1
        self.records_written += batch.records
        self.segments_deleted += len(batch.deletable)
        self.bytes_on_disk += sum(len(data) for _, data in batch.chunks) - batch.freed
        for transfer in batch.waiters:
            transfer.release()

    def write_batch(self, batch: Batch) -> None:
        """Write and fsync a batch, then delete what it compacts (worker thread). Raises OSError with
        nothing half-done: a failed write cuts the whole batch back, and a retry writes it again."""
        if batch.done == 0 and batch.chunks:
            self.dir.mkdir(parents=True, exist_ok=True)
        while batch.done < len(batch.chunks):
            seg, data = batch.chunks[batch.done]
            try:
                fd = self._open(seg, batch)
                start = os.lseek(fd, 0, os.SEEK_END)
                batch.written.append((seg, start))
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            except OSError:
                self.write_errors += 1
                self._cut_back(batch)
                raise
            self.bytes_written += len(data)
            batch.unsynced.add(seg)
            batch.done += 1
        if self.fsync and batch.unsynced:
            if self._fd_seg in batch.unsynced:
                os.fsync(self._fd)
                self.fsyncs += 1
        batch.unsynced.clear()
        for seg in batch.deletable:
            try:
                os.unlink(self.dir / segment_name(seg))
            except FileNotFoundError:
                pass
        self.look_at_disk()

    def _cut_back(self, batch: Batch) -> None:
        """After a failed write: truncate every segment the batch wrote to where its chunk began, so
        none of it is on disk, and start the batch over (a chunk that cannot be cut back is logged:
        recovery then replays it, or cuts a torn tail)."""
        for seg, start in reversed(batch.written):
            try:
                if start == 0:
                    # The batch made this file: remove it rather than leave it empty, which recovery reads
                    # as a segment emptied, its messages lost (one ERROR per file after a disk-full, a
                    # tester). The retry makes it again.
                    if seg == self._fd_seg and self._fd >= 0:
                        os.close(self._fd)
                        self._fd = -1
                    os.unlink(self.dir / segment_name(seg))
                elif seg == self._fd_seg and self._fd >= 0:
                    os.ftruncate(self._fd, start)
                else:
                    os.truncate(self.dir / segment_name(seg), start)
            except OSError as exc:
                LOGGER.error("journal: cannot cut segment %d back after a failed write: %s", seg, exc)
        batch.written.clear()
        batch.unsynced.clear()
        batch.done = 0

    def _open(self, seg: int, batch: Batch) -> int:
        """The fd of segment `seg`; moving to a new segment syncs and closes the previous one first, and
        syncs the directory once the new file exists, so a commit never covers an unsynced file."""
        if seg == self._fd_seg and self._fd >= 0:
            return self._fd
        if self._fd >= 0:
            if self.fsync and self._fd_seg in batch.unsynced:
                os.fsync(self._fd)
                self.fsyncs += 1
            batch.unsynced.discard(self._fd_seg)
            os.close(self._fd)
            self._fd = -1
        self._fd = os.open(self.dir / segment_name(seg), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._fd_seg = seg
        if self.fsync:
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return self._fd

    def look_at_disk(self) -> None:
        """Free space under the data directory (worker thread: statvfs may block on a sick disk)."""
        try:
            st = os.statvfs(self.dir if self.dir.exists() else self.dir.parent)
        except OSError:
            return
        self.free_bytes = st.f_bavail * st.f_frsize

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.lock_fd >= 0:  # the data directory's lock (journalshell.lock_data_dir) goes last
            os.close(self.lock_fd)
            self.lock_fd = -1
