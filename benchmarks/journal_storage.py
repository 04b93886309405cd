"""The journal's storage, chosen by measurement: flowbroker's segment log against SQLite in WAL mode, both
making every group commit durable (fsync / synchronous=FULL) on the same disk, in the same run.

For each group size (records per commit) it writes `--records` message records of `--size` bytes and prints
records/s and commits/s. The segment log is broker/journal.py itself (`Journal.write_batch` on batches
built by its appends); SQLite is a table (queue id, offset, body) with one transaction per group. LMDB is not
measured: no lmdb binding is installed here.

    python benchmarks/journal_storage.py [--records 20000] [--size 1024] [--dir DIR]

Without --dir it writes under a temporary directory (flowbroker-storage-*) and removes it at the end;
with --dir it writes under DIR and leaves what it wrote there.

    python benchmarks/journal_storage.py --roll 1000,10000,31000

instead prints the CPU a segment roll costs the trio thread (`Journal._roll`: the new segment's snapshot)
beside N durable queues, each bound to a topic exchange, one of them taking 100 messages between rolls
(median, min and max of 9 rolls, the first roll after the declarations apart: it joins what they changed).
Nothing is written to disk.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.journal import Journal
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.message import Message
from flowbroker.broker.recovery import topology_records
from flowbroker.broker.store import MemoryStore, QueueStore


def segment_log(directory: Path, records: int, size: int, group: int) -> float:
    journal = Journal(directory, 64 * 1024 * 1024, True, 0, 0)
    journal.dormant = False
    journal._roll()
    store = JournalStore(journal, 1)
    body = b"x" * size
    start = time.perf_counter()
    for i in range(records):
        msg = Message("", "q", body, None, size + 512)
        msg.offset = i
        journal.message(store, msg)
        if (i + 1) % group == 0:
            journal.write_batch(journal.take_batch())
    if journal.pending:
        journal.write_batch(journal.take_batch())
    elapsed = time.perf_counter() - start
    journal.close()
    return elapsed


def sqlite_wal(directory: Path, records: int, size: int, group: int) -> float:
    directory.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(directory / "journal.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE messages (qid INTEGER, offset INTEGER, body BLOB, PRIMARY KEY (qid, offset))")
    body = b"x" * size
    start = time.perf_counter()
    for first in range(0, records, group):
        db.execute("BEGIN")
        db.executemany("INSERT INTO messages VALUES (1, ?, ?)",
                       ((i, body) for i in range(first, min(records, first + group))))
        db.execute("COMMIT")
    elapsed = time.perf_counter() - start
    db.close()
    return elapsed


def roll_cost(queues: int, directory: Path) -> None:
    config = load_config(None, {"server": {"max_queues": queues + 10, "max_bindings": queues + 10,
                                           "memory_quota": 1 << 32}})
    core = BrokerCore(config, time.monotonic_ns)
    journal = Journal(directory, 64 * 1024 * 1024, False, 0, 0)
    journal.topology = lambda: topology_records(core)  # as broker/journalshell.py wires it
    core.journal = journal

    def store_factory(name: str, durable: bool) -> QueueStore:
        return JournalStore(journal, journal.new_queue_id()) if durable else MemoryStore()

    core.store_factory = store_factory
    exchange = core.exchanges["amq.topic"]
    for i in range(queues):
        queue = core.declare_queue(f"durable-queue-{i:06d}", {"flow_stop_count": 5000}, True)
        key = f"orders.region{i}.#"
        exchange.bind(queue, key)
        core._journal_binding(exchange, queue, key, True)
        if i % 1000 == 0:
            journal.take_batch()  # (dropped: nothing is written)
    busy = core.queues["durable-queue-000000"]
    first = 0.0
    cpu: list[float] = []
    for i in range(10):
        journal.take_batch()
        for _ in range(100):
            busy.add(Message("", busy.name, b"x" * 100, None, 612), None, 0)
        start = time.thread_time()
        journal._roll()
        elapsed = (time.thread_time() - start) * 1000
        if i == 0:
            first = elapsed
        else:
            cpu.append(elapsed)
    cpu.sort()
    print(f"{queues:>7,} durable queues and bindings: a roll {cpu[len(cpu) // 2]:.2f} ms CPU (min {cpu[0]:.2f}, "
          f"max {cpu[-1]:.2f}); the first after the declarations {first:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write, kept afterwards [default: a temporary directory, removed at the end]")
    parser.add_argument("--roll", default=None, metavar="N,N,...",
                        help="print a segment roll's CPU beside N durable queues and bindings instead")
    args = parser.parse_args()
    if args.roll is not None:
        for n in args.roll.split(","):
            roll_cost(int(n), Path(tempfile.gettempdir()) / "flowbroker-roll-unused")
        return
    if args.dir is not None:
        run(args.dir, args.records, args.size)
        return
    with tempfile.TemporaryDirectory(prefix="flowbroker-storage-") as tmp:
        run(Path(tmp), args.records, args.size)


def run(base: Path, records_wanted: int, size: int) -> None:
    print(f"{records_wanted:,} records of {size} B, every commit fsynced, under {base}")
    for group in (1, 10, 100, 1000):
        records = min(records_wanted, 500 * group)  # one fsync per record is slow: fewer of them
        for name, fn in (("segment log", segment_log), ("SQLite WAL ", sqlite_wal)):
            elapsed = fn(base / f"{name.strip().replace(' ', '-')}-{group}", records, size, group)
            commits = -(-records // group)
            print(f"group of {group:>4}: {name}: {records / elapsed:>9,.0f} records/s, "
                  f"{commits / elapsed:>6,.0f} commits/s")


if __name__ == "__main__":
    main()
