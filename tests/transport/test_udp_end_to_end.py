"""A publication and a subscription exchanging messages over real UDP sockets on 127.0.0.1."""

from __future__ import annotations

import trio

from flowbroker.transport.channel import parse_channel
from flowbroker.transport.publication import OfferResult, Publication
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig
from flowbroker.transport.udp import PublicationDriver, SubscriptionDriver, now_ns, open_udp

COUNT = 3_000


async def test_messages_arrive_in_order_over_loopback_and_end_of_stream_tears_down() -> None:
    sub_endpoint = open_udp(("127.0.0.1", 0), so_rcvbuf=1 << 20)
    port = sub_endpoint.local_address[1]
    uri = parse_channel(f"aeron:udp?endpoint=127.0.0.1:{port}|term-length=64k|linger=200ms")
    channel = ReceiveChannel(10, ReceiverConfig.from_channel(uri, receiver_id=4242, ))
    gone: list[object] = []
    subscription = channel.add_subscription(0, on_unavailable_image=gone.append)
    pub_endpoint = open_udp(("127.0.0.1", 0))
    now = now_ns()
    publication = Publication.from_channel(uri, 10, 5001, now, destination=sub_endpoint.local_address)
    pub_driver = PublicationDriver(publication, pub_endpoint)
    sub_driver = SubscriptionDriver(channel, sub_endpoint)
    received: list[int] = []

    def handler(message: memoryview | bytes) -> None:
        received.append(int.from_bytes(message[:4], "little"))
        assert len(message) == 4 + int.from_bytes(message[:4], "little") % 700

    with trio.fail_after(20):
        async with pub_endpoint, sub_endpoint, trio.open_nursery() as nursery:
            nursery.start_soon(pub_driver.run)
            nursery.start_soon(sub_driver.run)
            # not connected yet: a zero deadline gives the failure code back at once
            assert await pub_driver.publish(b"x", deadline=trio.current_time()) == OfferResult.NOT_CONNECTED

            async def produce() -> None:
                for i in range(COUNT):
                    position = await pub_driver.publish(
                        i.to_bytes(4, "little") + b"m" * (i % 700), deadline=trio.current_time() + 5
                    )
                    assert position > 0, f"publish {i} failed with {position}"
                publication.close(now_ns())

            nursery.start_soon(produce)
            while len(received) < COUNT:
                await sub_driver.receive(subscription, handler, 256, deadline=trio.current_time() + 5)
            assert received == list(range(COUNT))
            # end of stream: the publication lingers and finishes, the image drains and goes away
            while publication.is_done is False or gone == []:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert publication.counters.data_datagrams_sent > 0
    assert channel.dispositions["data"] > 0
    assert publication.counters.setups_sent >= 1


async def test_a_refused_image_comes_back_to_the_publication_as_an_err_frame() -> None:
    """The receiver refuses the publication's MTU (larger than its window): ERR over the wire, never connected."""
    sub_endpoint = open_udp(("127.0.0.1", 0))
    port = sub_endpoint.local_address[1]
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=77, receiver_window=4096))
    channel.add_subscription(0)
    pub_endpoint = open_udp(("127.0.0.1", 0))
    uri = parse_channel(f"aeron:udp?endpoint=127.0.0.1:{port}|mtu=8k|term-length=64k")
    publication = Publication.from_channel(uri, 10, 5002, now_ns(),
                                           destination=sub_endpoint.local_address)
    pub_driver = PublicationDriver(publication, pub_endpoint)
    sub_driver = SubscriptionDriver(channel, sub_endpoint)
    with trio.fail_after(10):
        async with pub_endpoint, sub_endpoint, trio.open_nursery() as nursery:
            nursery.start_soon(pub_driver.run)
            nursery.start_soon(sub_driver.run)
            while publication.counters.errors_received < 2:
                await trio.sleep(0.01)
            assert await pub_driver.publish(b"x", deadline=trio.current_time()) == OfferResult.NOT_CONNECTED
            nursery.cancel_scope.cancel()
    assert publication.last_error is not None and publication.last_error.receiver_id == 77
    assert "mtu_exceeds_window" in publication.last_error.message
    assert not channel.images and channel.errors_sent >= 2
