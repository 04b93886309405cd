"""Producer credit in the core: byte buffers granted by the broker, absolute BUFFER_ACK positions,
re-advertisement, credit violations, and the aggressive policy resizing live connections."""

from __future__ import annotations

import pytest
from coreharness import Harness, MiB, Producer

from flowbroker.broker.session import SessionFault
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import BufferAck, BufferControl, Transfer, TransferEntry

BODY = b"p" * 200
SIZE = message_size(BODY)  # 232


def static(size: int, **sections: dict[str, object]) -> Harness:
    return Harness(credit={"policy": "static", "static_size": size}, **sections)  # type: ignore[arg-type]


def fill(p: Producer, queue: str = "q") -> int:
    """Send while the client's books allow; returns how many went."""
    n = 0
    while p.can_send():
        p.send("", queue, BODY)
        n += 1
    return n


def test_welcome_buffer_and_one_message_overflow_then_violation() -> None:
    h = static(1000)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer("bad")
    good = h.producer("good")
    assert p.welcome_buffer == 1000
    assert fill(p) == 5  # 0, 232, 464, 696, 928 < 1000: the fifth overflows the buffer
    assert p.credit.outstanding == 5 * SIZE
    with pytest.raises(SessionFault) as info:
        p.send("", "q", BODY, force=True)  # before any BUFFER_ACK
    assert info.value.code is ErrorCode.CREDIT_VIOLATION
    assert "1000" in str(info.value)
    h.core.close_session(p.session)  # what the shell does
    # the well-behaved connection carries on
    assert fill(good) == 5
    good.pump()
    assert good.outstanding == {} and good.grants
    assert fill(good) > 0
    assert h.core.queues["q"].count >= 10


def test_violation_inside_one_batch() -> None:
    h = static(500)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    with pytest.raises(SessionFault) as info:
        p.handle(Transfer(1, [TransferEntry("", "q", BODY)] * 4))  # 0, 232, 464 ok; 696 >= 500
    assert info.value.code is ErrorCode.CREDIT_VIOLATION


def test_grants_follow_completions_and_carry_absolute_position() -> None:
    h = static(1000)
    h.queue("q", flow_stop_count=2)
    p = h.producer()
    assert fill(p) == 5
    frames = p.pump()
    # two completed (464 bytes) >= threshold (200): granted; three held by the saturated queue
    acks = [f for f in frames if isinstance(f, BufferAck)]
    assert acks == [BufferAck(0, 2 * SIZE, 2 * SIZE)]
    assert p.credit.acked_total == 2 * SIZE
    assert p.can_send()  # 1160 < 464 + 1000
    assert fill(p) == 2  # 1160, 1392 < 1464 -> 1624
    c = h.consumer()
    c.subscribe("q")
    c.ack()
    p.pump()
    assert p.outstanding == {}
    assert p.credit.acked_total == 7 * SIZE == p.credit.sent_total


def test_poll_credit_readvertises_after_a_dropped_grant() -> None:
    h = static(1000)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    fill(p)
    frames = p.session.collect(h.now)  # the grant is lost on the way: not applied to the client
    assert any(isinstance(f, BufferAck) for f in frames)
    p.pump()
    assert not p.can_send()  # stalled
    p.session.poll_credit(h.now)  # within the interval: nothing
    assert p.pump() == []
    h.advance(5)
    p.session.poll_credit(h.now)
    frames = p.pump()
    assert [f for f in frames if isinstance(f, BufferAck)] == [BufferAck(0, 0, 5 * SIZE)]
    assert p.can_send()
    fill(p)
    # re-advertised with nothing new, and a duplicate grant is harmless
    p.pump()
    h.advance(5)
    p.session.poll_credit(h.now)
    h.advance(5)
    p.session.poll_credit(h.now)
    frames = p.pump()
    totals = [f.acked_total for f in frames if isinstance(f, BufferAck)]
    assert totals == [p.credit.sent_total] * 2


