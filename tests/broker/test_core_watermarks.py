"""Queue watermarks in the core: held completions, FLOW_STOPPED / FLOW_RESUMED, release paths."""

from __future__ import annotations

import pytest

from tests.broker.coreharness import Consumer, Harness, MiB, Producer

from flowbroker.protocol.credit import message_size
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import (
    Complete,
    DeleteQueue,
    Error,
    FlowResumed,
    FlowStopped,
    Ok,
    Transfer,
    TransferEntry,
)


def make(**credit: object) -> Harness:
    return Harness(credit={"policy": "static", "static_size": 1 << 20, **credit})


def tag_of(c: Consumer, body: bytes) -> int:
    for tag, (_, entry) in c.unsettled.items():
        if entry.body == body:
            return tag
    raise AssertionError(f"{body!r} is not an unsettled delivery of {c.session!r}")


def flow(p: Producer) -> list[tuple[str, str]]:
    return [(type(e).__name__, e.destination) for e in p.flow_events]


def test_saturate_hold_then_resume_completes_held_transfers() -> None:
    h = make()
    h.queue("q", flow_stop_count=4, flow_resume_count=3)
    p = h.producer()
    for i in range(1, 7):
        assert p.send("", "q", b"m%d" % i) == i
    frames = p.pump()
    stopped = [f for f in frames if isinstance(f, FlowStopped)]
    assert len(stopped) == 1
    s = stopped[0]
    assert (s.destination, s.threshold, s.limit, s.value) == ("q", "flow_stop_count", 4, 5)
    assert "q" in s.reason
    assert [f for f in frames if isinstance(f, Complete)] == [Complete(4, [])]
    assert sorted(p.outstanding) == [5, 6]
    assert set(p.stopped) == {"q"}

    c = h.consumer()
    c.subscribe("q")
    assert c.bodies() == [b"m%d" % i for i in range(1, 7)]  # held messages are delivered all the same
    c.ack([tag_of(c, b"m1"), tag_of(c, b"m2"), tag_of(c, b"m3")])  # count 3: not under resume 3
    assert p.pump() == []
    assert sorted(p.outstanding) == [5, 6]
    c.ack([tag_of(c, b"m4")])  # count 2 < 3: clear
    frames = p.pump()
    assert FlowResumed("q") in frames
    assert p.outstanding == {}
    assert p.completed.cumulative == 6
    assert p.stopped == {}
    assert flow(p) == [("FlowStopped", "q"), ("FlowResumed", "q")]


def test_count_or_size_trips_and_both_must_be_under_resume() -> None:
    small = message_size(b"s0")
    big_body = b"B" * (8 * small)
    big_size = message_size(big_body)
    stop, resume = 6 * small + big_size // 2, 8 * small
    h = make()
    h.queue("q", flow_stop_count=10, flow_resume_count=5, flow_stop_size=stop, flow_resume_size=resume)
    p = h.producer()
    for i in range(6):
        p.send("", "q", b"s%d" % i)  # 6 small: under both stop thresholds
    big = p.send("", "q", big_body)  # 6 small + big > stop: size trips, count (7) does not
    p.pump()
    s = p.received(FlowStopped)[0]
    assert (s.threshold, s.limit) == ("flow_stop_size", stop)
    assert s.value == 6 * small + big_size
    assert list(p.outstanding) == [big]

    c = h.consumer()
    c.subscribe("q")
    c.ack([tag_of(c, big_body)])  # the held message itself: released at once
    p.pump()
    assert p.is_complete(big)
    # size 6 small < resume (8 small), count 6 is not < 5: still saturated, the next transfer is held
    assert p.received(FlowResumed) == []
    nxt = p.send("", "q", b"s6")
    p.pump()
    assert list(p.outstanding) == [nxt]
    assert len(p.received(FlowStopped)) == 1  # told once per saturation, not per transfer
    c.pump()
    c.ack([tag_of(c, b"s0"), tag_of(c, b"s1")])  # count 5, not < 5
    p.pump()
    assert list(p.outstanding) == [nxt]
    c.ack([tag_of(c, b"s2")])  # count 4, size 4 small: both under resume
    p.pump()
    assert p.outstanding == {}
    assert flow(p) == [("FlowStopped", "q"), ("FlowResumed", "q")]


