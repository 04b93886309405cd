"""DELIVER entries waiting for a connection's writer are bounded (Outbox's MAX_DELIVERIES_WAITING).

Credit comes back without the client reading: a CANCEL, or a SETTLE(REQUEUE) of tags it may never have
received, returns the messages to their queue, which delivered them again while the first entries still
waited in the outbox. A connection that never read took the broker from 60 to 1,240 MiB with
SUBSCRIBE/CANCEL pairs (a tester), and requeues the same way (455 MiB). Here the client never collects
until the end; then it reads and acknowledges, and every message is delivered exactly once more.
"""

from __future__ import annotations

from tests.broker.coreharness import REQUEST_ID_BASE, Consumer, Harness

from flowbroker.broker.outbox import MAX_DELIVERIES_WAITING, MAX_DELIVERY_BYTES_WAITING
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.frames import Cancel, Deliver, Outcome, Settle, Subscribe

MESSAGES = 30_000


def _filled(h: Harness) -> None:
    h.queue("q")
    p = h.producer("p", flow_control=False)
    for start in range(0, MESSAGES, 1000):
        p.send_many([("", "q", b"%06d" % i, None) for i in range(start, start + 1000)])


def _drain(c: Consumer, h: Harness) -> list[bytes]:
    """Read and acknowledge until the queue is empty; the bodies of the deliveries whose ack settled them."""
    q = h.core.queues["q"]
    acked: list[bytes] = []
    for _ in range(1000):
        c.pump()
        outstanding = c.session.deliveries.unsettled
        live = [tag for tag in c.tags() if tag in outstanding]  # the rest were requeued before they were read
        acked += [c.unsettled[tag][1].body for tag in live]
        c.ack(live)
        c.unsettled.clear()
        if not q.count and not outstanding:
            return acked
    raise AssertionError("the queue did not drain")


def test_subscribe_cancel_churn_of_a_client_that_never_reads_is_bounded() -> None:
    h = Harness()
    _filled(h)
    c = h.consumer()
    outbox = c.session.outbox
    rid = REQUEST_ID_BASE
    for sub_id in range(1, 201):
        c.handle(Subscribe(rid, sub_id, "q", 0, 0))  # prefetch 0: the broker's max_prefetch, 10,000
        c.handle(Cancel(rid + 1, sub_id))
        rid += 2
        assert outbox.deliveries_waiting <= MAX_DELIVERIES_WAITING
    assert outbox.deliveries_waiting == 0  # a cancelled subscription's deliveries are dropped with it
    c.handle(Subscribe(rid, 1000, "q", 0, 0))  # (delivers once the writer collects: the churn filled it)
    assert not [f for f in c.pump() if isinstance(f, Deliver) and f.subscription_id != 1000]
    assert sorted(_drain(c, h)) == [b"%06d" % i for i in range(MESSAGES)]


def test_requeue_churn_of_a_client_that_never_reads_is_bounded() -> None:
    h = Harness()
    _filled(h)
    c = h.consumer()
    outbox = c.session.outbox
    c.handle(Subscribe(REQUEST_ID_BASE, 1, "q", 0, 0))
    for _ in range(50):
        c.handle(Settle(Outcome.REQUEUE, [(1, 2**40)]))  # tags it never received, guessed
        assert outbox.deliveries_waiting <= MAX_DELIVERIES_WAITING < 2 * 10_000  # (10,000 more each, unbounded)
    assert outbox.full
    assert sorted(_drain(c, h)) == [b"%06d" % i for i in range(MESSAGES)]


def test_subscriptions_held_back_by_a_full_outbox_deliver_again_once_the_writer_takes_it() -> None:
    """Three subscriptions of prefetch 10,000 on one connection (30,000 > the bound): each gets its
    messages, in order, once the writer (`collect`) has taken what waited."""
    h = Harness()
    for name in ("a", "b", "c"):
        h.queue(name)
    p = h.producer("p", flow_control=False)
    for name in ("a", "b", "c"):
        for start in range(0, 12_000, 1000):
            p.send_many([("", name, b"%s%06d" % (name.encode(), i), None) for i in range(start, start + 1000)])
    c = h.consumer()
    subs = {name: c.subscribe(name, prefetch=10_000) for name in ("a", "b", "c")}
    assert c.session.outbox.deliveries_waiting <= MAX_DELIVERIES_WAITING
    for _ in range(100):
        c.pump()
        c.ack()
        if all(not h.core.queues[name].count for name in subs) and not c.session.deliveries.unsettled:
            break
    for name, sub_id in subs.items():
        assert c.bodies(sub_id) == [b"%s%06d" % (name.encode(), i) for i in range(12_000)]


