"""BUFFER_LIMIT in the core: a producer's answer to a shrink lowers its credit limit, so the promise the
shrink left drains at once and a producer waiting for a share gets it; a client from before
BUFFER_LIMIT keeps today's behaviour; an answer that cannot be right ends the connection."""

from __future__ import annotations

import pytest
from tests.broker.coreharness import Harness, MiB, Producer

from flowbroker.broker.session import SessionFault
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import BufferLimit, TransferEntry, Transfer

IDLE = 4


def idle_then_late(*, fences: bool) -> tuple[Harness, list[Producer], Producer]:
    """Four producers register (one message each) and go idle; a fifth registers after them. The pool
    is 3.2 MiB, shares [64 KiB, 1 MiB]: each newcomer shrinks the earlier ones' grants."""
    h = Harness(
        server={"memory_quota": 64 * MiB, "max_message_size": 65536, "max_connections": 50},
        credit={"policy": "aggressive", "min_size": 64 * 1024, "max_size": MiB},
    )
    idle = []
    for i in range(IDLE):
        p = h.producer(f"idle{i}", fences=fences)
        p.register()
        p.pump()
        idle.append(p)
    late = h.producer("late", fences=fences)
    late.register()
    for p in idle:
        p.pump()  # the idle producers read their shrinks (and, with fences, answer them)
    late.pump()
    return h, idle, late


def test_without_buffer_limit_a_producer_after_idle_ones_waits() -> None:
    """Today's behaviour for a client that never answers: the idle producers' old limits stay promised."""
    h, idle, late = idle_then_late(fences=False)
    credit = h.core.credit
    assert credit.is_waiting(late.session.conn_id)
    assert credit.total_committed() > credit.total_granted()


def test_with_buffer_limit_the_late_producer_gets_its_share() -> None:
    h, idle, late = idle_then_late(fences=True)
    credit = h.core.credit
    assert not credit.is_waiting(late.session.conn_id)
    assert late.session.buffer_size == credit.target()
    assert credit.total_committed() == credit.total_granted() <= credit.pool
    for p in idle:
        s = p.session
        assert p.buffer_limits and p.buffer_limits[-1].size == s.buffer_size
        assert s.transfers.promised == s.buffer_size  # the shrink's promise drained at once
        assert s.window_listener is None
        assert not p.errors
    assert late.credit.may_send()


def test_the_late_producer_sends_its_share_and_the_idle_ones_still_may_send() -> None:
    h, idle, late = idle_then_late(fences=True)
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    sent = 0
    while late.can_send():
        late.send("", "q", b"x" * 60_000)
        sent += 1
    assert sent > 1 and not late.errors
    for p in idle:  # every byte the new limit allows goes through without a CREDIT_VIOLATION
        while p.can_send():
            p.send("", "q", b"y" * 60_000)
        assert not p.errors and p.session.fault is None


def test_an_answer_below_the_bytes_received_ends_the_connection() -> None:
    h = Harness(credit={"policy": "static", "static_size": 100_000})
    p = h.producer("p")
    p.register()
    p.pump()
    with pytest.raises(SessionFault) as raised:
        p.handle(BufferLimit(1, 100_000, 10))
    assert raised.value.code is ErrorCode.CREDIT_VIOLATION
    assert "below the" in str(raised.value)


def test_an_answer_to_a_buffer_control_never_sent_ends_the_connection() -> None:
    h = Harness(credit={"policy": "static", "static_size": 100_000})
    p = h.producer("p")
    p.register()
    with pytest.raises(SessionFault) as raised:
        p.handle(BufferLimit(7, 100_000, 10**6))
    assert raised.value.code is ErrorCode.CREDIT_VIOLATION


def test_a_stale_answer_changes_nothing() -> None:
    """Shrunk, then grown again before the answer arrived: transfers admitted under the grow may follow it."""
    h, idle, late = idle_then_late(fences=False)
    p = idle[0]
    s = p.session
    controls = len(p.buffer_controls)
    limit = s.receiver_window.limit
    late.close()  # idle0's grant grows again: a BUFFER_CONTROL the stale answer below does not know
    p.pump()
    assert len(p.buffer_controls) == controls + 1
    p.handle(BufferLimit(controls, p.buffer_controls[controls - 1].buffer_size, s.receiver_window.position))
    assert s.receiver_window.limit >= limit and s.fault is None
    p.handle(Transfer(p.next_id, [TransferEntry("amq.fanout", "", b"z" * 1000)]))  # still within the old limit
    assert not p.errors and s.fault is None
