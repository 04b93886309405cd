"""A durable queue's offsets go on from where they were after a restart, never reused (docs/storage.md,
"Recovery"): recovery took a queue's next offset from the QUEUE records (the newest snapshot's) and its
unsettled messages only, so the offsets of messages enqueued and settled after the newest segment's
snapshot were handed out again after a restart."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.broker.journalharness import Broker


class _Waiter:
    def release(self) -> None:
        pass


def test_offsets_go_on_from_where_they_were_after_compaction_deleted_every_message_record(tmp_path: Path) -> None:
    """`busy` takes and settles 230 messages over many segments, the early ones deleted by compaction, the
    last ones after the newest snapshot: the snapshot's next offset and the message records after it
    both count (it came back at 226). `quiet`'s 3 are only in deleted segments: the snapshot counts."""
    broker = Broker(tmp_path / "journal", segment_size=2048)
    core = broker.core
    quiet = core.declare_queue("quiet", None, True)
    busy = core.declare_queue("busy", None, True)
    broker.send(quiet, 3)
    for _ in range(20):
        broker.send(busy, 10, 100)
        broker.settle_all(busy)
        broker.commit()
    broker.settle_all(quiet)
    broker.send(busy, 30, 100)  # rolls
    broker.settle_all(busy)
    broker.commit()
    broker.commit()  # (compaction happens at the commit after the settlements)
    broker.journal.after_commit(_Waiter())
    broker.commit()
    assert broker.journal.oldest_seg > 3  # the early segments, with the first messages, are gone
    broker.journal.close()
    shutil.copytree(tmp_path / "journal", tmp_path / "copy")
    again = Broker(tmp_path / "copy")
    again.restore()
    assert again.core.queues["busy"].next_offset == busy.next_offset == 230
    assert again.core.queues["quiet"].next_offset == quiet.next_offset == 3