def test_a_cancel_requeues_deliveries_never_sent_with_the_flag_they_had() -> None:
    """`flowbroker consume -n 1`: its acknowledgement let the broker deliver the next message, which its
    CANCEL then gave back flagged redelivered though the consumer never saw it (a tester). Dropped from the
    outbox unsent, it keeps its flag; one that was sent comes back flagged."""
    h = Harness()
    h.queue("q")
    p = h.producer("p", flow_control=False)
    p.send_many([("", "q", b"%d" % i, None) for i in range(3)])
    c = h.consumer()
    sub = c.subscribe("q", prefetch=1)
    c.ack()  # the first, read: the second is delivered into the outbox, not yet written
    c.ack()  # (nothing more read: the first only)
    assert c.ok(lambda rid: Cancel(rid, sub)) == {"requeued": 1}
    assert not [f for f in c.frames if isinstance(f, Deliver) and any(e[3] == b"1" for e in f.entries)]
    c2 = h.consumer("second")
    c2.subscribe("q", prefetch=10)
    c2.pump()
    assert [(e.body, e.redelivered) for _, e in c2.deliveries] == [(b"1", False), (b"2", False)]
    c2.requeue(c2.tags())  # read, then given back: flagged
    c2.pump()
    assert [(e.body, e.redelivered) for _, e in c2.deliveries[2:]] == [(b"1", True), (b"2", True)]


def test_a_cancel_that_empties_a_full_outbox_resumes_the_other_subscriptions() -> None:
    """The outbox filled (subscription 1's 1,500 and subscription 2's 548) before subscription 3 got
    any; CANCELs of 1 and 2 drop their unsent deliveries, leaving it empty: the writer's next collect,
    with only the OKs to take, must let 3 deliver, or it waited for a settle that could never come."""
    h = Harness()
    p = h.producer("p", flow_control=False)
    for name in ("a", "b", "c"):
        h.queue(name)
        for start in range(0, 12_000, 1000):
            p.send_many([("", name, b"%06d" % i, None) for i in range(start, start + 1000)])
    c = h.consumer()
    for sub_id, name, prefetch in ((1, "a", 1_500), (2, "b", 1_500), (3, "c", 10_000)):
        c.handle(Subscribe(REQUEST_ID_BASE + sub_id, sub_id, name, prefetch, 0))
    assert c.session.outbox.full and c.session.outbox.deliveries_waiting <= MAX_DELIVERIES_WAITING
    c.handle(Cancel(REQUEST_ID_BASE + 11, 1))
    outbox = c.session.outbox
    staying = [e for f in outbox.sealed if isinstance(f, Deliver) for e in f.entries]
    staying += [e for entries in outbox.open_frames.values() for e in entries]
    assert staying and outbox.deliveries_waiting == len(staying)  # what stays, counted without walking it
    assert outbox.delivery_bytes_waiting == sum(message_size(e[3], e[4]) for e in staying)
    c.handle(Cancel(REQUEST_ID_BASE + 12, 2))
    assert c.session.outbox.deliveries_waiting == 0 == c.session.outbox.delivery_bytes_waiting
    for _ in range(20):
        c.pump()
        c.ack([tag for tag in c.tags(3) if tag in c.session.deliveries.unsettled])
        c.unsettled.clear()
        if not h.core.queues["c"].count and not c.session.deliveries.unsettled:
            break
    assert c.bodies(3) == [b"%06d" % i for i in range(12_000)]


def test_acknowledging_unread_tags_pins_no_more_than_the_outboxs_bytes() -> None:
    """SETTLE(ACK) of tags never read dequeues messages whose entries still wait for the writer: the queue
    and the memory alarm let go of them while the entries keep their bodies. Counted in entries alone, one
    connection pinned 3 GiB of 256 KiB bodies (a tester); the outbox's bytes are bounded too."""
    h = Harness()
    h.queue("big")
    body = b"x" * 65536  # (one object: the test's own memory stays small)
    p = h.producer("p", flow_control=False)
    for _ in range(40):
        p.send_many([("", "big", body, None)] * 100)
    c = h.consumer()
    outbox = c.session.outbox
    c.handle(Subscribe(REQUEST_ID_BASE, 1, "big", 0, 0))
    for _ in range(30):
        c.handle(Settle(Outcome.ACK, [(1, 2**40)]))  # tags it never read, guessed: each refills the prefetch
        assert outbox.delivery_bytes_waiting <= MAX_DELIVERY_BYTES_WAITING + 66_000
    assert outbox.full and outbox.deliveries_waiting * 65536 <= MAX_DELIVERY_BYTES_WAITING + 66_000
    pending = [f for f in c.pump() if isinstance(f, Deliver)]  # what it pins, taken by the writer
    assert sum(len(f.entries) for f in pending) * 65536 <= MAX_DELIVERY_BYTES_WAITING + 66_000


def test_one_collect_of_a_fast_consumer_delivers_a_few_milliseconds_of_messages() -> None:
    """A consumer that reads everything at once, with 20 subscriptions at a prefetch of 10,000: each of its
    writer's collects refilled the outbox with 16,384 deliveries in one step, and every other connection
    waited 124-573 ms (a tester, 3 of 3). A collect now takes, and refills, at most 2,048 (~2-4 ms)."""
    h = Harness()
    _filled(h)
    c = h.consumer()
    for sub_id in range(1, 21):
        c.handle(Subscribe(REQUEST_ID_BASE + sub_id, sub_id, "q", 10_000, 0))
    per_collect = []
    delivered = 0
    for _ in range(100):
        frames = c.session.collect(h.now)
        entries = sum(len(f.entries) for f in frames if isinstance(f, Deliver))
        per_collect.append(entries)
        delivered += entries
        if delivered >= MESSAGES:
            break
    assert delivered == MESSAGES and max(per_collect) <= 2_048, per_collect
