"""Producer credit in the core: byte buffers granted by the broker, absolute BUFFER_ACK positions,
re-advertisement, credit violations, and the aggressive policy resizing live connections."""

from __future__ import annotations

import pytest
from tests.broker.coreharness import Harness, MiB, Producer

from flowbroker.broker.session import SessionFault
from flowbroker.policies.credit import WAIT_GRANT
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import BufferAck, BufferControl, BufferLimit, Transfer, TransferEntry

BODY = b"p" * 200
SIZE = message_size(BODY)
BUFFER = 4 * SIZE + SIZE // 3
"""A buffer of 4.33 messages: four fit, the fifth overflows it, a sixth is a credit violation."""


def static(size: int, **sections: dict[str, object]) -> Harness:
    return Harness(credit={"policy": "static", "static_size": size}, **sections)


REG = message_size(b"x")
"""The message `ready` registers a producer with: its first TRANSFER, which the provisional grant
(WAIT_GRANT: one message) allows, and which makes it a producer with the policy's share."""


def ready(h: Harness, name: str = "producer") -> Producer:
    """A producer that has registered and had its first message acknowledged: its whole buffer is free,
    and every absolute position below is offset by REG."""
    p = h.producer(name)
    assert p.welcome_buffer == WAIT_GRANT
    p.register()
    h.advance(5)
    p.session.poll_credit(h.now)
    p.pump()
    assert p.credit.acked_position == REG and p.credit.outstanding == 0
    p.grants.clear()
    return p


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
    p = ready(h, "bad")
    good = ready(h, "good")
    assert p.credit.window == BUFFER
    assert fill(p) == 5  # 0, SIZE, 2 SIZE, 3 SIZE, 4 SIZE < BUFFER: the fifth overflows the buffer
    assert p.credit.outstanding == 5 * SIZE
    with pytest.raises(SessionFault) as info:
        p.send("", "q", BODY, force=True)  # before any BUFFER_ACK
    assert info.value.code is ErrorCode.CREDIT_VIOLATION
    assert f"limit {REG + BUFFER} (buffer {BUFFER} bytes)" in str(info.value)
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
    p = ready(h)
    with pytest.raises(SessionFault) as info:
        p.handle(Transfer(2, [TransferEntry("", "q", BODY)] * 4))  # 0, SIZE, 2 SIZE ok; 3 SIZE >= 2.17 SIZE
    assert info.value.code is ErrorCode.CREDIT_VIOLATION


def test_grants_follow_completions_and_carry_absolute_position() -> None:
    h = static(BUFFER)
    h.queue("q", flow_stop_count=2)
    p = ready(h)
    assert fill(p) == 5
    frames = p.pump()
    # two completed (2 SIZE) >= threshold (20 % of BUFFER): granted; three held by the saturated queue
    acks = [f for f in frames if isinstance(f, BufferAck)]
    assert acks == [BufferAck(0, 2 * SIZE, REG + 2 * SIZE)]
    assert p.credit.acked_position == REG + 2 * SIZE
    assert p.can_send()  # 5 SIZE < 2 SIZE + BUFFER
    assert fill(p) == 2  # 5 SIZE, 6 SIZE < 6.33 SIZE -> 7 SIZE
    c = h.consumer()
    c.subscribe("q")
    c.ack()
    p.pump()
    assert p.outstanding == {}
    assert p.credit.acked_position == REG + 7 * SIZE == p.credit.position


def test_poll_credit_readvertises_after_a_dropped_grant() -> None:
    h = static(BUFFER)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = ready(h)
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
    assert [f for f in frames if isinstance(f, BufferAck)] == [BufferAck(0, 0, REG + 5 * SIZE)]
    assert p.can_send()
    fill(p)
    # re-advertised with nothing new, and a duplicate grant is harmless
    p.pump()
    h.advance(5)
    p.session.poll_credit(h.now)
    h.advance(5)
    p.session.poll_credit(h.now)
    frames = p.pump()
    totals = [f.acked_position for f in frames if isinstance(f, BufferAck)]
    assert totals == [p.credit.position] * 2


