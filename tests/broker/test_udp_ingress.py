"""The broker's UDP ingress in memory (no trio, no sockets): a transport `Publication` and the broker's
`DataPath` exchange datagrams by hand. Over UDP the image's window is the producer's credit and the
consumption position its completion point: a saturated queue stops it, draining the queue moves it on."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.broker.core import PACE_MAX_NS
from flowbroker.broker.queue import Queue
from flowbroker.broker.udp.datapath import DataPath
from flowbroker.broker.udp.ingress import MAX_MESSAGES_PER_CYCLE
from flowbroker.protocol.credit import MESSAGE_OVERHEAD
from flowbroker.protocol.envelope import encode_publish, encode_publish_batch
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import ClosePublication, Error, FlowResumed, FlowStopped, RegisterPublication
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from flowbroker.transport.frames import (
    BEGIN_FLAG,
    DATA_HEADER_LENGTH,
    END_FLAG,
    DataFrame,
    Setup,
    encode_data,
    encode_setup,
)
from flowbroker.transport.publication import OfferResult, Publication, PublicationConfig
from tests.broker.coreharness import Consumer, Harness, Producer

ENDPOINT = ("127.0.0.1", 5682)
SOURCE = ("127.0.0.1", 40001)
MS = 1_000_000


class Rig:
    """A broker core with its data path, one owner connection, and a publication registered by it."""

    def __init__(self, *, stream_id: int = 1001, source: tuple[str, int] = SOURCE, exchange: str = "",
                 routing_key: str = "q", before: Any = None, **sections: dict[str, Any]) -> None:
        sections.setdefault("credit", {"policy": "static", "static_size": 64 * 1024})
        self.h = Harness(**sections)
        self.core = self.h.core
        self.wakes = 0
        self.datapath = DataPath(self.h.config.udp, self.core, ENDPOINT, self._wake, seed=7)
        self.core.udp = self.datapath
        self.owner: Producer = self.h.producer("owner")
        self.source = source
        self.owner.session.peer_host = source[0]
        if before is not None:  # what the registration needs first (an exchange, say)
            before(self)
        answer = self.owner.ok(lambda rid: RegisterPublication(rid, exchange, routing_key, stream_id, source[1]))
        self.answer = answer
        self.session_id: int = answer["session_id"]
        udp = self.h.config.udp
        self.pub = Publication(
            PublicationConfig(self.session_id, stream_id, term_length=udp.term_length, mtu=answer["mtu"],
                              max_messages_per_send=64),
            self.h.now, destination=ENDPOINT,
        )

    def _wake(self) -> None:
        self.wakes += 1

    def cycle(self, rounds: int = 3, step_ms: int = 1) -> None:
        """Datagrams both ways until quiet, advancing the clock a little each round."""
        for _ in range(rounds):
            self.h.t[0] += step_ms * MS
            now = self.h.now
            for datagram, address in self.pub.do_work(now):
                assert address == ENDPOINT
                self.datapath.on_datagram(datagram, self.source, now)
            for datagram, address in self.datapath.do_work(now):
                assert address == self.source
                self.pub.on_datagram(datagram, ENDPOINT, now)

    def offer_all(self, bodies: list[bytes], rounds: int = 200) -> int:
        """Offer every body in order, cycling while back-pressured; returns how many were offered."""
        sent = 0
        for _ in range(rounds):
            while sent < len(bodies):
                if self.pub.offer(encode_publish(bodies[sent])) < 0:
                    break
                sent += 1
            self.cycle()
            if sent == len(bodies):
                break
        return sent

    @property
    def image(self) -> Any:
        return self.datapath.ingress.publications[self.session_id].image

    def bodies(self, queue: str = "q") -> list[bytes]:
        return [m.body for m in self.core.queues[queue].store]


def test_registration_answers_the_session_and_geometry_and_opens_a_producer_session() -> None:
    rig = Rig()
    rig.h.queue("q")
    udp = rig.h.config.udp
    assert rig.answer["endpoint"] == "127.0.0.1:5682" and rig.answer["stream_id"] == 1001
    # from a loopback address: datagrams of loopback_mtu (at most term_length / 8 and max_receiver_window)
    assert (rig.answer["term_length"], rig.answer["mtu"]) == (udp.term_length, 65504)
    pub_session = rig.core.sessions[rig.answer["connection"]]
    assert pub_session.client_name == f"owner udp:{rig.session_id}"
    assert pub_session.conn_id in rig.core.credit.producer_ids


def test_a_publication_from_another_host_sends_with_the_configured_mtu_and_loopback_mtu_is_bounded() -> None:
    rig = Rig(source=("10.1.2.3", 40001))
    rig.h.queue("q")
    assert rig.answer["mtu"] == rig.h.config.udp.mtu == 8192
    bodies = [b"%04d" % i + b"r" * 3000 for i in range(200)]
    assert rig.offer_all(bodies) == len(bodies)
    rig.cycle(rounds=20)
    assert rig.bodies() == bodies
    small = Rig(udp={"term_length": 65536, "mtu": 4096, "min_receiver_window": 4096, "max_receiver_window": 32768})
    assert small.answer["mtu"] == 8192  # term_length / 8
    narrow = Rig(udp={"max_receiver_window": 20000})
    assert narrow.answer["mtu"] == 20000 & ~31  # a window holds at least one datagram
    assert Rig(udp={"loopback_mtu": 4096}).answer["mtu"] == 4096


def test_a_window_never_closes_below_one_datagram_of_the_publication_so_big_messages_go_through() -> None:
    """The credit grant (static 16 KiB here) is below loopback_mtu: the image's window is raised to one
    datagram, or a message fragmented into mtu-sized frames could never be sent."""
    rig = Rig(credit={"policy": "static", "static_size": 16 * 1024})
    rig.h.queue("q")
    bodies = [b"%04d" % i + b"B" * 200_000 for i in range(6)]  # each in four 64 KiB frames
    assert rig.offer_all(bodies) == len(bodies)
    for _ in range(50):
        rig.cycle()
        if len(rig.bodies()) == len(bodies):
            break
    assert rig.bodies() == bodies
    assert rig.image.statistics().receiver_window >= 65504


def test_messages_are_routed_in_order_and_the_window_is_the_credit_grant() -> None:
    rig = Rig()
    rig.h.queue("q")
    bodies = [b"m%05d" % i for i in range(500)]
    assert rig.offer_all(bodies) == 500
    rig.cycle()
    assert rig.bodies() == bodies
    assert rig.image.window_cap == 64 * 1024  # the static grant
    assert rig.image.statistics().consumption_position == rig.pub.position  # all completed


def test_a_saturated_queue_closes_the_window_and_draining_it_reopens_it() -> None:
    rig = Rig()
    rig.h.queue("q", flow_stop_count=10, flow_resume_count=5)
    body = b"x" * 1000
    total = 1500  # more than the publication's window (pub-wnd: term_length / 2) can buffer
    sent = rig.offer_all([body] * total, rounds=30)
    assert sent < total  # back-pressured: the broker's window closed, the sender stopped, the term filled
    assert rig.pub.offer(encode_publish(body)) == OfferResult.BACK_PRESSURED
    queue = rig.core.queues["q"]
    # past the stop threshold by at most one window of messages (each 1,000 B + 32 B header + 1 B envelope)
    assert 10 < len(queue.store) <= 10 + 64 * 1024 // 1056 + 1
    rig.owner.pump()
    stops = rig.owner.received(FlowStopped)
    assert [s.destination for s in stops] == ["q"]
    before = rig.image.statistics().consumption_position
    rig.cycle(rounds=10, step_ms=300)  # time passes: nothing moves while the queue is saturated
    assert rig.image.statistics().consumption_position == before
    rig.owner.pump()
    assert rig.core.delete_queue("q") or True
    rig.h.queue("q")  # a fresh queue: the held transfers were released by the delete
    rig.cycle(rounds=5)
    rig.owner.pump()
    assert rig.image.statistics().consumption_position > before
    rest = rig.offer_all([body] * (total - sent))
    assert rest == total - sent


def test_resume_releases_the_holds_in_order() -> None:
    rig = Rig()
    rig.h.queue("q", flow_stop_count=20, flow_resume_count=10)
    bodies = [b"%04d" % i + b"y" * 500 for i in range(300)]
    sent = rig.offer_all(bodies, rounds=20)
    assert rig.pub.sender_position < rig.pub.position  # stopped on the queue
    consumer = rig.h.consumer("c")
    consumer.subscribe("q", prefetch=7)
    for _ in range(500):
        consumer.pump()
        consumer.ack()  # a consumer that takes and settles everything, 7 at a time
        rig.cycle(rounds=1)
        while sent < len(bodies) and rig.pub.offer(encode_publish(bodies[sent])) > 0:
            sent += 1
        if len(consumer.bodies()) == len(bodies):
            break
    assert consumer.bodies() == bodies
    rig.owner.pump()
    kinds = [type(f) for f in rig.owner.frames if isinstance(f, (FlowStopped, FlowResumed))]
    assert kinds[:2] == [FlowStopped, FlowResumed]


def test_stop_all_holds_udp_producers_too() -> None:
    rig = Rig()
    rig.h.queue("q")
    rig.core.stop_all_producers()
    sent = rig.offer_all([b"z" * 1000] * 200, rounds=20)
    assert rig.pub.sender_position < rig.pub.position  # the broker's window closed: data waits in the term
    rig.owner.pump()
    stops = rig.owner.received(FlowStopped)
    assert "*" in [s.destination for s in stops]
    rig.core.start_all_producers()
    assert rig.offer_all([b"z" * 1000] * (200 - sent)) == 200 - sent
    rig.cycle()
    assert len(rig.core.queues["q"].store) == 200


def test_refusals_are_relayed_to_the_owner_with_the_session_id() -> None:
    rig = Rig()  # no queue "q": every message is refused NOT_FOUND, and completed (the window moves on)
    assert rig.offer_all([b"lost?"] * 50) == 50
    rig.cycle()
    rig.owner.pump()
    errors = [e for e in rig.owner.errors if isinstance(e, Error)]
    assert errors and all(e.session_id == rig.session_id and e.ref_id is None for e in errors)
    assert rig.image.statistics().consumption_position == rig.pub.position


def test_datagrams_that_are_not_the_registered_publications_are_refused_by_reason() -> None:
    rig = Rig()
    rig.h.queue("q")
    rig.offer_all([b"a"])
    setup_like = [d for d, _ in rig.pub.do_work(rig.h.now + 200 * MS)] or [b""]
    refused = rig.datapath.refused
    for datagram in setup_like:
        if len(datagram) >= 20:
            rig.datapath.on_datagram(datagram, ("127.0.0.1", SOURCE[1] + 1), rig.h.now)  # another port
            rig.datapath.on_datagram(datagram, ("127.0.0.2", SOURCE[1]), rig.h.now)  # another host
    assert refused["wrong_source"] >= 2
    other = Publication(PublicationConfig(rig.session_id, 999, term_length=rig.h.config.udp.term_length,
                                          mtu=rig.h.config.udp.mtu), rig.h.now, destination=ENDPOINT)
    for datagram, _ in other.do_work(rig.h.now):
        rig.datapath.on_datagram(datagram, SOURCE, rig.h.now)
    assert refused["wrong_stream"] >= 1
    assert len(rig.datapath.ingress.publications) == 1


def test_a_setup_with_other_geometry_is_refused() -> None:
    rig = Rig(source=("10.1.2.3", 40001))
    udp = rig.h.config.udp
    for config, reason in (
        (PublicationConfig(rig.session_id, 1001, term_length=udp.term_length * 2, mtu=udp.mtu), "setup_term_length"),
        (PublicationConfig(rig.session_id, 1001, term_length=udp.term_length, mtu=udp.mtu * 2), "setup_mtu"),
    ):
        wrong = Publication(config, rig.h.now, destination=ENDPOINT)
        for datagram, _ in wrong.do_work(rig.h.now):
            rig.datapath.on_datagram(datagram, rig.source, rig.h.now)
        assert rig.datapath.refused[reason] == 1
    assert rig.image is None


def test_closing_the_publication_or_its_owner_ends_it() -> None:
    rig = Rig()
    rig.h.queue("q")
    rig.offer_all([b"a"] * 10)
    pub_conn = rig.answer["connection"]
    assert rig.owner.ok(lambda rid: ClosePublication(rid, rig.session_id)) == {"session_id": rig.session_id,
                                                                                "messages": 10}
    assert rig.datapath.ingress.publications == {} and pub_conn not in rig.core.sessions
    assert rig.session_id not in rig.datapath.session_ids.live
    again = rig.owner.ok(lambda rid: RegisterPublication(rid, "", "q", 1001, SOURCE[1]))
    rig.owner.close()
    assert rig.datapath.ingress.publications == {}
    assert again["connection"] not in rig.core.sessions


def test_registrations_are_bounded() -> None:
    rig = Rig(udp={"max_publications_per_connection": 1})
    answer = rig.owner.request(lambda rid: RegisterPublication(rid, "", "q", 1002, SOURCE[1] + 1))
    assert isinstance(answer, Error) and "max_publications_per_connection 1" in answer.text


def test_a_registration_whose_routing_key_is_too_long_is_refused_at_once() -> None:
    """Every message on it would have been refused KEY_TOO_LONG; the registration was accepted (a tester)."""
    rig = Rig()
    answer = rig.owner.request(lambda rid: RegisterPublication(rid, "", "k" * 257, 1002, SOURCE[1] + 1))
    assert isinstance(answer, Error) and answer.code is ErrorCode.KEY_TOO_LONG and "257 bytes" in answer.text


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=120), st.integers(0, 2**32))
def test_every_message_lands_once_in_order_and_the_held_bytes_stay_within_the_window(
    sizes: list[int], seed: int
) -> None:
    import random

    rng = random.Random(seed)
    rig = Rig()
    rig.h.queue("q", flow_stop_count=15, flow_resume_count=5)
    consumer = rig.h.consumer("c")
    consumer.subscribe("q", prefetch=10)
    bodies = [b"%06d" % i + b"b" * n for i, n in enumerate(sizes)]
    sent = 0
    for _ in range(3000):
        while sent < len(bodies) and rig.pub.offer(encode_publish(bodies[sent])) > 0:
            sent += 1
        now = rig.h.now
        for datagram, _ in rig.pub.do_work(now):  # 5 % lost each way
            if rng.random() > 0.05:
                rig.datapath.on_datagram(datagram, SOURCE, now)
        for datagram, _ in rig.datapath.do_work(now):
            if rng.random() > 0.05:
                rig.pub.on_datagram(datagram, ENDPOINT, now)
        rig.h.t[0] += rng.choice([1, 5, 50]) * MS
        image = rig.image
        if image is not None:
            sub_id = rig.datapath.ingress.publications[rig.session_id].subscription.subscription_id
            # what the broker holds for this producer (routed, not completed) stays within its window
            assert image.subscriber_hold(sub_id) <= image.window_length
        if rng.random() < 0.3:
            consumer.pump()
            consumer.ack()
        if len(consumer.bodies()) == len(bodies):
            break
    assert consumer.bodies() == bodies


def test_many_terms_later_every_message_is_still_routed_once_in_order() -> None:
    """The image's log is three terms: a position reported outside the quarter-window rule (report_now,
    the periodic SM) must clean the partition the sender writes into next, or stale frames are read again."""
    rig = Rig(udp={"term_length": 65536, "mtu": 4096, "min_receiver_window": 4096, "max_receiver_window": 32768})
    rig.h.queue("q")
    bodies = [b"%06d" % i + b"t" * 90 for i in range(3000)]  # 3,000 x 128 term bytes: almost 6 terms
    sent = 0
    for _ in range(3000):
        while sent < len(bodies) and rig.pub.offer(encode_publish(bodies[sent])) > 0:
            sent += 1
        rig.cycle(rounds=1, step_ms=rig.h.now % 3 * 100 + 1)  # now and then past the periodic SM timeout
        if sent == len(bodies) and rig.image.statistics().consumption_position == rig.pub.position:
            break
    assert rig.bodies() == bodies


def test_a_publication_closed_while_flow_stopped_leaves_its_owner_resumed() -> None:
    rig = Rig()
    rig.h.queue("q", flow_stop_count=5, flow_resume_count=2)
    rig.offer_all([b"s" * 500] * 100, rounds=10)
    rig.owner.pump()
    assert [f.destination for f in rig.owner.received(FlowStopped)] == ["q"]
    rig.owner.ok(lambda rid: ClosePublication(rid, rig.session_id))
    assert [f.destination for f in rig.owner.received(FlowResumed)] == ["q"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["bare", "keyed", "headers", "empty", "bad_kind", "batch", "bad_batch"]),
                min_size=60, max_size=200),
       st.integers(0, 2**32))
def test_mixed_envelopes_complete_in_order_and_the_consumption_position_never_passes_an_unrouted_message(
    kinds: list[str], seed: int
) -> None:
    """Polls of only bare messages and PUBLISH_BATCHes are taken in bulk, anything else message by
    message; either way every good message lands once and in order, every bad payload is counted, and the
    consumption position the producer sees never passes a message that is not complete (a saturated queue
    holds them): a batch's bytes go only once all of its messages are complete."""
    _check_envelopes(kinds, seed)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["bare", "batch"]), min_size=60, max_size=200), st.integers(0, 2**32))
