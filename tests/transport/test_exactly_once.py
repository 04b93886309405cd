"""Every message exactly once and in order, through a lossy, duplicating, reordering network.

The publication and the receive channel talk only through ``FakeNetwork`` with simulated time. Streams
start just below the int32 term-id wrap, so each run crosses term rotations and the wrap to -2**31.
"""

from __future__ import annotations

import struct
from typing import Callable

import pytest
from tests.transport.fakenet import FakeNetwork, pump

from flowbroker.transport.publication import OfferResult, Publication, PublicationConfig
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig, Subscription

PUB = ("10.0.0.1", 40001)
SUB = ("10.0.0.2", 40002)
TERM = 64 * 1024
STEP_NS = 50_000
_SEQ = struct.Struct("<I")


def payload(seq: int, max_extra: int) -> bytes:
    """Message ``seq``: its number, then a length and filler that vary with it (some need fragments)."""
    extra = (seq * 7919) % (max_extra + 1)
    return _SEQ.pack(seq) + bytes([seq & 0xFF]) * extra


def run(
    net: FakeNetwork,
    count: int,
    *,
    max_extra: int = 300,
    initial_term_id: int = 2**31 - 3,
    cc: str | None = None,
    poll_limit: int = 1000,
    mtu: int = 1408,
    on_step: Callable[[Publication, Subscription], None] | None = None,
) -> tuple[list[int], Publication, ReceiveChannel]:
    config = PublicationConfig(
        session_id=1234, stream_id=10, term_length=TERM, mtu=mtu, initial_term_id=initial_term_id,
        max_messages_per_send=4,
    )
    pub = Publication(config, 0, destination=SUB)
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=99, congestion_control=cc))
    sub = channel.add_subscription(0)
    received: list[int] = []

    def handler(message: memoryview | bytes) -> None:
        seq = _SEQ.unpack_from(message, 0)[0]
        assert bytes(message) == payload(seq, max_extra), f"message {seq} corrupted"
        received.append(seq)

    sent = 0
    now = 0
    deadline = 120 * 10**9
    while len(received) < count and now < deadline:
        while sent < count:
            result = pub.offer(payload(sent, max_extra))
            if result == OfferResult.ADMIN_ACTION:
                continue
            if result < 0:
                break
            sent += 1
        pump(net, {PUB: pub, SUB: channel}, now)
        sub.poll(handler, poll_limit)
        if on_step is not None:
            on_step(pub, sub)
        now += STEP_NS
    return received, pub, channel


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_exactly_once_in_order_through_loss_duplication_and_reordering(seed: int) -> None:
    net = FakeNetwork(seed, loss=0.05, duplicate=0.01, reorder=0.01, jitter_ns=20_000)
    received, pub, channel = run(net, 20_000)
    assert received == list(range(20_000))
    image = channel.images[1234]
    # the run really crossed the term-id wrap and really lost data that NAKs recovered
    assert image.rebuild_position > 3 * TERM
    assert image.rebuilder.term_id_for_position(image.rebuild_position) < 0
    assert net.stats.dropped > 0 and net.stats.duplicated > 0 and net.stats.reordered > 0
    assert image.naks_sent > 0 and pub.counters.retransmits_sent > 0
    assert image.duplicates > 0


def test_fragmented_messages_survive_loss_across_the_wrap() -> None:
    net = FakeNetwork(7, loss=0.05, duplicate=0.01, reorder=0.01)
    received, pub, _ = run(net, 2_000, max_extra=5_000, initial_term_id=2**31 - 1)
    assert received == list(range(2_000))
    assert pub.counters.retransmits_sent > 0


def test_cubic_congestion_control_delivers_everything_and_shrinks_on_loss() -> None:
    net = FakeNetwork(11, loss=0.05, duplicate=0.01, reorder=0.01)
    received, pub, channel = run(net, 10_000, cc="cubic")
    assert received == list(range(10_000))
    image = channel.images[1234]
    assert image.rttms_sent > 0 and pub.counters.rttm_replies_sent > 0
    assert image.window_length < image.congestion.max_window_length() or image.loss.gaps_found > 0


def test_slow_consumer_paces_the_publication_by_processing() -> None:
    """A consumer that processes 5 messages per step holds the publisher within two windows of itself."""
    net = FakeNetwork(5)
    lead: list[int] = []

    def check(pub: Publication, sub: Subscription) -> None:
        if sub.images:
            lead.append(pub.position - sub.position(1234))

    received, pub, channel = run(net, 5_000, max_extra=100, poll_limit=5, on_step=check)
    assert received == list(range(5_000))
    receiver_window = channel.images[1234].window_length
    # Aeron's end-to-end bound: publication window + receiver window (+ one message in flight).
    bound = pub.publication_window + receiver_window + 200
    assert max(lead) <= bound
    assert max(lead) > receiver_window  # the bound is reached: the consumer, not the network, sets the pace
    assert pub.counters.back_pressure_events > 500
    assert channel.images[1234].overruns == 0
