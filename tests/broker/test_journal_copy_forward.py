"""One durable message a consumer takes and never settles kept its segment, and every segment after it,
on disk (docs/storage.md, "Compaction"): a tester's journal grew 870 MB in 20 s beside such a consumer,
and under a quota every durable producer of the broker was held for good by the disk alarm, its own
queue drained. Compaction now copies the few live messages of the oldest segment forward
(broker/journal.py, COPY_FORWARD_FRACTION), so the journal stays near what is live. Over real sockets,
with the broker's committer; the journal state machine (test_journal_state_machine.py) checks what
recovery reads after copies and crashes."""

from __future__ import annotations

from pathlib import Path

import trio

import flowbroker.client as fb
from flowbroker.broker import journal as journal_module
from flowbroker.broker.journal import Journal
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.message import Message
from tests.broker.test_journal_recovery import broker, drain
from tests.serving import url

BODY = b"x" * 1024
SEGMENT = 256 * 1024
QUOTA = 4 * SEGMENT


async def _through_work(conn: fb.Connection, count: int) -> None:
    """`count` messages of BODY to the durable queue 'work', each acknowledged by a consumer as it comes:
    all of them completed and consumed, or the test fails (a producer the disk alarm held for good sees
    its sends time out)."""
    received = 0
    async with conn.consumer("work", prefetch=500) as worker, trio.open_nursery() as nursery:
        async def ack_all() -> None:
            nonlocal received
            async for msg in worker:
                await msg.ack()
                received += 1

        nursery.start_soon(ack_all)
        producer = conn.producer("", "work")
        for _ in range(count):
            await producer.send(BODY, timeout=10)
        await producer.flush(timeout=20)
        with trio.fail_after(20):
            while received < count:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


def _segments(directory: Path) -> dict[str, int]:
    """The segment files and their sizes now (the committer deletes old ones meanwhile: skipped)."""
    sizes: dict[str, int] = {}
    for path in directory.iterdir():
        try:
            sizes[path.name] = path.stat().st_size
        except FileNotFoundError:
            continue
    return sizes


async def test_a_message_never_settled_neither_keeps_the_journal_nor_holds_another_queues_producer(
        tmp_path: Path) -> None:
    async with broker(tmp_path, segment_size=SEGMENT, quota=QUOTA) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("pinned", durable=True)
            await conn.declare_queue("work", durable=True, flow_stop_count=100_000)
            first = conn.producer("", "pinned")
            await first.send(b"held for good")
            await first.flush(timeout=10)
            async with conn.consumer("pinned", prefetch=1) as holder:
                held = await holder.receive(timeout=10)  # never settled
                await _through_work(conn, 4000)  # 4.4 MB through the journal: four times its quota
                journal = server.journal
                assert journal is not None and journal.messages_moved >= 1
                on_disk = _segments(tmp_path / "journal")
                assert sum(on_disk.values()) <= QUOTA and len(on_disk) <= 5, on_disk
                assert held.body == b"held for good"
    async with broker(tmp_path, segment_size=SEGMENT, quota=QUOTA) as server:  # moved, not lost
        async with await fb.connect(url(server)) as conn:
            assert await drain(conn, "pinned", 1) == [(b"held for good", True)]
            assert server.core.queues["work"].count == 0


async def test_a_backlog_of_small_messages_is_copied_forward_by_its_records_bytes(tmp_path: Path) -> None:
    """Live messages were counted as message_size (512 bytes over the body) against the segments' bytes on
    disk: a backlog of 9-byte messages (about 60 bytes each on disk) was never a quarter of anything, so it
    was never copied forward, and under a quota the disk alarm held another queue's producer for good (a
    tester: 100,000 of them under 32 MiB). They are counted by their records now."""
    quota = 8 * SEGMENT
    async with broker(tmp_path, segment_size=SEGMENT, quota=quota) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("backlog", durable=True, flow_stop_count=100_000)
            await conn.declare_queue("work", durable=True, flow_stop_count=100_000)
            small = conn.producer("", "backlog")
            for i in range(5000):  # 2.6 MB as message_size, 0.3 MB on disk: nobody consumes it
                await small.send(b"%09d" % i)
            await small.flush(timeout=20)
            await _through_work(conn, 6000)  # 6.6 MB through the journal: three times its quota
            journal = server.journal
            assert journal is not None and journal.messages_moved >= 5000
    async with broker(tmp_path, segment_size=SEGMENT, quota=quota) as server:  # moved, not lost
        assert server.core.queues["backlog"].count == 5000


def test_one_batch_copies_at_most_copy_forward_messages(tmp_path: Path) -> None:
    """Each copy is encoded on the trio thread: a backlog of 100,000 small messages was copied forward in one
    batch, every connection held 120 ms (a tester). A batch copies COPY_FORWARD_MESSAGES at most, the rest
    at the next ones, and ends with none of it left behind."""
    journal = Journal(tmp_path / "journal", 64 * 1024, False, 0, 0)
    journal.dormant = False
    journal._roll()
    kept, traffic = JournalStore(journal, 1), JournalStore(journal, 2)
    for i in range(10_000):  # about 0.5 MB of records, live
        msg = Message("", "kept", b"k", None, 513)
        msg.offset = i
        kept.append(msg)
    for i in range(40_000):  # 42 MB of records, every one settled: the kept ones are far under a quarter
        msg = Message("", "traffic", b"t" * 1000, None, 1512)
        msg.offset = i
        traffic.append(msg)
        traffic.settle(msg)
    moved = []
    for _ in range(100):  # as the committer does: a batch while anything is pending, copies included
        if not journal.pending:  # (under a disk alarm nothing else commits: a run copied in part freed
            break  # nothing, and a producer stayed held for good, a later tester)
        before = journal.messages_moved
        journal.write_batch(journal.take_batch())
        moved.append(journal.messages_moved - before)
    assert max(moved) <= journal_module.COPY_FORWARD_MESSAGES and sum(moved) >= 10_000, moved
    on_disk = sum(_segments(tmp_path / "journal").values())
    live = sum(journal.live_bytes.values())  # the kept ones moved, the traffic's segments gone:
    assert not journal.pending and on_disk <= journal_module.COPY_FORWARD_FRACTION * live + 64 * 1024, (on_disk, live)
    journal.close()
