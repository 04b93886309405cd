"""A stray segment file numbered far past the others (a valid segment copied into journal/ as
00000000010000000000.seg, a tester) hung the broker at start: compaction walked every number from the
oldest segment to the newest, ten billion of them, on the trio thread (100 % CPU, no answers, SIGTERM
ignored). docs/storage.md, "Recovery": a gap is logged as lost and recovery goes on with the rest. The
journal now walks the segments there are, never the numbers between them."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import trio

from flowbroker.broker.journal import segment_name

from tests.broker.journalharness import Broker

FAR = 10**18  # numbers between the two segments: a walk over them never ends


def _recover_and_compact(broker: Broker) -> None:
    broker.restore()
    broker.commit()


async def test_a_stray_segment_numbered_far_past_the_others_recovers_and_compacts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "journal"
    broker = Broker(directory)
    kept = broker.core.declare_queue("kept", None, True)
    traffic = broker.core.declare_queue("traffic", None, True)
    broker.send(kept, 3)
    broker.send(traffic, 200, size=1000)
    broker.settle_all(traffic)  # the segment is mostly dead: compaction copies the kept ones forward
    broker.commit()
    broker.journal.close()
    shutil.copyfile(directory / segment_name(1), directory / segment_name(FAR))  # the tester's stray copy

    again = Broker(directory)
    with caplog.at_level(logging.ERROR, logger="flowbroker.journal"):
        with trio.fail_after(30):  # (a hang, not a timing: the walk over the numbers never returned)
            await trio.to_thread.run_sync(_recover_and_compact, again, abandon_on_cancel=True)
    assert f"{segment_name(2)} to {segment_name(FAR - 1)}: missing between" in caplog.text
    assert again.core.queues["kept"].count == 3
    # the copy's messages (the same offsets: one each) moved past the gap, both old segments deleted
    assert again.journal.messages_moved == 3
    assert sorted(p.name for p in directory.iterdir()) == [segment_name(FAR + 1)]
    again.journal.close()

    once_more = Broker(directory)
    once_more.restore()
    assert once_more.core.queues["kept"].count == 3
    once_more.journal.close()
