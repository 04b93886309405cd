"""Pacing in the core ([queues] pace_producers): a producer that routed to a queue holding more ready
messages than twice its consumers' combined prefetch is paced on it (`Session.paced_on`, `Queue.paced`):
its completions and credit are held back (`Session.collect`) until the queue is down to that prefetch, it is
purged or deleted, the producer leaves, or the flow timer gives up waiting (PACE_MAX_NS). Nothing is
refused, stopped or lost."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.broker.coreharness import Consumer, Harness, Producer

from flowbroker.broker.core import PACE_MAX_NS
from flowbroker.broker.queue import Queue
from flowbroker.protocol.frames import BufferAck, Cancel, Complete, DeleteQueue, FlowStopped, Ok, PurgeQueue

ONE = [("", "q", b"x", None)]


def make(pace: bool = True) -> Harness:
    return Harness(credit={"policy": "static", "static_size": 1 << 20}, queues={"pace_producers": pace})


def producer(h: Harness, name: str = "producer") -> Producer:
    p = h.producer(name)
    p.register()  # its first message brings its share of the pool
    return p


def paced_queue(prefetch: int) -> tuple[Harness, Queue, Consumer, Producer]:
    """A pacing broker with queue "q", one consumer subscribed with `prefetch`, and a producer."""
    h = make()
    h.queue("q")
    c = h.consumer()
    c.subscribe("q", prefetch=prefetch)
    return h, h.core.queues["q"], c, producer(h)


def completed(p: Producer) -> int:
    """What the producer has learnt is complete, once it has read what the broker has for it."""
    p.pump()
    return p.completed.cumulative


def test_completions_wait_past_twice_the_prefetch_ready_and_come_at_the_prefetch() -> None:
    h, queue, c, p = paced_queue(3)
    assert (queue.pace_clear, queue.pace_limit) == (3, 6)
    first = p.send_many(ONE * 9)  # 3 delivered, 6 ready: not more than twice the prefetch
    assert p.session.paced_on is None and completed(p) == first[-1]
    last = p.send("", "q")  # 7 ready: paced
    assert p.session.paced_on is queue and p.session in queue.paced and p.session.paced_total == 1
    assert completed(p) == first[-1]  # routed and enqueued, but its completion waits
    assert not p.received(FlowStopped)  # not a stop: nothing is told
    c.pump()
    c.ack()  # 3 more delivered: 4 ready, still behind
    assert p.session.paced_on is queue and completed(p) == first[-1]
    c.pump()
    c.ack()  # 3 more: 1 ready, caught up
    assert p.session.paced_on is None and not queue.paced
    assert completed(p) == last and p.received(Complete)[-1].cumulative_id == last


def test_credit_waits_too() -> None:
    """A producer that counts only bytes is paced as well: its BUFFER_ACKs wait with its completions."""
    h, _, c, p = paced_queue(1)
    p.pump()
    acks = len(p.received(BufferAck))
    p.send_many([("", "q", b"x" * 60_000, None)] * 4)  # 3 ready: paced; 240 KB consumed, an ack is due
    assert p.session.paced_on is not None
    p.pump()
    assert len(p.received(BufferAck)) == acks
    for _ in range(2):  # 1 ready
        c.pump()
        c.ack()
    p.pump()
    assert p.session.paced_on is None and len(p.received(BufferAck)) > acks


def test_the_flow_timer_releases_a_producer_whose_queue_does_not_catch_up() -> None:
    h, _, c, p = paced_queue(1)  # whose consumer never settles
    last = p.send_many(ONE * 5)[-1]
    assert p.session.paced_on is not None and completed(p) < last
    h.advance(PACE_MAX_NS / 2e9)
    h.core.tick(h.now)
    assert p.session.paced_on is not None  # not yet
    h.advance(PACE_MAX_NS / 1e9)
    h.core.tick(h.now)
    assert p.session.paced_on is None and completed(p) == last and not h.core.paced_queues
    p.send("", "q")  # still behind: paced again, up to its watermarks
    assert p.session.paced_on is not None and p.session.paced_total == 2


def test_a_queue_without_consumers_paces_no_one() -> None:
    h = make()
    h.queue("q")
    p = producer(h)
    last = p.send_many(ONE * 50)[-1]
    assert p.session.paced_on is None and completed(p) == last
    assert h.core.queues["q"].pace_limit == sys.maxsize


def test_the_limits_follow_subscriptions_and_the_last_consumer_leaving_releases() -> None:
    h = make()
    h.queue("q")
    queue = h.core.queues["q"]
    a, b = h.consumer("a"), h.consumer("b")
    sub_a = a.subscribe("q", prefetch=5)
    b.subscribe("q", prefetch=7)
    assert (queue.pace_clear, queue.pace_limit) == (12, 24)
    assert isinstance(a.request(lambda rid: Cancel(rid, sub_a)), Ok)
    assert (queue.pace_clear, queue.pace_limit) == (7, 14)
    p = producer(h)
    last = p.send_many(ONE * 22)[-1]  # 7 delivered to b, 15 ready
    assert p.session.paced_on is queue
    b.close()  # no consumer left: nothing to be behind, so nothing holds the producer back
    assert queue.pace_limit == sys.maxsize and p.session.paced_on is None and completed(p) == last


def test_purge_and_delete_release_the_producers_paced_on_a_queue() -> None:
    h = make()
    for name in ("q1", "q2"):
        h.queue(name)
    c = h.consumer()
    c.subscribe("q1", prefetch=1)
    c.subscribe("q2", prefetch=1)
    p1, p2 = producer(h, "p1"), producer(h, "p2")
    last1 = p1.send_many([("", "q1", b"x", None)] * 5)[-1]  # 4 ready: over twice the prefetch of 1
    last2 = p2.send_many([("", "q2", b"x", None)] * 5)[-1]
    assert p1.session.paced_on is h.core.queues["q1"] and p2.session.paced_on is h.core.queues["q2"]
    assert isinstance(c.request(lambda rid: PurgeQueue(rid, "q1")), Ok)
    assert p1.session.paced_on is None and completed(p1) == last1
    queue2 = h.core.queues["q2"]
    assert isinstance(c.request(lambda rid: DeleteQueue(rid, "q2")), Ok)
    assert p2.session.paced_on is None and not queue2.paced and completed(p2) == last2


def test_a_closed_producer_leaves_the_queue_it_was_paced_on() -> None:
    """A queue whose consumers never catch up must not keep every producer that ever waited on it."""
    h = make()
    h.queue("q")
    queue = h.core.queues["q"]
    c = h.consumer()
    c.subscribe("q", prefetch=1)
    for i in range(5):
        p = producer(h, f"p{i}")
        p.send_many(ONE * 4)
        assert p.session in queue.paced
        p.close()
    assert not queue.paced


def test_pace_producers_false_is_the_default_and_paces_no_one() -> None:
    h = Harness(credit={"policy": "static", "static_size": 1 << 20})
    h.queue("q")
    c = h.consumer()
    c.subscribe("q", prefetch=1)
    p = producer(h)
    last = p.send_many(ONE * 10)[-1]
    assert p.session.paced_on is None and not h.core.queues["q"].paced and completed(p) == last


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20), st.booleans()), min_size=1, max_size=12),
       st.integers(1, 8))
def test_paced_past_twice_the_prefetch_until_down_to_it(steps: list[tuple[int, int, bool]], prefetch: int) -> None:
    """A frame paces the producer exactly when it leaves more than twice the prefetch ready; while paced,
    no completion reaches it; a settlement that brings the queue down to the prefetch, or the flow timer,
    releases it. Every body sent is delivered once, in order, and every transfer completes."""
    h, queue, c, p = paced_queue(prefetch)
    sent: list[bytes] = []
    last = 0
    for frame, acks, timer in steps:
        bodies = [str(len(sent) + i).encode() for i in range(frame)]
        was = p.session.paced_on
        seen = completed(p)
        last = p.send_many([("", "q", body, None) for body in bodies], force=True)[-1]
        sent += bodies
        if was is None:
            assert (p.session.paced_on is queue) == (len(queue.store) > 2 * prefetch)
        if p.session.paced_on is not None:
            assert completed(p) == seen  # what it routed while paced is not told complete
        c.pump()
        c.ack(list(c.unsettled)[:acks])
        if len(queue.store) <= prefetch:
            assert p.session.paced_on is None and not queue.paced
        if timer:
            h.advance(2 * PACE_MAX_NS / 1e9)
            h.core.tick(h.now)
            assert p.session.paced_on is None
    while True:
        c.pump()
        if not c.unsettled:
            break
        c.ack()
    assert c.bodies() == sent
    assert p.session.paced_on is None and completed(p) == last
