"""A seeded in-memory datagram network for sans-IO transport tests.

Datagrams are scheduled for delivery at ``now_ns + delay``; each may be dropped, duplicated or reordered
(held back by an extra delay so later datagrams overtake it). All randomness comes from one seeded
``random.Random``, and time is whatever ``now_ns`` the test passes in, so a run is exactly repeatable.
The in-flight queue is bounded like a socket buffer: beyond ``capacity`` datagrams are dropped and counted.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from collections.abc import Hashable, Mapping
from typing import Callable, Protocol

Address = Hashable  # as in transport/: any hashable address, (host, port) here

__all__ = ["Address", "Endpoint", "FakeNetwork", "NetStats", "pump"]


@dataclass(slots=True)
class NetStats:
    sent: int = 0
    delivered: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    overflowed: int = 0


@dataclass(order=True, slots=True)
class _InFlight:
    deliver_at_ns: int
    seq: int
    src: Address = field(compare=False)
    dst: Address = field(compare=False)
    data: bytes = field(compare=False)


class FakeNetwork:
    """Lossy, duplicating, reordering, delaying datagram network driven by simulated time.

    Args:
        seed: the only source of randomness.
        loss: probability a datagram is dropped.
        duplicate: probability a datagram is delivered twice.
        reorder: probability a datagram is held back by ``reorder_delay_ns`` so later ones overtake it.
        delay_ns: base one-way latency.
        jitter_ns: uniform extra latency in [0, jitter_ns].
        capacity: most datagrams in flight; more are dropped (a full socket buffer).
        drop_if: optional predicate on the datagram bytes, for targeted loss (e.g. only DATA frames).
    """

    def __init__(
        self,
        seed: int,
        *,
        loss: float = 0.0,
        duplicate: float = 0.0,
        reorder: float = 0.0,
        delay_ns: int = 50_000,
        jitter_ns: int = 0,
        reorder_delay_ns: int = 300_000,
        capacity: int = 100_000,
        drop_if: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.loss = loss
        self.duplicate = duplicate
        self.reorder = reorder
        self.delay_ns = delay_ns
        self.jitter_ns = jitter_ns
        self.reorder_delay_ns = reorder_delay_ns
        self.capacity = capacity
        self.drop_if = drop_if
        self.stats = NetStats()
        self._queue: list[_InFlight] = []
        self._seq = 0

    def _latency(self) -> int:
        extra = self.rng.randint(0, self.jitter_ns) if self.jitter_ns else 0
        return self.delay_ns + extra

    def _push(self, at_ns: int, src: Address, dst: Address, data: bytes) -> None:
        if len(self._queue) >= self.capacity:
            self.stats.overflowed += 1
            return
        self._seq += 1
        heapq.heappush(self._queue, _InFlight(at_ns, self._seq, src, dst, data))

    def send(self, src: Address, dst: Address, data: bytes, now_ns: int) -> None:
        """Hand one datagram to the network."""
        self.stats.sent += 1
        if self.drop_if is not None and self.drop_if(data):
            self.stats.dropped += 1
            return
        if self.loss and self.rng.random() < self.loss:
            self.stats.dropped += 1
            return
        at = now_ns + self._latency()
        if self.reorder and self.rng.random() < self.reorder:
            self.stats.reordered += 1
            at += self.reorder_delay_ns
        self._push(at, src, dst, bytes(data))
        if self.duplicate and self.rng.random() < self.duplicate:
            self.stats.duplicated += 1
            self._push(at + self._latency(), src, dst, bytes(data))

    def deliver(self, now_ns: int) -> list[tuple[Address, Address, bytes]]:
        """Every datagram due by ``now_ns``, in delivery order, as ``(dst, src, data)``."""
        out: list[tuple[Address, Address, bytes]] = []
        queue = self._queue
        while queue and queue[0].deliver_at_ns <= now_ns:
            item = heapq.heappop(queue)
            out.append((item.dst, item.src, item.data))
        self.stats.delivered += len(out)
        return out

    def next_delivery_ns(self) -> int | None:
        return self._queue[0].deliver_at_ns if self._queue else None

    @property
    def in_flight(self) -> int:
        return len(self._queue)


class Endpoint(Protocol):
    """Anything with the sans-IO duty-cycle shape of a publication or a receive channel."""

    def on_datagram(self, data: bytes, source: Address, now_ns: int) -> None: ...

    def do_work(self, now_ns: int) -> list[tuple[bytes, Address]]: ...


def pump(net: FakeNetwork, endpoints: Mapping[Address, Endpoint], now_ns: int) -> int:
    """One round: every endpoint's duty cycle onto the network, then every due datagram to its endpoint.

    Returns how many datagrams were delivered. Datagrams for an address with no endpoint vanish, like
    UDP to a closed port.
    """
    for address, endpoint in endpoints.items():
        for data, destination in endpoint.do_work(now_ns):
            assert isinstance(destination, tuple)
            net.send(address, destination, data, now_ns)
    delivered = net.deliver(now_ns)
    for destination, source, data in delivered:
        target = endpoints.get(destination)
        if target is not None:
            target.on_datagram(data, source, now_ns)
    return len(delivered)
