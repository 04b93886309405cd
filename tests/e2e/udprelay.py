"""A lossy UDP relay for tests: it forwards datagrams between one client and one server on 127.0.0.1 and,
seeded, drops, duplicates and reorders them, so that the Aeron data path's NAKs, retransmits and
duplicate detection are exercised over real sockets.

Two sockets, both bound to port 0 on ``host`` when the relay is made (before anything is sent):

- ``client_side`` (``relay.client_address``): the client sends here instead of to the server. The relay
  learns the client's address from its first datagram (or the test names it: ``relay.client = addr``).
- ``server_side`` (``relay.server_port``): the relay sends everything for the server FROM this socket, so
  the server sees ``(host, relay.server_port)`` as the client's source; the server's answers arrive here
  and go back to the client from ``client_side``.

Why two sockets rather than one: the broker accepts a producer's DATA/SETUP only from the address the
producer registered (its host and UDP source port, REGISTER_PUBLICATION ``source_port``), and sends its
SMs/NAKs there. Through the relay that source is the relay's ``server_side`` socket, whose port is known
as soon as the relay exists. So:

- producer -> relay -> broker: register the publication with ``source_port=relay.server_port`` (a test
  that sends REGISTER_PUBLICATION itself; an SDK producer needs a way to name the port it registers),
  set ``relay.server = (broker host, broker.udp_port)``, and send the producer's datagrams to
  ``relay.client_address`` (the SDK: ``udp_endpoint=f"127.0.0.1:{relay.client_address[1]}"``).
- broker -> relay -> consumer: subscribe with ``port=relay.server_port``, set ``relay.server`` to the
  broker's UDP endpoint and ``relay.client`` to the consumer's UDP address (the broker speaks first, with
  SETUP, so the relay cannot learn the consumer from its first datagram).

Impairments are drawn per datagram, per direction, from ``random.Random`` seeded from ``seed``, so a run is
reproducible for a given arrival order: lost (``loss``), sent twice (``duplication``), or held and sent
right after the next datagram in its direction (``reordering``). Bounded: each direction holds at most
one datagram (a second reorder draw while one is held sends at once), a held datagram that no other
follows within ``hold_timeout`` seconds goes out alone (so reordering never becomes loss at the end of a
stream), there are no queues, and the kernel buffers are the only buffering. ``counters`` per direction
say what the relay did.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import trio

from flowbroker.transport.udp import Address, UdpEndpoint, open_udp

__all__ = ["CLEAN", "Impairment", "Lane", "LaneCounters", "LossyRelay", "Send"]


@dataclass(frozen=True, slots=True)
class Impairment:
    """Per-datagram probabilities for one direction (each drawn independently)."""

    loss: float = 0.05
    duplication: float = 0.01
    reordering: float = 0.01


CLEAN = Impairment(0.0, 0.0, 0.0)


@dataclass(slots=True)
class LaneCounters:
    """What one direction of the relay did."""

    received: int = 0  # datagrams that arrived from the expected peer
    forwarded: int = 0  # datagrams sent on (a duplicate counts twice, a held one when it goes)
    dropped: int = 0  # lost on purpose
    duplicated: int = 0
    reordered: int = 0  # held and sent after the next one
    released_idle: int = 0  # held ones sent alone after hold_timeout
    foreign: int = 0  # from another address than the peer: dropped
    no_destination: int = 0  # arrived before the other side's address was known: dropped
    send_drops: int = 0  # the kernel refused the send (full buffer): lost too


@dataclass(slots=True)
class Lane:
    """One direction's impairments, sans-IO: ``forward`` decides, ``send`` (any callable) puts on the wire."""

    impairment: Impairment
    rng: random.Random
    counters: LaneCounters = field(default_factory=LaneCounters)
    held: bytes | None = None

    def forward(self, datagram: bytes, send: Callable[[bytes], None]) -> None:
        """One datagram through the impairments; ``send`` puts one on the wire."""
        imp, c = self.impairment, self.counters
        c.received += 1
        if self.rng.random() < imp.loss:
            c.dropped += 1
            return
        copies = 2 if self.rng.random() < imp.duplication else 1
        if copies == 2:
            c.duplicated += 1
        if self.held is None and self.rng.random() < imp.reordering:
            self.held = datagram
            c.reordered += 1
            copies -= 1  # a duplicated datagram that is held: one copy now, one after the next
            for _ in range(copies):
                send(datagram)
            return
        for _ in range(copies):
            send(datagram)
        if self.held is not None:
            held, self.held = self.held, None
            send(held)

    def release(self, send: Callable[[bytes], None]) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self.counters.released_idle += 1
            send(held)