def test_poll_credit_flushes_pending_below_threshold() -> None:
    h = static(100_000)  # threshold 20 % = 20000 bytes
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = ready(h)
    p.send("", "q", BODY)
    p.pump()
    assert SIZE < 20_000
    assert p.grants == []  # SIZE bytes pending, under the threshold
    h.advance(5)
    p.session.poll_credit(h.now)
    p.pump()
    assert p.grants == [BufferAck(0, SIZE, REG + SIZE)]


def test_credit_limit_only_moves_with_grants_actually_sent() -> None:
    """The broker checks the position it advertised, not what it has merely completed."""
    h = static(BUFFER)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = ready(h)
    fill(p)  # completed at once but no grant collected yet
    with pytest.raises(SessionFault):
        p.send("", "q", BODY, force=True)


def aggressive(quota: int, min_size: int, max_size: int) -> Harness:
    """Maximum messages of 64 KiB (a share holds at least 66048 bytes), 100 connection slots (the
    pool's reserve for wait grants is 100 bytes)."""
    return Harness(
        server={"memory_quota": quota, "max_message_size": 65536, "max_connections": 100},
        credit={"policy": "aggressive", "min_size": min_size, "max_size": max_size},
    )


def granted_to_all(h: Harness) -> int:
    """Every buffer the broker has granted to a flow-controlled connection, registered or provisional."""
    return sum(s.buffer_size for s in h.core.sessions.values() if s.flow_control)


def test_aggressive_shares_the_pool_and_a_shrunk_window_stays_charged_until_it_drains() -> None:
    h = aggressive(100 * MiB, 256 * 1024, 4 * MiB)  # pool 5 MiB
    credit = h.core.credit
    shareable = credit.shareable
    assert shareable == 100 * MiB * 5 // 100 - 100
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p1 = h.producer("p1")
    assert p1.welcome_buffer == WAIT_GRANT  # provisional until its first transfer
    p1.register()
    assert p1.buffer_controls == [BufferControl(0, 4 * MiB)]  # clamp(pool / 1, min, max)
    legacy = h.producer("legacy", flow_control=False)
    assert legacy.welcome_buffer == 0
    legacy.register()
    assert p1.pump() == []  # a legacy producer does not count, even once it sends
    p2 = h.producer("p2")
    assert p1.pump() == []  # connecting alone changes no one's share
    p2.register()
    half = shareable // 2
    assert [f for f in p1.pump() if isinstance(f, BufferControl)] == [BufferControl(0, half)]
    # p1 may still send up to its old 4 MiB limit (it may not have read the shrink): p2 gets the rest
    assert p2.buffer_controls == [BufferControl(0, shareable - (4 * MiB - 1) + 1)]
    assert credit.total_committed() <= credit.pool
    big = b"z" * 60_000
    for _ in range(40):  # as acknowledgements overtake p1's old limit, p2 grows to its share
        while p1.can_send():
            p1.send("", "q", big)
        p1.pump()
    p2.pump()
    assert p1.credit.window == p2.credit.window == half
    assert p2.buffer_controls[-1] == BufferControl(0, half)
    producers = [p1, p2]
    for i in range(3, 31):
        producers.append(h.producer(f"p{i}"))
        producers[-1].register()
        for p in producers:
            p.pump()
        assert granted_to_all(h) == credit.total_granted() <= credit.pool
        assert credit.total_committed() <= credit.pool
        need = credit.need()
        for p in producers:
            assert p.credit.window >= need or credit.is_waiting(p.session.conn_id)
    assert credit.waiting() > 0  # p1 and p2 hold their windows: later ones wait for a share
    assert legacy.pump() == []
    for p in producers[2:]:
        p.close()
    p1.pump()
    p2.pump()
    assert p1.credit.window == p2.credit.window == half


