"""Multicast and multi-destination-cast end to end over real sockets on the loopback interface.

Multicast: a 239.255/16 group kept on ``lo`` (``interface=127.0.0.1|ttl=0``): data to the odd group address,
SMs/NAKs to the next even one. One publication, two receive channels on their own sockets (SO_REUSEADDR on
the group's port); every datagram is sent once and both receivers get it. Flow control ``min`` holds the
sender to the slower receiver, ``max`` lets the faster one set the pace.

Multi-destination-cast on 127.0.0.1: ``control-mode=dynamic`` (receivers announce themselves to the
publication's control address and become destinations) and ``control-mode=manual`` (``add_destination`` /
``remove_destination``). Every test is bounded by ``trio.fail_after`` and closes every socket it opened.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import pytest
import trio

from flowbroker.transport.channel import ChannelUri, parse_channel
from flowbroker.transport.publication import OfferResult, Publication
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig, Subscription
from flowbroker.transport.udp import (
    PublicationDriver,
    SubscriptionDriver,
    UdpEndpoint,
    open_publication_endpoint,
    open_subscription_endpoint,
    now_ns,
    open_udp,
    resolve,
)

STREAM = 10
TERM = 64 * 1024
WINDOW = TERM // 2  # receiver window (static cc: min(128 KiB, term / 2)) and publication window
_groups = itertools.count(1)


def free_port() -> int:
    probe = open_udp(("127.0.0.1", 0))
    port = probe.local_address[1]
    probe.close()
    return port


def message(i: int) -> bytes:
    """Message ``i``: its number, then a body from 0 to ~3 KiB (so some are fragmented at MTU 1408)."""
    return i.to_bytes(4, "little") + bytes([i % 251]) * ((i * 37) % 3000)


class Collector:
    """A handler that checks each message's content and records the numbers in arrival order."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, payload: memoryview | bytes) -> None:
        i = int.from_bytes(payload[:4], "little")
        assert bytes(payload) == message(i), f"message {i} corrupted"
        self.ids.append(i)


class Receiver:
    """One receive channel on its own socket, with its subscription, driver and collector."""

    def __init__(self, endpoint: UdpEndpoint, config: ReceiverConfig) -> None:
        self.endpoint = endpoint
        self.channel = ReceiveChannel(STREAM, config)
        self.subscription: Subscription = self.channel.add_subscription(now_ns())
        self.driver = SubscriptionDriver(self.channel, endpoint)
        self.collector = Collector()

    async def consume(self, count: int) -> None:
        while len(self.collector.ids) < count:
            await self.driver.receive(self.subscription, self.collector, 256, deadline=trio.current_time() + 5)

    @property
    def data_datagrams(self) -> int:
        return self.channel.dispositions["data"]


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    with trio.move_on_after(timeout):
        while not condition():
            await trio.sleep(0.005)
    assert condition(), f"timed out waiting for {what}"


async def publish_all(driver: PublicationDriver, numbers: range) -> None:
    for i in numbers:
        position = await driver.publish(message(i), deadline=trio.current_time() + 5)
        assert position > 0, f"publish {i} failed with {OfferResult(position)!r}"


async def run_with(drivers: list[Callable[[], Awaitable[None]]], body: Callable[[], Awaitable[None]]) -> None:
    """Run the drivers in the background while ``body`` runs; then stop them."""
    async with trio.open_nursery() as nursery:
        for run in drivers:
            nursery.start_soon(run)
        await body()
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------------------ multicast


async def open_multicast(stack: ExitStack, fc: str) -> tuple[ChannelUri, Publication, PublicationDriver,
                                                              list[Receiver]]:
    group = f"239.255.{next(_groups)}.1"
    port = free_port()
    channel = parse_channel(
        f"aeron:udp?endpoint={group}:{port}|interface=127.0.0.1|ttl=0|term-length=64k|fc={fc}"
    )
    assert channel.endpoint is not None and channel.control_endpoint is not None
    data_address = await resolve(channel.endpoint)
    control_address = await resolve(channel.control_endpoint)
    assert control_address == (f"239.255.{group.split('.')[2]}.2", port)
    pub_endpoint = await open_publication_endpoint(channel)
    stack.callback(pub_endpoint.close)
    receivers: list[Receiver] = []
    for receiver_id in (101, 102):
        endpoint = await open_subscription_endpoint(channel)
        stack.callback(endpoint.close)
        config = ReceiverConfig.from_channel(channel, receiver_id, control_address=control_address, seed=receiver_id)
        assert config.multicast
        receivers.append(Receiver(endpoint, config))
    publication = Publication.from_channel(channel, STREAM, 7001, now_ns(), destination=data_address)
    return channel, publication, PublicationDriver(publication, pub_endpoint), receivers


