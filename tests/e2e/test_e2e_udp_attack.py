"""Spoofed and random datagrams beside a registered UDP producer, end to end over real sockets on 127.0.0.1.

A producer registers a UDP publication and sends MESSAGES to a queue, a TCP consumer reads them, and
meanwhile an attacker on its own sockets sends ATTACK datagrams to the broker's UDP endpoint, three kinds
in turn:
- "wrong session": valid-looking DATA/SETUP/SM/NAK/RTTM frames with session ids the broker never handed out;
- "wrong source": DATA, SETUP and RTTM frames with the producer's own session and stream id, from another
  port than the one the producer registered (what an attacker who sniffed the session id would send);
- "wrong direction": SM, NAK and ERR frames (a receiver's frames, for the broker's publications) with the
  producer's session id: the broker only receives that session, it never sends it;
- "random bytes": short garbage and headers of types no side speaks.
The producer's messages must all arrive exactly once and in order, the attacker must create nothing (one
publication, no subscription, no extra session), and ``DataPath.refused`` must show the attack by reason.
"""

from __future__ import annotations

import random
import struct
from collections import Counter

import pytest
import trio

import flowbroker.client as fb
from flowbroker.client.udpconsumer import UdpConsumer
from flowbroker.client.udpproducer import UdpProducer
from flowbroker.transport import frames as f
from flowbroker.transport.udp import open_udp
from tests.conftest import RunningBroker

MESSAGES = 5_000
ATTACK = 100_000
QUEUE = "udp-attack"
STREAM_ID = 1001  # the SDK's default stream id for a UDP producer (the design's)


def _wrong_session(rng: random.Random, live: set[int]) -> bytes:
    session_id = rng.randrange(-(2**31), 2**31)
    while session_id in live:
        session_id = rng.randrange(-(2**31), 2**31)
    stream_id = rng.choice([STREAM_ID, rng.randrange(-(2**31), 2**31)])
    term_id = rng.randrange(-(2**31), 2**31)
    return rng.choice([
        f.encode_data(f.DataFrame(32 + 64, f.UNFRAGMENTED, 0, session_id, stream_id, term_id, 0, rng.randbytes(64))),
        f.encode_setup(f.Setup(0, session_id, stream_id, term_id, term_id, 2 << 20, 8192)),
        f.encode_status_message(f.StatusMessage(session_id, stream_id, term_id, 0, 1 << 20, 1)),
        f.encode_nak(f.Nak(session_id, stream_id, term_id, 0, 4096)),
        f.encode_rttm(f.RttMeasurement(session_id, stream_id, 0, 0, 1, flags=f.RTTM_REPLY_FLAG)),
    ])


def _wrong_source(rng: random.Random, session_id: int) -> bytes:
    """The producer's own (session, stream) with plausible positions: only the source port gives it away."""
    term_id = rng.randrange(-(2**31), 2**31)
    offset = rng.randrange(0, 1 << 16) & ~31
    draw = rng.random()
    if draw < 0.15:
        return f.encode_setup(f.Setup(offset, session_id, STREAM_ID, term_id, term_id, 2 << 20, 8192))
    if draw < 0.25:
        rttm = f.RttMeasurement(session_id, STREAM_ID, rng.getrandbits(62), 0, 1, flags=f.RTTM_REPLY_FLAG)
        return f.encode_rttm(rttm)
    body = rng.randbytes(rng.randrange(0, 1024))
    return f.encode_data(f.DataFrame(32 + len(body), f.UNFRAGMENTED, offset, session_id, STREAM_ID, term_id, 0, body))


def _wrong_direction(rng: random.Random, session_id: int) -> bytes:
    """A receiver's frames about the producer's session, as if the broker were sending it."""
    term_id = rng.randrange(-(2**31), 2**31)
    return rng.choice([
        f.encode_status_message(f.StatusMessage(session_id, STREAM_ID, term_id, 0, 1 << 30, 1)),
        f.encode_nak(f.Nak(session_id, STREAM_ID, term_id, 0, 1 << 20)),
        f.encode_error(f.ErrorFrame(session_id, STREAM_ID, 1, f.ERROR_CODE_IMAGE_REJECTED, "go away")),
    ])


def _random_bytes(rng: random.Random) -> bytes:
    """Garbage the header check refuses as "malformed": shorter than a header, or a type nobody takes."""
    if rng.random() < 0.5:
        return rng.randbytes(rng.randrange(0, 8))
    ftype = rng.choice([7, 8, 9, 10, 0xFFFF, rng.randrange(12, 0xFFFF)])
    return struct.pack("<iBBH", rng.randrange(-(2**31), 2**31), 0, 0, ftype) + rng.randbytes(rng.randrange(0, 256))


