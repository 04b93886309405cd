"""The broker's UDP egress in memory (no trio, no sockets): a UDP subscription's publication and a transport
`ReceiveChannel` playing the consumer exchange datagrams by hand. The consumer's window is its credit: the
broker never has more than that window (plus one message) unprocessed in flight; settlement stays on TCP.

Most tests run twice: with a consumer whose HELLO asked for capability "deliver-batch" (the SDK's: runs go
out as DELIVER_BATCH payloads, a batch's term bytes shared out among its messages as the SDK does) and
with one that did not (one DELIVER per message)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.broker.udp.datapath import DataPath
from flowbroker.protocol.capabilities import CAPABILITY_DELIVER_BATCH
from flowbroker.protocol.envelope import DELIVER_BATCH, decode_delivery, decode_delivery_batch
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from flowbroker.protocol.frames import (
    Cancel,
    Error,
    Outcome,
    RegisterPublication,
    SubscribeUdp,
    Transfer,
    TransferEntry,
)
from flowbroker.transport.frames import (
    UNFRAGMENTED,
    DataFrame,
    Nak,
    Setup,
    StatusMessage,
    encode_data,
    encode_heartbeat,
    encode_nak,
    encode_setup,
    encode_status_message,
)
from flowbroker.transport.positions import compute_term_id_from_position, frame_space
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig
from tests.broker.coreharness import Consumer, Harness

ENDPOINT = ("127.0.0.1", 5682)
CONSUMER = ("127.0.0.1", 41001)
MS = 1_000_000


class Rig:
    """A core with its data path, a consumer connection with a UDP subscription, and its receive channel."""

    def __init__(self, *, window: int = 16 * 1024, prefetch: int = 1000, batches: bool = False,
                 **sections: dict[str, Any]) -> None:
        self.h = Harness(**sections)
        self.core = self.h.core
        self.datapath = DataPath(self.h.config.udp, self.core, ENDPOINT, lambda: None, seed=3)
        self.core.udp = self.datapath
        self.h.queue("q")
        self.owner: Consumer = self.h.consumer(
            "udp-consumer", capabilities=[CAPABILITY_DELIVER_BATCH] if batches else [])
        self.owner.session.peer_host = CONSUMER[0]
        self.answer = self.owner.ok(lambda rid: SubscribeUdp(rid, 1, "q", prefetch, window, CONSUMER[1], 1002))
        self.channel = ReceiveChannel(1002, ReceiverConfig(receiver_id=9, receiver_window=window,
                                                          session_id=self.answer["session_id"], so_rcvbuf=1 << 20))
        self.sub = self.channel.add_subscription(0)
        self.window = window
        self.held: list[tuple[int, int]] = []  # (tag, term bytes) handed up, not processed
        self.tags: list[int] = []
        self.bodies: list[bytes] = []
        self.payloads: list[tuple[int, int]] = []  # (envelope kind, entries) of every payload polled
        self.loss = 0.0
        self.rng = random.Random(5)

    def publish(self, bodies: list[bytes]) -> None:
        producer = self.h.producer("p", flow_control=False)
        producer.handle(Transfer(producer.session.next_transfer_id, [TransferEntry("", "q", b) for b in bodies]))

    def cycle(self, rounds: int = 2, step_ms: int = 1) -> None:
        for _ in range(rounds):
            self.h.t[0] += step_ms * MS
            now = self.h.now
            for datagram, address in self.datapath.do_work(now):
                assert address == CONSUMER
                if self.rng.random() >= self.loss:
                    self.channel.on_datagram(datagram, ENDPOINT, now)
            for datagram, address in self.channel.do_work(now):
                assert address == ENDPOINT
                if self.rng.random() >= self.loss:
                    self.datapath.on_datagram(datagram, CONSUMER, now)
            image = self.image

            def take(payload: memoryview | bytes) -> None:
                assert image is not None
                space = frame_space(len(payload), image.mtu)
                image.hold(self.sub.subscription_id, space)
                if payload[0] == DELIVER_BATCH:
                    entries = decode_delivery_batch(payload)
                    share, extra = divmod(space, len(entries))  # as the SDK shares a batch's bytes out
                    tags = [e[0] for e in entries]
                    assert tags == list(range(tags[0], tags[0] + len(tags)))
                    self.held += [(tag, share + (extra if i == 0 else 0)) for i, tag in enumerate(tags)]
                    self.bodies += [e[3] for e in entries]
                    self.payloads.append((DELIVER_BATCH, len(entries)))
                    return
                entry = decode_delivery(payload)
                self.held.append((entry.delivery_tag, space))
                self.bodies.append(entry.body)
                self.payloads.append((payload[0], 1))

            self.channel.do_work(now)
            while self.sub.poll(take, 64):
                pass

    @property
    def image(self) -> Any:
        return next(iter(self.channel.images.values()), None)

    def process(self, count: int, outcome: Outcome = Outcome.ACK) -> None:
        """The application processes the `count` oldest messages: their bytes leave the hold, then settle."""
        done, self.held = self.held[:count], self.held[count:]
        for tag, space in done:
            self.image.release(self.sub.subscription_id, space)
        if done:
            self.owner.settle(outcome, [tag for tag, _ in done])

    def consume(self, count: int, rounds: int) -> None:
        """Cycle, processing everything handed up each time, until `count` messages have arrived."""
        for _ in range(rounds):
            self.cycle()
            self.process(len(self.held))
            if len(self.bodies) == count:
                break

    @property
    def stream(self) -> Any:
        return self.datapath.egress.subscriptions[self.answer["session_id"]]

    def unprocessed_in_flight(self) -> int:
        """Term bytes the broker's publication holds beyond what the consumer has processed."""
        image = self.image
        processed = 0 if image is None else image.subscriber_position(self.sub.subscription_id) - image.subscriber_hold(
            self.sub.subscription_id)
        return int(self.stream.publication.position - processed)


