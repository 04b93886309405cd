"""The journal's quota and the disk alarm, on the `Journal` alone (no trio, no broker): why `[storage]
quota` must be at least two segments (broker/config.py refuses less), and what the alarm's log says
when it clears."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flowbroker.broker.journal import Journal
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.message import Message

SEGMENT = 64 * 1024


def journal_with_quota(tmp_path: Path, quota: int) -> tuple[Journal, JournalStore]:
    journal = Journal(tmp_path / "journal", SEGMENT, False, 0, quota)
    journal.dormant = False
    journal._roll()
    return journal, JournalStore(journal, 1)


def commit(journal: Journal) -> None:
    """One group commit, as the shell runs it, then the alarm as the shell sets it after a commit."""
    batch = journal.take_batch()
    journal.write_batch(batch)
    journal.committed(batch)
    journal.set_alarm(journal.check_disk())


def fill_then_drain(journal: Journal, store: JournalStore) -> None:
    """Append 1 KiB messages (a commit every ten) until the quota raises the alarm, then deliver and
    settle every one of them, as consumers would, and commit."""
    offset = 0
    while journal.alarm is None:
        msg = Message("", "q", b"x" * 1024, None, 1024 + 512)
        msg.offset = offset
        offset += 1
        store.append(msg)
        if offset % 10 == 0:
            commit(journal)
    while store:
        store.settle(store.take())
    commit(journal)


def test_under_a_quota_of_two_segments_the_alarm_clears_once_every_message_is_settled(tmp_path: Path) -> None:
    journal, store = journal_with_quota(tmp_path, 2 * SEGMENT)
    fill_then_drain(journal, store)
    assert journal.segments_deleted > 0
    assert journal.alarm is None
    journal.close()


def test_under_a_quota_below_a_segment_the_alarm_would_never_clear(tmp_path: Path) -> None:
    """Why the config refuses it: the segment being written is never deleted, and it alone is over
    the quota, so settling everything frees nothing."""
    journal, store = journal_with_quota(tmp_path, SEGMENT // 2)
    fill_then_drain(journal, store)
    assert journal.alarm is not None
    journal.close()


def test_the_cleared_log_line_gives_the_figures_now_not_those_of_the_alarm(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal, store = journal_with_quota(tmp_path, 2 * SEGMENT)
    fill_then_drain(journal, store)
    (raised,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("disk alarm:")]
    (cleared,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("disk alarm cleared")]
    used = sum(journal.sizes.values())
    assert f"the journal holds {used} bytes" in cleared and f"quota {2 * SEGMENT}" in cleared
    assert f"{journal.free_bytes} bytes free" in cleared
    over = raised.split("the journal holds ")[1].split(" bytes")[0]
    assert int(over) > 2 * SEGMENT > used and over not in cleared
    journal.close()


@pytest.fixture(autouse=True)
def _journal_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="flowbroker.journal")
