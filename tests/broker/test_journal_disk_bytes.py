"""The journal's `bytes` (/api/broker, docs/management.md) are its segment files' bytes: on a 32 MiB tmpfs
whose writes hit ENOSPC it said 34,239,756 bytes, more than the file system, with 688,128 free (a tester):
it counted what was buffered and what the failing write cut back (docs/storage.md, "The disk as flow
control"). It counts what commits wrote now, less the segments they deleted."""

from __future__ import annotations

import errno
import os as real_os
from pathlib import Path
from typing import Any

import pytest

import flowbroker.broker.journal as journal_module
from flowbroker.broker import views

from tests.broker.journalharness import Broker


def on_disk(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def reported(broker: Broker) -> int:
    view = views.journal_view(broker.core)
    assert view is not None
    return int(view["bytes"])


def test_the_journals_bytes_are_what_is_on_disk_through_a_failed_write_its_retry_and_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "journal"
    broker = Broker(directory, segment_size=64 * 1024)
    queue = broker.core.declare_queue("d", None, True)
    broker.send(queue, 200, size=1000)  # about 200 KB: a few segments
    broker.commit()
    assert reported(broker) == on_disk(directory) > 0

    full = {"on": True}

    class FullDisk:  # every write fails as on a full disk, until space frees
        def __getattr__(self, name: str) -> Any:
            return getattr(real_os, name)

        def write(self, fd: int, data: Any) -> int:
            if full["on"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_os.write(fd, data)

    monkeypatch.setattr(journal_module, "os", FullDisk())
    broker.send(queue, 100, size=1000)
    batch = broker.journal.take_batch()
    with pytest.raises(OSError):
        broker.journal.write_batch(batch)  # cut back: nothing of it on disk
    broker.send(queue, 10, size=1000)  # buffered for the next batch meanwhile
    assert reported(broker) == on_disk(directory)

    full["on"] = False  # the retry lands
    broker.journal.write_batch(batch)
    broker.journal.committed(batch)
    assert reported(broker) == on_disk(directory)
    broker.settle_all(queue)  # the old segments go with the next commit
    broker.commit()
    assert broker.journal.segments_deleted > 0
    assert reported(broker) == on_disk(directory)
    broker.journal.close()

    again = Broker(directory, segment_size=64 * 1024)
    again.restore()  # (its new segment's snapshot waits for the first commit)
    assert reported(again) == on_disk(directory)
    again.commit()
    assert reported(again) == on_disk(directory)
    again.journal.close()