def test_count_trips_size_must_also_be_under_resume() -> None:
    one, large = message_size(b"b"), message_size(b"A" * 1500)
    # size never trips (at most large + 2 one), and only `large` alone keeps it over resume
    stop, resume = large + 3 * one, (large + one) // 2
    h = make()
    h.queue("q", flow_stop_count=2, flow_resume_count=2, flow_stop_size=stop, flow_resume_size=resume)
    p = h.producer()
    p.send("", "q", b"A" * 1500)
    p.send("", "q", b"b")
    third = p.send("", "q", b"c")  # count 3 > 2
    p.pump()
    s = p.received(FlowStopped)[0]
    assert (s.threshold, s.limit, s.value) == ("flow_stop_count", 2, 3)
    c = h.consumer()
    c.subscribe("q")
    c.ack([tag_of(c, b"b")])  # count 2, not < 2
    p.pump()
    assert list(p.outstanding) == [third]
    # a fourth message while still saturated
    fourth = p.send("", "q", b"d")
    c.pump()
    c.ack([tag_of(c, b"d")])  # held itself: released; count 2
    p.pump()
    assert list(p.outstanding) == [third] and p.is_complete(fourth)
    # count 1 < 2 but size `large` >= resume: still saturated
    c.ack([tag_of(c, b"c")])
    p.pump()
    assert p.is_complete(third)
    assert p.received(FlowResumed) == []
    held = p.send("", "q", b"e")
    p.pump()
    assert list(p.outstanding) == [held]
    c.pump()
    c.ack([tag_of(c, b"A" * 1500)])  # count 1, size `one` < resume: clear
    p.pump()
    assert p.outstanding == {} and p.received(FlowResumed) == [FlowResumed("q")]


def test_qpid_defaults_without_arguments() -> None:
    h = make(static_size=256 * MiB)
    p = h.producer()
    assert isinstance(p.declare_queue("q"), Ok)
    t = h.core.queues["q"].thresholds
    assert (t.max_size, t.flow_stop_size, t.flow_resume_size) == (100 * MiB, 83886080, 73400320)
    assert (t.max_count, t.flow_stop_count) == (0, 0)
    body = b"\0" * MiB  # one bytes object shared by every message: cheap
    for _ in range(79):
        p.send("", "q", body)
    p.pump()
    assert p.outstanding == {} and p.received(FlowStopped) == []
    size = message_size(body)
    assert 79 * size <= 83886080 < 80 * size and 69 * size < 73400320 <= 70 * size
    eightieth = p.send("", "q", body)  # 80 MiB + 80 x the overhead > 80 % of 100 MiB
    p.pump()
    s = p.received(FlowStopped)[0]
    assert (s.destination, s.threshold, s.limit, s.value) == ("q", "flow_stop_size", 83886080, 80 * size)
    assert list(p.outstanding) == [eightieth]
    c = h.consumer()
    c.subscribe("q", prefetch=11)
    c.pump()  # (the outbox passes the writer 8 MiB of deliveries at a time: MAX_DELIVERY_BYTES_WAITING)
    assert len(c.tags()) == 11
    c.ack(c.tags()[:10])  # 70 messages: 70 MiB + 70 x the overhead, not under 70 % = 73400320
    p.pump()
    assert list(p.outstanding) == [eightieth]
    c.pump()
    c.ack(c.tags()[:1])  # 69 messages
    p.pump()
    assert p.outstanding == {} and p.received(FlowResumed) == [FlowResumed("q")]