def test_bare_and_batched_polls_taken_in_bulk_hold_a_batch_until_all_of_it_is_complete(
    kinds: list[str], seed: int
) -> None:
    """The SDK's payloads only: every poll is taken in bulk (`_poll`), and when a saturated queue holds
    some of a poll's messages each batch stays held to its last message."""
    _check_envelopes(kinds, seed)


def _check_envelopes(kinds: list[str], seed: int) -> None:
    import random

    rng = random.Random(seed)
    rig = Rig()
    rig.h.queue("q", flow_stop_count=12, flow_resume_count=4)
    rig.h.queue("other", flow_stop_count=12, flow_resume_count=4)
    consumers = {name: rig.h.consumer(f"c-{name}") for name in ("q", "other")}
    for name, consumer in consumers.items():
        consumer.subscribe(name, prefetch=5)
    payloads: list[bytes] = []
    good: list[tuple[str, bytes]] = []  # (queue, body) of each good message, in order
    carried: list[int] = []  # good messages in each payload
    for i, kind in enumerate(kinds):
        body = b"%06d" % i + b"m" * rng.randrange(0, 1500)
        before = len(good)
        if kind == "batch":
            bodies = [body + b"%d" % j for j in range(rng.randrange(1, 6))]
            payloads.append(encode_publish_batch(bodies))
            good += [("q", b) for b in bodies]
        elif kind == "bad_batch":
            payloads.append(encode_publish_batch([body])[:-1])  # its body one byte short: not msgpack
        elif kind == "bare":
            payloads.append(encode_publish(body))
            good.append(("q", body))
        elif kind == "keyed":
            payloads.append(encode_publish(body, "other"))
            good.append(("other", body))
        elif kind == "headers":
            payloads.append(encode_publish(body, None, {"h": i}))
            good.append(("q", body))
        elif kind in ("empty", "bad_kind"):
            payloads.append(b"" if kind == "empty" else b"\x07" + body)
        carried.append(len(good) - before)
    ends: list[int] = []
    sent = 0
    for _ in range(3000):
        while sent < len(payloads):
            end = rig.pub.offer(payloads[sent])
            if end < 0:
                break
            ends.append(end)
            sent += 1
        rig.cycle(rounds=1, step_ms=rng.choice([1, 5, 50]))
        image = rig.image
        if image is not None and ends:
            # The payloads whose messages are all complete (and any bad ones right after them) may be
            # consumed; transfer ids count the good messages from 1.
            reached = rig.datapath.ingress.publications[rig.session_id].session.transfers.completed.cumulative
            allowed = rig.pub.start_position
            count = 0
            for index, end in enumerate(ends):
                if carried[index] and count + carried[index] > reached:
                    break
                count += carried[index]
                allowed = end
            assert image.statistics().consumption_position <= allowed
        if rng.random() < 0.4:
            for consumer in consumers.values():
                consumer.pump()
                consumer.ack()
        if (sent == len(payloads) and sum(len(c.bodies()) for c in consumers.values()) == len(good)
                and image is not None and image.statistics().consumption_position == rig.pub.position):
            break
    for name, consumer in consumers.items():
        assert consumer.bodies() == [body for queue, body in good if queue == name]
    bad = carried.count(0)
    assert rig.datapath.ingress.messages_dropped == bad


