"""A segment file truncated to 0 bytes (the newest one, say) lost its snapshot and its messages, and
recovery logged only "recovered ... N message(s)": no ERROR, while every other damage is logged at ERROR
with where it was cut (docs/storage.md, "Recovery": every cut is logged). A tester's kill -9 loop."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from flowbroker.broker.journal import segment_name

from tests.broker.journalharness import Broker


def test_an_empty_newest_segment_is_logged_at_error_and_the_rest_recovers(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    broker = Broker(tmp_path / "journal")
    queue = broker.core.declare_queue("kept", None, True)
    broker.send(queue, 5)
    broker.commit()
    broker.journal._roll()  # the newest segment: its snapshot and 7 more messages
    broker.send(queue, 7)
    broker.commit()
    broker.journal.close()
    shutil.copytree(tmp_path / "journal", tmp_path / "copy")
    newest = tmp_path / "copy" / segment_name(broker.journal.active_seg)
    newest.write_bytes(b"")
    again = Broker(tmp_path / "copy")
    with caplog.at_level(logging.INFO, logger="flowbroker.journal"):
        again.restore()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"journal: {newest.name}: the segment is empty (0 bytes): if the broker stopped right after "
                      "creating it, nothing was in it; if it was emptied, its snapshot and its messages are lost; "
                      "removed"]
    assert again.core.queues["kept"].count == 5  # the older segment's messages
    summary = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    assert summary and summary[0].endswith("; 1 cut"), summary
    # said once: the empty file is gone, and the next restart finds nothing to say (a kill -9 right after a
    # roll left one, and every restart said "are lost" at ERROR until compaction reached it; a tester)
    assert not newest.exists()
    caplog.clear()
    once_more = Broker(tmp_path / "copy")
    with caplog.at_level(logging.INFO, logger="flowbroker.journal"):
        once_more.restore()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert once_more.core.queues["kept"].count == 5