def test_held_message_acked_is_released_while_queue_stays_saturated() -> None:
    h = make()
    h.queue("q", flow_stop_count=2)  # resume = stop
    p = h.producer()
    for i in range(1, 5):
        p.send("", "q", b"m%d" % i)
    p.pump()
    assert sorted(p.outstanding) == [3, 4]
    c = h.consumer()
    c.subscribe("q")
    c.ack([tag_of(c, b"m4")])
    frames = p.pump()
    assert Complete(2, [(4, 4)]) in frames  # out of order: a range above the cumulative point
    assert sorted(p.outstanding) == [3]
    assert p.received(FlowResumed) == []
    assert h.core.queues["q"].saturated
    c.ack([tag_of(c, b"m1"), tag_of(c, b"m2")])  # count 1 < 2: clear releases m3
    frames = p.pump()
    assert Complete(4, []) in frames and FlowResumed("q") in frames


def test_rejected_and_requeued_held_messages() -> None:
    h = make()
    h.queue("q", flow_stop_count=1)
    p = h.producer()
    p.send("", "q", b"m1")
    held = p.send("", "q", b"m2")
    p.pump()
    c = h.consumer()
    c.subscribe("q")
    c.requeue([tag_of(c, b"m2")])  # a requeue keeps the message, and with it the hold
    p.pump()
    assert list(p.outstanding) == [held]
    c.pump()
    c.reject([tag_of(c, b"m2")])  # rejected: dequeued for good, released
    p.pump()
    assert p.outstanding == {}


def test_two_destinations_one_saturated_completes_only_when_it_releases() -> None:
    h = make()
    h.queue("a", flow_stop_count=2)
    h.queue("b", flow_stop_count=100)
    p = h.producer()
    assert isinstance(p.declare_exchange("fan", "fanout"), Ok)
    assert isinstance(p.bind("a", "fan"), Ok) and isinstance(p.bind("b", "fan"), Ok)
    ids = [p.send("fan", "", b"m%d" % i) for i in range(1, 4)]
    p.pump()
    assert list(p.outstanding) == [ids[2]]
    assert [(f.destination) for f in p.received(FlowStopped)] == ["a"]
    cb = h.consumer("cb")
    cb.subscribe("b")
    cb.ack()  # draining the unsaturated destination changes nothing
    assert p.pump() == []
    assert list(p.outstanding) == [ids[2]]
    ca = h.consumer("ca")
    ca.subscribe("a")
    ca.ack([tag_of(ca, b"m1")])  # a: count 2, not < 2
    assert p.pump() == []
    ca.ack([tag_of(ca, b"m2")])  # a: count 1 -> clear
    frames = p.pump()
    assert FlowResumed("a") in frames and p.outstanding == {}


def test_transfer_held_by_two_saturated_queues_needs_both() -> None:
    h = make()
    h.queue("a", flow_stop_count=1)
    h.queue("b", flow_stop_count=1)
    p = h.producer()
    assert isinstance(p.declare_exchange("t", "topic"), Ok)
    p.bind("a", "t", "x.#")
    p.bind("b", "t", "x.y")
    p.send("t", "x.y", b"m1")
    held = p.send("t", "x.y", b"m2")
    p.pump()
    assert {f.destination for f in p.received(FlowStopped)} == {"a", "b"}
    ca = h.consumer()
    ca.subscribe("a")
    ca.ack()  # a clears and releases its share
    p.pump()
    assert p.received(FlowResumed) == [FlowResumed("a")]
    assert list(p.outstanding) == [held]  # b still holds it
    result = p.purge("b")
    assert isinstance(result, Ok) and result.result == {"purged": 2}
    p.pump()
    assert p.outstanding == {}
    assert FlowResumed("b") in p.received(FlowResumed)
    assert h.core.queues["b"].count == 0


def test_purge_releases_held_transfers_but_unsettled_keep_queue_saturated() -> None:
    h = make()
    h.queue("q", flow_stop_count=1)
    p = h.producer()
    c = h.consumer()
    c.subscribe("q", prefetch=1)
    ids = [p.send("", "q", b"m%d" % i) for i in range(1, 4)]
    p.pump()
    assert sorted(p.outstanding) == ids[1:]
    c.pump()
    assert c.bodies() == [b"m1"]
    result = p.purge("q")
    assert isinstance(result, Ok) and result.result == {"purged": 2}
    p.pump()
    assert p.outstanding == {}  # purged messages released their holds
    assert p.received(FlowResumed) == []  # m1 is still unsettled: count 1, not < 1
    q = h.core.queues["q"]
    assert (q.count, q.saturated) == (1, True)
    c.ack()
    p.pump()
    assert p.received(FlowResumed) == [FlowResumed("q")]
    assert (q.count, q.size, q.saturated) == (0, 0, False)


