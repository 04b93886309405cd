"""Consumers over UDP end to end: `conn.consumer(queue, transport="udp")` against a real `BrokerServer`,
over real UDP and TCP sockets on 127.0.0.1. The consumer's window is its credit and its processing, not
the arrival of datagrams, moves the broker on; settlement stays on TCP."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker import views
from flowbroker.client import blocking
from flowbroker.client.udpconsumer import UdpConsumer
from flowbroker.protocol import Frame
from flowbroker.protocol.frames import SubscribeUdp
from tests.conftest import RunningBroker

LIMIT = 20.0
Start = Callable[..., Awaitable[RunningBroker]]


async def fill(conn: fc.Connection, queue: str, bodies: list[bytes]) -> None:
    await conn.declare_queue(queue)
    async with conn.producer("", queue) as producer:
        for body in bodies:
            await producer.send(body)


@pytest.mark.parametrize("batches", [True, False])
async def test_a_slow_udp_consumer_paces_the_broker_within_its_window(start_flowbroker: Start, batches: bool) -> None:
    """With DELIVER_BATCH payloads (the SDK asks for capability "deliver-batch") and without (a broker that
    does not know it, as an older one: one DELIVER per message)."""
    broker = await start_flowbroker()
    window = 32 * 1024
    bodies = [b"%05d" % i + b"s" * 1000 for i in range(400)]
    worst = 0
    got: list[bytes] = []
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "slow", bodies)
        datapath = broker.core.udp
        assert datapath is not None
        if not batches:
            for session in broker.core.sessions.values():
                session.deliver_batches = False
        with trio.fail_after(60):
            async with conn.consumer("slow", transport="udp", buffer_size=window) as consumer:
                assert isinstance(consumer, UdpConsumer)
                assert bool(next(iter(datapath.egress.subscriptions.values())).batch_room) == batches
                async for msg in consumer:
                    # what the broker has sent beyond what this consumer has processed (all before `msg`)
                    stream = next(iter(datapath.egress.subscriptions.values()))
                    sent = stream.publication.sender_position
                    image, sub_id = consumer._image, consumer._subscription_id_in_image()
                    assert image is not None
                    processed = image.subscriber_position(sub_id) - image.subscriber_hold(sub_id)
                    worst = max(worst, sent - processed)
                    # what the image reports consumed never passes what the application processed (the
                    # messages before `msg`: at most 1,088 term bytes each, one DELIVER's frame)
                    assert processed - image.statistics().join_position <= len(got) * 1088
                    await trio.sleep(0.001)  # a slow handler
                    got.append(msg.body)
                    await msg.ack()
                    if len(got) == len(bodies):
                        break
    assert got == bodies
    assert worst <= window + 1088  # the window, and at most one message (1,056 term bytes) over it
    assert worst > window // 2  # and the window was used
    assert datapath.refused.total() == 0


async def test_messages_kept_unsettled_leave_the_rest_of_the_window_open(start_flowbroker: Start) -> None:
    """An application that keeps most of a window's messages unsettled and settles the rest one by one gets
    every message: a message it moved past is processed (its bytes leave the image's hold whenever it is
    settled), and the processed bytes, released in steps of a sixteenth of the window, always reach the
    image (at once when everything handed out is processed, else by the receiving task's next cycle)."""
    broker = await start_flowbroker()
    window = 64 * 1024
    kept_count = 59  # 59 x 1,088 term bytes: all but 1,344 bytes of the window
    bodies = [b"%05d" % i + b"k" * 1000 for i in range(kept_count + 150)]
    kept: list[fc.Message] = []
    got: list[bytes] = []
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "kept", bodies)
        with trio.fail_after(60):
            async with conn.consumer("kept", transport="udp", buffer_size=window, prefetch=1000) as consumer:
                async for msg in consumer:
                    got.append(msg.body)
                    if len(kept) < kept_count:
                        kept.append(msg)  # not settled: its bytes stay held
                    else:
                        await msg.ack()
                    if len(got) == len(bodies):
                        break
                for msg in kept:
                    await msg.ack()
    assert got == bodies


async def test_a_message_settled_after_the_next_was_taken_is_released(start_flowbroker: Start) -> None:
    """Taking the next message processes the previous one (docs/client.md): its bytes leave the image's
    hold then, whenever it is settled. (They were released only by a settle that came first: settling
    each message after taking the next stalled the consumer once its window was used.)"""
    broker = await start_flowbroker()
    window = 32 * 1024
    bodies = [b"%05d" % i + b"n" * 1000 for i in range(200)]  # about 7 windows
    got: list[bytes] = []
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "next", bodies)
        with trio.fail_after(LIMIT):
            async with conn.consumer("next", transport="udp", buffer_size=window) as consumer:
                previous: fc.Message | None = None
                async for msg in consumer:
                    if previous is not None:
                        await previous.ack()
                    previous = msg
                    got.append(msg.body)
                    if len(got) == len(bodies):
                        await msg.ack()
                        break
    assert got == bodies


