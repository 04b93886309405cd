"""Fan-out under the memory alarm is parked, not copied (broker/parking.py): credit bounds what a
producer holds once per message, but a message held in K queues was K copies (a tester's 1-byte bodies to
600 queues took the broker to 7.6 times its bound's growth), and refusing them instead gave a producer
connected throughout 100,000 refusals (another tester). A message that would fan out while the alarm is on
waits unrouted, one copy, with everything its connection sends after it, until the alarm clears; then it
is routed, in order, and completed. Nothing is refused, lost or duplicated."""

from __future__ import annotations

import pytest

from flowbroker.broker.session import SessionFault
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error
from tests.broker.coreharness import Consumer, Harness, Producer

SERVER = {"memory_quota": 64 * 1024 * 1024, "max_message_size": 4096, "max_frame_size": 65536,
          "memory_watermark": 32 * 1024}
CREDIT = {"policy": "static", "static_size": 65536, "quota": 65536}
QUEUES = 10


def fanout(h: Harness) -> Consumer:
    """A fanout `fan` over QUEUES queues without limits, and a consumer subscribed to each."""
    admin = h.consumer("admin")
    admin.declare_exchange("fan", "fanout")
    for i in range(QUEUES):
        admin.declare_queue(f"f{i}", max_size=0, flow_stop_size=0, flow_resume_size=0)
        admin.bind(f"f{i}", "fan")
    return admin


def fill(p: Producer, exchange: str = "fan", key: str = "", start: int = 0) -> list[int]:
    """Send numbered 3,000-byte bodies while credit allows; the ids sent."""
    ids = []
    n = start
    while p.can_send():
        ids.append(p.send(exchange, key, n.to_bytes(4, "big") + b"z" * 2996))
        n += 1
        p.pump()
    return ids


def drain(h: Harness, producers: list[Producer], c: Consumer | None = None) -> Consumer:
    """Consume and acknowledge every queue (with `c`, subscribed already) until no producer has a
    transfer outstanding."""
    if c is None:
        c = h.consumer("drain")
        for i in range(QUEUES):
            c.subscribe(f"f{i}", prefetch=1000)
    for _ in range(10_000):
        c.pump()
        c.ack()
        for p in producers:
            p.pump()
        if not any(p.outstanding for p in producers):
            c.pump()
            c.ack()
            return c
    raise AssertionError(f"still outstanding: {[len(p.outstanding) for p in producers]}")


def numbers(c: Consumer, sub_id: int) -> list[int]:
    return [int.from_bytes(body[:4], "big") for body in c.bodies(sub_id)]


def test_a_producer_connected_throughout_is_parked_never_refused_and_everything_arrives_in_order() -> None:
    h = Harness(server=SERVER, credit=CREDIT)
    fanout(h)
    p = h.producer("p", fences=True)
    p.send("fan", "", (0).to_bytes(4, "big") + b"z" * 2996)  # registers: its grant follows
    p.pump()
    ids = [1] + fill(p, start=1)
    memory = h.core.memory
    per_message = QUEUES * p.sizes[1]
    assert memory.alarm and p.session.parked.messages > 0
    # held: the watermark, plus the copies of the message that passed it (the copies were QUEUES x credit)
    assert memory.held < memory.watermark + per_message
    assert p.errors == []
    c = drain(h, [p])
    assert p.errors == [] and all(p.is_complete(tid) for tid in ids)
    for sub_id in range(1, QUEUES + 1):  # every message in every queue, once, in order
        assert numbers(c, sub_id) == list(range(len(ids)))
    assert not p.session.parked and memory.held == 0


def test_what_follows_a_parked_message_waits_behind_it_whatever_its_queue() -> None:
    """A direct message to one of the fanout's queues sent after a parked message is parked too: routed
    at once, it would reach that queue before the message sent before it."""
    h = Harness(server=SERVER, credit=CREDIT)
    fanout(h)
    p = h.producer("p", fences=True)
    p.register()
    ids: list[int] = []
    while len(p.session.parked.rests) < 2:  # to the alarm, and two parked past it
        assert p.can_send()
        ids.append(p.send("fan", "", len(ids).to_bytes(4, "big") + b"z" * 2996))
        p.pump()
    parked_before = p.session.parked.messages
    assert p.can_send()
    last = p.send("", "f0", len(ids).to_bytes(4, "big") + b"d")
    assert p.session.parked.messages == parked_before + 1 and not p.is_complete(last)
    c = drain(h, [p])
    assert numbers(c, 1) == list(range(len(ids) + 1))  # f0: the direct message last
    assert numbers(c, 2) == list(range(len(ids)))


