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


def test_a_flow_controlled_producers_fanned_out_messages_are_refused_past_the_watermark_and_all_credit() -> None:
    """Credit bounds a producer's messages in flight once, but each held message fanned out is held once per
    queue: a window of 1-byte bodies to a fanout of 600 queues took the broker to 7.6 times the bound's
    growth (a tester). Past the watermark plus all credit (`held_room`), a fanned-out message is refused
    RESOURCE_EXHAUSTED; held bytes stay within that plus one message's copies."""
    h = Harness(server={"memory_quota": 16 << 20, "memory_watermark": WATERMARK}, credit={"policy": "aggressive"})
    fanned(h)
    p = h.producer("paced")
    p.register()
    assert h.core.memory.held_room < 16 << 20  # 5 % of 16 MiB, and a maximum message per connection
    ids: list[int] = []
    while p.can_send() and len(ids) < 2_000:  # messages of 528 bytes, 200 copies each, up to the window
        ids += p.send_many([("wide", "", b"x" * 16, None)])
        p.pump()
    memory = h.core.memory
    assert memory.alarm
    assert memory.held <= WATERMARK + memory.held_room + QUEUES * 528
    refused = [tid for tid in ids if any(e.code is ErrorCode.RESOURCE_EXHAUSTED for e in p.errors_for(tid))]
    assert refused and "held once in each of 200 queues" in p.errors_for(refused[0])[0].text
    # a message to one queue is held, never refused
    h.consumer("admin").declare_queue("single", max_size=0)
    one = p.send("", "single", b"y")
    p.pump()
    assert p.errors_for(one) == [] and not p.is_complete(one)
