"""The journal's storage, chosen by measurement: flowbroker's segment log against SQLite in WAL mode, both
making every group commit durable (fsync / synchronous=FULL) on the same disk, in the same run.

For each group size (records per commit) it writes `--records` message records of `--size` bytes and prints
records/s and commits/s. The segment log is broker/journal.py itself (`Journal.write_batch` on batches
built by its appends); SQLite is a table (queue id, offset, body) with one transaction per group. LMDB is not
measured: no lmdb binding is installed here.

    python benchmarks/journal_storage.py [--records 20000] [--size 1024] [--dir DIR]

Without --dir it writes under a temporary directory (flowbroker-storage-*) and removes it at the end;
with --dir it writes under DIR and leaves what it wrote there.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

from flowbroker.broker.journal import Journal
from flowbroker.broker.message import Message


def segment_log(directory: Path, records: int, size: int, group: int) -> float:
    journal = Journal(directory, 64 * 1024 * 1024, True, 0, 0)
    journal.dormant = False
    journal._roll()
    body = b"x" * size
    start = time.perf_counter()
    for i in range(records):
        msg = Message("", "q", body, None, size + 512)
        msg.offset = i
        journal.message(1, msg)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write, kept afterwards [default: a temporary directory, removed at the end]")
    args = parser.parse_args()
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