async def test_ack_reject_and_requeue_go_over_tcp(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "settle", [b"a", b"b", b"c"])
        async with conn.consumer("settle", transport="udp", prefetch=10) as consumer:
            with trio.fail_after(LIMIT):
                first = await consumer.receive()
                second = await consumer.receive()
                third = await consumer.receive()
                assert [first.body, second.body, third.body] == [b"a", b"b", b"c"]
                await first.ack()
                await second.reject()
                await third.requeue()
                again = await consumer.receive()
                assert (again.body, again.redelivered) == (b"c", True)
                await again.ack()
        await trio.sleep(0.05)
    assert len(broker.core.queues["settle"].store) == 0


async def test_closing_the_connection_requeues_unsettled_in_order(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    bodies = [b"u%d" % i for i in range(20)]
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "back", bodies)
    async with await fc.connect(broker.url) as conn:
        consumer = conn.consumer("back", transport="udp")
        with trio.fail_after(LIMIT):
            for _ in range(5):
                await consumer.receive()  # taken, never settled
    datapath = broker.core.udp
    assert datapath is not None
    with trio.fail_after(LIMIT):
        while datapath.egress.subscriptions:
            await trio.sleep(0.01)
    queue = broker.core.queues["back"]
    assert [m.body for m in queue.store] == bodies
    assert [m.redelivered for m in queue.store][:5] == [True] * 5


async def test_the_blocking_api_consumes_over_udp(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "blocking", [b"%d" % i for i in range(50)])
    got: list[bytes] = []

    def consume() -> None:
        with blocking.connect(broker.url) as bconn:
            with bconn.consumer("blocking", transport="udp") as consumer:
                for _ in range(50):
                    msg = consumer.receive(timeout=LIMIT)
                    got.append(msg.body)
                    msg.ack()

    thread = threading.Thread(target=consume)
    thread.start()
    with trio.fail_after(LIMIT * 2):
        while thread.is_alive():
            await trio.sleep(0.01)
    thread.join()
    assert got == [b"%d" % i for i in range(50)]


async def test_udp_producer_to_udp_consumer(start_flowbroker: Start) -> None:
    broker = await start_flowbroker()
    bodies = [b"%06d" % i + b"e" * 500 for i in range(3000)]
    got: list[bytes] = []
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("both")

        async def consume() -> None:
            async with conn.consumer("both", transport="udp") as consumer:
                async for msg in consumer:
                    got.append(msg.body)
                    await msg.ack()
                    if len(got) == len(bodies):
                        return

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                async with conn.producer("", "both", transport="udp") as producer:
                    for body in bodies:
                        await producer.send(body)
    assert got == bodies


async def test_through_a_lossy_relay_every_message_is_delivered_once_in_order(start_flowbroker: Start) -> None:
    """Broker -> lossy relay (5 % loss, 1 % duplication, 1 % reordering, both ways) -> SDK UDP consumer.

    The broker sends to the port SUBSCRIBE_UDP names; here that is the relay's server-side port (the consumer
    below asks for it instead of its own), and the relay forwards to the consumer's socket."""
    from tests.e2e.udprelay import Impairment, LossyRelay

    broker = await start_flowbroker()
    assert broker.udp_port is not None
    count = 20_000  # about 1,000 datagrams of deliveries, batched: enough for the relay's 1 % faults to hit
    bodies = [b"%06d" % i + b"r" * 300 for i in range(count)]
    impairment = Impairment(0.05, 0.01, 0.01)
    relay = LossyRelay(("127.0.0.1", broker.udp_port), seed=11, to_server=impairment, to_client=impairment)

    class RelayedConsumer(UdpConsumer):
        def _subscribe_frame(self, request_id: int) -> Frame:

            relay.client = self._endpoint.local_address
            return SubscribeUdp(request_id, self.subscription_id, self.queue, self.prefetch, self.window,
                                relay.server_port, self.stream_id)

    got: list[bytes] = []
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "lossy", bodies)
        with trio.fail_after(90):
            async with relay, trio.open_nursery() as nursery:
                nursery.start_soon(relay.run)
                consumer = RelayedConsumer(conn, "lossy", 100, prefetch=500, buffer_size=64 * 1024)
                async with consumer:
                    async for msg in consumer:
                        got.append(msg.body)
                        await msg.ack()
                        if len(got) == count:
                            break
                nursery.cancel_scope.cancel()
    assert got == bodies
    counters = relay.counters
    assert counters["to_client"].dropped > 0 and counters["to_client"].duplicated > 0
    await trio.sleep(0.05)
    assert len(broker.core.queues["lossy"].store) == 0