def test_delete_releases_held_and_cancels_subscriptions_with_error() -> None:
    h = make()
    h.queue("q", flow_stop_count=1)
    p = h.producer()
    c = h.consumer()
    sub = c.subscribe("q", prefetch=1)
    for i in range(1, 4):
        p.send("", "q", b"m%d" % i)
    p.pump()
    c.pump()
    assert len(p.outstanding) == 2 and c.bodies() == [b"m1"]
    answer = p.request(lambda rid: DeleteQueue(rid, "q"))
    assert isinstance(answer, Ok) and answer.result == {"deleted": 3}
    p.pump()
    assert p.outstanding == {} and FlowResumed("q") in p.received(FlowResumed)
    c.pump()
    errors = [e for e in c.errors if e.code is ErrorCode.NOT_FOUND]
    assert len(errors) == 1 and errors[0].destination == "q"
    assert sub not in c.session.subscriptions
    c.ack()  # settling a delivery of the deleted queue is harmless
    c.pump()
    assert [e for e in c.errors if e.code is ErrorCode.UNKNOWN_DELIVERY] == []
    tid = p.send("", "q", b"late")
    p.pump()
    late = p.errors_for(tid)
    assert [(e.code, e.destination) for e in late] == [(ErrorCode.NOT_FOUND, "q")]
    assert p.is_complete(tid)


def test_runtime_threshold_change_releases_and_stops() -> None:
    h = make()
    h.queue("q", flow_stop_count=2)
    p = h.producer()
    for i in range(4):
        p.send("", "q", b"m%d" % i)
    p.pump()
    assert len(p.outstanding) == 2
    h.core.set_queue_thresholds("q", {"flow_stop_count": 10})  # raised: re-evaluated at once
    frames = p.pump()
    assert FlowResumed("q") in frames and p.outstanding == {}
    assert p.send("", "q", b"m4") and p.pump() and p.outstanding == {}  # count 5 <= 10: completes

    h.core.set_queue_thresholds("q", {"flow_stop_count": 3, "flow_resume_count": 1})  # lowered under count 5
    assert h.core.queues["q"].saturated
    nxt = p.send("", "q", b"m5")
    p.pump()
    assert list(p.outstanding) == [nxt]
    s = p.received(FlowStopped)[-1]
    assert (s.threshold, s.limit) == ("flow_stop_count", 3) and s.value >= 4
    # a raise that is still not under resume (count 6 >= 1) keeps the hold
    h.core.set_queue_thresholds("q", {"flow_stop_count": 4, "flow_resume_count": 1})
    assert p.pump() == [] and list(p.outstanding) == [nxt]
    h.core.set_queue_thresholds("q", {"flow_stop_size": 0, "flow_stop_count": 0})  # watermarks off
    frames = p.pump()
    assert FlowResumed("q") in frames and p.outstanding == {}


def test_legacy_producer_reject_names_queue_and_keeps_connection() -> None:
    h = make()
    h.queue("q", max_count=2, overflow="reject")
    p = h.producer(flow_control=False)
    assert p.session.buffer_size == 0
    ids = [p.send("", "q", b"m%d" % i) for i in range(3)]
    p.pump()
    (err,) = p.errors
    assert (err.code, err.ref_id, err.destination) == (ErrorCode.QUEUE_FULL, ids[2], "q")
    assert "'q'" in err.text
    assert p.outstanding == {}  # refused transfers still complete
    assert p.session.conn_id in h.core.sessions
    c = h.consumer()
    c.subscribe("q")
    assert c.bodies() == [b"m0", b"m1"]
    c.ack()
    tid = p.send("", "q", b"again")
    p.pump()
    assert p.is_complete(tid) and p.errors_for(tid) == []
    c.pump()
    assert c.bodies()[-1] == b"again"


