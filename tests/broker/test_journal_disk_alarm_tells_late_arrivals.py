"""When a commit fails and the disk alarm comes up, every producer waiting for the journal is told
FLOW_STOPPED (threshold disk): the failing batch's, and those whose transfers arrived while the failing
write ran, which wait in the next batch (not taken while the first is retried). Those were told nothing:
a producer's flush timed out naming no queue, its flow_state still empty 20 s later (a tester)."""

from __future__ import annotations

from pathlib import Path

from flowbroker.protocol.frames import FlowStopped
from flowbroker.protocol.names import THRESHOLD_DISK

from tests.broker.journalharness import Broker


def test_a_producer_whose_transfer_arrived_during_the_failing_write_is_told_flow_stopped(tmp_path: Path) -> None:
    b = Broker(tmp_path / "journal")
    b.core.declare_queue("kept", None, True)
    b.commit()
    first, late = b.h.producer("first", fences=True), b.h.producer("late", fences=True)
    first.register()
    late.register()
    first.pump()
    late.pump()
    first.send("", "kept", b"one")
    failing = b.journal.take_batch()  # the write of this batch is running (and will fail)
    late.send("", "kept", b"two")  # arrives meanwhile: in the next batch
    b.journal.set_alarm(FlowStopped("*", THRESHOLD_DISK, 0, 0, "the journal cannot write: No space left on device"))
    b.journal.tell_held(failing)  # what the committer does when the write fails
    for producer in (first, late):
        producer.pump()
        stops = [f for f in producer.frames if isinstance(f, FlowStopped)]
        assert [(s.destination, s.threshold) for s in stops] == [("kept", THRESHOLD_DISK)], producer.frames
