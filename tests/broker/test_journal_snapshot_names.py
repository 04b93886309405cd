"""The journal's snapshot keeps each durable queue's QUEUE record encoded once, not its bytes before and after
the next offset beside it: those held the queue's name encoded a second time, 1.3 KiB a queue more for a
255-emoji name (a durable queue with such a name cost 10.1 KiB of RSS, a tester; docs/architecture.md,
"Bounded everything"). A roll still re-encodes the record of a queue that took messages around its new next
offset, and recovery reads it back whole."""

from __future__ import annotations

import tracemalloc

from flowbroker.broker.journal import Snapshot
from flowbroker.broker.journalrecord import QUEUE, pack, scan

QUEUES = 200


def name(i: int) -> str:
    return f"{i:06d}" + "\U0001f600" * 249  # 255 characters, 1,002 bytes of UTF-8


def record(i: int, next_offset: int) -> list[object]:
    return [QUEUE, i, name(i), {"max_count": 1000, "overflow": "drop-head"}, next_offset, "alice"]


def test_a_durable_queue_record_holds_its_name_encoded_once() -> None:
    records = [record(i, 0) for i in range(QUEUES)]
    for r in records:  # the name's UTF-8, which CPython caches in the string at its first encoding (a declare's
        pack(r[2])  # answer, a DELIVER): the queue's, not the snapshot's, so made outside the measure
    snapshot = Snapshot([])
    snapshot.queue(record(QUEUES, 0))  # the dicts' first growth, outside the measure
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sizes = [len(snapshot.queue(r)) for r in records]
        kept = (tracemalloc.get_traced_memory()[0] - before) / QUEUES
    finally:
        tracemalloc.stop()
    encoded = sum(sizes) / QUEUES  # 1,056 bytes: kept 1,345 a queue with the dicts' entries (2,394 before)
    assert kept < encoded + 512, (kept, encoded)


def test_a_queue_that_took_messages_is_recorded_with_its_new_next_offset_around_the_same_bytes() -> None:
    snapshot = Snapshot([record(i, 0) for i in range(3)])
    for moved in ({1: 5}, {1: 70_000, 2: 2**40}, {1: 70_001}):  # (the packed offset grows from 1 to 5 and 9 bytes)
        data, count = snapshot.encoded(moved)
        got = scan(bytes(data))
        assert got.error is None and len(got.records) == count
        latest = {r[1]: r for r in got.records}  # QUEUE records are upserts: the last of a queue wins
        expected = {0: 0, 1: moved[1], 2: moved.get(2, latest[2][4])}
        assert {qid: r[4] for qid, r in latest.items()} == expected
        assert all(r == record(qid, expected[qid]) for qid, r in latest.items())