def test_legacy_producer_drop_head_keeps_newest() -> None:
    h = make()
    h.queue("q", max_count=2, overflow="drop-head")
    p = h.producer(flow_control=False)
    for i in range(5):
        p.send("", "q", b"m%d" % i)
    p.pump()
    assert p.errors == [] and p.outstanding == {}
    q = h.core.queues["q"]
    assert (q.count, q.counters.dropped) == (2, 3)
    c = h.consumer()
    c.subscribe("q")
    assert c.bodies() == [b"m3", b"m4"]


def test_legacy_producer_never_paced_by_credit() -> None:
    h = make(static_size=100)
    h.queue("q")
    p = h.producer(flow_control=False)
    for i in range(50):
        p.send("", "q", b"x" * 100)  # far beyond any buffer: no violation for a legacy producer
    p.pump()
    assert p.outstanding == {} and p.grants == []


def test_message_too_large_and_unknown_destinations() -> None:
    h = Harness(server={"max_message_size": 100}, credit={"policy": "static", "static_size": 10_000})
    h.queue("q")
    p = h.producer()
    ok = p.send("", "q", b"x" * 99)  # with its routing key "q": 100 bytes
    big = p.send("", "q", b"x" * 100)
    nowhere = p.send("", "nope", b"x")
    bad_exchange = p.send("missing", "k", b"x")
    p.pump()
    assert p.errors_for(ok) == []
    (e,) = p.errors_for(big)
    assert e.code is ErrorCode.MESSAGE_TOO_LARGE and "101 bytes" in e.text and "max_message_size 100" in e.text
    (e,) = p.errors_for(nowhere)
    assert (e.code, e.destination) == (ErrorCode.NOT_FOUND, "nope") and "nope" in e.text
    (e,) = p.errors_for(bad_exchange)
    assert (e.code, e.destination) == (ErrorCode.NOT_FOUND, "missing")
    assert p.outstanding == {}
    assert h.core.queues["q"].count == 1


def test_errors_in_a_batched_transfer_name_each_transfer_id() -> None:
    h = make()
    h.queue("q", max_count=1, flow_stop_count=0)
    p = h.producer(flow_control=False)  # the hard limit applies to producers without flow control
    ids = p.send_many([("", "q", b"a", None), ("", "nope", b"b", None), ("", "q", b"c", None)])
    p.pump()
    assert [(e.ref_id, e.code) for e in p.errors] == [(ids[1], ErrorCode.NOT_FOUND), (ids[2], ErrorCode.QUEUE_FULL)]
    assert p.outstanding == {} and p.completed.cumulative == 3


def test_hard_limit_never_refuses_a_flow_controlled_producer() -> None:
    """Credit bounds a flow-controlled producer; past the stop threshold its transfers are held, and the
    hard limit (meant for producers nothing else paces) must not refuse what credit already allowed."""
    h = make()
    h.queue("q", max_count=3, flow_stop_count=2, flow_resume_count=1)
    p = h.producer()
    p.register()  # a batch needs a share: the provisional grant (WAIT_GRANT) lets one message go
    legacy = h.producer("legacy", flow_control=False)
    ids = p.send_many([("", "q", b"m%d" % i, None) for i in range(5)])
    p.pump()
    assert p.errors == []
    assert h.core.queues["q"].count == 5  # over max_count: all held, none refused
    assert set(p.outstanding) == set(ids[2:])  # the messages past the stop threshold are held
    legacy.send("", "q", b"x")
    legacy.pump()
    assert [e.code for e in legacy.errors] == [ErrorCode.QUEUE_FULL]