def test_subscribe_udp_answers_like_subscribe_plus_the_session() -> None:
    rig = Rig()
    assert rig.answer["queue"] == "q" and rig.answer["endpoint"] == "127.0.0.1:5682"
    assert rig.answer["stream_id"] == 1002 and rig.answer["session_id"] in rig.datapath.session_ids.live
    assert 1 in rig.owner.session.subscriptions


@pytest.mark.parametrize("batches", [False, True])
def test_messages_arrive_in_order_over_udp_and_settle_over_tcp(batches: bool) -> None:
    rig = Rig(batches=batches)
    bodies = [b"m%04d" % i for i in range(300)]
    rig.publish(bodies)
    rig.consume(300, 100)
    assert rig.bodies == bodies
    rig.cycle()
    assert len(rig.core.queues["q"].store) == 0 and not rig.owner.session.deliveries.unsettled


@pytest.mark.parametrize("batches", [False, True])
def test_a_slow_consumer_never_has_more_than_its_window_unprocessed_in_flight(batches: bool) -> None:
    rig = Rig(window=16 * 1024, batches=batches)
    rig.publish([b"x" * 1000] * 200)
    frame = frame_space(1000 + 40, rig.h.config.udp.mtu)  # body + the envelope's few bytes
    for _ in range(30):
        rig.cycle(step_ms=50)
        assert rig.unprocessed_in_flight() <= rig.window + frame
        rig.process(1)  # a slow application: one message per cycle, so runs start with little window left
    per_message = 1000 + 10 if batches else frame  # in a batch, a body and its entry's few bytes
    before = len(rig.bodies)
    assert 0 < before - 30 <= rig.window // per_message + 2
    rig.process(len(rig.held))
    for _ in range(5):
        rig.cycle()
    assert len(rig.bodies) >= before + rig.window // per_message // 2  # processing opened the window


@pytest.mark.parametrize("batches", [False, True])
def test_a_message_larger_than_the_window_is_sent_whole_and_nothing_after_it_until_it_is_processed(
        batches: bool) -> None:
    """A message may overflow the window, but its frames past the window's end waited for a status message
    that processing could not cause (none of it is handed up before all of it is in): each such message
    took the consumer's periodic status message, ~100 ms (a tester: 55 ms a message against 0.5 ms)."""
    rig = Rig(window=16 * 1024, batches=batches)
    rig.publish([b"%03d" % i + b"x" * 20_000 for i in range(5)])
    for i in range(5):
        rig.cycle(rounds=3)  # (1 ms apart: no periodic status message in between)
        assert len(rig.bodies) == i + 1, "the message over the window did not arrive whole"
        assert rig.unprocessed_in_flight() <= rig.window + frame_space(20_003 + 40, rig.h.config.udp.mtu)
        rig.process(1)
    assert rig.bodies == [b"%03d" % i + b"x" * 20_000 for i in range(5)]


