"""The frozen ``statistics()`` snapshots of the transport's public objects move as traffic flows.

In memory through the sans-IO duties (no trio); the endpoint's over a real socket on 127.0.0.1, still
without trio (sending and ``try_receive`` never wait).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from tests.transport.memwire import SESSION, MemWire

from flowbroker.transport import frames as f
from flowbroker.transport.image import ImageState
from flowbroker.transport.udp import open_udp

MS = 1_000_000


def connected() -> MemWire:
    wire = MemWire()
    wire.step(0)
    wire.step(MS)
    return wire


def test_publication_statistics_follow_positions_and_counters() -> None:
    wire = MemWire()
    before = wire.publication.statistics()
    assert (before.position, before.sender_position, before.connected, before.setups_sent) == (0, 0, False, 0)
    wire.step(0)
    wire.step(MS)
    up = wire.publication.statistics()
    assert up.connected and up.receiver_count == 1 and up.setups_sent == 1 and up.status_messages_received == 1
    assert up.receiver_window > 0 and up.sender_limit == up.receiver_window
    assert up.publication_limit == up.sender_position + up.publication_window
    for i in range(10):
        wire.offer(b"x" * 100, 2 * MS)
    sent = wire.publication.statistics()
    assert sent.position == 10 * f.align(32 + 100) and sent.sender_position <= sent.position
    assert sent.data_datagrams_sent >= 1 and sent.bytes_sent == sent.sender_position
    assert before.position == 0  # a snapshot does not move with the object
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(sent, "position", 0)


def test_image_and_subscription_statistics_follow_rebuild_and_consumption() -> None:
    wire = connected()
    [image] = wire.channel.images.values()
    joined = image.statistics()
    assert (joined.state, joined.join_position, joined.rebuild_position, joined.subscribers) == (
        ImageState.ACTIVE, 0, 0, 1)
    assert joined.status_messages_sent == 1 and joined.receiver_window > 0
    for i in range(12):  # 12 x 1056 bytes: more than a quarter of the window, so processing is reported at once
        wire.offer(b"y" * 1000, 2 * MS)
    for t in range(2, 20):
        wire.step(t * MS)
    arrived = image.statistics()
    assert arrived.rebuild_position == arrived.hwm_position == wire.publication.position
    assert arrived.datagrams_inserted > 0 and arrived.consumption_position == 0
    assert wire.subscription.statistics().consumption_positions == ((SESSION, 0),)
    wire.poll(20 * MS)
    consumed = image.statistics()
    assert consumed.consumption_position == wire.publication.position
    assert consumed.status_message_position == wire.publication.position  # processing is reported at once
    assert consumed.status_messages_sent > arrived.status_messages_sent
    sub = wire.subscription.statistics()
    assert sub.consumption_positions == ((SESSION, wire.publication.position),) and sub.messages == 12
    assert sub.tether and not sub.closed


def test_a_lost_datagram_shows_as_a_gap_a_nak_and_a_retransmit() -> None:
    wire = connected()
    wire.drop_data = 1
    for i in range(4):
        wire.offer(b"z" * 500, 2 * MS)
    for t in range(2, 40):
        wire.step(t * MS)
    image = wire.channel.images[SESSION].statistics()
    pub = wire.publication.statistics()
    assert image.loss_gaps == 1 and image.naks_sent >= 1
    assert pub.naks_received >= 1 and pub.retransmits_sent >= 1 and pub.retransmitted_bytes > 0
    assert image.rebuild_position == pub.position  # repaired


def test_idle_streams_count_heartbeats_and_status_messages() -> None:
    wire = connected()
    for t in range(1, 11):
        wire.step(t * 100 * MS)
    pub = wire.publication.statistics()
    image = wire.channel.images[SESSION].statistics()
    # each step's heartbeat arrives at the next step: the last one is still on the wire
    assert pub.heartbeats_sent >= 5 and image.heartbeats_received == pub.heartbeats_sent - 1
    assert image.status_messages_sent >= 3 and pub.status_messages_received == image.status_messages_sent


def test_receive_channel_statistics_count_refused_datagrams_by_reason() -> None:
    wire = connected()
    wire.to_receiver += [(b"\x01\x02", ("10.9.9.9", 1)), (b"\x00" * 7, ("10.9.9.9", 1))]
    other_stream = f.encode_heartbeat(0, 99, 11, 0)
    wire.to_receiver.append((other_stream, ("10.9.9.9", 1)))
    wire.step(2 * MS)
    stats = wire.channel.statistics()
    assert dict(stats.refused) == {"rejected:too_short": 2, "other_stream": 1}
    assert stats.datagrams_refused == 3
    assert sum(n for _, n in stats.dispositions) == stats.datagrams_received
    assert dict(stats.dispositions)["setup"] == 1 and (stats.images, stats.subscriptions) == (1, 1)


def test_endpoint_statistics_count_datagrams_and_bytes() -> None:
    a, b = open_udp(), open_udp()
    try:
        assert a.statistics().datagrams_sent == 0 and a.statistics().local_address == a.local_address
        for _ in range(3):
            assert a.send(b"q" * 40, b.local_address)
        got = 0
        deadline = time.monotonic() + 5
        while got < 3 and time.monotonic() < deadline:
            got += b.try_receive() is not None
        sent, received = a.statistics(), b.statistics()
        assert (sent.datagrams_sent, sent.bytes_sent, sent.send_drops) == (3, 120, 0)
        assert (received.datagrams_received, received.bytes_received) == (3, 120)
    finally:
        a.close()
        b.close()
    closed = a.statistics()
    assert closed.closed and closed.local_address is None and closed.datagrams_sent == 3
