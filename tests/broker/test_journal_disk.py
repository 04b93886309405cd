"""The disk as flow control (issue 14 item 3), on a small tmpfs each test mounts (the tests run as root):
free space under `disk_free_limit` holds producers of durable queues with FLOW_STOPPED threshold "disk"
and resumes them when compaction frees space; a write that fails outright (ENOSPC) holds them too and is
retried, so a full disk paces producers, loses no completed message and does not stop the broker."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import flowbroker.client as fb
from flowbroker.broker import views
from tests.broker.test_journal_recovery import broker, drain
from tests.serving import url

BODY = b"x" * 1024


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of its own (unmounted after the test)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


async def next_event(events: fb.FlowEvents, kind: str) -> fb.FlowEvent:
    with trio.fail_after(20):
        while True:
            event = await events.get()
            assert event is not None
            if event.kind == kind:
                return event


async def test_low_free_space_holds_durable_producers_and_compaction_resumes_them(tmpfs: Path) -> None:
    async with broker(tmpfs, segment_size=128 * 1024, disk_free_limit=2 * 1024 * 1024) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("d", durable=True)
            await conn.declare_queue("m")
            events = conn.flow_events()
            durable = conn.producer(routing_key="d", window=100_000)
            memory = conn.producer(routing_key="m", window=100_000)
            sent = 0
            with trio.fail_after(30):
                while not conn.flow_state.is_stopped:
                    await durable.send(BODY)
                    sent += 1
                    if sent % 100 == 0:
                        await trio.sleep(0.005)  # let commits and the disk check run
            stopped = await next_event(events, "stopped")
            assert stopped.destination == "d" and stopped.stop is not None
            assert stopped.stop.threshold == "disk" and "disk_free_limit" in stopped.stop.reason
            # held: what was sent after the alarm does not complete...
            for _ in range(50):
                await durable.send(BODY)
            with pytest.raises(fb.FlowControlTimeout):
                await durable.flush(timeout=1.0)
            # ...while a memory-only queue's producer is not paced by the disk
            await memory.send(BODY)
            await memory.flush(timeout=5)
            assert server.journal is not None and server.journal.alarm is not None
            assert "disk_free_limit" in views.broker_view(server.core)["journal"]["disk_alarm"]
            # consumers settle: compaction deletes segments, space frees, producers resume
            await drain(conn, "d", sent + 50)
            resumed = await next_event(events, "resumed")
            assert resumed.destination == "d"
            await durable.flush(timeout=20)
            assert durable.statistics().completed == sent + 50
            assert server.journal.segments_deleted > 0


async def test_a_full_disk_holds_producers_retries_and_loses_nothing(tmpfs: Path) -> None:
    ballast = tmpfs / "ballast"
    ballast.write_bytes(b"\0" * (2 * 1024 * 1024))
    async with broker(tmpfs, segment_size=8 * 1024 * 1024, disk_free_limit=0) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("d", durable=True)
            events = conn.flow_events()
            p = conn.producer(routing_key="d", window=100_000)
            sent = 0
            with trio.fail_after(30):
                while not conn.flow_state.is_stopped:
                    await p.send(BODY)
                    sent += 1
                    if sent % 100 == 0:
                        await trio.sleep(0.005)
            stopped = await next_event(events, "stopped")
            assert stopped.stop is not None and "cannot write" in stopped.stop.reason
            journal = server.journal
            assert journal is not None and journal.write_errors > 0
            completed = p.statistics().completed
            assert completed < sent
            ballast.unlink()  # the operator frees space: the same batch is retried and lands
            await next_event(events, "resumed")
            await p.flush(timeout=20)
            assert p.statistics().completed == sent
    async with broker(tmpfs) as server:  # every completed message is on disk, once
        assert server.core.queues["d"].count == sent
        async with await fb.connect(url(server)) as conn:
            got = await drain(conn, "d", sent)
        assert all(body == BODY for body, _ in got)


async def test_a_producer_waiting_on_a_write_that_fails_is_told_which_queue_holds_it(tmpfs: Path) -> None:
    """Its transfers are in the batch that cannot be written: FLOW_STOPPED comes now, not with a next
    transfer it may never send, so its flush() timeout names the queue (client.md, rule 1)."""
    async with broker(tmpfs, segment_size=8 * 1024 * 1024, disk_free_limit=0) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("d", durable=True)
            p = conn.producer(routing_key="d")
            await p.send(BODY)
            await p.flush(timeout=10)  # the journal's segment exists and took a commit
            ballast = tmpfs / "ballast"
            fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
            try:
                with pytest.raises(OSError):
                    while True:  # until the disk is full
                        os.write(fd, b"\0" * 65536)
            finally:
                os.close(fd)
            events = conn.flow_events()
            for _ in range(20):
                await p.send(BODY)
            with pytest.raises(fb.FlowControlTimeout) as waited:
                await p.flush(timeout=3)
            assert tuple(waited.value.destinations) == ("d",), waited.value
            stopped = await next_event(events, "stopped")
            assert stopped.destination == "d" and stopped.stop is not None and stopped.stop.threshold == "disk"
            ballast.unlink()
            await next_event(events, "resumed")
            await p.flush(timeout=20)
            assert p.statistics().completed == 21
