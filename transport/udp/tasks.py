"""The trio tasks that run a publication or a receive channel over a ``UdpEndpoint``, and the shells' clock.

Each is the sans-IO duty cycle of ``transport.drivers`` plus the waits: for datagrams (with the duty
cycle's deadline as the timeout) and, for a publisher, for window. Sends are non-blocking and happen in the
caller's task right after an offer or a poll (so a publish costs no task switch); ``run()``, started in a
nursery, handles received control/data datagrams and the timers (SETUP, heartbeat, SM, NAK).
"""

from __future__ import annotations

import math

import trio

from flowbroker.transport.drivers import Buffer, OfferVerdict, Outgoing, ReceiverDuty, SenderDuty, offer_verdict
from flowbroker.transport.image import MessageHandler
from flowbroker.transport.publication import Publication
from flowbroker.transport.subscription import ReceiveChannel, Subscription
from flowbroker.transport.udp.sockets import DEFAULT_BATCH, UdpEndpoint

__all__ = ["PublicationDriver", "SubscriptionDriver", "now_ns"]


def now_ns() -> int:
    """trio's clock in nanoseconds, the ``now_ns`` every sans-IO core takes; call it only inside ``trio.run``.

    trio's clock rather than ``time.monotonic_ns``: under ``trio.testing.MockClock`` it is virtual, so tests
    of timers (SETUP, heartbeats, status messages, buffer acks) are deterministic. The broker uses the same
    function for its core."""
    return int(trio.current_time() * 1_000_000_000)


def _send_all(endpoint: UdpEndpoint, out: Outgoing) -> None:
    for datagram, address in out:
        assert isinstance(address, tuple)
        endpoint.send(datagram, address)


class PublicationDriver:
    """Runs a ``Publication`` over a ``UdpEndpoint``: ``await publish(...)`` waits for window with a deadline.

    Start ``run()`` in a nursery; it returns once the publication is closed, drained and done lingering.
    """

    def __init__(self, publication: Publication, endpoint: UdpEndpoint, *, receive_batch: int = DEFAULT_BATCH) -> None:
        self.publication = publication
        self.endpoint = endpoint
        self.duty = SenderDuty(publication)
        self._batch = receive_batch
        self._progress = trio.Event()

    def flush(self) -> None:
        """Run one duty cycle now and send its datagrams (non-blocking)."""
        _send_all(self.endpoint, self.duty.do_work(now_ns()))

    def offer(self, payload: Buffer) -> int:
        """``Publication.offer`` and send at once; returns the position or an ``OfferResult``."""
        result, out = self.duty.offer(payload, now_ns())
        _send_all(self.endpoint, out)
        return result

    async def publish(self, payload: Buffer, *, deadline: float = math.inf) -> int:
        """Offer ``payload``, waiting (until trio time ``deadline``) while back-pressured or not connected.

        Returns the new position, or the last ``OfferResult`` if the deadline passed (``CLOSED`` and
        ``MAX_POSITION_EXCEEDED`` at once): back pressure is a return value, not an exception.
        """
        await trio.lowlevel.checkpoint()
        while True:
            result = self.offer(payload)
            verdict = offer_verdict(result)
            if verdict is OfferVerdict.DONE:
                return result
            if verdict is OfferVerdict.RETRY_NOW:
                continue
            with trio.move_on_at(deadline):
                await self._progress.wait()
            if trio.current_time() >= deadline:
                return self.offer(payload)

    def _signal_progress(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def run(self) -> None:
        """Receive SMs/NAKs/RTTMs and keep the timers until the publication is done."""
        duty = self.duty
        while not duty.is_done:
            batch: list[tuple[bytes, tuple[str, int]]] = []
            with trio.move_on_at(duty.deadline_ns() / 1_000_000_000):
                batch = await self.endpoint.receive_batch(self._batch)
            out, progressed = duty.cycle(batch, now_ns())
            _send_all(self.endpoint, out)
            if progressed:
                self._signal_progress()
        self._signal_progress()


class SubscriptionDriver:
    """Runs a ``ReceiveChannel`` over a ``UdpEndpoint``; ``await receive(...)`` waits for messages."""

    def __init__(self, channel: ReceiveChannel, endpoint: UdpEndpoint, *, receive_batch: int = DEFAULT_BATCH) -> None:
        self.channel = channel
        self.endpoint = endpoint
        self.duty = ReceiverDuty(channel)
        self._batch = receive_batch
        self._arrived = trio.Event()

    def flush(self) -> None:
        """Run the channel's duty cycle now and send its SMs/NAKs (non-blocking)."""
        _send_all(self.endpoint, self.duty.do_work(now_ns()))

    def poll(self, subscription: Subscription, handler: MessageHandler, fragment_limit: int = 64) -> int:
        """Poll without waiting; positions moved by processing go out in SMs at once."""
        count, out = self.duty.poll(subscription, handler, fragment_limit, now_ns())
        _send_all(self.endpoint, out)
        return count

    async def receive(
        self, subscription: Subscription, handler: MessageHandler, fragment_limit: int = 64, *,
        deadline: float = math.inf,
    ) -> int:
        """Wait (until trio time ``deadline``) for at least one fragment, then poll; returns fragments read."""
        await trio.lowlevel.checkpoint()
        while True:
            count = self.poll(subscription, handler, fragment_limit)
            if count or trio.current_time() >= deadline:
                return count
            with trio.move_on_at(deadline):
                await self._arrived.wait()

    async def run(self) -> None:
        """Receive data and SETUPs, keep the SM/NAK timers. Runs until cancelled."""
        duty = self.duty
        while True:
            batch: list[tuple[bytes, tuple[str, int]]] = []
            with trio.move_on_at(duty.deadline_ns(now_ns()) / 1_000_000_000):
                batch = await self.endpoint.receive_batch(self._batch)
            _send_all(self.endpoint, duty.cycle(batch, now_ns()))
            self._arrived.set()
            self._arrived = trio.Event()