def test_aggressive_shrink_below_in_flight_loses_nothing() -> None:
    quota = 20 * MiB  # pool 1 MiB
    h = aggressive(quota, 1024, 1 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    big = b"z" * 60_000
    p1 = h.producer("p1")
    p1.register()
    shareable = h.core.credit.shareable
    assert p1.credit.window == shareable  # alone: the whole pool but its reserve
    sent = 0
    while p1.can_send():
        p1.send("", "q", big)
        sent += 1
    shrunk = shareable // 10
    assert p1.credit.outstanding > shrunk  # in flight, unacknowledged, when the shrink comes
    others = [h.producer(f"o{i}") for i in range(9)]
    for o in others:
        o.register()  # each first transfer registers it: p1 shrinks to pool / 10 while full
    p1.pump()
    assert p1.buffer_controls[-1] == BufferControl(0, shrunk)
    assert p1.credit.window == shrunk
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
        assert granted_to_all(h) <= h.core.credit.pool
    c.pump()
    assert len(c.bodies()) == sent


def test_set_credit_policy_while_running_pushes_new_sizes() -> None:
    h = static(BUFFER)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = ready(h)
    fill(p)
    h.core.set_credit_policy(static_size=5 * BUFFER)
    p.pump()
    assert p.buffer_controls == [BufferControl(0, BUFFER), BufferControl(0, 5 * BUFFER)]
    assert p.credit.window == 5 * BUFFER
    fill(p)  # no violation with the larger size
    assert p.credit.position > 5 * SIZE


# -- registration on the first transfer: connections that only consume do not dilute the shares --


def test_consumer_only_flow_controlled_connections_do_not_dilute_aggressive_shares() -> None:
    quota = 100 * MiB  # pool 5 MiB: 11 producers would get 465 KiB each
    h = aggressive(quota, 256 * 1024, 4 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer("p")
    p.register()
    assert p.credit.window == 4 * MiB
    consumers = [h.consumer(f"c{i}", flow_control=True) for i in range(10)]  # the SDK's default
    for c in consumers:
        assert c.session.buffer_size == WAIT_GRANT  # WELCOME: the provisional grant, one byte
        c.subscribe("q", prefetch=5)
    for _ in range(20):
        p.send("", "q", BODY)
    for c in consumers:
        c.pump()
        c.ack()
    assert sum(len(c.bodies()) for c in consumers) == 20  # they consume, they never transfer
    p.pump()
    assert p.buffer_controls == [BufferControl(0, 4 * MiB)]  # only its own registration's
    assert h.core.credit.producers() == (p.session.conn_id,)
    assert all(c.received(BufferControl) == [] for c in consumers)
    # every grant counted, the provisional ones included, all within the pool
    assert granted_to_all(h) == h.core.credit.total_granted() == 4 * MiB + 10 <= quota * 5 // 100


@pytest.mark.parametrize(
    ("credit", "provisional", "registered"),
    [
        ({"policy": "none"}, 0, 0),
        ({"policy": "static", "static_size": 3000}, 1, 3000),
        ({"policy": "dynamic", "min_size": 2000, "max_size": 8000}, 1, 8000),  # 1 % of 1 MiB, clamped
        ({"policy": "aggressive", "min_size": 2000, "max_size": 8000}, 1, 8000),
        ({"policy": "aggressive", "min_size": 2000, "override_size": 7000}, 1, 7000),
        ({"policy": "dynamic", "override_size": 7000}, 1, 7000),
    ],
)
def test_welcome_carries_the_provisional_grant_and_the_first_transfer_registers(
    credit: dict[str, object], provisional: int, registered: int
) -> None:
    h = Harness(server={"memory_quota": 1 * MiB, "max_message_size": 1000}, credit=credit)
    p = h.producer()
    assert p.welcome_buffer == provisional
    assert p.session.conn_id in h.core.credit and not h.core.credit.is_producer(p.session.conn_id)
    assert p.pump() == []
    p.register()
    assert h.core.credit.is_producer(p.session.conn_id)
    assert h.core.credit.size_of(p.session.conn_id) == registered
    # told only when the registered size differs from the one it already has
    assert p.buffer_controls == ([] if registered == provisional else [BufferControl(0, registered)])
    assert p.credit.window == registered
    p.register()  # later transfers do not register again
    assert p.buffer_controls == ([] if registered == provisional else [BufferControl(0, registered)])
    assert h.core.credit.producers() == (p.session.conn_id,)


def test_first_transfer_registers_and_pushes_the_new_shares() -> None:
    h = aggressive(100 * MiB, 256 * 1024, 4 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    half = h.core.credit.shareable // 2
    p1 = h.producer("p1")
    p1.register()
    p2 = h.producer("p2")
    assert p1.pump() == [] and p2.pump() == []
    assert not h.core.credit.is_producer(p2.session.conn_id)
    tid = p2.send("", "q", BODY)  # its first transfer, to a real queue
    assert h.core.credit.is_producer(p2.session.conn_id)
    assert [f for f in p1.pump() if isinstance(f, BufferControl)] == [BufferControl(0, half)]
    p2.pump()
    # what p1's old 4 MiB limit leaves, until p1 has sent past it and been acknowledged
    assert p2.buffer_controls == [BufferControl(0, h.core.credit.shareable - (4 * MiB - 1) + 1)]
    assert p2.is_complete(tid) and h.core.queues["q"].count == 1  # the transfer itself went through
    while p1.credit.acked_position < 4 * MiB:
        while p1.can_send():
            p1.send("", "q", b"y" * 60_000)
        p1.pump()
    p2.pump()
    assert p2.buffer_controls[-1] == BufferControl(0, half)
    p2.close()
    p1.pump()
    assert p1.buffer_controls[-1] == BufferControl(0, 4 * MiB)
    assert h.core.credit.producers() == (p1.session.conn_id,)


def test_closing_a_provisional_connection_pushes_nothing() -> None:
    h = aggressive(100 * MiB, 256 * 1024, 4 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    p = h.producer("p")
    p.register()
    p.send("", "q", BODY)
    idle = h.producer("idle")  # flow-controlled, never sends
    c = h.consumer("c", flow_control=True)
    c.subscribe("q")
    assert len(c.bodies()) == 1
    p.pump()
    before = (h.core.credit.total_granted(), len(p.frames))
    idle.close()
    c.close()  # with an unsettled delivery: it is requeued, nothing else changes
    assert p.pump() == []
    assert (h.core.credit.total_granted(), len(p.frames)) == (before[0] - 2, before[1])
    assert p.credit.window == 4 * MiB and len(h.core.credit) == 1


def test_provisional_connection_may_send_one_message_then_waits_for_its_share() -> None:
    h = aggressive(100 * MiB, BUFFER, 4 * MiB)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    good = h.producer("good")
    good.register()
    p = h.producer("greedy")
    assert p.welcome_buffer == WAIT_GRANT
    # the first message overflows the one-byte grant (allowed); the second starts beyond it
    with pytest.raises(SessionFault) as info:
        p.handle(Transfer(1, [TransferEntry("", "q", BODY)] * 2))
    assert info.value.code is ErrorCode.CREDIT_VIOLATION
    assert f"limit {WAIT_GRANT} (buffer {WAIT_GRANT} bytes)" in str(info.value)  # the provisional grant
    h.core.close_session(p.session)
    good.pump()
    assert h.core.credit.producers() == (good.session.conn_id,)
    ok = h.producer("ok")
    ok.handle(Transfer(1, [TransferEntry("", "q", BODY)]))  # one message in the first transfer is fine
    ok.pump()
    assert ok.errors == [] and h.core.credit.is_producer(ok.session.conn_id)


def test_a_waiting_producer_gets_no_acknowledgement_until_it_has_a_share() -> None:
    h = Harness(server={"memory_quota": 1 * MiB, "max_message_size": 1000, "max_connections": 100},
                credit={"policy": "static", "static_size": 20_000})  # S = 1 MiB - 100: 52 shares, one of 8529
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    holders = []
    for i in range(53):
        holders.append(h.producer(f"h{i}"))
        holders[-1].register()
    late = h.producer("late")
    tid = late.send("", "q", BODY)
    late.pump()
    assert h.core.credit.is_waiting(late.session.conn_id)
    assert late.is_complete(tid) and late.grants == [] and not late.can_send()
    h.advance(10)
    late.session.poll_credit(h.now)  # not even the periodic re-advertisement
    assert late.pump() == [] and not late.can_send()
    holders[0].close()  # a share is free: the waiting one is upgraded and its acknowledgement flows
    late.pump()
    # first come first served: the short holder grows to 20000 first, the late one gets the rest
    assert late.buffer_controls == [BufferControl(0, 8529)]
    assert not h.core.credit.is_waiting(late.session.conn_id)
    assert late.can_send()
    h.advance(5)
    late.session.poll_credit(h.now)  # and its acknowledgements flow again
    late.pump()
    assert late.grants[-1].acked_position == SIZE


def test_policy_change_keeps_provisional_grants_at_one_byte() -> None:
    h = aggressive(100 * MiB, 1 * MiB, 4 * MiB)
    idle = h.producer("idle")
    assert idle.welcome_buffer == WAIT_GRANT
    h.core.set_credit_policy(min_size=1000)
    h.core.set_credit_policy(policy="static", static_size=3000)
    assert idle.pump() == []
    assert not h.core.credit.is_producer(idle.session.conn_id) and h.core.credit.total_granted() == 1
    h.core.set_credit_policy(policy="none")
    idle.pump()
    assert idle.buffer_controls == [BufferControl(0, 0)]  # not paced
    h.core.set_credit_policy(policy="static")
    idle.register()
    assert idle.buffer_controls[-1] == BufferControl(0, 3000)
    assert h.core.credit.size_of(idle.session.conn_id) == 3000


def test_what_a_producer_had_in_flight_under_none_drains_from_the_pool_after_a_switch_to_a_paced_policy() -> None:
    """Under `none` an SDK producer sends unpaced; after a live switch its BUFFER_LIMIT names what it has
    in flight (its position), which the pool charges. As the broker acknowledges those bytes, the charge
    comes back down to the grant: it stayed at the answer's window for good (committed 36 MB over a 3.3 MB
    pool, a tester), and a newcomer waited for a share that never came."""
    h = Harness(server={"memory_quota": 10 * MiB, "max_message_size": 1000}, credit={"policy": "none"})
    h.queue("q")
    p = h.producer("p")
    p.register()
    h.core.set_credit_policy(policy="static", static_size=3000)
    for _ in range(40):  # sent unpaced before it reads the BUFFER_CONTROL: in flight, not acknowledged yet
        p.send("", "q", b"x" * 1000, force=True)
    assert p.credit.position - p.credit.acked_position > 60_000
    p.handle(BufferLimit(1, 3000, p.credit.position))  # its answer, as the SDK's: what it sent
    conn = p.session.conn_id
    assert h.core.credit.window_of(conn) > 60_000  # charged to the pool while in flight
    p.pump()  # the BUFFER_CONTROL, completions, acknowledgements
    for i in range(10):
        while p.can_send():
            p.send("", "q", b"y%d" % i)
        p.pump()
    assert h.core.credit.window_of(conn) == h.core.credit.size_of(conn) == 3000
    assert h.core.credit.total_committed() <= h.core.credit.pool