@pytest.mark.parametrize("overflow", ["reject", "drop-head"])
def test_a_queue_without_flow_control_holds_every_producer_to_its_hard_limit(overflow: str) -> None:
    """With every stop threshold off, nothing holds a flow-controlled producer back at the queue: its
    hard limit must apply to it too (`flowbroker queue set --flow-stop-count 0 --flow-stop-size 0
    --max-count 2` used to let the CLI's flow-controlled publish put 4 messages in)."""
    h = make()
    h.queue("q", max_count=2, flow_stop_count=0, flow_stop_size=0, overflow=overflow)
    p = h.producer()
    p.register()
    for i in range(4):
        p.send("", "q", b"m%d" % i)
        p.pump()
    q = h.core.queues["q"]
    assert q.count == 2 and not q.saturated and p.outstanding == {}
    if overflow == "reject":
        assert [e.code for e in p.errors] == [ErrorCode.QUEUE_FULL] * 2 and q.counters.rejected == 2
    else:
        assert p.errors == [] and q.counters.dropped == 2


def test_stop_all_and_start_all_producers() -> None:
    h = make()
    h.queue("q")
    p1 = h.producer("p1")
    legacy = h.producer("legacy", flow_control=False)
    h.core.stop_all_producers()
    f = p1.pump()
    assert [(x.destination, x.threshold) for x in f if isinstance(x, FlowStopped)] == [("*", "admin")]
    assert legacy.pump() == []
    held = p1.send("", "q", b"a")
    free = legacy.send("", "q", b"b")
    p1.pump()
    legacy.pump()
    assert list(p1.outstanding) == [held]
    assert legacy.is_complete(free)  # legacy producers are never paced
    late = h.producer("late")  # connects while stopped: told at once
    assert [x.destination for x in late.pump() if isinstance(x, FlowStopped)] == ["*"]
    late_id = late.send("", "q", b"c")
    h.core.stop_all_producers()  # idempotent: no second notice
    assert p1.pump() == []
    h.core.start_all_producers()
    f = p1.pump()
    assert FlowResumed("*") in f and p1.outstanding == {}
    f = late.pump()
    assert FlowResumed("*") in f and late.is_complete(late_id)
    assert legacy.pump() == []
    assert h.core.queues["q"].count == 3


def test_admin_stop_and_saturated_queue_both_hold() -> None:
    h = make()
    h.queue("q", flow_stop_count=1)
    p = h.producer()
    p.send("", "q", b"a")
    h.core.stop_all_producers()
    held = p.send("", "q", b"b")  # held by the admin stop and by q
    p.pump()
    assert {x.destination for x in p.received(FlowStopped)} == {"*", "q"}
    h.core.start_all_producers()
    p.pump()
    assert list(p.outstanding) == [held]  # q still holds it
    c = h.consumer()
    c.subscribe("q")
    c.ack()
    p.pump()
    assert p.outstanding == {}


def test_transfer_id_gap_is_a_session_fault() -> None:
    import pytest

    from flowbroker.broker.session import SessionFault

    h = make()
    h.queue("q")
    p = h.producer()
    p.send("", "q", b"a")
    with pytest.raises(SessionFault) as info:
        p.handle(Transfer(5, [TransferEntry("", "q", b"b")]))
    assert info.value.code is ErrorCode.TRANSFER_ID_GAP


def test_flow_stopped_producer_that_disconnects_is_forgotten() -> None:
    h = make()
    h.queue("q", flow_stop_count=1)
    p = h.producer()
    p.send("", "q", b"a")
    p.send("", "q", b"b")
    p.pump()
    p.close()
    q = h.core.queues["q"]
    assert q.stopped_producers == {}
    c = h.consumer()
    c.subscribe("q")
    assert c.bodies() == [b"a", b"b"]  # its messages stay
    c.ack()
    assert (q.count, q.saturated) == (0, False)
    other = h.producer()
    other.send("", "q", b"c")
    other.pump()
    assert other.outstanding == {} and [e for e in other.frames if isinstance(e, Error)] == []


