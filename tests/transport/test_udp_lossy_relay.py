"""A publication and a subscription over real UDP through a lossy relay (tests/e2e/udprelay.py): 5 % loss,
1 % duplication and 1 % reordering both ways, and still every message exactly once, in order: NAKs and
retransmits repair the losses, the image drops the duplicates, and the term positions put reordered
frames back in place."""

from __future__ import annotations

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.transport.channel import parse_channel
from flowbroker.transport.publication import Publication
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig
from flowbroker.transport.udp import PublicationDriver, SubscriptionDriver, now_ns, open_udp
from tests.e2e.udprelay import CLEAN, Impairment, Lane, LossyRelay

COUNT = 20_000


def _message(i: int) -> bytes:
    return i.to_bytes(4, "little") + bytes([i & 0xFF]) * (i % 300)


async def test_every_message_exactly_once_in_order_through_loss_duplication_and_reordering() -> None:
    sub_endpoint = open_udp(("127.0.0.1", 0), so_rcvbuf=4 << 20)
    pub_endpoint = open_udp(("127.0.0.1", 0), so_rcvbuf=4 << 20)
    relay = LossyRelay(sub_endpoint.local_address, seed=11,
                       to_server=Impairment(0.05, 0.01, 0.01), to_client=Impairment(0.05, 0.01, 0.01))
    host, port = relay.client_address
    uri = parse_channel(f"aeron:udp?endpoint={host}:{port}|term-length=64k|linger=200ms")
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=4343))
    subscription = channel.add_subscription(0)
    publication = Publication.from_channel(uri, 10, 5001, now_ns(), destination=relay.client_address)
    pub_driver = PublicationDriver(publication, pub_endpoint)
    sub_driver = SubscriptionDriver(channel, sub_endpoint)
    received: list[bytes] = []

    def handler(message: memoryview | bytes) -> None:
        received.append(bytes(message))

    with trio.fail_after(60):
        async with pub_endpoint, sub_endpoint, relay, trio.open_nursery() as nursery:
            nursery.start_soon(relay.run)
            nursery.start_soon(pub_driver.run)
            nursery.start_soon(sub_driver.run)

            async def produce() -> None:
                for i in range(COUNT):
                    position = await pub_driver.publish(_message(i), deadline=trio.current_time() + 20)
                    assert position > 0, f"publish {i} failed with {position}"

            nursery.start_soon(produce)
            while len(received) < COUNT:
                await sub_driver.receive(subscription, handler, 256, deadline=trio.current_time() + 20)
            # a while longer: a late duplicate or retransmit must not deliver anything twice
            await trio.sleep(0.3)
            sub_driver.poll(subscription, handler, 256)
            nursery.cancel_scope.cancel()

    assert len(received) == COUNT
    assert received == [_message(i) for i in range(COUNT)]
    up, down = relay.counters["to_server"], relay.counters["to_client"]
    # the impairments happened (seeded: these are not luck), and the transport repaired them
    assert up.dropped > 0 and up.duplicated > 0 and up.reordered > 0
    assert down.received > 0 and up.foreign == 0 and down.foreign == 0
    assert publication.counters.naks_received > 0 and publication.counters.retransmits_sent > 0


async def test_a_clean_relay_forwards_both_ways_and_counts_foreign_senders() -> None:
    """Without impairments the relay is a pipe: the client learns nothing of it but its address, the
    server sees the relay's server-side port as the source, and a third sender is dropped and counted."""
    server = open_udp(("127.0.0.1", 0))
    client = open_udp(("127.0.0.1", 0))
    stranger = open_udp(("127.0.0.1", 0))
    relay = LossyRelay(server.local_address, to_server=CLEAN, to_client=CLEAN)
    with trio.fail_after(10):
        async with server, client, stranger, relay, trio.open_nursery() as nursery:
            nursery.start_soon(relay.run)
            for i in range(100):
                client.send(i.to_bytes(2, "little"), relay.client_address)
            got: list[bytes] = []
            while len(got) < 100:
                for data, source in await server.receive_batch():
                    assert source == ("127.0.0.1", relay.server_port)
                    got.append(data)
            assert got == [i.to_bytes(2, "little") for i in range(100)]
            server.send(b"back", ("127.0.0.1", relay.server_port))
            data, source = await client.receive()
            assert (data, source) == (b"back", relay.client_address)
            stranger.send(b"spoof", relay.client_address)
            stranger.send(b"spoof", ("127.0.0.1", relay.server_port))
            while relay.counters["to_server"].foreign + relay.counters["to_client"].foreign < 2:
                await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
    assert relay.counters["to_server"].forwarded == 100 and relay.counters["to_client"].forwarded == 1
    assert relay.counters["to_server"].foreign == 1 and relay.counters["to_client"].foreign == 1


_probability = st.sampled_from([0.0, 0.01, 0.05, 0.3, 0.5, 1.0])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 400), _probability, _probability, _probability, st.integers(0, 2**32))
def test_property_a_lane_loses_duplicates_and_swaps_neighbours_only(
    n: int, loss: float, duplication: float, reordering: float, seed: int
) -> None:
    """Sans-IO, the relay's one direction: every datagram goes out 0 (lost), 1 or 2 (duplicated) times,
    never more than one is held, and its first copy is at most one place from where it would be
    without reordering (a held datagram swaps with the next only)."""
    import random

    lane = Lane(Impairment(loss, duplication, reordering), random.Random(seed))
    wire: list[bytes] = []
    for i in range(n):
        lane.forward(i.to_bytes(2, "big"), wire.append)  # big-endian: sorted bytes are sorted numbers
        assert lane.held is None or isinstance(lane.held, bytes)  # one slot, no queue
    lane.release(wire.append)
    assert lane.held is None
    c = lane.counters
    copies = {d: wire.count(d) for d in set(wire)}
    assert c.received == n and c.forwarded == 0  # ``forwarded`` is Send's to count; a plain callable here
    assert len(wire) == n - c.dropped + c.duplicated
    assert all(k in (1, 2) for k in copies.values()) and sum(k == 2 for k in copies.values()) == c.duplicated
    assert c.reordered <= n - c.dropped
    firsts: list[bytes] = []
    for d in wire:
        if d not in firsts:
            firsts.append(d)
    survivors = sorted(firsts)
    assert all(abs(firsts.index(d) - survivors.index(d)) <= 1 for d in firsts)
