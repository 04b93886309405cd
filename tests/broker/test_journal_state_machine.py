"""The journal against a model (hypothesis state machine): random appends, deliveries, settlements,
requeues, purges and commits on two durable queues over tiny segments; after every commit, what recovery
reads from the directory is exactly what the model says the queues own, each message flagged redelivered
exactly when it was delivered, no segment older than the oldest owned message is left on disk, and
compaction copied forward the live messages of any run of segments from the oldest that was a quarter live
or less (a message never settled kept every later segment on disk). A commit may also "crash" before its
deletions: the segments it freed stay on disk beside the copies of their messages, and recovery still
reads each message once."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowbroker.broker import journal as journal_module
from flowbroker.broker.journal import Journal
from flowbroker.broker.journalrecord import QUEUE
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.message import Message
from flowbroker.broker.recovery import read_journal

QIDS = (1, 2)


class JournalMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="journal-sm-"))
        self.journal = Journal(self.dir / "journal", 64 * 1024, False, 0, 0)
        self.journal.segment_size = 2048  # tiny segments: rolls and compaction on every few messages
        self._per_record = journal_module.SETTLED_PER_RECORD
        journal_module.SETTLED_PER_RECORD = 3  # a purge's settlements over several SETTLED_MANY records
        self._budget = journal_module.COPY_FORWARD_BUDGET
        journal_module.COPY_FORWARD_BUDGET = 1000  # (each batch copies all it should: the invariant below)
        self.stores = {qid: JournalStore(self.journal, qid) for qid in QIDS}
        self.next_offset = {qid: 0 for qid in QIDS}
        self.journal.topology = self._topology
        self.journal.dormant = False
        self.journal._roll()
        # the model: per queue, offset -> delivered at least once; and the deliveries outstanding
        self.owned: dict[int, dict[int, bool]] = {qid: {} for qid in QIDS}
        self.taken: dict[int, list[Message]] = {qid: [] for qid in QIDS}
        self.committed: dict[int, dict[int, bool]] | None = None

    def _topology(self) -> list[list[Any]]:
        return [[QUEUE, qid, f"q{qid}", {}, self.next_offset[qid]] for qid in QIDS]

    def teardown(self) -> None:
        journal_module.SETTLED_PER_RECORD = self._per_record
        journal_module.COPY_FORWARD_BUDGET = self._budget
        self.journal.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(qid=st.sampled_from(QIDS), size=st.integers(0, 600))
    def append(self, qid: int, size: int) -> None:
        msg = Message("", f"q{qid}", b"b" * size, None, size + 512)
        msg.offset = self.next_offset[qid]
        self.next_offset[qid] += 1
        self.stores[qid].append(msg)
        self.owned[qid][msg.offset] = False

    @rule(qid=st.sampled_from(QIDS))
    def take(self, qid: int) -> None:
        store = self.stores[qid]
        if store:
            msg = store.take()
            self.taken[qid].append(msg)
            self.owned[qid][msg.offset] = True

    @rule(qid=st.sampled_from(QIDS), data=st.data())
    def settle(self, qid: int, data: st.DataObject) -> None:
        if self.taken[qid]:
            msg = self.taken[qid].pop(data.draw(st.integers(0, len(self.taken[qid]) - 1)))
            self.stores[qid].settle(msg)
            del self.owned[qid][msg.offset]

    @rule(k=st.integers(1, 8), size=st.integers(0, 600))
    def traffic(self, k: int, size: int) -> None:
        """Queue 2 takes k messages, and everything it has is delivered and settled: segments fill and die
        behind what queue 1 keeps (what compaction's copy forward is for)."""
        qid = 2
        for _ in range(k):
            self.append(qid, size)
        while self.stores[qid]:
            self.take(qid)
        for msg in self.taken[qid]:
            self.stores[qid].settle(msg)
            del self.owned[qid][msg.offset]
        self.taken[qid] = []

    @rule(qid=st.sampled_from(QIDS))
    def requeue(self, qid: int) -> None:
        msgs, self.taken[qid] = self.taken[qid], []
        for msg in msgs:
            msg.redelivered = True
        self.stores[qid].requeue(msgs)

    @rule(qid=st.sampled_from(QIDS))
    def purge(self, qid: int) -> None:
        for msg in self.stores[qid].purge():
            del self.owned[qid][msg.offset]

    @rule()
    def commit(self) -> None:
        moved = self.journal.messages_moved
        self.journal.write_batch(self.journal.take_batch())
        self.committed = {qid: dict(owned) for qid, owned in self.owned.items()}
        event("copied forward" if self.journal.messages_moved > moved else "nothing copied")

    @rule()
    def commit_then_crash_before_deleting(self) -> None:
        """The batch is on disk and the process dies before its unlinks: what a restart reads then (the freed
        segments beside the copies of their messages) is what the model owns, each message once. Then the
        unlinks happen after all, and the journal goes on."""
        batch = self.journal.take_batch()
        freed, batch.deletable = batch.deletable, []
        self.journal.write_batch(batch)
        self.committed = {qid: dict(owned) for qid, owned in self.owned.items()}
        if freed:
            event("a crash left freed segments on disk")
            self._recovery_reads_the_model()
            for seg in freed:
                (self.dir / "journal" / journal_module.segment_name(seg)).unlink()

    @precondition(lambda self: self.committed is not None and not self.journal.pending)
    @invariant()
    def recovery_reads_what_was_committed(self) -> None:
        self._recovery_reads_the_model()
        self._compaction_left_nothing_it_should_not()

    def _recovery_reads_the_model(self) -> None:
        rec = read_journal(self.journal)
        assert not rec.cut
        got = {qid: {offset: delivered for offset, (_, _, delivered) in rq.messages.items()}
               for qid, rq in rec.queues.items()}
        assert got == self.committed
        for qid, rq in rec.queues.items():
            assert rq.next_offset <= self.next_offset[qid]

    def _compaction_left_nothing_it_should_not(self) -> None:
        # compaction: nothing older than the oldest segment still holding an owned message
        live = [seg for qid in QIDS for seg in self.stores[qid].segs.values()]
        floor = min(live, default=self.journal.active_seg)
        on_disk = sorted(int(p.name[:-4]) for p in (self.dir / "journal").iterdir())
        assert all(n >= floor for n in on_disk), (on_disk, floor)
        # ...and no run of segments from it is a quarter live or less: that would have been copied forward
        journal = self.journal
        held = total = 0
        for n in range(floor, journal.active_seg):
            held += journal.live_bytes.get(n, 0)
            total += journal.sizes.get(n, 0)
            assert not held or held * journal_module.COPY_FORWARD_FRACTION > total, (floor, n, held, total)


JournalMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestJournalMachine = JournalMachine.TestCase
