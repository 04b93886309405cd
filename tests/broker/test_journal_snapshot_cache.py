"""A segment roll opens the new segment with a snapshot of the durable topology. It was built on the trio
thread by walking every durable queue and binding and encoding each (about 5 us apiece: 160-178 ms of CPU
per roll beside 31,000 of each, every 2.2 s under a 20 MiB/s durable producer, a tester); it is now kept
encoded as the declarations change (`journal.Snapshot`). These check that a roll no longer walks the
topology, and that the kept snapshot is exactly what walking it gives, through declarations, bindings,
deletions, threshold changes, messages, rolls, compaction and a restart."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from flowbroker.broker.journal import Journal, segment_name
from flowbroker.broker.journalrecord import BIND, EXCHANGE, PRODUCERS, QUEUE, scan
from flowbroker.broker.recovery import topology_records

from tests.broker.journalharness import Broker


def state(records: list[list[Any]]) -> tuple[dict[int, tuple[Any, ...]], list[tuple[Any, ...]], set[tuple[Any, ...]]]:
    """What recovery takes from snapshot records: queues by id in first-listed order (QUEUE records are
    upserts, the higher next offset wins), exchanges in order, bindings."""
    queues: dict[int, tuple[Any, ...]] = {}
    exchanges: list[tuple[Any, ...]] = []
    bindings: set[tuple[Any, ...]] = set()
    for r in records:
        if r[0] == QUEUE:
            old = queues.get(r[1])
            queues[r[1]] = (r[2], r[3], max(r[4], old[2]) if old else r[4], r[5])
        elif r[0] == EXCHANGE:
            exchanges.append((r[1], r[2]))
        elif r[0] == BIND:
            bindings.add((r[1], r[2], r[3]))
    return queues, exchanges, bindings


def newest_snapshot(journal: Journal) -> list[list[Any]]:
    """The records the newest segment on disk opens with, up to the PRODUCERS record that ends them."""
    path = journal.dir / segment_name(journal.active_seg)
    records = scan(path.read_bytes()).records
    end = next(i for i, r in enumerate(records) if r[0] == PRODUCERS)
    return records[:end]


def roll(broker: Broker) -> None:
    broker.journal._roll()
    broker.commit()


def test_a_roll_does_not_walk_the_topology_and_costs_the_same_beside_20000_durable_queues(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "journal")
    core = broker.core
    broker.exchange("orders", "topic")
    queues = [core.declare_queue(f"durable-queue-{i:06d}", {"flow_stop_count": 5000}, True) for i in range(20_000)]
    for i, queue in enumerate(queues):
        broker.bind(queue.name, "orders", f"orders.region{i}.#")
    broker.commit()
    assert broker.walks == 1  # once, when the first durable queue woke the journal
    busy = queues[0]
    roll(broker)  # (joins the blocks the declarations left to join)
    cpu: list[float] = []
    for _ in range(5):
        broker.send(busy, 100)
        t0 = time.thread_time()
        broker.journal._roll()
        cpu.append(time.thread_time() - t0)
        broker.commit()
    assert broker.walks == 1
    cpu.sort()
    # walking and encoding them took ~100 ms a roll here; joining kept bytes takes well under 1 ms
    assert cpu[2] < 0.030, cpu
    assert state(newest_snapshot(broker.journal)) == state(topology_records(core))
    assert state(newest_snapshot(broker.journal))[0][busy.store.qid][2] == busy.next_offset == 500  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_snapshot_is_what_walking_the_topology_gives_through_random_changes(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    broker = Broker(tmp_path / "journal", segment_size=4096)
    core = broker.core
    exchanges = ["ex-a", "ex-b", "ex-c"]
    kinds = {"ex-a": "direct", "ex-b": "fanout", "ex-c": "topic"}
    names = [f"q{i}" for i in range(12)]
    for step in range(600):
        action = rng.randrange(10)
        name = rng.choice(names)
        queue = core.queues.get(name)
        if action == 0 and queue is None:
            core.declare_queue(name, {"flow_stop_count": rng.randrange(10, 100)} if rng.random() < 0.5 else None,
                               durable=rng.random() < 0.7)
        elif action == 1 and queue is not None:
            core.delete_queue(name)
        elif action == 2:
            ex = rng.choice(exchanges)
            if ex in core.exchanges:
                core.delete_exchange(ex)
            else:
                broker.exchange(ex, kinds[ex])
        elif action in (3, 4) and queue is not None:
            ex = rng.choice(exchanges + ["amq.direct", "amq.fanout"])
            if ex in core.exchanges:
                broker.bind(name, ex, rng.choice(["", "k1", "k2"]), bound=action == 3)
        elif action == 5 and queue is not None:
            core.set_queue_thresholds(name, {"flow_stop_count": rng.randrange(10, 100)})
        elif action in (6, 7) and queue is not None:
            broker.send(queue, rng.randrange(1, 30), rng.randrange(0, 200))
        elif action == 8 and queue is not None:
            broker.settle_all(queue)
        elif action == 9:
            broker.commit()
        if not broker.journal.dormant and rng.random() < 0.1:
            roll(broker)
            assert state(newest_snapshot(broker.journal)) == state(topology_records(core)), step
    if broker.journal.dormant:
        return
    roll(broker)
    before = state(topology_records(core))
    assert state(newest_snapshot(broker.journal)) == before
    # a restart (what a kill -9 leaves: everything committed) recovers the same topology and offsets
    broker.journal.close()
    shutil.copytree(tmp_path / "journal", tmp_path / "copy")
    again = Broker(tmp_path / "copy")
    again.restore()
    assert state(topology_records(again.core)) == before
    for name, queue in core.queues.items():
        if queue.durable:
            assert again.core.queues[name].next_offset == queue.next_offset