def test_poll_credit_flushes_pending_below_threshold() -> None:
    h = static(100_000)  # threshold 20 % = 20000 bytes
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    p.send("", "q", BODY)
    p.pump()
    assert p.grants == []  # 232 bytes pending, under the threshold
    h.advance(5)
    p.session.poll_credit(h.now)
    p.pump()
    assert p.grants == [BufferAck(0, SIZE, SIZE)]


def test_credit_limit_only_moves_with_grants_actually_sent() -> None:
    """The broker checks the position it advertised, not what it has merely completed."""
    h = static(1000)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    fill(p)  # completed at once but no grant collected yet
    with pytest.raises(SessionFault):
        p.send("", "q", BODY, force=True)


def aggressive(quota: int, min_size: int, max_size: int) -> Harness:
    return Harness(
        server={"memory_quota": quota},
        credit={"policy": "aggressive", "min_size": min_size, "max_size": max_size},
    )


def test_aggressive_policy_pushes_buffer_control_on_connect_and_disconnect() -> None:
    quota = 100 * MiB  # pool 5 MiB
    h = aggressive(quota, 256 * 1024, 4 * MiB)
    pool = quota * 5 // 100
    p1 = h.producer("p1")
    assert p1.welcome_buffer == 4 * MiB  # clamp(5 MiB / 1, min, max)
    legacy = h.producer("legacy", flow_control=False)
    assert legacy.welcome_buffer == 0
    assert p1.pump() == []  # a legacy producer does not count
    p2 = h.producer("p2")
    assert p2.welcome_buffer == pool // 2
    assert [f for f in p1.pump() if isinstance(f, BufferControl)] == [BufferControl(0, pool // 2)]
    assert p2.pump() == []  # the new connection learns its size from WELCOME
    producers = [p1, p2]
    for i in range(3, 31):
        producers.append(h.producer(f"p{i}"))
        for p in producers:
            p.pump()
        sizes = [p.credit.max_bytes for p in producers]
        assert len(set(sizes)) == 1
        assert sum(sizes) <= pool + len(producers) * 256 * 1024
        assert sizes[0] == max(256 * 1024, min(4 * MiB, pool // len(producers)))
    assert legacy.pump() == []
    for p in producers[2:]:
        p.close()
    p1.pump()
    p2.pump()
    assert p1.credit.max_bytes == p2.credit.max_bytes == pool // 2
    assert p1.buffer_controls[-1] == BufferControl(0, pool // 2)


def test_aggressive_shrink_below_in_flight_loses_nothing() -> None:
    quota = 20 * MiB  # pool 1 MiB
    h = aggressive(quota, 1024, 1 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    big = b"z" * 60_000
    p1 = h.producer("p1")
    sent = 0
    while p1.can_send():
        p1.send("", "q", big)
        sent += 1
    others = [h.producer(f"o{i}") for i in range(9)]  # p1 shrinks to pool / 10 while full
    p1.pump()
    assert p1.credit.max_bytes == quota * 5 // 100 // 10
    assert p1.outstanding == {}
    assert p1.credit.outstanding == 0  # completions were granted back under the new size
    c = h.consumer()
    c.subscribe("q")
    assert len(c.bodies()) == sent
    # under the new size, sending resumes normally and never violates
    for _ in range(30):
        while p1.can_send():
            p1.send("", "q", big)
            sent += 1
        p1.pump()
        for o in others:
            o.pump()
    c.pump()
    assert len(c.bodies()) == sent


def test_set_credit_policy_while_running_pushes_new_sizes() -> None:
    h = static(1000)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    fill(p)
    h.core.set_credit_policy(static_size=5000)
    p.pump()
    assert p.buffer_controls == [BufferControl(0, 5000)]
    assert p.credit.max_bytes == 5000
    fill(p)  # no violation with the larger size
    assert p.credit.sent_total > 5 * SIZE