async def test_statistics_and_the_broker_views_show_the_udp_consumers_window(start_flowbroker: Start) -> None:
    """Regression: `statistics().window` was 0 and the views' `buffer` `{"size": 0, ...}` for a UDP consumer
    with `buffer_size=65536`: both showed the TCP byte buffer, which a UDP subscription does not use. Both
    now show the window its status messages grant (a window over half a term is capped there)."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "shown", [b"a", b"b"])
        async with conn.consumer("shown", transport="udp", buffer_size=65536, prefetch=10) as consumer:
            assert consumer.statistics().window == 65536
            msg = await consumer.receive(timeout=LIMIT)
            stats = consumer.statistics()
            assert stats.window == 65536 and stats.buffer_size == 65536
            with trio.fail_after(LIMIT):  # the broker's view once the consumer's status message said so
                while (subscription := _view(broker, "shown"))["buffer"]["size"] != 65536:
                    await trio.sleep(0.01)
            assert subscription["prefetch"] == 10 and 0 <= subscription["buffer"]["unacked"] <= 65536
            connection = views.connection_view(broker.core.sessions[conn.connection_id], broker.core.clock_ns())
            assert connection["consumer"]["subscriptions"][0]["buffer"]["size"] == 65536
            await msg.ack()
        async with conn.consumer("shown", transport="udp", buffer_size=8 << 20) as large:
            await large.receive(timeout=LIMIT)
            term_length = broker.core.config.udp.term_length
            assert large.statistics().window == term_length // 2
            with trio.fail_after(LIMIT):
                while _view(broker, "shown")["buffer"]["size"] != term_length // 2:
                    await trio.sleep(0.01)


def _view(broker: RunningBroker, queue: str) -> dict[str, Any]:
    """The queue's one subscription as GET /api/queues/{name} shows it."""
    subscriptions = views.queue_view(broker.core.queues[queue], broker.core.clock_ns())["subscriptions"]
    assert len(subscriptions) == 1
    return dict(subscriptions[0])


async def test_messages_larger_than_a_udp_consumers_window_go_through_whole(start_flowbroker: Start) -> None:
    """One message may overflow the window, but its frames past the window's end waited for a status message
    that processing could not cause (nothing of a message is processed before all of it is in): one such
    message per ~100 ms (a tester: 20 KB messages through a 16 KiB window, 55 ms each). The broker now sends
    the overflowing message whole, and still takes nothing more until the consumer has processed it."""
    broker = await start_flowbroker()
    window = 16384
    bodies = [b"%05d" % i + b"x" * 20_000 for i in range(100)]
    got: list[bytes] = []
    worst = 0
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "big", bodies)
        datapath = broker.core.udp
        assert datapath is not None
        async with conn.consumer("big", transport="udp", buffer_size=window) as consumer:
            assert isinstance(consumer, UdpConsumer)
            with trio.fail_after(LIMIT):
                async for msg in consumer:
                    stream = next(iter(datapath.egress.subscriptions.values()))
                    image, sub_id = consumer._image, consumer._subscription_id_in_image()
                    assert image is not None
                    processed = image.subscriber_position(sub_id) - image.subscriber_hold(sub_id)
                    worst = max(worst, stream.publication.sender_position - processed)
                    got.append(msg.body)
                    await msg.ack()
                    if len(got) == len(bodies):
                        break
    assert got == bodies
    assert worst <= window + 20_600  # the window and one message (its frames and envelope) over it


async def test_a_closed_udp_subscription_frees_its_log_without_the_garbage_collector(start_flowbroker: Start) -> None:
    """The subscription and its publication's stream referred to each other, so each closed UDP consumer's
    log (3 x term_length) waited for a garbage collection, which the broker process runs seldom (50,000
    allocations: cli.GC_GENERATION0_THRESHOLD): a quiet broker grew 6 MiB per consumer opened and closed
    (a tester: 240 MiB after 40). With the collector off, no closed one is left."""
    import gc

    from flowbroker.transport.publication import Publication

    broker = await start_flowbroker()
    datapath = broker.core.udp
    assert datapath is not None
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "freed", [b"m%d" % i for i in range(30)])
        gc.collect()
        gc.disable()
        try:
            for _ in range(6):
                async with conn.consumer("freed", transport="udp", buffer_size=65536) as consumer:
                    for _ in range(5):
                        await (await consumer.receive(timeout=LIMIT)).ack()
            with trio.fail_after(LIMIT):
                while datapath.egress.subscriptions or datapath.egress.closing():
                    await trio.sleep(0.05)
            await trio.sleep(0.1)
            # the broker's and the SDK's: the SDK's images are the application's garbage collector's
            broker_side = [o for o in gc.get_objects() if isinstance(o, Publication)]
            assert broker_side == []
        finally:
            gc.enable()


