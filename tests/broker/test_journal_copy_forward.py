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
from tests.broker.test_journal_recovery import broker, drain
from tests.serving import url

BODY = b"x" * 1024
SEGMENT = 256 * 1024
QUOTA = 4 * SEGMENT


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
                received = 0
                async with conn.consumer("work", prefetch=500) as worker, trio.open_nursery() as nursery:
                    async def ack_all() -> None:
                        nonlocal received
                        async for msg in worker:
                            await msg.ack()
                            received += 1

                    nursery.start_soon(ack_all)
                    producer = conn.producer("", "work")
                    for _ in range(4000):  # 4.4 MB through the journal: four times its quota
                        await producer.send(BODY, timeout=10)  # (held for good by the disk alarm before)
                    await producer.flush(timeout=20)
                    with trio.fail_after(20):
                        while received < 4000:
                            await trio.sleep(0.01)
                    nursery.cancel_scope.cancel()
                journal = server.journal
                assert journal is not None and journal.messages_moved >= 1
                on_disk = sorted((tmp_path / "journal").iterdir())
                assert sum(p.stat().st_size for p in on_disk) <= QUOTA and len(on_disk) <= 5, on_disk
                assert held.body == b"held for good"
    async with broker(tmp_path, segment_size=SEGMENT, quota=QUOTA) as server:  # moved, not lost
        async with await fb.connect(url(server)) as conn:
            assert await drain(conn, "pinned", 1) == [(b"held for good", True)]
            assert server.core.queues["work"].count == 0