def _held_charged(rig: Rig) -> int:
    """Charged bytes (message_size) of the publication session's messages routed and not complete."""
    window = rig.datapath.ingress.publications[rig.session_id].session.transfers.window
    return int(window.position - window.consumed_position)


def test_batches_of_empty_bodies_at_a_saturated_queue_hold_no_more_than_the_grant_and_one_batch() -> None:
    """A window of term bytes holds a thousand times more empty bodies in PUBLISH_BATCHes (two bytes each)
    than it holds charged bytes (512 each). The ingress stops polling once what it routed and has not
    completed reaches the grant: it held 16 MB on a 64 KiB grant before it did."""
    rig = Rig()
    rig.h.queue("q", flow_stop_count=10, flow_resume_count=5)
    payload = encode_publish_batch([b""] * MAX_ENTRIES_PER_FRAME)
    worst = 0
    for _ in range(100):
        while rig.pub.offer(payload) > 0:
            pass
        rig.cycle(rounds=1)
        worst = max(worst, _held_charged(rig))
    grant = rig.image.window_cap
    assert grant == 64 * 1024
    assert 0 < worst <= grant + MAX_ENTRIES_PER_FRAME * (MESSAGE_OVERHEAD + 2)
    assert len(rig.core.queues["q"].store) <= 10 + grant // MESSAGE_OVERHEAD + MAX_ENTRIES_PER_FRAME
    consumer = rig.h.consumer("c")  # draining the queue completes what was held: polling goes on
    consumer.subscribe("q", prefetch=5000)
    for _ in range(50):
        consumer.pump()
        consumer.ack()
        rig.cycle(rounds=1)
    assert len(consumer.bodies()) > 10 + grant // MESSAGE_OVERHEAD + MAX_ENTRIES_PER_FRAME