async def _attack(broker: RunningBroker, session_id: int, sent: Counter[str]) -> None:
    """ATTACK datagrams from four sockets (none of them the producer's), paced so that the broker's socket
    buffer, not the broker, is what an attacker could at most overflow."""
    rng = random.Random(1123)
    target = ("127.0.0.1", broker.udp_port or 0)
    datapath = broker.core.udp
    assert datapath is not None
    live = set(datapath.session_ids.live)
    sockets = [open_udp(("127.0.0.1", 0)) for _ in range(4)]
    try:
        for i in range(ATTACK):
            kind = i % 4
            if kind == 0:
                datagram, reason = _wrong_session(rng, live), "wrong_session"
            elif kind == 1:
                datagram, reason = _wrong_source(rng, session_id), "wrong_source"
            elif kind == 2:
                datagram, reason = _wrong_direction(rng, session_id), "wrong_direction"
            else:
                datagram, reason = _random_bytes(rng), "random_bytes"
            if sockets[kind].send(datagram, target):
                sent[reason] += 1
            if i % 50 == 49:
                await trio.sleep(0.001)
    finally:
        for s in sockets:
            s.close()


async def test_a_registered_udp_producer_is_untouched_by_spoofed_and_random_datagrams(start_flowbroker) -> None:
    broker: RunningBroker = await start_flowbroker()
    datapath = broker.core.udp
    assert datapath is not None and broker.udp_port is not None
    received: list[bytes] = []
    sent: Counter[str] = Counter()
    with trio.fail_after(120):
        async with await fb.connect(broker.url, client_name="udp-producer") as conn, \
                await fb.connect(broker.url, client_name="tcp-consumer") as consumer_conn:
            await conn.declare_queue(QUEUE)
            sessions_before = len(broker.core.sessions)
            producer = conn.producer("", QUEUE, transport="udp")
            async with producer:
                await producer.send(b"first", timeout=10)  # registered and connected before the attack
                assert len(datapath.ingress.publications) == 1
                session_id = next(iter(datapath.ingress.publications))
                refused_before = Counter(datapath.refused)

                async def consume() -> None:
                    async with consumer_conn.consumer(QUEUE, prefetch=500) as consumer:
                        async for msg in consumer:
                            received.append(msg.body)
                            await msg.ack()
                            if len(received) == MESSAGES + 1:
                                break

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consume)
                    nursery.start_soon(_attack, broker, session_id, sent)
                    for i in range(MESSAGES):
                        await producer.send(b"m%d" % i, timeout=30)
                        if i % 100 == 0:
                            await trio.sleep(0)  # let the attacker interleave
                    await producer.flush(timeout=30)
                # everything the attacker sent that reached the broker has been sorted: let the socket drain
                await trio.sleep(0.5)
                # the attacker created nothing: still the one publication, no UDP subscription, no session
                assert list(datapath.ingress.publications) == [session_id]
                assert len(datapath.egress.subscriptions) == 0
                assert len(broker.core.sessions) == sessions_before + 1  # the publication session only
                # Counted now, while the producer is registered: once it closes, its own last datagrams
                # (a heartbeat or RTTM in flight) are refused as an unregistered session, and would be
                # taken for the attacker's (the test failed once with one too many).
                refused = Counter(datapath.refused) - refused_before
    assert received == [b"first"] + [b"m%d" % i for i in range(MESSAGES)]
    assert sum(sent.values()) >= ATTACK * 0.99  # loopback sends hardly drop on the sender's side at this pace
    # Each kind shows under its reason. Only the broker's kernel receive buffer may lose some (it is not
    # the broker's to count), so each count is at most what was sent and at least most of it.
    assert sent["wrong_source"] * 0.9 <= refused["wrong_source"] <= sent["wrong_source"]
    # a receiver's frame for the producer's session: never taken, counted as what it is
    assert sent["wrong_direction"] * 0.9 <= refused["wrong_direction"] <= sent["wrong_direction"]
    assert sent["wrong_session"] * 0.9 <= refused["unregistered_session"] <= sent["wrong_session"]
    assert sent["random_bytes"] * 0.9 <= refused["malformed"] <= sent["random_bytes"]
    assert set(refused) <= {"wrong_source", "unregistered_session", "wrong_direction", "malformed"}


