"""What the sender and the receiver do with datagrams between two socket waits, without the socket.

Aeron's media driver runs three agents: the conductor (timers, images coming and going), the sender
(publications' duty cycles) and the receiver (datagrams into images, status messages and NAKs out). Here a
``Publication`` and a ``ReceiveChannel`` already hold the conductor's timers and all the state; what is left
is the cycle an I/O shell repeats: hand in what the socket delivered, run the duty cycle, send what comes
back, and know when to run again and whether a waiting publisher may retry. These two classes are that
cycle with the clock passed in as ``now_ns``, so the trio shell in ``transport.udp`` is only waits and
sends, and another shell (the broker's, a test's, a simulation's) drives the same cycle with its own loop.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from flowbroker.transport.image import MessageHandler
from flowbroker.transport.publication import OfferResult, Publication
from flowbroker.transport.subscription import Address, ReceiveChannel, Subscription

__all__ = ["Buffer", "OfferVerdict", "Outgoing", "Received", "ReceiverDuty", "SenderDuty", "offer_verdict"]

Buffer = bytes | bytearray | memoryview
Outgoing = list[tuple[bytes, Address]]
"""Datagrams to send now, each with its destination address."""
Received = Iterable[tuple[Buffer, Address]]
"""Datagrams the socket delivered, each with its source address."""


class OfferVerdict(enum.Enum):
    """What a publisher does with the result of one ``offer``."""

    DONE = "done"  # a position (> 0), or a failure retrying cannot fix: CLOSED, MAX_POSITION_EXCEEDED
    RETRY_NOW = "retry_now"  # ADMIN_ACTION: the term was padded and rotated; offer again at once
    WAIT = "wait"  # BACK_PRESSURED or NOT_CONNECTED: wait for the sender's progress (or give up at a deadline)


def offer_verdict(result: int) -> OfferVerdict:
    """Back pressure is a return value: sort an ``offer`` result into done, retry now, or wait."""
    if result > 0:
        return OfferVerdict.DONE
    if result == OfferResult.ADMIN_ACTION:
        return OfferVerdict.RETRY_NOW
    if result == OfferResult.BACK_PRESSURED or result == OfferResult.NOT_CONNECTED:
        return OfferVerdict.WAIT
    return OfferVerdict.DONE


class SenderDuty:
    """One publication's sender cycle: control datagrams in, data/SETUP/heartbeats/retransmits out.

    ``cycle`` also says whether the cycle made progress for a waiting publisher (the publication limit moved,
    or the publication is connected), which is when the shell wakes it to offer again.
    """

    __slots__ = ("publication",)

    def __init__(self, publication: Publication) -> None:
        self.publication = publication

    def offer(self, payload: Buffer, now_ns: int) -> tuple[int, Outgoing]:
        """``Publication.offer``; on success the duty cycle runs at once, so a publish costs no wait."""
        result = self.publication.offer(payload)
        return result, (self.publication.do_work(now_ns) if result > 0 else [])

    def do_work(self, now_ns: int) -> Outgoing:
        """One duty cycle of the publication (timers, resends, new data)."""
        return self.publication.do_work(now_ns)

    def cycle(self, received: Received, now_ns: int) -> tuple[Outgoing, bool]:
        """Feed what arrived (SMs, NAKs, ERRs, RTTMs), run the duty cycle; return what to send and progress."""
        pub = self.publication
        limit_before = pub.publication_limit
        for datagram, source in received:
            pub.on_datagram(datagram, source, now_ns)
        out = pub.do_work(now_ns)
        return out, pub.publication_limit != limit_before or pub.is_connected

    def deadline_ns(self) -> int:
        """When the next cycle must run if nothing arrives."""
        return self.publication.next_deadline_ns()

    @property
    def is_done(self) -> bool:
        """Closed, drained and lingered: the shell stops."""
        return self.publication.is_done


class ReceiverDuty:
    """One receive channel's cycle: data and SETUPs in, status messages, NAKs and RTTMs out."""

    __slots__ = ("channel",)

    def __init__(self, channel: ReceiveChannel) -> None:
        self.channel = channel

    def cycle(self, received: Received, now_ns: int) -> Outgoing:
        """Feed what arrived (never raises for any content), run every image's duty cycle."""
        channel = self.channel
        for datagram, source in received:
            channel.on_datagram(datagram, source, now_ns)
        return channel.do_work(now_ns)

    def do_work(self, now_ns: int) -> Outgoing:
        return self.channel.do_work(now_ns)

    def poll(self, subscription: Subscription, handler: MessageHandler, fragment_limit: int,
             now_ns: int) -> tuple[int, Outgoing]:
        """Poll without waiting; when fragments were processed, the SMs their new positions call for go out
        at once (the sender's window follows processing, not the next timer)."""
        count = subscription.poll(handler, fragment_limit)
        return count, (self.channel.do_work(now_ns) if count else [])

    def deadline_ns(self, now_ns: int) -> int:
        """When the next cycle must run if nothing arrives (SM, NAK and announcement timers)."""
        return self.channel.next_deadline_ns(now_ns)