def test_bare_messages_at_a_saturated_queue_hold_no_more_than_the_grant_and_one_message() -> None:
    rig = Rig()
    rig.h.queue("q", flow_stop_count=10, flow_resume_count=5)
    worst = 0
    for _ in range(100):
        while rig.pub.offer(encode_publish(b"")) > 0:
            pass
        rig.cycle(rounds=1)
        worst = max(worst, _held_charged(rig))
    assert 0 < worst <= rig.image.window_cap + MESSAGE_OVERHEAD


def test_a_cycle_routes_at_most_its_message_bound_and_one_batch_more() -> None:
    """A frame costs the broker time in proportion to what it carries: a cycle's messages are counted
    from each batch's header, not as one per payload (a window of batches of empty bodies is half a
    million messages)."""
    rig = Rig(credit={"policy": "static", "static_size": 1 << 20})
    rig.h.queue("q")
    payload = encode_publish_batch([b""] * MAX_ENTRIES_PER_FRAME)
    rig.cycle()  # connected: SETUP, status message
    for _ in range(200):
        if rig.pub.offer(payload) < 0:
            break
    for datagram, _ in rig.pub.do_work(rig.h.now):
        rig.datapath.on_datagram(datagram, SOURCE, rig.h.now)
    queue = rig.core.queues["q"]
    routed = []
    pending = []
    for _ in range(5):
        before = len(queue.store)
        rig.datapath.do_work(rig.h.now)
        routed.append(len(queue.store) - before)
        pending.append(rig.datapath.ingress.pending())
    assert max(routed) <= MAX_MESSAGES_PER_CYCLE + MAX_ENTRIES_PER_FRAME
    assert sum(routed) > MAX_MESSAGES_PER_CYCLE  # and the next cycles go on
    # a cycle stopped at a bound (here the grant, its messages completing at once) leaves the ingress
    # pending: the shell runs the next one at once. Once a cycle routes nothing (the queue saturated
    # at its stop size holds the grant), nothing is pending: no cycle spins on a held grant.
    assert all(pending)
    for _ in range(1000):
        before = len(queue.store)
        rig.datapath.do_work(rig.h.now)
        if len(queue.store) == before:
            break
    assert queue.saturated and not rig.datapath.ingress.pending()