@pytest.mark.parametrize("batches", [False, True])
def test_prefetch_bounds_unsettled_deliveries(batches: bool) -> None:
    rig = Rig(batches=batches, prefetch=5, window=1 << 20)
    rig.publish([b"p"] * 20)
    for _ in range(10):
        rig.cycle()
    assert len(rig.bodies) == 5
    rig.process(5)
    for _ in range(10):
        rig.cycle()
    assert len(rig.bodies) == 10


@pytest.mark.parametrize("batches", [False, True])
def test_a_lone_subscription_takes_its_window_in_one_run_across_term_ends(batches: bool) -> None:
    """A lone UDP subscription takes a run (`UdpSubscription.deliver_ready`) bounded by its window, with
    consecutive tags; a delivery that meets a term's end is offered again at once (the term rotated) rather
    than left in the slot until the next status message, so runs cross term ends without waiting. (With a
    window of a quarter term the publication's own limit, half a term past what it sent, is never what
    stops an offer: only a rotation could have put a delivery in the slot.)"""
    rig = Rig(window=16 * 1024, batches=batches, udp={"term_length": 64 * 1024, "max_receiver_window": 32 * 1024})
    count = 400  # about 6 terms of 1 KiB deliveries
    bodies = [b"%04d" % i + b"t" * 1000 for i in range(count)]
    rig.publish(bodies)
    frame = frame_space(1004 + 40, rig.h.config.udp.mtu)
    for _ in range(200):
        rig.cycle()
        assert rig.stream.slot is None
        assert rig.unprocessed_in_flight() <= rig.window + frame
        rig.process(len(rig.held))
        if len(rig.bodies) == count:
            break
    assert rig.bodies == bodies
    assert rig.stream.publication.position > 5 * 64 * 1024  # it crossed several term ends
    rig.cycle()
    assert len(rig.core.queues["q"].store) == 0 and not rig.owner.session.deliveries.unsettled


@pytest.mark.parametrize("batches", [False, True])
def test_closing_the_connection_requeues_in_order_and_ends_the_publication(batches: bool) -> None:
    rig = Rig(batches=batches)
    rig.publish([b"r%d" % i for i in range(10)])
    for _ in range(5):
        rig.cycle()
    assert len(rig.bodies) == 10
    session_id = rig.answer["session_id"]
    rig.owner.close()
    assert [m.body for m in rig.core.queues["q"].store] == [b"r%d" % i for i in range(10)]
    assert all(m.redelivered for m in rig.core.queues["q"].store)
    assert session_id not in rig.datapath.egress.subscriptions
    for _ in range(40):
        rig.cycle(step_ms=100)
    assert session_id not in rig.datapath.session_ids.live  # end of stream sent, lingered, given back


@pytest.mark.parametrize("batches", [False, True])
def test_cancel_requeues_and_closes_the_publication(batches: bool) -> None:
    rig = Rig(batches=batches)
    rig.publish([b"c%d" % i for i in range(4)])
    for _ in range(5):
        rig.cycle()
    rig.owner.ok(lambda rid: Cancel(rid, 1))
    rig.cycle()
    assert rig.answer["session_id"] not in rig.datapath.egress.subscriptions
    assert [m.body for m in rig.core.queues["q"].store] == [b"c%d" % i for i in range(4)]


def test_control_datagrams_from_elsewhere_are_refused() -> None:
    rig = Rig()
    rig.cycle()
    sm = [d for d, _ in rig.channel.do_work(rig.h.now + 300 * MS)]
    assert sm
    rig.datapath.on_datagram(sm[0], ("127.0.0.9", CONSUMER[1]), rig.h.now)
    assert rig.datapath.refused["wrong_source"] == 1
    bad = bytearray(sm[0])
    bad[8:12] = (12345).to_bytes(4, "little", signed=True)
    rig.datapath.on_datagram(bytes(bad), CONSUMER, rig.h.now)
    assert rig.datapath.refused["unregistered_session"] == 1