class Send:
    """Sends one datagram to ``destination`` from ``endpoint``, counting it as forwarded or dropped."""

    def __init__(self, endpoint: UdpEndpoint, destination: Address, counters: LaneCounters) -> None:
        self.endpoint = endpoint
        self.destination = destination
        self.counters = counters

    def __call__(self, datagram: bytes) -> None:
        if self.endpoint.send(datagram, self.destination):
            self.counters.forwarded += 1
        else:
            self.counters.send_drops += 1


class LossyRelay:
    """Client <-> relay <-> server, lossy both ways; ``async with relay, trio.open_nursery() as n:
    n.start_soon(relay.run)``. ``to_server`` / ``to_client`` set each direction's impairment."""

    def __init__(
        self,
        server: Address | None = None,
        *,
        seed: int = 0,
        to_server: Impairment = Impairment(),
        to_client: Impairment = Impairment(),
        host: str = "127.0.0.1",
        hold_timeout: float = 0.02,
        so_rcvbuf: int = 4 << 20,
        batch: int = 64,
    ) -> None:
        self.client_side = open_udp((host, 0), so_rcvbuf=so_rcvbuf, so_sndbuf=so_rcvbuf)
        try:
            self.server_side = open_udp((host, 0), so_rcvbuf=so_rcvbuf, so_sndbuf=so_rcvbuf)
        except BaseException:
            self.client_side.close()
            raise
        self.server = server
        self.client: Address | None = None
        self.hold_timeout = hold_timeout
        self._batch = batch
        self.upstream = Lane(to_server, random.Random(seed * 2 + 1))  # client -> server
        self.downstream = Lane(to_client, random.Random(seed * 2 + 2))  # server -> client

    @property
    def client_address(self) -> Address:
        """Where the client sends (in place of the server's address)."""
        return self.client_side.local_address

    @property
    def server_port(self) -> int:
        """The source port the server sees for everything the client sends: the one to register."""
        return self.server_side.local_address[1]

    @property
    def counters(self) -> dict[str, LaneCounters]:
        return {"to_server": self.upstream.counters, "to_client": self.downstream.counters}

    def close(self) -> None:
        self.client_side.close()
        self.server_side.close()

    async def __aenter__(self) -> LossyRelay:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def run(self) -> None:
        """Both directions until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, True)
            nursery.start_soon(self._pump, False)

    async def _pump(self, upstream: bool) -> None:
        source, sink = (self.client_side, self.server_side) if upstream else (self.server_side, self.client_side)
        lane = self.upstream if upstream else self.downstream
        send: Send | None = None
        while True:
            batch: list[tuple[bytes, Address]] = []
            if lane.held is not None:
                with trio.move_on_after(self.hold_timeout):
                    batch = await source.receive_batch(self._batch)
                if not batch:
                    if send is not None:
                        lane.release(send)
                    continue
            else:
                batch = await source.receive_batch(self._batch)
            for datagram, address in batch:
                if upstream and self.client is None:
                    self.client = address
                peer = self.client if upstream else self.server
                if address != peer:
                    lane.counters.foreign += 1
                    continue
                destination = self.server if upstream else self.client
                if destination is None:
                    lane.counters.no_destination += 1
                    continue
                if send is None or send.destination != destination:
                    send = Send(sink, destination, lane.counters)
                lane.forward(datagram, send)
