"""The disk alarm against producers without flow control, in the core (no trio, no disk writes): nothing
paces them, so while the alarm is on their transfers to durable queues are refused with
RESOURCE_EXHAUSTED naming the alarm (as the memory alarm refuses theirs), rather than journalled past
the quota; memory-only queues take them, and flow-controlled producers are held as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowbroker.broker import views
from flowbroker.broker.journal import Journal
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.recovery import topology_records
from flowbroker.broker.store import MemoryStore, QueueStore
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import FlowStopped

from tests.broker.coreharness import Harness


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    """A core whose durable queues are journalled (as broker/journalshell.py wires it), with the disk
    alarm on: queue `d` durable, `m` memory-only, both bound to amq.fanout."""
    h = Harness()
    core = h.core
    journal = core.journal = Journal(tmp_path / "journal", 1 << 20, False, 0, 0)
    journal.topology = lambda: topology_records(core)

    def store_factory(name: str, durable: bool) -> QueueStore:
        return JournalStore(journal, journal.new_queue_id()) if durable else MemoryStore()

    core.store_factory = store_factory
    for name, durable in (("d", True), ("m", False)):
        core.declare_queue(name, durable=durable)
        core.exchanges["amq.fanout"].bind(core.queues[name], "")
    journal.set_alarm(FlowStopped("*", "disk", 1000, 2000, "the journal holds 2000 bytes, over its quota 1000"))
    return h


def test_an_unpaced_producer_is_refused_by_a_durable_queue_and_taken_by_a_memory_only_one(h: Harness) -> None:
    p = h.producer("legacy", flow_control=False)
    to_durable, to_memory, to_both = (p.send(exchange, key, force=True)
                                      for exchange, key in (("", "d"), ("", "m"), ("amq.fanout", "")))
    p.pump()
    refusals = [(e.ref_id, e.code, e.destination) for e in p.errors]
    assert refusals == [(to_durable, ErrorCode.RESOURCE_EXHAUSTED, "d"), (to_both, ErrorCode.RESOURCE_EXHAUSTED, "d")]
    assert "disk alarm" in p.errors[0].text and "quota 1000" in p.errors[0].text
    assert {to_durable, to_memory, to_both} <= set(p.completions)  # refused transfers complete too
    assert (h.core.queues["d"].count, h.core.queues["m"].count) == (0, 2)


def test_a_flow_controlled_producer_is_held_not_refused(h: Harness) -> None:
    p = h.producer()
    tid = p.send("", "d")
    p.pump()
    assert not p.errors and tid not in p.completions
    assert p.stopped["d"].threshold == "disk"
    assert h.core.queues["d"].count == 1
    # the views (GET /api/connections, flowbroker_flow_stop_info) say the disk alarm holds it, with its
    # figures; they said "admin", a stop-all nobody had made (a tester)
    assert views.stopped_destinations(p.session) == [("d", p.session.flow_stopped_on["d"][1], "disk", "disk", 1000, 2000)]
    flow = views.connection_view(p.session, h.now)["flow"]
    assert not flow["admin_stopped"] and flow["destinations"][0]["threshold"] == "disk"
    assert flow["blocking_queues"] == ["d"]  # (the disk alarm's queue was left out: BLOCKING empty, a tester)
    assert h.core.journal is not None
    h.core.journal.set_alarm(None)
    assert p.session.disk_stop is None and views.stopped_destinations(p.session) == []


def test_once_the_alarm_clears_an_unpaced_producer_is_taken_again(h: Harness) -> None:
    assert h.core.journal is not None
    h.core.journal.set_alarm(None)
    p = h.producer("legacy", flow_control=False)
    p.send("", "d", force=True)
    p.pump()
    assert not p.errors and h.core.queues["d"].count == 1
