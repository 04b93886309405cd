"""Durable queues across restarts of a real broker (BrokerServer over TCP, in process): what the journal
keeps, what completion waits for, what recovery rebuilds, and what it cuts.

A "crash" here is a copy of the data directory taken while the first broker runs: exactly the bytes a
kill -9 would leave (what the broker wrote is in the kernel's page cache, which a killed process does not
take with it). The subprocess crash loop (tests/e2e/test_e2e_durable_crash.py) kills real brokers.
"""

from __future__ import annotations

import logging
import shutil
import threading
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import trio

import flowbroker.client as fb
from flowbroker.broker import views
from flowbroker.broker.idempotence import scoped
from flowbroker.broker.journal import Journal, segment_name
from flowbroker.broker.journalrecord import MESSAGE, QUEUE, encode
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.message import Message
from flowbroker.broker.recovery import read_journal
from flowbroker.broker.server import BrokerServer

from tests.serving import serving, url


def broker(data_dir: Path, **storage: Any) -> AbstractAsyncContextManager[BrokerServer]:
    return serving(storage={"data_dir": str(data_dir), **storage})


async def drain(conn: fb.Connection, queue: str, count: int, ack: bool = True) -> list[tuple[bytes, bool]]:
    got: list[tuple[bytes, bool]] = []
    if count == 0:
        return got
    async with conn.consumer(queue, prefetch=count) as consumer:
        while len(got) < count:
            msg = await consumer.receive(timeout=10)
            got.append((msg.body, msg.redelivered))
            if ack:
                await msg.ack()
    return got


async def test_durable_topology_and_messages_survive_a_restart_and_memory_queues_do_not(tmp_path: Path) -> None:
    async with broker(tmp_path) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("kept", durable=True, flow_stop_count=5000)
            await conn.declare_queue("lost")
            await conn.declare_exchange("events", "topic")
            await conn.bind("kept", "events", "order.*")
            p = conn.producer("events", "order.new")
            for i in range(100):
                await p.send(b"e%d" % i)
            await p.flush(timeout=10)
            direct = conn.producer(routing_key="lost")
            await direct.send(b"gone")
            await direct.flush(timeout=10)
            # 10 acked (gone for good), 5 delivered and never settled (come back redelivered)
            assert await drain(conn, "kept", 10) == [(b"e%d" % i, False) for i in range(10)]
            async with conn.consumer("kept", prefetch=5) as consumer:
                for _ in range(5):
                    await consumer.receive(timeout=10)
                journal = server.journal
                assert journal is not None
                # wait until the delivery records are committed, then "crash" with the consumer attached
                with trio.fail_after(10):
                    while journal.pending:
                        await trio.sleep(0.01)
                    await trio.sleep(0.05)
                shutil.copytree(tmp_path / "journal", tmp_path / "crash" / "journal")
    async with broker(tmp_path / "crash") as server:
        core = server.core
        assert "lost" not in core.queues
        queue = core.queues["kept"]
        assert queue.durable and queue.count == 90 and queue.thresholds.flow_stop_count == 5000
        assert core.exchanges["events"].kind.value == "topic"
        async with await fb.connect(url(server)) as conn:
            p = conn.producer("events", "order.new")  # the binding came back
            await p.send(b"after")
            await p.flush(timeout=10)
            got = await drain(conn, "kept", 91)
        assert [b for b, _ in got] == [b"e%d" % i for i in range(10, 100)] + [b"after"]
        # The 5 left unsettled come back flagged; so may a few the first consumer had prefetched after
        # its last ack and gave back when it left (delivered is delivered); never one not delivered.
        flags = [r for _, r in got]
        delivered = flags.index(False)
        assert 5 <= delivered <= 20 and not any(flags[delivered:])
        assert queue.next_offset == 101  # offsets continue past the recovered ones


