"""Issue 11, transport fix (a): a publication with more sendable data than one duty cycle sends (at most
``max_messages_per_send`` datagrams) is due again at once, not at the next status message or heartbeat.
Found by interop with the real C driver: 1,000 messages of 5,000 B in 64 KiB terms took 52 s through
``PublicationDriver``, which slept until the next SM after every two datagrams."""

from __future__ import annotations

import trio

from flowbroker.transport.frames import StatusMessage, encode_status_message
from flowbroker.transport.publication import Publication, PublicationConfig
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig
from flowbroker.transport.udp import PublicationDriver, SubscriptionDriver, open_udp

RECEIVER = ("127.0.0.1", 40999)
TERM = 64 * 1024


def test_the_next_cycle_is_due_at_once_while_the_window_allows_more() -> None:
    pub = Publication(PublicationConfig(7, 10, term_length=TERM, mtu=1408), 0, destination=RECEIVER)
    pub.do_work(0)  # SETUP
    pub.on_datagram(encode_status_message(StatusMessage(7, 10, 0, 0, TERM // 2, 3, None, 0)), RECEIVER, 1)
    for _ in range(4):
        assert pub.offer(bytes(5000)) > 0  # 4 fragments each: 16 datagrams
    now = 2
    sent = len(pub.do_work(now))
    assert sent == 2  # max_messages_per_send
    cycles = 1
    while pub.next_deadline_ns() <= now:  # due again at once: run it, as a shell does
        sent += len(pub.do_work(now))
        cycles += 1
        assert cycles < 100
    assert pub.sender_position == pub.position and sent == 16
    assert pub.next_deadline_ns() > now  # nothing left: back to the heartbeat timer


async def test_fragmented_messages_flow_without_waiting_for_status_messages() -> None:
    count, size = 1000, 5000
    received: list[bytes] = []
    sub_endpoint = open_udp(("127.0.0.1", 0))
    pub_endpoint = open_udp(("127.0.0.1", 0))
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3, receiver_window=TERM // 2, so_rcvbuf=1 << 20))
    subscription = channel.add_subscription(0)
    now = int(trio.current_time() * 1e9)
    publication = Publication(PublicationConfig(7, 10, term_length=TERM, mtu=1408), now,
                              destination=sub_endpoint.local_address)
    pub, sub = PublicationDriver(publication, pub_endpoint), SubscriptionDriver(channel, sub_endpoint)
    with trio.fail_after(30):  # before the fix: ~52 s; this bounds the test, it measures nothing
        async with pub_endpoint, sub_endpoint, trio.open_nursery() as nursery:
            nursery.start_soon(pub.run)
            nursery.start_soon(sub.run)

            async def publish() -> None:
                for i in range(count):
                    await pub.publish(i.to_bytes(4, "big") + bytes(size - 4))

            nursery.start_soon(publish)
            while len(received) < count:
                await sub.receive(subscription, lambda m: received.append(bytes(m[:4])),
                                  deadline=trio.current_time() + 5)
            nursery.cancel_scope.cancel()
    assert received == [i.to_bytes(4, "big") for i in range(count)]