def _forged_sm(rig: Rig, ahead: int, window: int) -> bytes:
    """An SM for the rig's session saying the consumer processed `ahead` bytes past what was sent and
    grants `window`: what an attacker who knows the session (and the term ids) would send."""
    pub = rig.stream.publication
    position = pub.position + ahead
    term_id = compute_term_id_from_position(position, pub.position_bits_to_shift, pub.initial_term_id)
    return encode_status_message(StatusMessage(rig.answer["session_id"], 1002, term_id,
                                               position & (pub.term_length - 1), window, 999))


def test_status_messages_from_another_port_of_the_consumers_host_are_refused_and_open_nothing() -> None:
    """Regression: only the host was compared, so SMs with the consumer's session id from any port of its
    host were taken and opened the window past what the consumer had processed."""
    rig = Rig(window=16 * 1024)
    rig.publish([b"x" * 1000] * 100)
    for _ in range(5):
        rig.cycle()  # nothing processed: the consumer's window is used up
    pub = rig.stream.publication
    limit, delivered = pub.sender_limit, len(rig.bodies)
    assert pub.position >= limit
    for port in (CONSUMER[1] + 1, ENDPOINT[1], 1):
        rig.datapath.on_datagram(_forged_sm(rig, 64 * 1024, 1 << 20), (CONSUMER[0], port), rig.h.now)
    assert rig.datapath.refused == {"wrong_source": 3}
    assert pub.sender_limit == limit
    assert rig.datapath.do_work(rig.h.now + MS) == []  # no delivery went out on the forged window
    rig.cycle()
    assert len(rig.bodies) == delivered
    rig.datapath.on_datagram(_forged_sm(rig, 0, 1 << 20), CONSUMER, rig.h.now)  # the registered address
    assert pub.sender_limit > limit and rig.datapath.refused == {"wrong_source": 3}


def test_a_receivers_frame_for_a_producers_session_and_a_senders_for_a_consumers_are_wrong_direction() -> None:
    """SM and NAK for the session of a publication the broker receives, DATA/PAD/SETUP for one it sends on:
    refused as `wrong_direction` (not `unregistered_session`: the id is live, on the other side)."""
    rig = Rig()
    producer = rig.h.producer("udp-producer")
    producer.session.peer_host = CONSUMER[0]
    ingress_id = producer.ok(lambda rid: RegisterPublication(rid, "", "q", 1001, 40002))["session_id"]
    egress_id = rig.answer["session_id"]
    sources = [CONSUMER, ("127.0.0.1", 40002)]  # each side's registered address: the direction is what is wrong
    receivers = [encode_status_message(StatusMessage(ingress_id, 1001, 0, 0, 65536, 1)),
                 encode_nak(Nak(ingress_id, 1001, 0, 0, 1024))]
    senders = [encode_data(DataFrame(40, UNFRAGMENTED, 0, egress_id, 1002, 0, 0, b"x" * 8)),
               encode_heartbeat(0, egress_id, 1002, 0),
               encode_setup(Setup(0, egress_id, 1002, 0, 0, rig.h.config.udp.term_length, 1408))]
    for datagram in receivers + senders:
        for source in sources:
            rig.datapath.on_datagram(datagram, source, rig.h.now)
    assert rig.datapath.refused == {"wrong_direction": 2 * len(receivers + senders)}
    assert rig.datapath.ingress.publications[ingress_id].image is None  # nothing reached either side
    assert len(rig.bodies) == 0
    gone = 12345  # an id nobody holds is still unregistered, whatever its direction
    rig.datapath.on_datagram(encode_status_message(StatusMessage(gone, 1001, 0, 0, 65536, 1)), CONSUMER, rig.h.now)
    assert rig.datapath.refused["unregistered_session"] == 1


