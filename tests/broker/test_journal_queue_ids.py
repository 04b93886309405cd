"""A queue id is not handed out again after a restart (docs/storage.md): the id of the newest durable queue,
deleted before the restart, went to the next one declared after it, and the journal held QUEUE records of
two queues under one id (a tester)."""

from __future__ import annotations

from pathlib import Path

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