async def test_data_forged_from_another_address_is_not_taken(start_flowbroker: Start) -> None:
    """The SDK took DATA from any source: one datagram from another port of the host, at the position the
    broker's next data would take, was handed out as a delivery (its ack an UNKNOWN_DELIVERY), and the
    consumer received nothing more (a tester: 30 of 300). The image takes only its SETUP's source now."""
    import socket

    from flowbroker.protocol.envelope import encode_delivery_of
    from flowbroker.transport.frames import write_data_header
    from flowbroker.transport.positions import compute_term_id_from_position, compute_term_offset_from_position

    broker = await start_flowbroker()
    count = 120
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "forged", [b"%04d" % i + b"q" * 500 for i in range(count)])
        async with conn.consumer("forged", transport="udp", buffer_size=16384, prefetch=100_000) as consumer:
            assert isinstance(consumer, UdpConsumer)
            first = await consumer.receive(timeout=LIMIT)  # the window is full: the broker waits for an SM
            await trio.sleep(0.2)
            image = consumer._image
            assert image is not None
            position = image.hwm_position
            bits = image.term_length.bit_length() - 1
            payload = encode_delivery_of(10**6, "", "forged", b"EVIL", None, False)
            frame = bytearray((32 + len(payload) + 31) & ~31)
            write_data_header(frame, 0, 32 + len(payload), 0xC0, compute_term_offset_from_position(position, bits),
                              consumer.session_id or 0, consumer.stream_id,
                              compute_term_id_from_position(position, bits, image.initial_term_id))
            frame[32:32 + len(payload)] = payload
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
                attacker.bind(("127.0.0.1", 0))
                attacker.sendto(bytes(frame), ("127.0.0.1", consumer._endpoint.local_address[1]))
            await trio.sleep(0.2)
            got = [first.body[:4]]
            await first.ack()
            while len(got) < count:
                message = await consumer.receive(timeout=LIMIT)
                got.append(message.body[:4])
                await message.ack()
            assert got == [b"%04d" % i for i in range(count)]
            assert consumer.foreign == 1


async def test_a_window_below_the_mtu_is_refused_at_subscribe(start_flowbroker: Start) -> None:
    """A unicast UDP consumer with buffer_size under [udp] mtu was subscribed, and its image then refused
    the broker's SETUP (mtu over the window): every receive timed out and nothing said why (a tester, 6 of
    6). The broker refuses it at SUBSCRIBE_UDP now, as it does a multicast member's."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("small")
        with pytest.raises(fc.RequestError, match=r"buffer_size 4096 is below the UDP mtu \(\[udp\] mtu 8192\)"):
            async with conn.consumer("small", transport="udp", buffer_size=4096):
                pass
        async with conn.consumer("small", transport="udp", buffer_size=8192):
            pass  # one datagram's worth is enough


@pytest.mark.parametrize("batches", [True, False])
async def test_a_message_too_large_for_udp_ends_the_udp_consumer_and_stays_in_the_queue(
        start_flowbroker: Start, batches: bool) -> None:
    """A queued message over what the UDP data path carries (term_length / 8 with its envelope: 262,144
    bytes by default) was offered to a UDP consumer's publication, which raised, and the broker died (a
    tester: a 262,143-byte body from a UDP producer, or any TCP one from about 262,110 bytes up). Now the UDP
    subscription ends with MESSAGE_TOO_LARGE, what it had comes back, the message stays in the queue for a TCP
    consumer, and everything else goes on."""
    broker = await start_flowbroker()
    big = b"B" * 300_000
    async with await fc.connect(broker.url) as conn:
        await fill(conn, "mixed", [b"small-1", b"small-2", big, b"small-3"])
        if not batches:  # one DELIVER a message, as for a client that does not ask for DELIVER_BATCH
            for session in broker.core.sessions.values():
                session.deliver_batches = False
        with trio.fail_after(LIMIT):
            got: list[bytes] = []
            async with conn.consumer("mixed", transport="udp", prefetch=10) as consumer:
                with pytest.raises(fc.MessageTooLarge, match="over what the UDP data path carries"):
                    while True:  # (what it had not handed out when the error came went back to the queue)
                        msg = await consumer.receive()
                        got.append(msg.body)
                        await msg.ack()
            assert got == [b"small-1", b"small-2"][:len(got)]
            async with conn.consumer("mixed", prefetch=10) as tcp:  # over TCP: the rest, in order
                while len(got) < 4:
                    msg = await tcp.receive()
                    got.append(msg.body)
                    await msg.ack()
        assert got == [b"small-1", b"small-2", big, b"small-3"]  # each once
        await conn.declare_queue("after")  # the broker is alive and serving