def test_a_caught_up_status_message_waits_while_more_data_waits_for_later_passes() -> None:
    """Completing everything received sends a status message at once (a flushing producer waits for
    exactly that), unless the shell says DATA is left for later passes: a producer still sending is not
    waiting, and the pass that leaves none sends it."""
    for more_waiting in (False, True):
        rig = Rig()
        rig.h.queue("q")
        rig.cycle()  # connected: SETUP, status message
        for i in range(10):  # far below a quarter window: only the caught-up rule reports them
            assert rig.pub.offer(encode_publish(b"m%03d" % i)) >= 0
        now = rig.h.now
        for datagram, _ in rig.pub.do_work(now):
            rig.datapath.on_datagram(datagram, SOURCE, now)
        rig.datapath.more_waiting = more_waiting
        out = rig.datapath.do_work(now)
        assert len(rig.bodies()) == 10
        image = rig.image
        end = image.statistics().consumption_position
        assert end == rig.pub.position
        if not more_waiting:
            assert image.last_sm_position == end and out
            continue
        assert image.last_sm_position < end and not out  # deferred
        assert rig.datapath.do_work(now) == [] and image.last_sm_position < end  # still waiting
        rig.datapath.more_waiting = False  # no DATA left for later passes
        out = rig.datapath.do_work(now)
        assert len(out) == 1 and image.last_sm_position == end
        limit = rig.pub.sender_limit
        for datagram, _ in out:
            rig.pub.on_datagram(datagram, ENDPOINT, now)
        assert rig.pub.sender_limit == end + image.statistics().receiver_window > limit  # the producer told


