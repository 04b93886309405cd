"""What producers that sent past a stop and left add is bounded: held messages stay enqueued when their
producer's connection closes, and each new connection gets a fresh grant, so without a bound a queue (or
the memory alarm) grew with every reconnect. Beyond what the live producers' credit could have in flight
(`MemoryMeter.held_room`: the pool plus one maximum message per connection), a flow-controlled producer's
message is refused, not held."""

from __future__ import annotations

from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error
from tests.broker.coreharness import Harness

SERVER = {"memory_quota": 64 * 1024 * 1024, "max_message_size": 4096, "max_frame_size": 65536}
CREDIT = {"policy": "static", "static_size": 8192, "quota": 65536}


def test_a_saturated_queue_does_not_grow_with_every_producer_that_sends_and_leaves() -> None:
    """A tester's queue with max_count 10 reached 2,400 messages, 200 more each time an SDK producer
    connected, sent its window and closed."""
    h = Harness(server=SERVER, credit=CREDIT)
    h.consumer("admin").declare_queue("q", flow_stop_count=5, flow_resume_count=2)
    queue = h.core.queues["q"]
    refused: list[Error] = []
    for round in range(12):
        p = h.producer(f"p{round}")
        for _ in range(200):
            if not p.can_send():
                break
            p.send("", "q", b"x" * 1000)
            p.pump()
        p.pump()
        refused += [f for f in p.frames if isinstance(f, Error)]
        p.close()
        # the room while two connections were open (the admin's and this producer's), one message over
        assert queue.size <= queue._saturated_size + h.core.credit.pool + 2 * h.core.credit.floor + 1512
    assert refused and all(e.code is ErrorCode.QUEUE_FULL and e.destination == "q" for e in refused)
    assert "would take it past its stop plus the credit its live producers could have in flight" in refused[0].text
    assert queue.count < 100


def test_the_memory_alarm_does_not_grow_with_every_connection_that_sends_its_one_message_and_leaves() -> None:
    """Each new flow-controlled connection may send one message on its first byte of credit; under the
    memory alarm it was held, and stayed enqueued when the connection closed: a tester's queue reached 600
    MiB over a 256 MiB quota, one 4 MiB message per connection."""
    h = Harness(server={**SERVER, "memory_watermark": 32 * 1024}, credit=CREDIT)
    h.consumer("admin").declare_queue("open", max_size=0, flow_stop_size=0, flow_resume_size=0)
    memory = h.core.memory
    refused = 0
    for round in range(200):
        p = h.producer(f"c{round}")
        p.send("", "open", b"y" * 4000, force=True)  # the one message its first byte allows
        p.pump()
        refused += sum(1 for f in p.frames if isinstance(f, Error) and f.code is ErrorCode.RESOURCE_EXHAUSTED)
        p.close()
        assert memory.held <= memory.watermark + h.core.credit.pool + 2 * h.core.credit.floor + 4512
    assert memory.alarm and refused > 0


def test_a_quota_lowered_under_the_alarm_leaves_room_for_what_was_promised_under_the_old_one() -> None:
    """`policy set --quota 1MiB` while the alarm was on: connected producers' transfers admitted under
    their old grants were refused RESOURCE_EXHAUSTED, the room counted from the new, smaller pool (a
    tester, 3 of 3). The room is the larger of the pool and what is still promised."""
    h = Harness(server={**SERVER, "memory_watermark": 32 * 1024}, credit=CREDIT)
    h.consumer("admin").declare_queue("open", max_size=0, flow_stop_size=0, flow_resume_size=0)
    producers = [h.producer(f"p{i}") for i in range(3)]
    for p in producers:
        p.register()
    windows = sum(p.session.transfers.promised for p in producers)  # 3 x 8192, granted under the 64 KiB pool
    h.core.set_credit_policy(quota=8192)
    sessions = len(h.core.sessions)
    assert h.core.credit.pool == 8192 < windows
    assert h.core.memory.held_room == windows + sessions * h.core.credit.floor  # not 8192 + ...


def test_a_producer_connected_before_the_queue_saturated_is_never_refused_by_the_bound() -> None:
    """The bound was queue-wide: short jobs that sent past the stop and left filled it, and then the
    producer that stayed connected throughout got QUEUE_FULL for credit-legal messages (a tester: 100
    refused). Only connections opened after the queue saturated meet it."""
    h = Harness(server=SERVER, credit={"policy": "static", "static_size": 65536, "quota": 1 << 20})
    h.consumer("admin").declare_queue("q", flow_stop_count=5, flow_resume_count=2)
    live = h.producer("live", fences=True)
    for _ in range(6):  # saturates the queue, with most of its 64 KiB window left
        live.send("", "q", b"x" * 1000)
        live.pump()
    queue = h.core.queues["q"]
    assert queue.saturated
    round = 0
    while queue.size <= queue._saturated_size + h.core.memory.held_room:  # jobs come, fill it past the room, go
        job = h.producer(f"job{round}")
        while job.can_send():
            job.send("", "q", b"j" * 1000)
            job.pump()
        job.close()
        round += 1
    for _ in range(30):  # then the live producer goes on within its credit
        live.send("", "q", b"x" * 1000)
        live.pump()
    assert not [f for f in live.frames if isinstance(f, Error)]
