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
SIZE = message_size(BODY)
BUFFER = 4 * SIZE + SIZE // 3
"""A buffer of 4.33 messages: four fit, the fifth overflows it, a sixth is a credit violation."""


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
    h = static(BUFFER)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer("bad")
    good = h.producer("good")
    assert p.welcome_buffer == BUFFER
    assert fill(p) == 5  # 0, SIZE, 2 SIZE, 3 SIZE, 4 SIZE < BUFFER: the fifth overflows the buffer
    assert p.credit.outstanding == 5 * SIZE
    with pytest.raises(SessionFault) as info:
        p.send("", "q", BODY, force=True)  # before any BUFFER_ACK
    assert info.value.code is ErrorCode.CREDIT_VIOLATION
    assert f"limit {BUFFER} (buffer {BUFFER} bytes)" in str(info.value)
    h.core.close_session(p.session)  # what the shell does
    # the well-behaved connection carries on
    assert fill(good) == 5
    good.pump()
    assert good.outstanding == {} and good.grants
    assert fill(good) > 0
    assert h.core.queues["q"].count >= 10


def test_violation_inside_one_batch() -> None:
    h = static(BUFFER // 2)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    with pytest.raises(SessionFault) as info:
        p.handle(Transfer(1, [TransferEntry("", "q", BODY)] * 4))  # 0, SIZE, 2 SIZE ok; 3 SIZE >= 2.17 SIZE
    assert info.value.code is ErrorCode.CREDIT_VIOLATION


def test_grants_follow_completions_and_carry_absolute_position() -> None:
    h = static(BUFFER)
    h.queue("q", flow_stop_count=2)
    p = h.producer()
    assert fill(p) == 5
    frames = p.pump()
    # two completed (2 SIZE) >= threshold (20 % of BUFFER): granted; three held by the saturated queue
    acks = [f for f in frames if isinstance(f, BufferAck)]
    assert acks == [BufferAck(0, 2 * SIZE, 2 * SIZE)]
    assert p.credit.acked_total == 2 * SIZE
    assert p.can_send()  # 5 SIZE < 2 SIZE + BUFFER
    assert fill(p) == 2  # 5 SIZE, 6 SIZE < 6.33 SIZE -> 7 SIZE
    c = h.consumer()
    c.subscribe("q")
    c.ack()
    p.pump()
    assert p.outstanding == {}
    assert p.credit.acked_total == 7 * SIZE == p.credit.sent_total


def test_poll_credit_readvertises_after_a_dropped_grant() -> None:
    h = static(BUFFER)
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
    assert SIZE < 20_000
    assert p.grants == []  # SIZE bytes pending, under the threshold
    h.advance(5)
    p.session.poll_credit(h.now)
    p.pump()
    assert p.grants == [BufferAck(0, SIZE, SIZE)]


def test_credit_limit_only_moves_with_grants_actually_sent() -> None:
    """The broker checks the position it advertised, not what it has merely completed."""
    h = static(BUFFER)
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
    assert p1.welcome_buffer == 256 * 1024  # provisional (the floor) until its first transfer
    p1.register()
    assert p1.buffer_controls == [BufferControl(0, 4 * MiB)]  # clamp(5 MiB / 1, min, max)
    assert p1.credit.max_bytes == 4 * MiB
    legacy = h.producer("legacy", flow_control=False)
    assert legacy.welcome_buffer == 0
    legacy.register()
    assert p1.pump() == []  # a legacy producer does not count, even once it sends
    assert legacy.buffer_controls == []
    p2 = h.producer("p2")
    assert p2.welcome_buffer == 256 * 1024
    assert p1.pump() == []  # connecting alone changes no one's share
    p2.register()
    assert [f for f in p1.pump() if isinstance(f, BufferControl)] == [BufferControl(0, pool // 2)]
    assert p2.buffer_controls == [BufferControl(0, pool // 2)]  # its registered size, pushed once
    producers = [p1, p2]
    for i in range(3, 31):
        producers.append(h.producer(f"p{i}"))
        producers[-1].register()
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
    p1.register()
    assert p1.credit.max_bytes == 1 * MiB  # alone: the whole pool
    sent = 0
    while p1.can_send():
        p1.send("", "q", big)
        sent += 1
    shrunk = quota * 5 // 100 // 10
    assert p1.credit.outstanding > shrunk  # in flight, unacknowledged, when the shrink comes
    others = [h.producer(f"o{i}") for i in range(9)]
    for o in others:
        o.register()  # each first transfer registers it: p1 shrinks to pool / 10 while full
    p1.pump()
    assert p1.buffer_controls[-1] == BufferControl(0, shrunk)
    assert p1.credit.max_bytes == shrunk
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
    h = static(BUFFER)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    fill(p)
    h.core.set_credit_policy(static_size=5 * BUFFER)
    p.pump()
    assert p.buffer_controls == [BufferControl(0, 5 * BUFFER)]
    assert p.credit.max_bytes == 5 * BUFFER
    fill(p)  # no violation with the larger size
    assert p.credit.sent_total > 5 * SIZE


# -- registration on the first transfer: connections that only consume do not dilute the shares --


def granted_to_all(h: Harness) -> int:
    """Every buffer the broker has granted to a flow-controlled connection, registered or provisional."""
    return sum(s.buffer_size for s in h.core.sessions.values() if s.flow_control)


def test_consumer_only_flow_controlled_connections_do_not_dilute_aggressive_shares() -> None:
    quota = 100 * MiB  # pool 5 MiB: 11 registered connections would get 465 KiB each
    min_size = 256 * 1024
    h = aggressive(quota, min_size, 4 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer("p")
    p.register()
    assert p.credit.max_bytes == 4 * MiB
    consumers = [h.consumer(f"c{i}", flow_control=True) for i in range(10)]  # the SDK's default
    for c in consumers:
        assert c.session.buffer_size == min_size  # WELCOME: the provisional size
        c.subscribe("q", prefetch=5)
    for _ in range(20):
        p.send("", "q", BODY)
    for c in consumers:
        c.pump()
        c.ack()
    assert sum(len(c.bodies()) for c in consumers) == 20  # they consume, they never transfer
    p.pump()
    assert p.buffer_controls == [BufferControl(0, 4 * MiB)]  # only its own registration's
    assert p.credit.max_bytes == 4 * MiB
    assert all(c.received(BufferControl) == [] for c in consumers)
    assert h.core.credit.connections() == (p.session.conn_id,)
    assert granted_to_all(h) == 4 * MiB + 10 * min_size <= quota * 5 // 100 + 11 * min_size


@pytest.mark.parametrize(
    ("credit", "provisional", "registered"),
    [
        ({"policy": "none"}, 0, 0),
        ({"policy": "static", "static_size": 3000}, 3000, 3000),
        ({"policy": "dynamic", "min_size": 2000, "max_size": 8000}, 2000, 8000),  # 1 % of 1 MiB, clamped
        ({"policy": "aggressive", "min_size": 2000, "max_size": 8000}, 2000, 8000),
        ({"policy": "aggressive", "min_size": 2000, "override_size": 7000}, 7000, 7000),
        ({"policy": "dynamic", "override_size": 7000}, 7000, 7000),
    ],
)
def test_welcome_carries_the_provisional_size_and_the_first_transfer_registers(
    credit: dict[str, object], provisional: int, registered: int
) -> None:
    h = Harness(server={"memory_quota": 1 * MiB}, credit=credit)
    p = h.producer()
    assert p.welcome_buffer == provisional == h.core.credit.provisional_size()
    assert p.session.conn_id not in h.core.credit
    assert p.pump() == []
    p.register()
    assert p.session.conn_id in h.core.credit
    assert h.core.credit.size_of(p.session.conn_id) == registered
    # told only when the registered size differs from the one it already has
    assert p.buffer_controls == ([] if registered == provisional else [BufferControl(0, registered)])
    assert p.credit.max_bytes == registered
    p.register()  # later transfers do not register again
    assert p.buffer_controls == ([] if registered == provisional else [BufferControl(0, registered)])
    assert len(h.core.credit) == 1


def test_first_transfer_registers_and_pushes_the_new_shares() -> None:
    quota = 100 * MiB  # pool 5 MiB
    h = aggressive(quota, 256 * 1024, 4 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    pool = quota * 5 // 100
    p1 = h.producer("p1")
    p1.register()
    p2 = h.producer("p2")
    assert p1.pump() == [] and p2.pump() == []
    assert p2.session.conn_id not in h.core.credit
    tid = p2.send("", "q", BODY)  # its first transfer, to a real queue
    assert p2.session.conn_id in h.core.credit
    assert [f for f in p1.pump() if isinstance(f, BufferControl)] == [BufferControl(0, pool // 2)]
    p2.pump()
    assert p2.buffer_controls == [BufferControl(0, pool // 2)]
    assert p2.is_complete(tid) and h.core.queues["q"].count == 1  # the transfer itself went through
    assert p1.credit.max_bytes == p2.credit.max_bytes == pool // 2
    p2.close()
    p1.pump()
    assert p1.buffer_controls[-1] == BufferControl(0, 4 * MiB)
    assert h.core.credit.connections() == (p1.session.conn_id,)


def test_closing_an_unregistered_connection_pushes_nothing() -> None:
    quota = 100 * MiB  # pool 5 MiB
    h = aggressive(quota, 256 * 1024, 4 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer("p")
    p.register()
    p.send("", "q", BODY)
    idle = h.producer("idle")  # flow-controlled, never sends
    c = h.consumer("c", flow_control=True)
    c.subscribe("q")
    assert len(c.bodies()) == 1
    p.pump()
    before = (len(h.core.credit), h.core.credit.total_granted(), len(p.frames))
    idle.close()
    c.close()  # with an unsettled delivery: it is requeued, nothing else changes
    assert p.pump() == []
    assert (len(h.core.credit), h.core.credit.total_granted(), len(p.frames)) == before
    assert p.credit.max_bytes == 4 * MiB


def test_provisional_connection_overrunning_its_provisional_credit_is_a_violation() -> None:
    h = aggressive(100 * MiB, BUFFER, 4 * MiB)  # provisional BUFFER bytes; registered alone: 4 MiB
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    good = h.producer("good")
    good.register()
    p = h.producer("greedy")
    assert p.welcome_buffer == BUFFER
    # 0, SIZE, ..., 4 SIZE < BUFFER: the fifth overflows, allowed; the sixth starts at 5 SIZE
    with pytest.raises(SessionFault) as info:
        p.handle(Transfer(1, [TransferEntry("", "q", BODY)] * 6))
    assert info.value.code is ErrorCode.CREDIT_VIOLATION
    # checked against the provisional grant, not the 4 MiB share
    assert f"limit {BUFFER} (buffer {BUFFER} bytes)" in str(info.value)
    h.core.close_session(p.session)
    good.pump()
    assert good.credit.max_bytes == 4 * MiB
    assert h.core.credit.connections() == (good.session.conn_id,)
    # one message of overflow in the first transfer is still fine
    ok = h.producer("ok")
    ok.handle(Transfer(1, [TransferEntry("", "q", BODY)] * 5))
    ok.pump()
    assert ok.errors == [] and ok.session.conn_id in h.core.credit


def test_policy_change_resizes_provisional_buffers() -> None:
    h = aggressive(100 * MiB, 1 * MiB, 4 * MiB)
    idle = h.producer("idle")
    assert idle.welcome_buffer == 1 * MiB
    h.core.set_credit_policy(min_size=1000)  # never above what registering would give
    idle.pump()
    assert idle.buffer_controls == [BufferControl(0, 1000)]
    h.core.set_credit_policy(policy="static", static_size=3000)
    idle.pump()
    assert idle.buffer_controls[-1] == BufferControl(0, 3000)
    assert idle.session.conn_id not in h.core.credit and h.core.credit.total_granted() == 0
    idle.register()
    assert idle.buffer_controls[-1] == BufferControl(0, 3000) and len(idle.buffer_controls) == 2
    assert h.core.credit.size_of(idle.session.conn_id) == 3000