def test_a_fragmented_batch_is_dropped_and_counted_and_the_window_moves_on() -> None:
    """The SDK never fragments a PUBLISH_BATCH; one that is would be up to MAX_ENTRIES_PER_FRAME messages
    the poll could not see coming, so it is a bad envelope."""
    rig = Rig()
    rig.h.queue("q")
    big = encode_publish_batch([b"f" * 40_000, b"g" * 40_000])  # over one frame of the 64 KiB mtu
    assert rig.offer_all([b"before"]) == 1
    assert rig.pub.offer(big) > 0
    assert rig.offer_all([b"after"]) == 1
    rig.cycle(rounds=5)
    assert rig.bodies() == [b"before", b"after"]
    assert rig.datapath.ingress.messages_dropped == 1
    assert rig.datapath.statistics().messages_dropped == 1  # the metric's and the admin view's figure
    assert rig.datapath.ingress.publications[rig.session_id].session.messages_dropped == 1  # its connection's
    assert rig.image.statistics().consumption_position == rig.pub.position


def raw_datagrams(rig: Rig, payloads: list[bytes], term_id: int = 777) -> tuple[list[bytes], int]:
    """What a client writing its own frames sends for `payloads` on the rig's registration: a SETUP, then
    each payload in frames of the mtu the answer gave (fragmented past it, as a publication would, with
    no length limit); the datagrams and the position after the last."""
    mtu, term_length = rig.answer["mtu"], rig.answer["term_length"]
    datagrams = [encode_setup(Setup(0, rig.session_id, 1001, term_id, term_id, term_length, mtu))]
    offset = 0
    for payload in payloads:
        pieces = [payload[i:i + mtu - DATA_HEADER_LENGTH] for i in range(0, len(payload), mtu - DATA_HEADER_LENGTH)]
        for k, piece in enumerate(pieces):
            flags = (BEGIN_FLAG if k == 0 else 0) | (END_FLAG if k == len(pieces) - 1 else 0)
            datagrams.append(encode_data(DataFrame(DATA_HEADER_LENGTH + len(piece), flags, offset, rig.session_id,
                                                   1001, term_id, 0, piece)))
            offset += (DATA_HEADER_LENGTH + len(piece) + 31) & ~31
    return datagrams, offset


