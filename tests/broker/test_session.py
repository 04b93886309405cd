"""`Session` as the core leaves it: its statistics snapshot, and what a close leaves of it."""

from __future__ import annotations

import dataclasses

import pytest
from tests.broker.coreharness import Harness, MiB

from flowbroker.broker.session import SessionStatistics
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.frames import Noop


def test_statistics_snapshot_the_producer_and_the_consumer_side() -> None:
    h = Harness(credit={"policy": "static", "static_size": MiB})
    h.queue("orders", flow_stop_count=2, flow_resume_count=1)
    producer = h.producer("producer")
    c = h.consumer("reader")
    c.subscribe("orders", prefetch=1)
    for i in range(3):  # one delivered, two ready: the third is over the stop count and held
        producer.send("", "orders", b"m%d" % i)
    producer.pump()
    c.pump()
    size = message_size(b"m0")

    stats = producer.session.statistics()
    assert isinstance(stats, SessionStatistics)
    assert (stats.conn_id, stats.client_name, stats.open) == (producer.session.conn_id, "producer", True)
    assert (stats.position, stats.transfers_received, stats.window) == (3 * size, 3, MiB)
    assert (stats.transfers_completed, stats.consumed_position, stats.acked_position) == (2, 2 * size, 0)
    assert stats.limit == MiB and (stats.transfers_held_now, stats.transfers_held_total) == (1, 1)
    assert stats.flow_stopped_destinations == 1

    reader = c.session.statistics()
    assert (reader.subscriptions, reader.unsettled, reader.delivered) == (1, 1, 1)
    assert (reader.sender_position, reader.sender_acked_position, reader.sender_window) == (size, 0, 0)
    assert (reader.position, reader.transfers_received) == (0, 0)

    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.position = 0  # type: ignore[misc]
    c.ack()
    assert c.session.statistics().delivered == 2 and reader.delivered == 1  # a snapshot, not a view


def test_a_closed_session_gives_its_deliveries_back_and_stops_collecting() -> None:
    h = Harness()
    h.queue("q")
    p = h.producer()
    c = h.consumer()
    c.subscribe("q", prefetch=5)
    for i in range(3):
        p.send("", "q", b"%d" % i)
    p.pump()
    c.pump()
    session = c.session
    assert len(session.unsettled) == 3
    h.core.close_session(session)
    stats = session.statistics()
    assert (stats.open, stats.unsettled, stats.subscriptions) == (False, 0, 0)
    assert h.core.queues["q"].count == 3 and len(h.core.queues["q"].store) == 3
    session.send(Noop(1, True))
    assert session.collect(h.now) == []  # nothing is queued after the close