async def test_multicast_two_receivers_get_every_message_once_in_order() -> None:
    count = 1500
    with trio.fail_after(60), ExitStack() as stack:
        channel, publication, pub_driver, receivers = await open_multicast(stack, "min")

        async def body() -> None:
            await wait_until(lambda: publication.receiver_count == 2 and all(r.subscription.is_connected for r in receivers),
                             "both multicast receivers")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish_all, pub_driver, range(count))
                for r in receivers:
                    nursery.start_soon(r.consume, count)

        await run_with([pub_driver.run, *(r.driver.run for r in receivers)], body)

    for r in receivers:
        assert r.collector.ids == list(range(count))
    assert publication.destinations == [(channel.endpoint.host, channel.endpoint.port)]  # type: ignore[union-attr]
    assert publication.position > 10 * TERM  # many term rotations
    # Fan-out happened in the network, not in the sender: together the receivers took in more data
    # datagrams than the publication's socket sent datagrams of any kind.
    assert sum(r.data_datagrams for r in receivers) > pub_driver.endpoint.counters.datagrams_sent
    # Control went to the control group: the publication heard SMs from both receivers.
    assert publication.counters.status_messages_received > 2


@pytest.mark.parametrize("fc", ["min", "max"])
async def test_multicast_flow_control_min_waits_for_the_slow_receiver_max_does_not(fc: str) -> None:
    target = 16 * TERM  # what the publisher tries to get through while the slow receiver reads nothing
    with trio.fail_after(60), ExitStack() as stack:
        _, publication, pub_driver, (fast, slow) = await open_multicast(stack, fc)
        outcome: dict[str, int] = {}

        async def body() -> None:
            await wait_until(lambda: publication.receiver_count == 2 and fast.subscription.is_connected
                             and slow.subscription.is_connected, "both multicast receivers")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fast.consume, 1 << 30)  # keeps up, forever
                sent = 0
                result = 0
                while publication.position < target:
                    result = await pub_driver.publish(message(sent), deadline=trio.current_time() + 1)
                    if result < 0:
                        break
                    sent += 1
                outcome.update(sent=sent, result=result, position=publication.position)
                if fc == "max":
                    await wait_until(lambda: len(fast.collector.ids) == sent, "the fast receiver")
                else:
                    await trio.sleep(0.3)  # whatever the sender may send has arrived and been read
                fast_image = fast.channel.images[7001]
                slow_image = slow.channel.images[7001]
                outcome.update(
                    sender_position=publication.sender_position,
                    fast_position=fast_image.subscriber_position(fast.subscription.subscription_id),
                    slow_position=slow_image.subscriber_position(slow.subscription.subscription_id),
                    slow_overruns=slow_image.overruns,
                )
                if fc == "min":
                    # Let the slow one catch up: then everything reaches both, exactly once, in order.
                    nursery.start_soon(slow.consume, sent)
                    await wait_until(lambda: len(slow.collector.ids) == sent and len(fast.collector.ids) == sent,
                                     "both receivers to catch up")
                nursery.cancel_scope.cancel()

        await run_with([pub_driver.run, fast.driver.run, slow.driver.run], body)

    assert fast.collector.ids == list(range(outcome["sent"]))
    assert outcome["slow_position"] == 0  # the slow receiver read nothing while the publisher ran
    if fc == "min":
        # Held to the slow receiver: nothing sent past its position (0) + its window, so the fast one
        # could not read further either, and the application ran at most a publication window ahead.
        assert outcome["result"] == OfferResult.BACK_PRESSURED
        assert outcome["sender_position"] <= WINDOW and outcome["fast_position"] <= WINDOW
        assert outcome["position"] <= 2 * WINDOW + len(message(outcome["sent"])) + 64
        assert outcome["slow_overruns"] == 0
        assert slow.collector.ids == list(range(outcome["sent"]))
    else:
        # The fast receiver sets the pace: the publisher went far past the slow one's window, and the
        # slow receiver's image dropped (and counted) what fell outside its window.
        assert outcome["position"] >= target and outcome["fast_position"] >= target
        assert outcome["slow_overruns"] > 0


# ------------------------------------------------------------------------------------------ MDC