def test_a_message_over_an_eighth_of_a_term_is_dropped_and_counted_and_the_window_moves_on() -> None:
    """docs/configuration.md, [udp] term_length: a message over UDP is at most term_length / 8 with its
    envelope. The SDK refuses a larger one, but a client writing its own frames got fragmented messages
    of 1,048,576 and 1,900,000 bytes routed whole (a 2 MiB term: 8 times the limit, the second almost
    twice the image's window), and UDP consumers then failed on them (a tester). Now the image lets go of
    one as its fragments pass the limit, here one datagram per duty cycle, and the ingress counts it as a
    dropped message and releases its bytes in its place; the messages around it, one exactly at the
    limit among them, are routed in order."""
    rig = Rig(udp={"term_length": 256 * 1024, "max_receiver_window": 128 * 1024})
    rig.h.queue("q")
    limit = rig.answer["term_length"] // 8
    assert rig.answer["mtu"] == limit == 32768
    at_limit = b"E" * (limit - 1)  # with its 1-byte envelope: the limit
    payloads = [encode_publish(b) for b in (b"before", b"X" * (3 * limit), at_limit, b"after")]
    datagrams, end = raw_datagrams(rig, payloads)
    for datagram in datagrams:
        rig.h.t[0] += MS
        rig.datapath.on_datagram(datagram, rig.source, rig.h.now)
        rig.datapath.do_work(rig.h.now)
    assert rig.bodies() == [b"before", at_limit, b"after"]
    assert rig.datapath.statistics().messages_dropped == 1  # the metric's and the admin view's figure
    assert rig.datapath.ingress.publications[rig.session_id].session.messages_dropped == 1  # its connection's
    assert sum(rig.datapath.refused.values()) == 0
    assert rig.image.statistics().consumption_position == end  # its bytes released: the window moved on


# -- pacing ([queues] pace_producers, docs/policies.md "Pacing") ------------------------------------


def paced_rig(pace: bool = True, prefetch: int = 5) -> tuple[Rig, Queue, Consumer]:
    """A rig whose queue "q" has one consumer subscribed with `prefetch`; the rig, the queue, the consumer."""
    rig = Rig(queues={"pace_producers": pace})
    rig.h.queue("q")
    consumer = rig.h.consumer()
    consumer.subscribe("q", prefetch=prefetch)
    return rig, rig.core.queues["q"], consumer


def test_a_paced_udp_producer_keeps_its_holds_until_its_queue_catches_up() -> None:
    """Over UDP the consumption position is the completion point: pacing holds it, so the producer's window
    closes a window past it, as a paced TCP producer's completions wait. The consumer catching up (the
    queue down to its prefetch) releases it; every message arrives once, in order."""
    rig, queue, consumer = paced_rig()
    body = b"p" * 1000  # 64 KiB static grant: some 60 messages a window; the term takes some 1,000
    bodies = [b"%04d" % i + body for i in range(1500)]
    sent = rig.offer_all(bodies, rounds=5)
    session = rig.core.sessions[rig.answer["connection"]]
    assert session.paced_on is queue and sent < len(bodies)  # paced, then back-pressured
    assert session in rig.core.queues["q"].paced
    held_at = rig.image.statistics().consumption_position
    assert held_at < rig.pub.position
    rig.cycle(rounds=10)  # time passes (well under PACE_MAX_NS): nothing moves while the queue is behind
    assert rig.image.statistics().consumption_position == held_at
    assert len(queue.store) <= queue.pace_limit + 64 * 1024 // 1000 + 1  # one window past the pace
    positions = [held_at]
    for _ in range(1000):  # the consumer takes its prefetch at a time until everything has arrived
        consumer.pump()
        consumer.ack()
        rig.cycle()
        positions.append(rig.image.statistics().consumption_position)
        while sent < len(bodies) and rig.pub.offer(encode_publish(bodies[sent])) >= 0:
            sent += 1
        if len(consumer.bodies()) == len(bodies):
            break
    assert consumer.bodies() == bodies  # once each, in order
    assert positions[-1] > held_at and session.paced_total > 1  # released, paced again, released ...
    assert session.paced_on is None and not queue.paced


def test_the_flow_timer_releases_a_paced_udp_producer() -> None:
    rig, queue, _ = paced_rig()  # its consumer never settles
    rig.offer_all([b"t" * 1000] * 100, rounds=3)
    session = rig.core.sessions[rig.answer["connection"]]
    assert session.paced_on is queue
    held_at = rig.image.statistics().consumption_position
    rig.h.advance(2 * PACE_MAX_NS / 1e9)
    rig.core.tick(rig.h.now)
    assert session.paced_on is None
    rig.cycle()
    assert rig.image.statistics().consumption_position > held_at  # the window moved on


def test_without_pacing_a_udp_producer_is_held_only_by_watermarks() -> None:
    rig, queue, _ = paced_rig(pace=False)
    bodies = [b"%04d" % i + b"u" * 1000 for i in range(400)]
    assert rig.offer_all(bodies, rounds=50) == len(bodies)
    rig.cycle(rounds=20)
    assert rig.image.statistics().consumption_position == rig.pub.position  # each window completed at once
    assert rig.core.sessions[rig.answer["connection"]].paced_total == 0 and len(queue.store) == 395


def test_a_publication_closed_or_its_owner_gone_while_paced_leaves_no_pace_behind() -> None:
    for close in ("publication", "owner"):
        rig, queue, consumer = paced_rig()
        rig.offer_all([b"c" * 1000] * 100, rounds=3)
        assert queue.paced and rig.core.paced_queues
        if close == "publication":
            rig.owner.ok(lambda rid: ClosePublication(rid, rig.session_id))
        else:
            rig.owner.close()
        assert not queue.paced and rig.answer["connection"] not in rig.core.sessions
        consumer.pump()
        consumer.ack()  # the queue catches up with no one to release
        rig.core.tick(rig.h.now)
        assert not rig.core.paced_queues
        consumer.pump()
        assert len(consumer.bodies()) == 10  # what was enqueued is still delivered


