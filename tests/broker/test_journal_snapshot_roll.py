"""A segment holds `segment_size` bytes of records beyond its opening snapshot: a snapshot bigger than a
segment (many durable queues with long names) must not make every record open a new segment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowbroker.broker.journal import Journal
from flowbroker.broker.journalrecord import QUEUE
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.message import Message

SEGMENT = 64 * 1024


def test_a_snapshot_bigger_than_a_segment_does_not_roll_a_segment_per_record(tmp_path: Path) -> None:
    """The snapshot counted toward the segment's size, so once it was over segment_size each new segment
    was full as it opened: every record opened another, with another whole snapshot (a tester: 2,000
    small messages wrote 855 MB and took 5.75 s beside 500 durable queues with long names)."""
    journal = Journal(tmp_path / "journal", SEGMENT, False, 0, 1 << 40)
    big: list[list[Any]] = [[QUEUE, i, "q" * 250 + str(i), {}, 0, None] for i in range(500)]  # ~130 KiB
    journal.topology = lambda: big
    journal.dormant = False
    journal._roll()
    store = JournalStore(journal, 1)
    first = journal.active_seg
    for offset in range(200):
        msg = Message("", "q", b"x" * 10, None, 10 + 512)
        msg.offset = offset
        store.append(msg)
    assert journal.active_seg == first  # 200 small records: a few KiB, well within one segment's records
    before = journal.bytes_written
    batch = journal.take_batch()
    journal.write_batch(batch)
    journal.committed(batch)
    assert journal.bytes_written - before < 3 * SEGMENT