def test_drop_head_that_empties_a_saturated_queue_clears_it() -> None:
    """Dropping the oldest messages is a dequeue: when it takes the queue under its resume
    thresholds, held transfers complete at once, not at some later settlement."""
    small_size, legacy_size = message_size(b"s" * 18), message_size(b"L" * 168)
    resume = small_size + legacy_size + 50
    stop = resume + 200
    big_body = b"B" * (stop + 300)
    big_size = message_size(big_body)
    max_size = big_size + small_size + legacy_size - 82
    h = make()
    h.queue("q", max_size=max_size, overflow="drop-head", flow_stop_count=0, flow_stop_size=stop,
            flow_resume_size=resume)
    p = h.producer("p")
    legacy = h.producer("legacy", flow_control=False)
    big = p.send("", "q", big_body)  # big > stop: saturated, held
    small = p.send("", "q", b"s" * 18)  # held
    p.pump()
    assert sorted(p.outstanding) == [big, small]
    tid = legacy.send("", "q", b"L" * 168)  # big + small + legacy > max_size: drops the big head
    q = h.core.queues["q"]
    assert (q.count, q.size, q.counters.dropped) == (2, small_size + legacy_size, 1)
    frames = p.pump()
    assert p.outstanding == {}, "small + legacy < resume: the queue must clear"
    assert FlowResumed("q") in frames
    assert not q.saturated
    legacy.pump()
    assert legacy.is_complete(tid) and legacy.received(FlowStopped) == []


def test_a_stop_changed_alone_keeps_the_queues_resume_ratio() -> None:
    """`queue set --flow-stop-size 10MiB` (PATCH with a stop alone) must not silently drop the
    hysteresis to resume = stop: the resume moves with the stop, at the queue's own ratio."""
    h = make()
    h.queue("q", max_size=0, flow_stop_size=1000, flow_resume_size=800, max_count=100, flow_stop_count=10,
            flow_resume_count=5)
    t = h.core.set_queue_thresholds("q", {"flow_stop_size": 10 << 20}).thresholds
    assert (t.flow_stop_size, t.flow_resume_size) == (10 << 20, 8 << 20)
    assert (t.flow_stop_count, t.flow_resume_count) == (10, 5)  # the other dimension untouched
    t = h.core.set_queue_thresholds("q", {"flow_stop_count": 40}).thresholds
    assert (t.flow_stop_count, t.flow_resume_count) == (40, 20)
    # a queue without a stop takes the [queues] percentages' ratio (70 / 80 by default)
    h.queue("off", max_size=0)
    t = h.core.set_queue_thresholds("off", {"flow_stop_size": 8000}).thresholds
    assert (t.flow_stop_size, t.flow_resume_size) == (8000, 7000)
    # both given: exactly those; a resume above the stop is refused, naming it
    t = h.core.set_queue_thresholds("q", {"flow_stop_size": 100, "flow_resume_size": 100}).thresholds
    assert (t.flow_stop_size, t.flow_resume_size) == (100, 100)
    with pytest.raises(Exception, match="flow_resume_size"):
        h.core.set_queue_thresholds("q", {"flow_stop_size": 100, "flow_resume_size": 200})


def test_a_hard_limit_lowered_under_its_stop_derives_the_thresholds_from_the_new_limit() -> None:
    """`queue set --max-size 10MiB` on a queue with the defaults (stop 80 MiB) was refused, stop above
    max: the stop and resume are derived from the new limit instead, as for a queue declared with it."""
    h = make()
    h.queue("q")
    before = h.core.queues["q"].thresholds
    assert before.flow_stop_size > 10 << 20
    t = h.core.set_queue_thresholds("q", {"max_size": 10 << 20}).thresholds
    assert (t.max_size, t.flow_stop_size, t.flow_resume_size) == (10 << 20, 8 << 20, 7 << 20)
    t = h.core.set_queue_thresholds("q", {"max_size": 100 << 20}).thresholds  # raised: the derived stop follows
    assert (t.max_size, t.flow_stop_size, t.flow_resume_size) == (100 << 20, 80 << 20, 70 << 20)
    with pytest.raises(Exception, match="flow_stop_size"):  # a stop given with it is taken as given
        h.core.set_queue_thresholds("q", {"max_size": 1000, "flow_stop_size": 2000})


