"""Consumer credit in the core: prefetch, DCP byte buffers (subscription and connection level),
buffer acknowledgements, settlement, requeue and session close."""

from __future__ import annotations

import pytest
from tests.broker.coreharness import Consumer, Harness, Producer

from flowbroker.broker.session import SessionFault
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Cancel, Deliver, Error, Ok, Subscribe

BODY = b"x" * 40
SIZE = message_size(BODY)
BUFFER = SIZE + SIZE // 2
"""A buffer of 1.5 messages: the first goes, the second overflows it, the third waits."""


def setup(*queues: str, n: int = 0) -> tuple[Harness, Producer]:
    h = Harness(credit={"policy": "static", "static_size": 1 << 20})
    for q in queues:
        h.queue(q, flow_stop_count=0, flow_stop_size=0)
    p = h.producer()
    for i in range(n):
        for q in queues:
            p.send("", q, BODY[:-3] + b"%03d" % i)
    return h, p


def delivered(c: Consumer, sub: int | None = None) -> int:
    c.pump()
    return len(c.bodies(sub))


def test_prefetch_bounds_unsettled() -> None:
    h, p = setup("q", n=6)
    c = h.consumer()
    c.subscribe("q", prefetch=2)
    assert delivered(c) == 2
    c.ack(c.tags()[:1])
    assert delivered(c) == 3
    c.ack()
    assert delivered(c) == 5
    assert len(c.unsettled) == 2


def test_zero_prefetch_is_capped_by_broker_maximum() -> None:
    h = Harness(queues={"max_prefetch": 3})
    h.queue("q")
    p = h.producer()
    for i in range(5):
        p.send("", "q", b"%d" % i)
    c = h.consumer()
    answer = c.request(lambda rid: Subscribe(rid, 1, "q", 0, 0))
    assert isinstance(answer, Ok) and answer.result["prefetch"] == 3
    assert delivered(c) == 3


def test_subscription_buffer_pauses_allows_one_overflow_and_resumes_on_ack() -> None:
    h, p = setup("q", n=6)
    c = h.consumer()
    sub = c.subscribe("q", buffer_size=BUFFER)
    assert delivered(c) == 2  # 0 < BUFFER: one; SIZE < BUFFER: a second overflows the buffer; 2 SIZE: pause
    c.ack()  # settlement is not a buffer acknowledgement
    assert delivered(c) == 2
    c.buffer_ack(sub, acked_position=SIZE)  # absolute: 2 SIZE - SIZE = SIZE < BUFFER -> one more
    assert delivered(c) == 3
    c.buffer_ack(sub, acked_position=SIZE)  # a duplicate changes nothing
    c.buffer_ack(sub, acked_position=10)  # nor does a stale one
    assert delivered(c) == 3
    c.buffer_ack(sub)  # everything delivered (3 SIZE): two more
    assert delivered(c) == 5
    with pytest.raises(SessionFault) as info:
        c.buffer_ack(sub, acked_position=c.delivered_bytes[sub] + 1)
    assert info.value.code is ErrorCode.CREDIT_VIOLATION


def test_message_bigger_than_the_whole_buffer_goes_when_empty() -> None:
    h, p = setup("q")
    big = b"B" * 500
    p.send("", "q", big)
    p.send("", "q", big)
    c = h.consumer()
    sub = c.subscribe("q", buffer_size=50)
    assert c.bodies() == [big]
    c.buffer_ack(sub, acked_position=message_size(big) - 1)  # 1 byte outstanding of 50: space left
    assert delivered(c) == 2


def test_connection_level_buffer_pauses_all_subscriptions() -> None:
    h, p = setup("a", "b", n=5)
    c = h.consumer()
    c.set_buffer(0, BUFFER)
    c.subscribe("a", sub_id=1)
    c.subscribe("b", sub_id=2)
    assert delivered(c) == 2  # shared: SIZE, 2 SIZE -> full for both
    c.buffer_ack(0, acked_position=SIZE)  # one more on either subscription
    assert delivered(c) == 3
    c.buffer_ack(0)
    assert delivered(c) == 5
    # the connection buffer acknowledged bytes of both subscriptions; 0 turns it off
    c.set_buffer(0, 0)
    assert delivered(c) == 10


def test_both_levels_apply() -> None:
    h, p = setup("q", n=10)
    c = h.consumer()
    c.set_buffer(0, 10 * SIZE)
    sub = c.subscribe("q", buffer_size=BUFFER)
    assert delivered(c) == 2  # the subscription level is the tighter here
    c.buffer_ack(sub)
    assert delivered(c) == 4
    c.set_buffer(0, 3 * BUFFER)  # now the connection level is: 4 SIZE < 4.5 SIZE -> one more (5 SIZE), then full
    c.buffer_ack(sub)
    assert delivered(c) == 5
    c.buffer_ack(sub)  # subscription has space, connection does not
    assert delivered(c) == 5
    c.buffer_ack(0)
    assert delivered(c) == 7


def test_zero_disables_subscription_buffer_mid_stream() -> None:
    h, p = setup("q", n=6)
    c = h.consumer()
    sub = c.subscribe("q", buffer_size=BUFFER)
    assert delivered(c) == 2
    c.set_buffer(sub, 0)
    assert delivered(c) == 6
    c.set_buffer(sub, BUFFER)  # back on: 6 SIZE unacknowledged, nothing more until acked
    p.send("", "q", BODY)
    assert delivered(c) == 6
    c.buffer_ack(sub)
    assert delivered(c) == 7


