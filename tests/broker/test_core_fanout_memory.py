"""The memory watermark under fan-out: one TRANSFER frame's messages, each bound to many queues, are
checked against the watermark message by message, not once at the end of the frame: a frame of 1,024
messages to 4,000 queues held 33 times the watermark (a tester's attacker, a producer without flow
control). The rest of the frame is refused RESOURCE_EXHAUSTED (no flow control) or held (flow control)."""

from __future__ import annotations

from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import FlowStopped

from tests.broker.coreharness import Harness

QUEUES = 200
WATERMARK = 1 << 20


def fanned(h: Harness) -> None:
    admin = h.consumer("admin")
    admin.declare_exchange("wide", "fanout")
    for i in range(QUEUES):
        admin.declare_queue(f"q{i}", max_size=0)
        admin.bind(f"q{i}", "wide")


def test_a_producer_without_flow_control_is_refused_once_a_fanned_out_entry_passes_the_watermark() -> None:
    h = Harness(server={"memory_watermark": WATERMARK}, credit={"policy": "static", "static_size": 1 << 20})
    fanned(h)
    p = h.producer("attacker", flow_control=False)
    ids = p.send_many([("wide", "", b"x" * 16, None)] * 1024, force=True)
    p.pump()
    memory = h.core.memory
    assert memory.alarm
    per_entry = QUEUES * 528  # message_size of a 16-byte body, in every bound queue
    assert memory.held < WATERMARK + per_entry  # the watermark, plus the entry that passed it
    refused = [tid for tid in ids if any(e.code is ErrorCode.RESOURCE_EXHAUSTED for e in p.errors_for(tid))]
    assert len(refused) > 900 and all(p.is_complete(tid) for tid in ids)


def test_a_flow_controlled_producer_is_held_once_a_fanned_out_entry_passes_the_watermark() -> None:
    h = Harness(server={"memory_watermark": WATERMARK}, credit={"policy": "static", "static_size": 1 << 20})
    fanned(h)
    p = h.producer("paced")
    p.register()
    ids = p.send_many([("wide", "", b"x" * 16, None)] * 20)
    p.pump()
    assert h.core.memory.alarm
    assert any(isinstance(f, FlowStopped) and f.destination == "*" for f in p.frames)
    assert not all(p.is_complete(tid) for tid in ids)  # held until the alarm clears, never refused
    assert p.errors == []