def test_a_connection_closed_with_messages_parked_drops_them_uncompleted() -> None:
    """They were never completed (its producer resends what it was not told was taken), as the unrouted
    rest of a TRANSFER is; nothing of them stays in the broker."""
    h = Harness(server=SERVER, credit={**CREDIT, "quota": 4 * 65536})  # room for both grants
    fanout(h)
    stays = h.producer("stays", fences=True)
    stays.register()
    leaves = h.producer("leaves", fences=True)
    leaves.register()
    fill(stays)
    left = fill(leaves, start=1000)
    parked = leaves.session.parked.messages
    assert parked > 0
    completed = [tid for tid in left if leaves.is_complete(tid)]
    leaves.close()
    assert not leaves.session.parked and leaves.session not in h.core._parked_sessions
    c = drain(h, [stays])
    got = numbers(c, 1)
    assert sum(1 for n in got if n >= 1000) == len(left) - parked  # its routed ones only
    assert len(completed) <= len(left) - parked


def test_the_alarm_coming_on_again_while_parked_messages_are_routed_parks_the_rest() -> None:
    h = Harness(server=SERVER, credit=CREDIT)
    fanout(h)
    p = h.producer("p", fences=True)
    p.register()
    ids = fill(p)
    total = p.session.parked.messages
    assert total > 4
    c = h.consumer("drain")
    subs = [c.subscribe(f"f{i}", prefetch=1000) for i in range(QUEUES)]
    c.pump()
    c.ack()  # the alarm clears: the writer routes the parked messages until it comes on again
    p.pump()
    memory = h.core.memory
    assert memory.alarm and 0 < p.session.parked.messages < total
    assert memory.held < memory.watermark + QUEUES * p.sizes[ids[0]]
    drain(h, [p], c)
    for sub_id in subs:
        assert numbers(c, sub_id) == list(range(len(ids)))
    assert all(p.is_complete(tid) for tid in ids) and p.errors == []


def test_an_idempotent_producers_parked_message_is_enqueued_once() -> None:
    """Its sequence is checked when it is routed, not when it is parked: checked twice, it was its own
    duplicate (completed, never enqueued)."""
    h = Harness(server=SERVER, credit=CREDIT)
    fanout(h)
    p = h.producer("p", fences=True)
    p.register()
    n = 0
    ids: list[int] = []
    while p.can_send():
        ids += p.send_many([("fan", "", n.to_bytes(4, "big") + b"i" * 2996, None)], producer_id="job",
                           sequences=[n])
        n += 1
        p.pump()
    assert p.session.parked
    c = drain(h, [p])
    assert p.errors == [] and p.session.duplicates == 0
    for sub_id in range(1, QUEUES + 1):
        assert numbers(c, sub_id) == list(range(n))


def test_a_connection_opened_under_the_alarm_is_parked_too() -> None:
    """It met the bound of connections that come and go (RESOURCE_EXHAUSTED past the watermark plus
    what live producers can have in flight): what it parks is one copy within its own credit, and goes
    with it if it leaves, so it is parked as the others are."""
    h = Harness(server=SERVER, credit=CREDIT)
    fanout(h)
    p = h.producer("p", fences=True)
    p.register()
    fill(p)
    held = h.core.memory.held
    late = h.producer("late", fences=True)
    late.send("fan", "", (5000).to_bytes(4, "big") + b"z" * 2996, force=True)
    late.pump()
    assert late.errors == [] and late.session.parked.messages == 1 and h.core.memory.held == held
    c = drain(h, [p, late])
    assert numbers(c, 1).count(5000) == 1 and late.is_complete(late.next_id - 1)


def test_a_credit_violation_behind_parked_messages_ends_the_connection_at_once() -> None:
    h = Harness(server=SERVER, credit=CREDIT)
    fanout(h)
    p = h.producer("p", fences=True)
    p.register()
    fill(p)
    assert p.session.parked
    with pytest.raises(SessionFault) as raised:
        for n in range(40):  # far past its credit
            p.send("fan", "", b"v" * 3000, force=True)
    assert raised.value.code is ErrorCode.CREDIT_VIOLATION
    assert not [f for f in p.frames if isinstance(f, Error)]


def test_parked_messages_share_one_copy_of_their_names() -> None:
    """Decoded, each message kept its own exchange name and routing key while parked, uncharged: a tester's
    255-emoji exchange took the broker to 2.5 times its bound's growth. Routed messages share one copy."""
    h = Harness(server=SERVER, credit=CREDIT)
    admin = fanout(h)
    admin.declare_exchange("fan\U0001F600", "fanout")
    for i in range(QUEUES):
        admin.bind(f"f{i}", "fan\U0001F600")
    p = h.producer("p", fences=True)
    p.register()
    while p.can_send():
        name = "".join(["fan", "\U0001F600"])  # a string of its own, as each decoded message has
        p.send(name, "".join(["k", "\U0001F600"]), b"z" * 3000)
        p.pump()
    entries = [e for rest in p.session.parked.rests for e in rest.entries]
    assert len(entries) > 1
    assert len({id(e.exchange) for e in entries}) == 1 and len({id(e.routing_key) for e in entries}) == 1