async def test_forged_status_messages_from_another_port_of_a_udp_consumers_host_open_nothing(
        start_flowbroker) -> None:
    """A UDP consumer that processes nothing has used its window; SMs with its session id, claiming it
    processed far ahead with a large window, sent from another port of its host (127.0.0.1), must be refused
    (`wrong_source`) and deliver nothing more: the broker takes SMs only from the port the consumer
    registered, which is the socket the SDK sends its own SMs from (so it still gets everything)."""
    broker: RunningBroker = await start_flowbroker()
    datapath = broker.core.udp
    assert datapath is not None and broker.udp_port is not None
    count, window = 200, 16 * 1024
    with trio.fail_after(60):
        async with await fb.connect(broker.url) as conn:
            await conn.declare_queue(QUEUE)
            async with conn.producer("", QUEUE) as producer:
                for i in range(count):
                    await producer.send(b"f%04d" % i + b"." * 500)
            async with conn.consumer(QUEUE, transport="udp", buffer_size=window) as consumer:
                await consumer.subscribe()
                assert isinstance(consumer, UdpConsumer) and consumer.session_id is not None
                stream = datapath.egress.subscriptions[consumer.session_id]
                pub = stream.publication
                while not (pub.is_connected and pub.position >= pub.sender_limit):
                    await trio.sleep(0.01)  # the window is used: the consumer processed nothing
                await trio.sleep(0.2)
                limit, buffered = pub.sender_limit, consumer.buffered
                attacker = open_udp(("127.0.0.1", 0))
                try:
                    for _ in range(50):
                        position = pub.position + (1 << 20)
                        term_id = position // pub.term_length + pub.initial_term_id
                        sm = f.StatusMessage(consumer.session_id, consumer.stream_id, (term_id + 2**31) % 2**32 - 2**31,
                                             position % pub.term_length, 1 << 24, 999)
                        attacker.send(f.encode_status_message(sm), ("127.0.0.1", broker.udp_port))
                        await trio.sleep(0.002)
                finally:
                    attacker.close()
                await trio.sleep(0.3)
                assert pub.sender_limit == limit and consumer.buffered == buffered
                assert datapath.refused["wrong_source"] == 50
                got = []
                for _ in range(count):  # the consumer's own SMs, from its registered port, still work
                    msg = await consumer.receive(timeout=10)
                    got.append(msg.body[:5])
                    await msg.ack()
    assert got == [b"f%04d" % i for i in range(count)]


async def test_forged_status_messages_to_a_udp_producer_complete_nothing(start_flowbroker) -> None:
    """A UDP producer whose queue is saturated has messages sent and not complete. Status messages forged
    with everything a sniffer of loopback learns (the broker image's receiver id, the session, stream and
    initial term id), claiming all of it consumed with a wide window, sent to the producer's socket from
    another port, must be dropped (`producer.foreign`): taken, they moved its completion point, and
    `flush()` reported complete 16,928 messages the broker never routed (a tester). The broker's own
    status messages still complete them once a consumer drains the queue: each delivered once."""
    broker: RunningBroker = await start_flowbroker(credit={"policy": "static", "static_size": 64 * 1024})
    with trio.fail_after(60):
        async with await fb.connect(broker.url) as conn:
            await conn.declare_queue(QUEUE, flow_stop_count=50, flow_resume_count=10)
            async with conn.producer("", QUEUE, transport="udp") as producer:
                sent = 0
                while True:  # until the broker's window closes and the publication's term fills
                    try:
                        await producer.send(b"m%05d" % sent, block=False)
                    except fb.FlowControlled:
                        break
                    sent += 1
                    if sent % 64 == 0:
                        await trio.sleep(0.001)
                assert isinstance(producer, UdpProducer)
                pub = producer.publication
                assert pub is not None and producer._endpoint is not None and producer.session_id is not None
                (receiver_id,) = list(pub._receivers)
                port = producer._endpoint.local_address[1]
                attacker = open_udp(("127.0.0.1", 0))
                try:
                    for _ in range(50):
                        position = pub.position
                        term_id = pub.initial_term_id + (position >> pub.position_bits_to_shift)
                        sm = f.StatusMessage(producer.session_id, producer.stream_id, term_id,
                                             position & (pub.term_length - 1), 1 << 20, receiver_id)
                        attacker.send(f.encode_status_message(sm), ("127.0.0.1", port))
                        await trio.sleep(0.002)
                    err = f.ErrorFrame(producer.session_id, producer.stream_id, receiver_id, 1, "go away")
                    attacker.send(f.encode_error(err), ("127.0.0.1", port))
                    await trio.sleep(0.3)
                finally:
                    attacker.close()
                assert producer.foreign == 51
                with pytest.raises(fb.FlowControlTimeout):
                    await producer.flush(timeout=0.5)  # nothing forged completed anything
                got: list[bytes] = []
                async with conn.consumer(QUEUE, prefetch=100) as consumer:

                    async def drain() -> None:
                        while len(got) < sent:
                            msg = await consumer.receive()
                            got.append(msg.body)
                            await msg.ack()

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(drain)
                        await producer.flush()
    assert got == [b"m%05d" % i for i in range(sent)]
