"""The journal's trio side: recovery at start, then the committer task (group commit, the disk alarm).

One commit at a time, on a worker thread (`trio.to_thread.run_sync`): the write and the fsync never
run on the trio thread, and everything appended while one commit runs is the next one's batch. When a
commit returns, the transfers it covered complete (their producers' credit comes back then). A failed
write (the disk full, an I/O error) raises the disk alarm, so producers of durable queues are held,
and the same batch is retried every RETRY_SECONDS: nothing completed is lost and nothing crashes.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import trio

from flowbroker.broker.config import StorageConfig
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.journal import Batch, Journal
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.recovery import read_journal, restore, topology_records
from flowbroker.broker.store import MemoryStore, QueueStore
from flowbroker.protocol.frames import FlowStopped
from flowbroker.protocol.names import THRESHOLD_DISK

__all__ = ["open_journal", "run_committer", "StorageStartError", "DataDirInUse", "lock_data_dir", "RETRY_SECONDS", "LOOK_SECONDS", "FINAL_COMMIT_SECONDS"]

LOGGER = logging.getLogger("flowbroker.journal")

RETRY_SECONDS = 1.0  # a failed commit is retried this often
LOOK_SECONDS = 1.0  # free space is looked at this often while the alarm is on (and after every commit)
IDLE_LOOK_SECONDS = 5.0  # ...and this often when idle without the alarm
FINAL_COMMIT_SECONDS = 5.0  # at shutdown, what is buffered (settlements) gets this long to reach the disk


class StorageStartError(Exception):
    """The data directory cannot be used: the broker does not start, and says why naming the key."""


class DataDirInUse(StorageStartError):
    """Another broker holds the data directory's lock: this one does not start (nor read its journal)."""


LOCK_FILE = "LOCK"


def lock_data_dir(data_dir: Path) -> int:
    """Take `<data_dir>/LOCK` for this process (flock, exclusive, released by the kernel when the process
    ends however it ends) and write our pid in it; returns its descriptor, kept open for the broker's life.
    Two brokers on one data directory each recovered the journal and wrote segments of their own: after a
    kill -9 a restart lost one of them's completed messages (a tester: 1,000 of 3,000)."""
    path = data_dir / LOCK_FILE
    try:
        if data_dir.exists() and not data_dir.is_dir():  # (mkdir's own words: "File exists")
            raise StorageStartError(f"[storage] data_dir {data_dir} cannot be used: it is not a directory; give "
                                    "--data-dir or [storage] data_dir a directory this user may write")
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        journal = data_dir / "journal"
        if journal.exists() and not journal.is_dir():
            # (the journal would be made at the first durable declare, whose answer then waited for a
            # commit that could never be written, a tester)
            raise StorageStartError(f"[storage] data_dir {data_dir} cannot be used: {journal} is not a directory "
                                    "(the journal's segments go there): move it away, or give --data-dir another "
                                    "directory")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:  # reported as the client port's listen failure before (a tester)
        raise StorageStartError(f"[storage] data_dir {data_dir} cannot be used: {exc.strerror or exc} "
                                f"({exc.filename or path}); give --data-dir or [storage] data_dir a directory "
                                "this user may write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise DataDirInUse(
            f"[storage] data_dir {data_dir} is in use by another broker (pid {holder}, which holds {path}): give "
            "this one a --data-dir of its own, or stop the other first") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, b"%d\n" % os.getpid())
    return fd


async def open_journal(config: StorageConfig, core: BrokerCore) -> Journal:
    """Lock `config`'s data directory, recover from it into `core` and make the journal its durable queues'
    store. Raises StorageStartError if the directory cannot be used (DataDirInUse: another broker holds it)."""
    journal_dir = config.journal_dir()
    lock_fd = await trio.to_thread.run_sync(lock_data_dir, journal_dir.parent)
    journal = Journal(config.journal_dir(), config.segment_size, config.fsync == "always",
                      config.disk_free_limit, config.quota)
    journal.topology = lambda: topology_records(core)
    journal.lock_fd = lock_fd
    core.journal = journal

    def store_factory(name: str, durable: bool) -> QueueStore:
        return JournalStore(journal, journal.new_queue_id()) if durable else MemoryStore()

    core.store_factory = store_factory
    try:
        recovered = await trio.to_thread.run_sync(read_journal, journal)
    except OSError as exc:
        # (a directory named like a segment, one the user may not read: the CLI said the client port's listen
        # failed, "Is a directory (another broker running?)", a tester)
        journal.close()  # (and its lock)
        raise StorageStartError(f"[storage] data_dir {journal_dir.parent} cannot be used: the journal cannot be "
                                f"read: {exc.filename or journal_dir}: {exc.strerror or exc}; move that away or "
                                "let this user read and write it, or give --data-dir or [storage] data_dir "
                                "another directory") from None
    restore(core, journal, recovered)
    return journal


class _Wakeup:
    def __init__(self) -> None:
        self.event = trio.Event()

    def set(self) -> None:
        self.event.set()

    async def wait(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            await self.event.wait()
        self.event = trio.Event()


async def run_committer(journal: Journal) -> None:
    """Commit whatever is buffered, one group at a time, until cancelled; then a last commit."""
    wakeup = _Wakeup()
    journal.wake = wakeup.set
    batch: Batch | None = None
    try:
        while True:
            if batch is None:
                if not journal.pending:
                    await wakeup.wait(LOOK_SECONDS if journal.alarm is not None else IDLE_LOOK_SECONDS)
                    if not journal.pending and not journal.dormant:
                        await trio.to_thread.run_sync(journal.look_at_disk)
                        journal.set_alarm(journal.check_disk())
                    continue
                batch = journal.take_batch()
            try:
                await trio.to_thread.run_sync(journal.write_batch, batch)
            except OSError as exc:
                journal.write_failing = True
                journal.set_alarm(FlowStopped(
                    "*", THRESHOLD_DISK, 0, 0,
                    f"the journal cannot write under {journal.dir}: {exc.strerror or exc}; transfers to durable "
                    "queues are held until it can"))
                journal.tell_held(batch)
                await trio.sleep(RETRY_SECONDS)
                continue
            journal.committed(batch)
            batch = None
            journal.set_alarm(journal.check_disk())
    finally:
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + FINAL_COMMIT_SECONDS
            try:
                if batch is None and journal.pending:
                    batch = journal.take_batch()
                if batch is not None:
                    await trio.to_thread.run_sync(journal.write_batch, batch)
            except OSError as exc:
                LOGGER.error("journal: the last commit failed: %s", exc)
            journal.close()
            if not journal.dormant:  # what the benchmark reads (benchmarks/durable_throughput.py)
                LOGGER.info("journal: %d commits, %d fsyncs, %d records, %d bytes written, %d segments deleted, "
                            "%d write errors", journal.commits, journal.fsyncs, journal.records_written,
                            journal.bytes_written, journal.segments_deleted, journal.write_errors)