def test_a_first_max_count_set_on_a_queue_without_count_thresholds_derives_them() -> None:
    """`queue set Q --max-count 5` on a queue declared with the defaults left the count stop off, so a
    flow-controlled producer was never stopped: 2,001 messages in a queue of max_count 5 (a tester). As
    for a queue declared with max_count=5, the stop and resume are derived (4 and 3)."""
    h = make()
    h.queue("q")
    assert h.core.queues["q"].thresholds.flow_stop_count == 0
    t = h.core.set_queue_thresholds("q", {"max_count": 5}).thresholds
    assert (t.max_count, t.flow_stop_count, t.flow_resume_count) == (5, 4, 3)
    h.queue("off", max_count=10, flow_stop_count=0)  # a stop turned off on purpose stays off
    t = h.core.set_queue_thresholds("off", {"max_count": 20}).thresholds
    assert (t.max_count, t.flow_stop_count) == (20, 0)


def test_a_stop_derived_from_a_limit_follows_the_limit_when_it_changes() -> None:
    """`queue set --max-count 5` derives stop 4 / resume 3; `--max-count 0` then left the queue stopping at 4
    messages with no limit, and `--max-count 50` kept stop 4 (a tester). A derived pair follows the limit; a
    stop set explicitly stays."""
    from tests.broker.coreharness import Harness

    h = Harness()
    h.consumer("admin").declare_queue("a")
    queue = h.core.queues["a"]
    pairs = []
    for limit in (5, 0, 50, 5):
        h.core.set_queue_thresholds("a", {"max_count": limit})
        pairs.append((queue.thresholds.flow_stop_count, queue.thresholds.flow_resume_count))
    assert pairs == [(4, 3), (0, 0), (40, 35), (4, 3)]
    h.core.set_queue_thresholds("a", {"flow_stop_count": 3, "flow_resume_count": 1})
    h.core.set_queue_thresholds("a", {"max_count": 100})
    assert (queue.thresholds.flow_stop_count, queue.thresholds.flow_resume_count) == (3, 1)


def test_a_null_max_follows_the_default_limit_as_any_new_limit() -> None:
    """`{"max_count": null}` is the default limit (management.md): a stop and resume derived from the
    old max follow it, as `{"max_count": 0}` does. They stayed: an unlimited queue still stopped its
    producers at 8 messages (a tester)."""
    h = make()
    h.queue("q", max_size=10 << 20, max_count=10)
    t = h.core.queues["q"].thresholds
    assert (t.flow_stop_count, t.flow_stop_size) == (8, 8 << 20)
    t = h.core.set_queue_thresholds("q", {"max_count": None}).thresholds
    zero = h.core.queue_thresholds({"max_count": 0})[0]
    assert (t.max_count, t.flow_stop_count, t.flow_resume_count) == (0, zero.flow_stop_count, zero.flow_resume_count)
    t = h.core.set_queue_thresholds("q", {"max_size": None}).thresholds
    default = h.core.queue_thresholds({})[0]
    assert (t.max_size, t.flow_stop_size, t.flow_resume_size) == (
        default.max_size, default.flow_stop_size, default.flow_resume_size)


def test_under_the_none_policy_a_flow_controlled_producer_past_the_hard_limit_is_held_not_refused() -> None:
    """Under `none` the SDK paces itself by its window of uncompleted transfers alone: held completions are
    what stops it. Refusing its transfers past the hard limit (to bound a client that ignores FLOW_STOPPED)
    made a well-behaved producer lose 1,300 of 3,000 messages (a tester); configuration.md says that under
    `none` such a client is bounded by nothing."""
    h = make(policy="none")
    h.queue("q", max_count=20, flow_stop_count=10, flow_resume_count=5)
    p = h.producer(window=1000)
    assert p.session.buffer_size == 0  # not paced by credit
    ids = [p.send("", "q", b"m%d" % i) for i in range(50)]
    p.pump()
    q = h.core.queues["q"]
    assert q.count == 50 and q.saturated and p.errors == []
    assert set(p.outstanding) == set(ids[10:])  # past the stop: held, completed as the queue drains
