"""The sans-IO duty cycles of ``transport.drivers``, over in-memory lists: no trio, no socket, no clock."""

from __future__ import annotations

import pytest
from tests.transport.memwire import MemWire

from flowbroker.transport.drivers import OfferVerdict, offer_verdict
from flowbroker.transport.publication import OfferResult

MS = 1_000_000


@pytest.mark.parametrize(
    ("result", "verdict"),
    [
        (1, OfferVerdict.DONE),
        (OfferResult.NOT_CONNECTED, OfferVerdict.WAIT),
        (OfferResult.BACK_PRESSURED, OfferVerdict.WAIT),
        (OfferResult.ADMIN_ACTION, OfferVerdict.RETRY_NOW),
        (OfferResult.CLOSED, OfferVerdict.DONE),
        (OfferResult.MAX_POSITION_EXCEEDED, OfferVerdict.DONE),
    ],
)
def test_offer_verdict(result: int, verdict: OfferVerdict) -> None:
    assert offer_verdict(result) is verdict


def test_the_first_status_message_is_progress_and_messages_flow_in_order() -> None:
    wire = MemWire()
    assert wire.offer(b"early", 0) == OfferResult.NOT_CONNECTED
    assert wire.step(0) is False  # SETUP out, nothing back yet
    assert wire.step(MS) is True  # the image's first SM: connected, a waiting publisher may retry
    for i in range(100):
        assert wire.offer(b"m%d" % i, 2 * MS) > 0
    for t in range(3, 200):
        wire.step(t * MS)
        wire.poll(t * MS)
    assert wire.received == [b"m%d" % i for i in range(100)]
    assert wire.publication.sender_position == wire.publication.position


def test_a_receiver_that_does_not_poll_back_pressures_and_its_poll_is_progress() -> None:
    wire = MemWire()
    wire.step(0)
    wire.step(MS)
    results = []
    now = 2 * MS
    while True:  # a message of 1 KiB per cycle until the windows are full
        result = wire.offer(bytes(1024), now)
        results.append(result)
        wire.step(now)
        now += MS
        if offer_verdict(result) is OfferVerdict.WAIT:
            break
        assert len(results) < 1000, "never back-pressured"
    assert results[-1] == OfferResult.BACK_PRESSURED
    assert wire.publication.position - wire.channel.images[1234].statistics().consumption_position > 0
    limit = wire.publication.publication_limit
    assert wire.poll(now) > 0  # processing sends its status message at once ...
    wire.step(now)
    assert wire.publication.publication_limit > limit  # ... which moves the publisher's limit
    assert offer_verdict(wire.offer(bytes(1024), now)) is OfferVerdict.DONE


def test_deadlines_come_from_the_timers() -> None:
    wire = MemWire()
    assert wire.sender.deadline_ns() == 0  # the first SETUP is due at creation
    wire.step(0)
    assert wire.sender.deadline_ns() == 100 * MS  # the next SETUP, until an SM arrives
    assert wire.receiver.deadline_ns(0) <= 200 * MS  # SM timeout at the latest