def test_slow_subscription_does_not_pause_fast_one_on_same_connection() -> None:
    h, p = setup("slow", "fast", n=20)
    c = h.consumer()
    slow = c.subscribe("slow", buffer_size=BUFFER, sub_id=1)
    fast = c.subscribe("fast", buffer_size=BUFFER, sub_id=2)
    c.pump()
    for _ in range(9):
        c.ack([t for t in c.tags(fast)])
        c.buffer_ack(fast)
        c.pump()
    assert len(c.bodies(fast)) == 20
    assert len(c.bodies(slow)) == 2


def test_buffer_control_for_unknown_subscription_is_an_error() -> None:
    h, p = setup("q")
    c = h.consumer()
    c.set_buffer(42, 100)
    c.pump()
    assert [e.code for e in c.errors] == [ErrorCode.NOT_FOUND]


def test_buffer_ack_for_cancelled_subscription_is_ignored() -> None:
    h, p = setup("q", n=2)
    c = h.consumer()
    sub = c.subscribe("q", buffer_size=10)
    answer = c.request(lambda rid: Cancel(rid, sub))
    # CANCEL gives the subscription's unsettled delivery back to the queue (the SDK relies on it)
    assert isinstance(answer, Ok) and answer.result == {"requeued": 1}
    c.buffer_ack(sub)  # a late buffer ack for the cancelled subscription is ignored
    c.pump()
    assert c.errors == []
    assert h.core.queues["q"].count == 2
    assert len(h.core.queues["q"].store) == 2


def test_requeue_keeps_order_and_marks_redelivered() -> None:
    h, p = setup("q", n=5)
    c = h.consumer()
    c.subscribe("q", prefetch=3)
    c.pump()
    first = [e for _, e in c.deliveries]
    assert [e.redelivered for e in first] == [False] * 3
    c.requeue([first[2].delivery_tag, first[0].delivery_tag, first[1].delivery_tag])
    c.pump()
    again = [e for _, e in c.deliveries[3:]]
    assert [e.body for e in again] == [e.body for e in first]  # same order, ahead of the rest
    assert all(e.redelivered for e in again)
    assert all(e.delivery_tag > first[-1].delivery_tag for e in again)
    c.ack()
    c.pump()
    rest = [e for _, e in c.deliveries[6:]]
    assert [e.body[-3:] for e in rest] == [b"003", b"004"] and not any(e.redelivered for e in rest)


def test_partial_requeue_goes_ahead_of_ready() -> None:
    h, p = setup("q", n=4)
    c = h.consumer()
    c.subscribe("q", prefetch=2)
    c.pump()
    t0, t1 = c.tags()
    c.requeue([t1])
    c.pump()
    assert [e.body[-3:] for _, e in c.deliveries] == [b"000", b"001", b"001"]
    c.ack()
    c.pump()
    assert [e.body[-3:] for _, e in c.deliveries[3:]] == [b"002", b"003"]


def test_close_session_requeues_unsettled_in_order() -> None:
    h, p = setup("q", n=6)
    a = h.consumer("a")
    a.subscribe("q", prefetch=3)
    a.pump()
    a.ack(a.tags()[:1])  # 000 acked; 001..003 unsettled
    a.pump()
    assert len(a.unsettled) == 3
    a.close()
    q = h.core.queues["q"]
    assert (q.count, len(q.store)) == (5, 5)
    b = h.consumer("b")
    b.subscribe("q")
    got = [(e.body[-3:], e.redelivered) for _, e in b.deliveries]
    assert got == [(b"001", True), (b"002", True), (b"003", True), (b"004", False), (b"005", False)]


def test_settle_unknown_tag_is_reported_not_fatal() -> None:
    h, p = setup("q", n=1)
    c = h.consumer()
    c.subscribe("q")
    c.ack([99])
    c.pump()
    assert [e.code for e in c.errors] == [ErrorCode.UNKNOWN_DELIVERY]
    c.ack()
    assert h.core.queues["q"].count == 0


def test_round_robin_between_subscriptions_of_one_queue() -> None:
    h, p = setup("q", n=6)
    a = h.consumer("a")
    b = h.consumer("b")
    a.subscribe("q", prefetch=100)
    b.subscribe("q", prefetch=100)  # a took everything ready when it subscribed
    a.pump()
    b.pump()
    assert (len(a.bodies()), len(b.bodies())) == (6, 0)
    for i in range(4):
        p.send("", "q", b"n%d" % i)
    a.pump()
    b.pump()
    assert len(a.bodies()) + len(b.bodies()) == 10
    assert len(b.bodies()) == 2


def test_large_deliveries_are_split_into_frames_under_the_frame_budget() -> None:
    h = Harness(server={"max_frame_size": 4096, "max_message_size": 2000})
    h.queue("q")
    p = h.producer()
    for i in range(10):
        p.send("", "q", b"%d" % i + b"y" * 400)
    c = h.consumer()
    c.subscribe("q")
    frames = [f for f in c.frames if isinstance(f, Deliver)]
    assert len(frames) > 1
    assert all(sum(len(e[3]) for e in f.entries) <= 4096 // 4 + 500 for f in frames)
    assert [e.body[:1] for _, e in c.deliveries] == [b"%d" % i for i in range(10)]
    tags = [e.delivery_tag for _, e in c.deliveries]
    assert tags == sorted(tags) and len(set(tags)) == 10


def test_subscribe_errors() -> None:
    h, p = setup("q")
    c = h.consumer()
    c.subscribe("q", sub_id=1)
    dup = c.request(lambda rid: Subscribe(rid, 1, "q", 0, 0))
    assert isinstance(dup, Error) and dup.code is ErrorCode.ALREADY_EXISTS
    missing = c.request(lambda rid: Subscribe(rid, 2, "nope", 0, 0))
    assert isinstance(missing, Error) and (missing.code, missing.destination) == (ErrorCode.NOT_FOUND, "nope")