def test_subscriptions_are_bounded_and_checked_like_subscribe() -> None:
    rig = Rig(udp={"max_subscriptions": 1})
    again = rig.owner.request(lambda rid: SubscribeUdp(rid, 2, "q", 10, 0, CONSUMER[1] + 1, 1002))
    assert isinstance(again, Error) and "max_subscriptions 1" in again.text
    other = Rig()
    missing = other.h.consumer("other")
    missing.session.peer_host = CONSUMER[0]
    answer = missing.request(lambda rid: SubscribeUdp(rid, 1, "nope", 10, 0, CONSUMER[1] + 2, 1002))
    assert isinstance(answer, Error) and "nope" in answer.text


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 150), st.sampled_from([Outcome.ACK, Outcome.REQUEUE]), st.booleans())
def test_with_loss_every_message_is_delivered_and_settled_exactly_once(seed: int, count: int,
                                                                        second: Outcome, batches: bool) -> None:
    rig = Rig(window=8 * 1024, batches=batches)
    rig.rng = random.Random(seed)
    rig.loss = 0.05
    bodies = [b"%05d" % i + b"z" * rig.rng.randrange(0, 2000) for i in range(count)]
    rig.publish(bodies)
    acked: list[bytes] = []
    requeued_once: set[bytes] = set()
    for _ in range(3000):
        rig.cycle(rounds=1, step_ms=rig.rng.choice([1, 10, 60]))
        if rig.held and rig.rng.random() < 0.5:
            n = rig.rng.randrange(1, len(rig.held) + 1)
            first_body = rig.bodies[len(rig.bodies) - len(rig.held)]
            outcome = second if first_body not in requeued_once else Outcome.ACK
            if outcome is Outcome.REQUEUE:
                requeued_once.add(first_body)
                n = 1
            taken = rig.bodies[len(rig.bodies) - len(rig.held):][:n]
            rig.process(n, outcome)
            if outcome is Outcome.ACK:
                acked += taken
        if sorted(acked) == sorted(bodies):
            break
    assert sorted(acked) == sorted(bodies) and len(acked) == len(set(acked))
    assert len(rig.core.queues["q"].store) == 0


def test_a_batching_consumer_gets_full_datagrams_of_deliveries_and_a_plain_one_a_delivery_each() -> None:
    """A run to a consumer whose connection asked for "deliver-batch" goes out as DELIVER_BATCH payloads,
    each filling one datagram of the publication's mtu (no fragments) as far as its messages allow; one
    that did not ask gets one DELIVER per message, as before the capability existed."""
    bodies = [b"%05d" % i + b"b" * 200 for i in range(600)]
    for batches in (True, False):
        rig = Rig(window=1 << 20, batches=batches)
        rig.publish(bodies)
        rig.consume(len(bodies), 20)
        assert rig.bodies == bodies
        mtu = rig.stream.publication.mtu
        if not batches:
            assert {kind for kind, _ in rig.payloads} == {0x02}
            continue
        assert {kind for kind, _ in rig.payloads} == {DELIVER_BATCH}
        per_datagram = (mtu - 32 - 6) // (205 + 4 * len("q") + 32)  # what the entry bounds let one carry
        assert [n for _, n in rig.payloads[:-1]] == [per_datagram] * (len(rig.payloads) - 1)
        assert rig.stream.publication.statistics().data_datagrams_sent >= len(rig.payloads)


def test_a_batch_is_never_fragmented_and_never_over_the_entry_limit() -> None:
    """Tiny messages: a batch stops at MAX_ENTRIES_PER_FRAME (what the consumer checks) before its datagram
    is full; a message too big for any batch goes alone as a DELIVER (fragmented by the publication), in
    its place in the order."""
    rig = Rig(window=1 << 20, prefetch=5000, batches=True)  # a loopback consumer: loopback_mtu's datagrams
    big = b"B" * 100_000
    bodies = [b"%d" % i for i in range(2500)] + [big] + [b"t%d" % i for i in range(10)]
    rig.publish(bodies)
    rig.consume(len(bodies), 50)
    assert rig.bodies == bodies
    assert rig.stream.publication.mtu == 65504
    assert max(n for kind, n in rig.payloads if kind == DELIVER_BATCH) == MAX_ENTRIES_PER_FRAME
    assert (0x02, 1) in rig.payloads
