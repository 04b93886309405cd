"""The credit pool in the core: however many flow-controlled connections there are, idle or not, and
whatever a producer does with a limit it was granted before a shrink, the grants (provisional and
waiting ones included) and the windows stay within the policy's pool (issue 8, item 3)."""

from __future__ import annotations

import pytest
from tests.broker.coreharness import Harness, Producer

from flowbroker.broker import views
from flowbroker.broker.session import SessionFault
from flowbroker.policies.credit import WAIT_GRANT
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Transfer, TransferEntry

BODY = b"b" * 60_000
SIZE = message_size(BODY)


def check_pool(h: Harness) -> dict[str, int]:
    """What the admin view reports, checked against the sessions themselves."""
    credit = h.core.credit
    view = views.policy_view(h.core)
    flow_controlled = [s for s in h.core.sessions.values() if s.flow_control]
    granted = sum(s.buffer_size for s in flow_controlled)
    assert view["granted"]["total"] == granted == credit.total_granted() <= credit.pool
    windows = sum(max(s.buffer_size, s.receiver_window.limit - s.receiver_window.acked_position) for s in flow_controlled)
    assert view["committed"] == windows == credit.total_committed() <= credit.pool
    assert all(s.buffer_size >= WAIT_GRANT for s in flow_controlled)
    return {"granted": granted, "committed": windows, "waiting": view["granted"]["waiting"]}


def test_1000_flow_controlled_connections_half_idle_stay_within_the_pool() -> None:
    h = Harness(server={"memory_quota": 1 << 30})  # aggressive, 5 %: a pool of 53687091 bytes
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    consumer = h.consumer("drain")
    consumer.subscribe("q")
    producers: list[Producer] = []
    idle: list[Producer] = []
    for i in range(1000):
        p = h.producer(f"p{i}")
        if i % 2:
            idle.append(p)  # connected, flow control on, never sends: provisional, one byte
        else:
            p.send("", "q", BODY)  # its first transfer makes it a producer
            producers.append(p)
        if i % 100 == 99:
            check_pool(h)
    for _ in range(3):  # every producer sends what its grant allows, the consumer drains the queue
        for p in producers:
            p.pump()
            while p.can_send():
                p.send("", "q", BODY)
        consumer.pump()
        consumer.ack()
        figures = check_pool(h)
    assert all(p.session.buffer_size == WAIT_GRANT for p in idle)
    assert figures["waiting"] > 0  # 500 producers do not fit: the pool gives shares to some, in order
    pool = h.core.credit.pool
    assert figures["granted"] <= pool
    for p in producers[:250]:  # half the producers leave: waiting ones are upgraded as shares free up
        p.close()
    check_pool(h)
    free = pool - h.core.credit.total_committed()
    assert h.core.credit.waiting() == 0 or free < h.core.credit.need() + h.core.credit.reserve


def test_producers_that_ignore_shrinks_cannot_hold_more_than_the_pool() -> None:
    """The issue's 887 MB: early producers keep a large credit limit after `aggressive` shrinks it.
    Here 30 attackers, each told a share as it joins, send up to every limit the broker ever allowed
    them (never reading a BUFFER_CONTROL) into a flow-stopped queue, where everything is held."""
    h = Harness(server={"memory_quota": 1 << 30, "max_message_size": 65536})  # pool 51.2 MiB
    h.queue("q", flow_stop_count=1)
    legacy = h.producer("legacy", flow_control=False)
    legacy.send("", "q", b"first")  # the queue is now at its stop threshold: what follows is held
    attackers: list[Producer] = []
    for i in range(30):
        a = h.producer(f"attacker{i}")
        a.reads_credit = False
        a.handle(Transfer(1, [TransferEntry("", "q", BODY)]))  # registers
        a.next_id = 2
        attackers.append(a)
        for b in attackers:  # everyone sends up to the highest limit it was ever granted
            s = b.session
            while s.receiver_window.position < s.receiver_window.limit:
                b.handle(Transfer(b.next_id, [TransferEntry("", "q", BODY)]))
                b.next_id += 1
        check_pool(h)
    held = sum(a.session.receiver_window.position for a in attackers)
    pool = h.core.credit.pool
    # what the pool bounds, plus DCP's one message of overflow per connection
    assert held <= pool + 30 * SIZE
    assert h.core.queues["q"].size <= message_size(b"first") + pool + 30 * SIZE
    assert held > pool // 2  # they did fill what they were given


def test_a_connection_beyond_the_pools_reserve_is_refused_alone() -> None:
    """Only when the pool is smaller than two bytes per connection slot: here 2 slots, so a third
    flow-controlled connection finds no byte for its wait grant and is closed with RESOURCE_EXHAUSTED."""
    h = Harness(server={"memory_quota": 1 << 30, "max_connections": 2}, credit={"policy": "static"})
    h.queue("q", flow_stop_count=0, flow_stop_size=0)
    a, b = h.producer("a"), h.producer("b")
    c = h.producer("c")
    assert c.session.fault is not None and c.session.fault.code is ErrorCode.RESOURCE_EXHAUSTED
    with pytest.raises(SessionFault) as info:
        c.send("", "q", BODY, force=True)
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and "reserve" in str(info.value)
    h.core.close_session(c.session)
    legacy = h.producer("legacy", flow_control=False)  # not paced: needs no grant
    for p in (a, b, legacy):
        p.send("", "q", BODY)
        p.pump()
        assert p.errors == []
    check_pool(h)


def test_a_user_capped_below_one_maximum_message_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    """A user whose credit_share_percent caps it below one maximum message has every producer wait for good:
    documented, but the broker said nothing (a tester's producer waited beside a consumer on an empty
    queue). Logged once per user and share, at its connection or at the new share."""
    import logging

    h = Harness(server={"memory_quota": 1 << 30})  # S about 53 MB: 1 % is below 4 MiB + 512, 100 % is not
    floor = h.core.credit.floor
    with caplog.at_level(logging.WARNING, logger="flowbroker.broker"):
        for _ in range(2):
            h.core.open_session("mallory-app", "mallory", True, lambda: None, credit_share_percent=1)
        h.core.open_session("alice-app", "alice", True, lambda: None, credit_share_percent=100)
    warned = [r.getMessage() for r in caplog.records if "below one maximum message" in r.getMessage()]
    assert len(warned) == 1 and "user 'mallory'" in warned[0] and f"({floor} bytes" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flowbroker.broker"):
        h.core.set_credit_share("mallory", 2)  # still below: said again, for the new share
        h.core.set_credit_share("mallory", 100)  # above: nothing
    assert sum("below one maximum message" in r.getMessage() for r in caplog.records) == 1