def test_a_registered_publications_datagrams_that_do_not_hold_together_are_counted_malformed() -> None:
    """A DATA frame whose length runs past its datagram, from the registered address: the channel dropped
    it, and udp.refused counted it under no reason (a tester)."""
    import struct

    rig = Rig()
    rig.h.queue("q")
    rig.offer_all([b"a"])
    data = next(d for d, _ in rig.pub.do_work(rig.h.now + 200 * MS) if len(d) >= 32 and d[6] == 1)
    broken = bytearray(data)
    struct.pack_into("<i", broken, 0, len(broken) + 64)  # frame_length past the datagram
    before = rig.datapath.refused["malformed"]
    rig.datapath.on_datagram(bytes(broken), SOURCE, rig.h.now)
    assert rig.datapath.refused["malformed"] == before + 1


def test_a_poll_whose_fan_out_passes_the_budget_routes_the_rest_in_later_cycles(monkeypatch: Any) -> None:
    """A UDP producer's poll to a fanout of many queues was routed in one step, as a TCP frame's was before
    a68e646 (55 messages to 10,000 queues: half a second). The rest of the poll is routed in the next
    cycles (the shell yields between them), first, with the same result: every message in every queue,
    in order, and the image's consumption position past all of them."""
    from flowbroker.broker import core as core_module

    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 100)

    def wide(rig: Rig) -> None:
        admin = rig.h.consumer("admin")
        admin.declare_exchange("wide", "fanout")
        for i in range(40):
            admin.declare_queue(f"w{i}")
            admin.bind(f"w{i}", "wide")

    rig = Rig(exchange="wide", routing_key="", before=wide, credit={"policy": "static", "static_size": 1 << 20})
    bodies = [b"m%d" % i for i in range(30)]
    for _ in range(20):  # SETUP and the first status message: the publication is connected
        rig.cycle(rounds=1)
        if rig.pub.offer(encode_publish(bodies[0])) >= 0:
            break
    for body in bodies[1:]:
        assert rig.pub.offer(encode_publish(body)) >= 0
    publication = rig.datapath.ingress.publications[rig.session_id]
    rests = 0
    for _ in range(100):
        rig.cycle(rounds=1)
        rests += publication.session.routing_rest is not None
        if all(len(rig.core.queues[f"w{i}"].store) == 30 for i in range(40)) and publication.session.routing_rest is None:
            break
    assert rests >= 5  # 30 messages x 40 queues, at most 100 copies (3 messages) a cycle
    for i in (0, 39):
        assert rig.bodies(f"w{i}") == bodies
    rig.cycle()
    assert rig.image.subscriber_position(publication.subscription.subscription_id) == rig.image.rebuild_position


def test_a_udp_publication_to_a_fanout_under_the_memory_alarm_is_parked_then_routed_in_order() -> None:
    """Under the memory alarm a message to K queues was held K times (broker/parking.py): a UDP
    publication's are parked as a TCP producer's are, one copy, nothing new polled behind them (it waits
    in the term, inside the window), and routed in order once consumers take the queues under the alarm's
    resume level; the image's consumption position then passes every message."""

    def wide(rig: Rig) -> None:
        admin = rig.h.consumer("admin")
        admin.declare_exchange("wide", "fanout")
        for i in range(10):
            admin.declare_queue(f"w{i}", max_size=0, flow_stop_size=0, flow_resume_size=0)
            admin.bind(f"w{i}", "wide")

    rig = Rig(exchange="wide", routing_key="", before=wide, server={"memory_watermark": 32 * 1024},
              credit={"policy": "static", "static_size": 1 << 20})
    bodies = [i.to_bytes(4, "big") + b"u" * 996 for i in range(60)]
    assert rig.offer_all(bodies) == len(bodies)
    memory = rig.core.memory
    publication = rig.datapath.ingress.publications[rig.session_id]
    parked = publication.session.parked.messages
    assert memory.alarm and parked > 0
    per_message = 10 * (1000 + 512)
    assert memory.held < memory.watermark + per_message  # copied, it was 10 x the grant's messages
    consumer = rig.h.consumer("c")
    subs = [consumer.subscribe(f"w{i}", prefetch=1000) for i in range(10)]
    for _ in range(200):
        consumer.pump()
        consumer.ack()
        rig.cycle(rounds=1)
        if all(len(consumer.bodies(s)) == len(bodies) for s in subs):
            break
    for s in subs:
        assert consumer.bodies(s) == bodies
    rig.cycle()
    assert not publication.session.parked
    assert rig.image.subscriber_position(publication.subscription.subscription_id) == rig.image.rebuild_position
