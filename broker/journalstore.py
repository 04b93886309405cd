"""A durable queue's store: the memory store's ready deque, and a journal record for every change.

The queue still serves from memory (the journal is written, never read, while the broker runs): an
append writes the message's record, the first delivery of a message a DELIVERED record (so after a
crash it comes back flagged redelivered), a settlement, purge or drop a SETTLED record. Each message's
segment is kept by offset, so a settlement tells the journal which segment has one live message fewer
(compaction deletes segments with none).
"""

from __future__ import annotations

from collections.abc import Iterable

from flowbroker.broker.journal import Journal
from flowbroker.broker.message import Message
from flowbroker.broker.store import MemoryStore

__all__ = ["JournalStore"]


class JournalStore(MemoryStore):
    """`MemoryStore` plus the journal. `segs` maps the offset of every message the queue owns (ready
    or delivered) to its segment."""

    __slots__ = ("journal", "qid", "segs", "start_offset")

    def __init__(self, journal: Journal, qid: int, start_offset: int = 0, recovered: Iterable[tuple[Message, int]] = ()):
        super().__init__()
        self.journal = journal
        self.qid = qid
        self.start_offset = start_offset
        self.segs: dict[int, int] = {}
        journal.stores[qid] = self
        for msg, seg in recovered:  # in offset order, already on disk
            super().append(msg)
            self.segs[msg.offset] = seg
            journal.adopt(self, msg, seg)

    def __repr__(self) -> str:
        return f"<JournalStore qid={self.qid} ready={len(self)} owned={len(self.segs)}>"

    def append(self, msg: Message) -> None:
        super().append(msg)
        self.segs[msg.offset] = self.journal.message(self, msg)

    def take(self) -> Message:
        msg = self.popleft()
        if not msg.redelivered:  # the first delivery; a redelivered one is on record already
            self.journal.delivered(self.qid, msg)
        return msg

    def settle(self, msg: Message) -> None:
        seg = self.segs.pop(msg.offset, None)
        if seg is not None:
            self.journal.settled(self, msg, seg)

    def purge(self) -> list[Message]:
        """The ready messages, gone: their settlements in SETTLED_MANY records, not a record each."""
        msgs = super().purge()
        pop = self.segs.pop
        gone: list[Message] = []
        segs: list[int] = []
        for msg in msgs:
            seg = pop(msg.offset, None)
            if seg is not None:
                gone.append(msg)
                segs.append(seg)
        if gone:
            self.journal.settled_many(self, gone, segs)
        return msgs

    def delete(self) -> None:
        super().delete()
        self.journal.forget(self, set(self.segs.values()))
        self.journal.stores.pop(self.qid, None)
        self.segs.clear()
        self.journal.queue_deleted(self.qid)
