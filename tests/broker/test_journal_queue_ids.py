"""A queue id is not handed out again after a restart (docs/storage.md): the id of the newest durable queue,
deleted before the restart, went to the next one declared after it, and the journal held QUEUE records of
two queues under one id (a tester)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.broker.journalharness import Broker


def qid(b: Broker, name: str) -> int:
    return int(getattr(b.core.queues[name].store, "qid"))


def test_a_deleted_queues_id_is_not_reused_after_a_restart(tmp_path: Path) -> None:
    first = Broker(tmp_path / "journal")
    first.core.declare_queue("A", None, True)
    first.core.declare_queue("B", None, True)
    deleted = qid(first, "B")
    first.core.delete_queue("B")
    first.commit()
    restarted = Broker(tmp_path / "journal")
    restarted.restore()
    assert "B" not in restarted.core.queues and "A" in restarted.core.queues
    restarted.core.declare_queue("C", None, True)
    assert qid(restarted, "C") > deleted


def test_a_deletion_when_the_segment_is_full_is_not_taken_for_a_cut_at_recovery(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The record rolled the segment after the kept snapshot had dropped the queue: the new segment opened
    without it and then said QUEUE_DELETED, and recovery warned "its deletion record was cut away" at every
    restart, though nothing was cut (a tester). The segment now rolls first."""
    b = Broker(tmp_path / "journal", segment_size=64 * 1024)
    for name in ("keep", "victim", "other"):
        b.core.declare_queue(name, None, True)
    b.exchange("ex", "fanout")
    pin = b.h.producer("pin", fences=True)  # an unsettled message keeps the first segment from compaction
    pin.register()
    pin.pump()
    pin.send("", "keep", b"pinned")
    b.commit()
    for kind, name in (("queue", "victim"), ("exchange", "ex")):
        b.journal.seg_bytes = b.journal.segment_size  # the active segment is full: the next record rolls
        if kind == "queue":
            b.core.delete_queue(name)
        else:
            b.core.delete_exchange(name)
        b.commit()
    restarted = Broker(tmp_path / "journal")
    restarted.restore()
    assert "victim" not in restarted.core.queues and "ex" not in restarted.core.exchanges
    assert set(restarted.core.queues) >= {"keep", "other"}
    assert not [r for r in caplog.records if "cut away" in r.getMessage()], [r.getMessage() for r in caplog.records]


def test_recovery_drops_the_bindings_of_deleted_queues_and_exchanges_and_keeps_later_ones(tmp_path: Path) -> None:
    """Recovery drops a deletion's bindings once, at the end, by record order (a walk over every binding at
    each deletion record made 5,000 deletions beside 5,000 bound queues 0.9 s, growing with the square):
    what was bound after a deletion, to an exchange declared again, stays."""
    b = Broker(tmp_path / "journal")
    for name in ("a", "b", "c"):
        b.core.declare_queue(name, None, True)
    b.exchange("ex", "direct")
    b.bind("a", "ex", "k")
    b.bind("b", "ex", "k")
    b.bind("c", "amq.topic", "t.#")
    b.core.delete_queue("a")  # its binding goes with it
    b.core.delete_exchange("ex")  # and b's with the exchange...
    b.exchange("ex", "direct")
    b.bind("b", "ex", "k2")  # ...but not the one made after it was declared again
    b.commit()
    restarted = Broker(tmp_path / "journal")
    restarted.restore()
    ex = restarted.core.exchanges["ex"]
    assert {k: sorted(q.name for q in qs) for k, qs in ex.bindings.items()} == {"k2": ["b"]}
    assert [q.name for q in restarted.core.exchanges["amq.topic"].bindings["t.#"]] == ["c"]
    assert "a" not in restarted.core.queues