async def test_a_durable_transfer_completes_only_when_its_commit_returns(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = Journal.write_batch

    def slow_write(self: Journal, batch: Any) -> None:
        gate.wait(20)
        real(self, batch)

    async with broker(tmp_path) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("fast")
            fast = conn.producer(routing_key="fast")
            monkeypatch.setattr(Journal, "write_batch", slow_write)
            await conn.declare_queue("d", durable=True)
            p = conn.producer(routing_key="d")
            for i in range(50):
                await p.send(b"%d" % i)
            await fast.send(b"memory-only")
            await fast.flush(timeout=5)  # the memory-only path does not wait for the disk
            with pytest.raises(fb.FlowControlTimeout):
                await p.flush(timeout=0.5)
            assert p.statistics().completed == 0
            assert server.core.queues["d"].count == 50  # enqueued (and deliverable), not complete
            gate.set()
            await p.flush(timeout=10)
            journal = server.journal
            assert journal is not None
            # group commit: 50 messages in far fewer fsyncs than messages
            assert 1 <= journal.fsyncs <= 10 and journal.commits <= 10
            view = views.broker_view(server.core)["journal"]
            assert view["awake"] and view["fsyncs"] == journal.fsyncs and view["disk_alarm"] is None
            assert view["directory"] == str(tmp_path / "journal") and view["segments"] >= 1


async def test_a_torn_and_a_corrupt_record_are_cut_off_logged_and_the_broker_starts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "journal"
    directory.mkdir()
    good = [encode([QUEUE, 1, "q", {}, 0])]
    good += [encode([MESSAGE, 1, i, "", "q", b"m%d" % i, None, 514, None, None]) for i in range(5)]
    # segment 1: intact records, then a record torn mid-write
    torn = encode([MESSAGE, 1, 5, "", "q", b"torn", None, 516, None, None])
    (directory / segment_name(1)).write_bytes(b"".join(good) + torn[:-3])
    # segment 2: one good message, one with a flipped bit, one good after it (untrusted: cut too)
    corrupt = bytearray(encode([MESSAGE, 1, 7, "", "q", b"bad", None, 515, None, None]))
    corrupt[-1] ^= 0x10
    seg2 = (encode([MESSAGE, 1, 6, "", "q", b"m6", None, 514, None, None]) + bytes(corrupt)
            + encode([MESSAGE, 1, 8, "", "q", b"after", None, 517, None, None]))
    (directory / segment_name(2)).write_bytes(seg2)
    caplog.set_level(logging.ERROR, "flowbroker.journal")
    async with broker(tmp_path) as server:
        assert (directory / segment_name(1)).stat().st_size == sum(len(g) for g in good)
        assert (directory / segment_name(2)).stat().st_size == len(seg2) - len(corrupt) - len(encode(
            [MESSAGE, 1, 8, "", "q", b"after", None, 517, None, None]))
        async with await fb.connect(url(server)) as conn:
            got = await drain(conn, "q", 6)
    assert [b for b, _ in got] == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m6"]
    text = caplog.text
    assert "torn record" in text and "checksum mismatch" in text and "cut at byte" in text


async def test_a_segment_missing_between_others_is_logged_as_a_loss(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Compaction removes only the oldest segments: a gap was a file deleted or lost, and the messages in it
    are gone. It was counted only in the INFO line (a tester: 1,116 confirmed messages, no ERROR)."""
    directory = tmp_path / "journal"
    directory.mkdir()
    (directory / segment_name(1)).write_bytes(
        encode([QUEUE, 1, "q", {}, 0]) + encode([MESSAGE, 1, 0, "", "q", b"m0", None, 514, None, None]))
    (directory / segment_name(4)).write_bytes(encode([MESSAGE, 1, 3, "", "q", b"m3", None, 514, None, None]))
    (directory / segment_name(6)).write_bytes(encode([MESSAGE, 1, 5, "", "q", b"m5", None, 514, None, None]))
    caplog.set_level(logging.ERROR, "flowbroker.journal")
    async with broker(tmp_path) as server:
        assert server.core.queues["q"].count == 3
    text = caplog.text
    assert f"{segment_name(2)} to {segment_name(3)}: missing between {segment_name(1)} and {segment_name(4)}" in text
    assert f"{segment_name(5)}: missing between {segment_name(4)} and {segment_name(6)}" in text
    assert "is lost" in text


async def test_recovered_messages_count_against_the_watermarks(tmp_path: Path) -> None:
    async with broker(tmp_path) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("d", durable=True, flow_stop_count=10, flow_resume_count=5)
            p = conn.producer(routing_key="d")
            for i in range(10):
                await p.send(b"%d" % i)
            await p.flush(timeout=10)
    async with broker(tmp_path) as server:
        queue = server.core.queues["d"]
        assert queue.count == 10 and not queue.saturated
        async with await fb.connect(url(server)) as conn:
            events = conn.flow_events()
            p = conn.producer(routing_key="d")
            await p.send(b"one too many")
            with pytest.raises(fb.FlowControlTimeout):
                await p.flush(timeout=0.5)  # held by the recovered depth
            assert queue.saturated
            with trio.fail_after(5):
                event = await events.get()
            assert event is not None and event.destination == "d"
            await drain(conn, "d", 11)
            await p.flush(timeout=10)


async def test_settled_segments_are_deleted_so_the_journal_stays_small(tmp_path: Path) -> None:
    async with broker(tmp_path, segment_size=64 * 1024) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("d", durable=True)
            p = conn.producer(routing_key="d")
            body = b"x" * 1024
            for _ in range(5):
                for _ in range(500):
                    await p.send(body)
                await p.flush(timeout=10)
                await drain(conn, "d", 500)
            await p.send(b"barrier")  # its commit carries every settlement before it
            await p.flush(timeout=10)
            journal = server.journal
            assert journal is not None
            assert journal.segments_deleted >= 20  # 2.5 MiB went through 64 KiB segments
            on_disk = sum(f.stat().st_size for f in (tmp_path / "journal").iterdir())
            assert on_disk < 4 * 64 * 1024
    async with broker(tmp_path) as server:
        assert server.core.queues["d"].count == 1


def test_the_journal_keeps_each_producer_ids_highest_sequence_for_idempotent_producers(tmp_path: Path) -> None:
    """The seam for idempotent producers: recovery hands the core each producer id's highest sequence
    journalled, even once its messages are settled and their segments compacted (the snapshot a new
    segment opens with carries it)."""
    journal = Journal(tmp_path / "journal", 64 * 1024, True, 0, 0)
    store = JournalStore(journal, journal.new_queue_id())
    journal.dormant = False
    journal._roll()
    for seq in range(3):
        msg = Message("", "q", b"x" * 40_000, None, 40_512, "p-1", seq)
        msg.offset = seq
        store.append(msg)
    journal.write_batch(journal.take_batch())
    for seq in range(3):  # all settled: the first segments go
        msg = Message("", "q", b"", None, 512, "p-1", seq)
        msg.offset = seq
        store.settle(msg)
    journal.record([QUEUE, 1, "q", {}, 3])  # rolls over: the new segment's snapshot has the producers
    journal.record([QUEUE, 1, "q", {}, 3])
    journal.write_batch(journal.take_batch())
    journal.write_batch(journal.take_batch())
    journal.close()
    assert not (tmp_path / "journal" / segment_name(1)).exists()
    assert read_journal(journal).producers == {"p-1": 2}


def test_a_producer_id_forgotten_stays_forgotten_after_a_restart(tmp_path: Path) -> None:
    """Forgotten after producer_id_ttl, an id came back at the next start from its messages' records (still
    on disk, unsettled), and a new stream under it was taken for duplicates of the old one: 10 messages
    completed and none enqueued (a tester). The forget is journalled; a message after it counts again."""
    journal = Journal(tmp_path / "journal", 1 << 20, True, 0, 0)
    store = JournalStore(journal, journal.new_queue_id())
    journal.dormant = False
    journal._roll()
    for seq in range(3):
        msg = Message("", "q", b"x", None, 513, "nightly", seq)
        msg.offset = seq
        store.append(msg)
        msg = Message("", "q", b"x", None, 513, "other", seq)
        msg.offset = 3 + seq
        store.append(msg)
    journal.producer_forgotten("nightly")
    journal.write_batch(journal.take_batch())
    assert read_journal(journal).producers == {"other": 2}  # (read while written: as at a kill -9)
    msg = Message("", "q", b"x", None, 513, "nightly", 0)  # the next run, from 0
    msg.offset = 6
    store.append(msg)
    journal.write_batch(journal.take_batch())
    journal.close()
    assert read_journal(journal).producers == {"other": 2, "nightly": 0}


def test_a_batch_whose_write_fails_in_its_second_segment_leaves_nothing_of_it_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit spanning two segments wrote the first and failed in the second (ENOSPC): the first
    chunk stayed, was replayed at recovery, and 74 of 200 messages a producer was told were not
    completed came back (a tester, after a stop with the disk full). Now the batch is cut back whole;
    the retry writes it all once."""
    import errno
    import os as real_os

    import flowbroker.broker.journal as journal_module

    journal = Journal(tmp_path / "journal", 64 * 1024, False, 0, 0)
    store = JournalStore(journal, journal.new_queue_id())
    journal.dormant = False
    journal._roll()
    journal.record([QUEUE, store.qid, "q", {}, 0])
    for seq in range(3):  # 120 KB: the batch rolls into a second segment
        msg = Message("", "q", b"x" * 40_000, None, 40_512, None, None)
        msg.offset = seq
        store.append(msg)
    batch = journal.take_batch()
    assert len({seg for seg, _ in batch.chunks}) == 2
    second = max(seg for seg, _ in batch.chunks)
    full = {"on": True}

    class FailingOs:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_os, name)

        def write(self, fd: int, data: Any) -> int:
            if full["on"] and journal._fd_seg == second:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_os.write(fd, data)

    monkeypatch.setattr(journal_module, "os", FailingOs())
    with pytest.raises(OSError):
        journal.write_batch(batch)
    assert sum(f.stat().st_size for f in (tmp_path / "journal").iterdir()) == 0
    # and no empty file of a segment the batch created: recovery takes one for a segment emptied, its
    # messages lost (one ERROR each after a disk-full, a tester)
    assert not list((tmp_path / "journal").iterdir())
    full["on"] = False  # space again: the retry writes the whole batch, each record once
    journal.write_batch(batch)
    journal.close()
    on_disk = sum(f.stat().st_size for f in (tmp_path / "journal").iterdir())
    assert on_disk == sum(len(data) for _, data in batch.chunks)  # each chunk once, none twice