async def open_mdc_receivers(stack: ExitStack, uris: list[str], control: tuple[str, int] | None) -> list[Receiver]:
    receivers: list[Receiver] = []
    for receiver_id, uri in enumerate(uris, start=201):
        channel = parse_channel(uri)
        endpoint = await open_subscription_endpoint(channel)
        stack.callback(endpoint.close)
        receivers.append(Receiver(endpoint, ReceiverConfig.from_channel(channel, receiver_id, control_address=control)))
    return receivers




async def test_mdc_dynamic_receivers_announce_themselves_and_each_get_everything() -> None:
    count = 1000
    control_port = free_port()
    control = ("127.0.0.1", control_port)
    ports = [free_port(), free_port()]
    with trio.fail_after(60), ExitStack() as stack:
        pub_channel = parse_channel(
            f"aeron:udp?control=127.0.0.1:{control_port}|control-mode=dynamic|term-length=64k|fc=min"
        )
        pub_endpoint = await open_publication_endpoint(pub_channel)
        stack.callback(pub_endpoint.close)
        assert pub_endpoint.local_address == control
        publication = Publication.from_channel(pub_channel, STREAM, 7002, now_ns())
        assert publication.dynamic and publication.destinations == []
        pub_driver = PublicationDriver(publication, pub_endpoint)
        receivers = await open_mdc_receivers(stack, [
            f"aeron:udp?endpoint=127.0.0.1:{port}|control=127.0.0.1:{control_port}|control-mode=dynamic"
            for port in ports
        ], control)

        async def body() -> None:
            await wait_until(lambda: publication.receiver_count == 2 and all(r.subscription.is_connected for r in receivers),
                             "both receivers to announce themselves")
            assert sorted(publication.destinations) == [("127.0.0.1", p) for p in sorted(ports)]  # type: ignore[type-var]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish_all, pub_driver, range(count))
                for r in receivers:
                    nursery.start_soon(r.consume, count)

        await run_with([pub_driver.run, *(r.driver.run for r in receivers)], body)

    for r in receivers:
        assert r.collector.ids == list(range(count))
        assert r.channel.announcements_sent >= 1
        assert r.endpoint.counters.datagrams_received >= r.data_datagrams > 0
    # Unicast to each destination: the sender sent every data datagram twice.
    assert pub_endpoint.counters.datagrams_sent >= 2 * publication.counters.data_datagrams_sent


async def test_mdc_manual_add_and_remove_destinations() -> None:
    first, second = 600, 400
    control_port = free_port()
    ports = [free_port(), free_port()]
    with trio.fail_after(60), ExitStack() as stack:
        pub_channel = parse_channel(f"aeron:udp?control=127.0.0.1:{control_port}|control-mode=manual|term-length=64k")
        pub_endpoint = await open_publication_endpoint(pub_channel)
        stack.callback(pub_endpoint.close)
        publication = Publication.from_channel(pub_channel, STREAM, 7003, now_ns())
        assert not publication.dynamic
        pub_driver = PublicationDriver(publication, pub_endpoint)
        keep, removed = await open_mdc_receivers(
            stack, [f"aeron:udp?endpoint=127.0.0.1:{port}" for port in ports], None
        )
        for port in ports:
            publication.add_destination(("127.0.0.1", port))
        counts: dict[str, int] = {}

        async def body() -> None:
            await wait_until(lambda: publication.receiver_count == 2 and keep.subscription.is_connected
                             and removed.subscription.is_connected, "both destinations to connect")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish_all, pub_driver, range(first))
                nursery.start_soon(keep.consume, first)
                nursery.start_soon(removed.consume, first)
            # Both had everything; now one destination goes.
            publication.remove_destination(("127.0.0.1", ports[1]))
            assert publication.destinations == [("127.0.0.1", ports[0])]
            await trio.sleep(0.05)  # anything already in flight lands
            counts["datagrams"] = removed.endpoint.counters.datagrams_received
            counts["data"] = removed.data_datagrams
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish_all, pub_driver, range(first, first + second))
                nursery.start_soon(keep.consume, first + second)
            await trio.sleep(0.3)  # more than a heartbeat interval: nothing at all reaches the removed one
            removed.driver.poll(removed.subscription, removed.collector)

        await run_with([pub_driver.run, keep.driver.run, removed.driver.run], body)

    assert keep.collector.ids == list(range(first + second))
    assert removed.collector.ids == list(range(first))
    assert removed.endpoint.counters.datagrams_received == counts["datagrams"]
    assert removed.data_datagrams == counts["data"] > 0