async def test_an_idempotent_producer_resending_after_a_restart_is_deduplicated(tmp_path: Path) -> None:
    """The producer ids' sequences come back with the durable messages: a producer that sends its stream
    again from sequence 0 to a restarted broker lands only what the broker did not have."""
    async with broker(tmp_path) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("d", durable=True)
            p = conn.producer(routing_key="d", producer_id="loader-1", idempotent=True)
            for i in range(10):
                await p.send(b"%d" % i)
            await p.flush(timeout=10)
    async with broker(tmp_path) as server:
        assert server.core.producer_sequences.store.last_accepted(scoped("guest", "loader-1")) == 9
        async with await fb.connect(url(server)) as conn:
            p = conn.producer(routing_key="d", producer_id="loader-1", idempotent=True)
            for i in range(15):  # the same stream again, and 5 more
                await p.send(b"%d" % i)
            await p.flush(timeout=10)
            assert server.core.queues["d"].count == 15
            got = await drain(conn, "d", 15)
        assert [b for b, _ in got] == [b"%d" % i for i in range(15)]


async def test_a_duplicate_does_not_complete_before_its_original_is_on_disk(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = Journal.write_batch

    def slow_write(self: Journal, batch: Any) -> None:
        gate.wait(20)
        real(self, batch)

    async with broker(tmp_path) as server:
        async with await fb.connect(url(server)) as first, await fb.connect(url(server)) as second:
            await first.declare_queue("d", durable=True)
            monkeypatch.setattr(Journal, "write_batch", slow_write)
            original = first.producer(routing_key="d", producer_id="p", idempotent=True)
            for i in range(5):
                await original.send(b"%d" % i)
            with trio.fail_after(5):
                while server.core.queues["d"].count < 5:
                    await trio.sleep(0.01)
            # (a new connection may send one message before its first grant: one duplicate is enough)
            again = second.producer(routing_key="d", producer_id="p", idempotent=True)
            await again.send(b"0")
            with trio.fail_after(5):
                while sum(s.duplicates for s in server.core.sessions.values()) < 1:
                    await trio.sleep(0.01)
            with pytest.raises(fb.FlowControlTimeout):
                await again.flush(timeout=0.5)  # the duplicates wait for the originals' commit
            gate.set()
            await again.flush(timeout=10)
            await original.flush(timeout=10)
            assert server.core.queues["d"].count == 5


async def test_recorded_arguments_the_broker_refuses_recover_the_queue_with_defaults(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    directory.mkdir()
    (directory / segment_name(1)).write_bytes(
        encode([QUEUE, 1, "q", {"no_such_argument": 1}, 0])
        + encode([MESSAGE, 1, 0, "", "q", b"kept", None, 516, None, None]))
    async with broker(tmp_path) as server:
        assert server.core.queues["q"].count == 1
        async with await fb.connect(url(server)) as conn:
            assert await drain(conn, "q", 1) == [(b"kept", False)]


async def test_fsync_never_writes_without_syncing_and_still_recovers(tmp_path: Path) -> None:
    async with broker(tmp_path, fsync="never") as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("d", durable=True)
            p = conn.producer(routing_key="d")
            for i in range(10):
                await p.send(b"%d" % i)
            await p.flush(timeout=10)
        assert server.journal is not None and server.journal.fsyncs == 0 and server.journal.commits >= 1
    async with broker(tmp_path) as server:
        assert server.core.queues["d"].count == 10


async def test_a_durable_queue_keeps_its_time_thresholds_and_the_flow_timer_ticks_it_after_a_restart(
        tmp_path: Path) -> None:
    async with broker(tmp_path) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("t", durable=True, flow_stop_age=0.3, flow_resume_age=0.1)
            p = conn.producer(routing_key="t")
            await p.send(b"old")
            await p.flush(timeout=10)
    async with broker(tmp_path) as server:
        queue = server.core.queues["t"]
        t = queue.thresholds
        assert (t.flow_stop_age, t.flow_resume_age, t.flow_stop_drain_time) == (0.3, 0.1, 0.0)
        assert server.core.timed_queues == {"t": queue}
        with trio.fail_after(5):
            while not queue.saturated:  # the recovered message ages past 0.3 s: the flow timer sees it
                await trio.sleep(0.05)
        assert queue.stop_reason[0] == "flow_stop_age"


async def test_a_queue_deleted_before_a_cut_in_an_older_segment_stays_deleted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The deletion's record lies in the cut-away part of segment 1; segment 2's snapshot, which does
    not list the queue, is what says it is gone (it used to come back with its message)."""
    async with broker(tmp_path, segment_size=64 * 1024) as server:
        async with await fb.connect(url(server)) as conn:
            await conn.declare_queue("kept", durable=True)
            await conn.declare_queue("gone", durable=True)
            await conn.declare_exchange("old", "fanout")
            await conn.bind("gone", "old")
            await conn.producer(routing_key="gone").send(b"ghost")
            p = conn.producer(routing_key="kept")
            for _ in range(300):
                await p.send(b"a" * 100)
            await p.flush(timeout=10)
            await conn.delete_queue("gone")
            await conn.delete_exchange("old")
            for _ in range(600):  # on into segment 2
                await p.send(b"b" * 100)
            await p.flush(timeout=10)
    segments = sorted((tmp_path / "journal").glob("*.seg"))
    assert len(segments) >= 2
    data = bytearray(segments[0].read_bytes())
    data[10_000] ^= 0x01  # among the messages to "kept", before the deletions' records
    segments[0].write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, "flowbroker.journal")
    async with broker(tmp_path) as server:
        assert "gone" not in server.core.queues and "old" not in server.core.exchanges
        assert "kept" in server.core.queues
    assert "checksum mismatch" in caplog.text and "queue 'gone' is not in a later segment's snapshot" in caplog.text


@pytest.mark.parametrize("late", [False, True])
async def test_a_graceful_shutdown_completes_what_it_journals_before_it_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late: bool) -> None:
    """Shutdown stops reading, commits what was taken, sends those completions and only then CLOSE:
    what a producer was told completed is exactly what the journal kept (it used to close first, so a
    producer heard "not completed" about messages that came back after the restart). `late`: a connection
    made once the shutdown began is refused SHUTDOWN (it was read on, and its producer told "not
    completed" about messages the journal kept: a tester, 949 of 999)."""
    real = Journal.write_batch

    def slow_write(self: Journal, batch: Any) -> None:  # a commit in flight whenever the signal comes
        threading.Event().wait(0.05)
        real(self, batch)

    monkeypatch.setattr(Journal, "write_batch", slow_write)
    async with broker(tmp_path) as server:
        with pytest.raises(fb.PublishFailures):  # the block's exit reports what was sent and not completed
            async with await fb.connect(url(server)) as conn:
                await conn.declare_queue("d", durable=True)
                p = conn.producer(routing_key="d", window=10_000)
                with pytest.raises(fb.ConnectionClosed):
                    for i in range(100_000):
                        await p.send(b"%d" % i)
                        if i == 300:
                            server.shutdown()
                            if late:
                                await trio.sleep(0.01)
                                with pytest.raises(fb.HandshakeError) as refused:
                                    await fb.connect(url(server), timeout=5)
                                assert refused.value.code is fb.ErrorCode.SHUTDOWN, refused.value
                        if i % 50 == 0:
                            await trio.sleep(0)
                completed = p.statistics().completed
    assert completed > 0
    async with broker(tmp_path) as server:
        assert server.core.queues["d"].count == completed


async def test_a_graceful_shutdown_tells_a_udp_producer_what_it_journalled(tmp_path: Path) -> None:
    """A UDP producer learns its completions from status messages, not from the TCP connection that the
    shutdown closes: the broker stops taking its datagrams with the TCP readers and sends the status
    messages of the last commit before CLOSE. What it was told completed is what the journal kept (the
    last window's completions never reached it, though the journal kept them)."""
    async with serving(storage={"data_dir": str(tmp_path)}, udp={"enabled": True, "endpoint": "127.0.0.1:0"}) as server:
        with pytest.raises(fb.PublishFailures):
            async with await fb.connect(f"{url(server)}?udp=127.0.0.1:{server.udp_port}") as conn:
                await conn.declare_queue("d", durable=True, flow_stop_count=10**8, flow_stop_size=1 << 40,
                                         max_count=0, max_size=0)
                p = conn.producer(routing_key="d", transport="udp")
                with pytest.raises(fb.ConnectionClosed):
                    for i in range(200_000):
                        await p.send(b"%d" % i, timeout=10)
                        if i == 20_000:
                            server.shutdown()
                completed = p.statistics().completed
    assert completed > 0
    async with broker(tmp_path) as server:
        assert server.core.queues["d"].count == completed


@pytest.mark.parametrize("bad", [
    [3, "exX", "nonsense-kind"],  # EXCHANGE of a kind no broker makes
    [1, "qidstr", "weird", {}, 0, None],  # QUEUE whose id is a string
    [MESSAGE, 1, "off", "", "q", b"body", None, 516, None, None],  # MESSAGE whose offset is a string
])
async def test_an_intact_record_with_wrong_field_types_is_skipped_not_a_refusal_to_start(
        tmp_path: Path, bad: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """Three such records stopped the broker at start with a traceback (ValueError from ExchangeKind,
    TypeError from `qid + 1` and from sorting offsets; a tester); storage.md says it never refuses to start
    over a bad record. Each is skipped and logged, and what is around it recovered."""
    from flowbroker.broker.journalrecord import EXCHANGE

    assert EXCHANGE == 3 and QUEUE == 1
    directory = tmp_path / "journal"
    directory.mkdir()
    (directory / segment_name(1)).write_bytes(
        encode([QUEUE, 1, "q", {}, 0]) + encode(bad)
        + encode([MESSAGE, 1, 0, "", "q", b"kept", None, 516, None, None]))
    with caplog.at_level(logging.ERROR):
        async with broker(tmp_path) as server:
            assert server.core.queues["q"].count == 1 and "weird" not in server.core.queues
            assert "exX" not in server.core.exchanges
            async with await fb.connect(url(server)) as conn:
                assert await drain(conn, "q", 1) == [(b"kept", False)]
    assert "skipped a malformed record" in caplog.text
