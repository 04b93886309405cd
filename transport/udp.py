"""The transport's only I/O: non-blocking UDP sockets driven by trio.

Why stdlib sockets plus ``trio.lowlevel.wait_readable`` rather than ``trio.socket``: the data path moves
well over 100k datagrams a second, and trio's socket methods yield to the scheduler on every call. Here a
send is a plain non-blocking ``sendto`` (a full kernel buffer is a dropped datagram, as UDP allows; it is
counted, and NAKs repair it), and a receive drains whatever the kernel holds in one go
(``receive_batch``) after a single wait. Everything above this module is sans-IO: publications and images
take datagrams and return datagrams to send.

Buffers are bounded: one receive buffer of ``max_datagram`` bytes per endpoint plus the kernel's
SO_RCVBUF/SO_SNDBUF (Aeron's defaults: 128 KiB receive, OS default send).
"""

from __future__ import annotations

import errno
import math
import ipaddress
import socket
import struct
from dataclasses import dataclass
from types import TracebackType
from typing import Final

import trio

from flowbroker.transport.channel import ChannelUri, Endpoint
from flowbroker.transport.errors import EndpointClosedError, TransportError

Address = tuple[str, int]
Buffer = bytes | bytearray | memoryview

MAX_UDP_PAYLOAD: Final = 65536
DEFAULT_BATCH: Final = 64
_DROP_ERRNOS: Final = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.ECONNREFUSED,
                                 errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EPERM})


@dataclass(slots=True)
class UdpCounters:
    """What happened on one endpoint; the drops are datagrams UDP lost on our side."""

    datagrams_sent: int = 0
    bytes_sent: int = 0
    send_drops: int = 0
    datagrams_received: int = 0
    bytes_received: int = 0
    receive_errors: int = 0


class UdpEndpoint:
    """One bound, non-blocking UDP socket.

    ``send`` never blocks; ``receive``/``receive_batch`` wait (cancellably) for datagrams. Received data is
    returned as ``bytes`` copies, so callers may keep them; use ``receive_into`` to fill a buffer of your own.
    """

    def __init__(self, sock: socket.socket, max_datagram: int = MAX_UDP_PAYLOAD) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._buffer = bytearray(max_datagram)
        self._view = memoryview(self._buffer)
        self.counters = UdpCounters()
        self._closed = False

    # -------------------------------------------------------------------- lifecycle

    @property
    def local_address(self) -> Address:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def family(self) -> int:
        return int(self._sock.family)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                trio.lowlevel.notify_closing(self._sock)
            except RuntimeError:
                pass  # not inside trio.run: nobody can be waiting on the socket
            self._sock.close()

    async def __aenter__(self) -> UdpEndpoint:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EndpointClosedError("UDP endpoint is closed")

    # -------------------------------------------------------------------- send

    def send(self, datagram: Buffer, addr: Address) -> bool:
        """Send one datagram now; False (and a counted drop) if the kernel would block or refuses."""
        self._check_open()
        try:
            sent = self._sock.sendto(datagram, addr)
        except OSError as exc:
            if exc.errno in _DROP_ERRNOS:
                self.counters.send_drops += 1
                return False
            raise
        self.counters.datagrams_sent += 1
        self.counters.bytes_sent += sent
        return True

    async def send_wait(self, datagram: Buffer, addr: Address) -> None:
        """Send one datagram, waiting for socket buffer space instead of dropping it."""
        while True:
            self._check_open()
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                sent = self._sock.sendto(datagram, addr)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._sock)
                continue
            self.counters.datagrams_sent += 1
            self.counters.bytes_sent += sent
            await trio.lowlevel.cancel_shielded_checkpoint()
            return

    # -------------------------------------------------------------------- receive

    def try_receive(self) -> tuple[bytes, Address] | None:
        """One datagram if the kernel has one, else None; never waits."""
        self._check_open()
        try:
            n, addr = self._sock.recvfrom_into(self._buffer)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            # An ICMP error reported on the socket (e.g. port unreachable) is no datagram: skip it.
            if exc.errno in _DROP_ERRNOS:
                self.counters.receive_errors += 1
                return None
            raise
        self.counters.datagrams_received += 1
        self.counters.bytes_received += n
        return bytes(self._view[:n]), (str(addr[0]), int(addr[1]))

    async def receive(self) -> tuple[bytes, Address]:
        """Wait for the next datagram (a trio checkpoint, cancellable)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            got = self.try_receive()
            if got is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return got
            await trio.lowlevel.wait_readable(self._sock)

    async def receive_batch(self, max_count: int = DEFAULT_BATCH) -> list[tuple[bytes, Address]]:
        """Wait for at least one datagram, then drain up to ``max_count`` without yielding again."""
        await trio.lowlevel.checkpoint_if_cancelled()
        batch: list[tuple[bytes, Address]] = []
        while True:
            while len(batch) < max_count:
                got = self.try_receive()
                if got is None:
                    break
                batch.append(got)
            if batch:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            await trio.lowlevel.wait_readable(self._sock)

    async def receive_into(self, buf: bytearray | memoryview) -> tuple[int, Address]:
        """Wait for a datagram and copy it into ``buf``; returns its length and source."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self._check_open()
            try:
                n, addr = self._sock.recvfrom_into(buf)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._sock)
                continue
            except OSError as exc:
                if exc.errno in _DROP_ERRNOS:
                    self.counters.receive_errors += 1
                    continue
                raise
            self.counters.datagrams_received += 1
            self.counters.bytes_received += n
            await trio.lowlevel.cancel_shielded_checkpoint()
            return n, (str(addr[0]), int(addr[1]))

    # -------------------------------------------------------------------- multicast

    def join_multicast(self, group: str, interface: str | None = None) -> None:
        """Join ``group`` on the interface with address ``interface`` (IPv4) or any interface."""
        ip = ipaddress.ip_address(group)
        if isinstance(ip, ipaddress.IPv4Address):
            mreq = struct.pack("4s4s", ip.packed, socket.inet_aton(interface or "0.0.0.0"))
            self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
        else:
            mreq6 = struct.pack("16sI", ip.packed, 0)
            self._sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, mreq6)

    def set_multicast_send(self, interface: str | None, ttl: int, loop: bool = True) -> None:
        """Where this socket's multicast goes out, with what TTL, and whether it loops back locally."""
        if self._sock.family == socket.AF_INET:
            if interface:
                self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
            self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, ttl)
            self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, int(loop))
        else:
            self._sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, ttl)
            self._sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_LOOP, int(loop))


# ------------------------------------------------------------------------------------------ opening


async def resolve(endpoint: Endpoint) -> Address:
    """Resolve a channel endpoint to a socket address (IP literals need no lookup)."""
    if endpoint.ip is not None:
        return endpoint.host, endpoint.port
    infos = await trio.socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_DGRAM)
    if not infos:
        raise TransportError(f"cannot resolve {endpoint}")
    sockaddr = infos[0][4]
    return str(sockaddr[0]), int(sockaddr[1])


def _family_of(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def open_udp(
    bind: Address = ("127.0.0.1", 0),
    *,
    so_rcvbuf: int | None = None,
    so_sndbuf: int | None = None,
    reuse_address: bool = False,
    max_datagram: int = MAX_UDP_PAYLOAD,
) -> UdpEndpoint:
    """A UDP endpoint bound to ``bind`` (port 0: ephemeral). Synchronous: binding does not block."""
    sock = socket.socket(_family_of(bind[0]), socket.SOCK_DGRAM)
    try:
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if so_rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, so_rcvbuf)
        if so_sndbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, so_sndbuf)
        sock.bind(bind)
    except BaseException:
        sock.close()
        raise
    return UdpEndpoint(sock, max_datagram)


def _interface_host(channel: ChannelUri, family: int) -> str:
    if channel.interface is not None:
        return channel.interface.host
    return "::" if family == socket.AF_INET6 else "0.0.0.0"


async def open_subscription_endpoint(channel: ChannelUri) -> UdpEndpoint:
    """The socket a subscription receives data on (and sends SMs/NAKs from).

    Unicast/MDC: bound to ``endpoint``. Multicast: bound to the endpoint's port, joined to the data group
    on ``interface``, sending control to the next-even group with the channel's TTL.
    """
    if channel.endpoint is None:
        raise TransportError(f"{channel}: a subscription needs an endpoint")
    host, port = await resolve(channel.endpoint)
    if not channel.is_multicast:
        return open_udp((host, port), so_rcvbuf=channel.so_rcvbuf, so_sndbuf=channel.so_sndbuf or None,
                        max_datagram=max(channel.mtu, MAX_UDP_PAYLOAD))
    family = _family_of(host)
    interface = channel.interface.host if channel.interface is not None else None
    endpoint = open_udp((host, port), so_rcvbuf=channel.so_rcvbuf, so_sndbuf=channel.so_sndbuf or None,
                        reuse_address=True)
    try:
        endpoint.join_multicast(host, interface if family == socket.AF_INET else None)
        endpoint.set_multicast_send(interface, channel.ttl)
    except BaseException:
        endpoint.close()
        raise
    return endpoint


async def open_publication_endpoint(channel: ChannelUri) -> UdpEndpoint:
    """The socket a publication sends data from and receives SMs/NAKs on.

    Unicast: an ephemeral port on ``interface`` (or any address). MDC: bound to ``control``. Multicast:
    bound to the control group's port and joined to the control group, data sent with the channel's TTL.
    """
    if channel.is_multicast:
        assert channel.endpoint is not None
        control = channel.control_endpoint
        assert control is not None
        family = _family_of(channel.endpoint.host)
        interface = channel.interface.host if channel.interface is not None else None
        endpoint = open_udp((control.host, control.port), so_rcvbuf=channel.so_rcvbuf,
                            so_sndbuf=channel.so_sndbuf or None, reuse_address=True)
        try:
            endpoint.join_multicast(control.host, interface if family == socket.AF_INET else None)
            endpoint.set_multicast_send(interface, channel.ttl)
        except BaseException:
            endpoint.close()
            raise
        return endpoint
    if channel.control is not None:
        host, port = await resolve(channel.control)
        return open_udp((host, port), so_rcvbuf=channel.so_rcvbuf, so_sndbuf=channel.so_sndbuf or None)
    family = _family_of(channel.endpoint.host) if channel.endpoint is not None else socket.AF_INET
    port = channel.interface.port if channel.interface is not None and channel.interface.port else 0
    return open_udp((_interface_host(channel, family), port), so_rcvbuf=channel.so_rcvbuf,
                    so_sndbuf=channel.so_sndbuf or None)


# ==========================================================================================================
# Publication and subscription drivers.
#
# The sans-IO state machines need a shell that feeds them received datagrams, calls their duty cycle on
# time and sends what they return. Sends are non-blocking and happen in the caller's task right after an
# offer or a poll (so a publish costs no task switch); a background task handles received control/data
# datagrams and the timers (SETUP, heartbeat, SM, NAK).
# ==========================================================================================================

from flowbroker.transport.publication import OfferResult, Publication  # noqa: E402
from flowbroker.transport.subscription import ReceiveChannel, Subscription  # noqa: E402
from flowbroker.transport.image import MessageHandler  # noqa: E402

_RETRYABLE: Final = (OfferResult.BACK_PRESSURED, OfferResult.NOT_CONNECTED, OfferResult.ADMIN_ACTION)


def _now_ns() -> int:
    """Trio's clock in ns (so a MockClock drives the state machines too)."""
    return int(trio.current_time() * 1_000_000_000)


class PublicationDriver:
    """Runs a ``Publication`` over a ``UdpEndpoint``: ``await publish(...)`` waits for window with a deadline.

    Start ``run()`` in a nursery; it returns once the publication is closed, drained and done lingering.
    """

    def __init__(self, publication: Publication, endpoint: UdpEndpoint, *, receive_batch: int = DEFAULT_BATCH) -> None:
        self.publication = publication
        self.endpoint = endpoint
        self._batch = receive_batch
        self._progress = trio.Event()

    def flush(self) -> None:
        """Run one duty cycle now and send its datagrams (non-blocking)."""
        for datagram, address in self.publication.do_work(_now_ns()):
            assert isinstance(address, tuple)
            self.endpoint.send(datagram, address)

    def offer(self, payload: Buffer) -> int:
        """``Publication.offer`` and send at once; returns the position or an ``OfferResult``."""
        result = self.publication.offer(payload)
        if result > 0:
            self.flush()
        return result

    async def publish(self, payload: Buffer, *, deadline: float = math.inf) -> int:
        """Offer ``payload``, waiting (until trio time ``deadline``) while back-pressured or not connected.

        Returns the new position, or the last ``OfferResult`` if the deadline passed (``CLOSED`` and
        ``MAX_POSITION_EXCEEDED`` at once): back pressure is a return value, not an exception.
        """
        await trio.lowlevel.checkpoint()
        while True:
            result = self.offer(payload)
            if result > 0 or result not in _RETRYABLE:
                return result
            if result == OfferResult.ADMIN_ACTION:
                continue
            with trio.move_on_at(deadline):
                await self._progress.wait()
            if trio.current_time() >= deadline:
                final = self.offer(payload)
                return final

    def _signal_progress(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def run(self) -> None:
        """Receive SMs/NAKs/RTTMs and keep the timers until the publication is done."""
        pub = self.publication
        while not pub.is_done:
            limit_before = pub.publication_limit
            with trio.move_on_at(pub.next_deadline_ns() / 1_000_000_000):
                batch = await self.endpoint.receive_batch(self._batch)
                now = _now_ns()
                for datagram, source in batch:
                    pub.on_datagram(datagram, source, now)
            self.flush()
            if pub.publication_limit != limit_before or pub.is_connected:
                self._signal_progress()
        self._signal_progress()


class SubscriptionDriver:
    """Runs a ``ReceiveChannel`` over a ``UdpEndpoint``; ``await poll(...)`` waits for messages."""

    def __init__(self, channel: ReceiveChannel, endpoint: UdpEndpoint, *, receive_batch: int = DEFAULT_BATCH) -> None:
        self.channel = channel
        self.endpoint = endpoint
        self._batch = receive_batch
        self._arrived = trio.Event()

    def flush(self) -> None:
        """Run the channel's duty cycle now and send its SMs/NAKs (non-blocking)."""
        for datagram, address in self.channel.do_work(_now_ns()):
            assert isinstance(address, tuple)
            self.endpoint.send(datagram, address)

    def poll(self, subscription: Subscription, handler: MessageHandler, fragment_limit: int = 64) -> int:
        """Poll without waiting; positions moved by processing go out in SMs at once."""
        count = subscription.poll(handler, fragment_limit)
        if count:
            self.flush()
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
        channel = self.channel
        while True:
            with trio.move_on_at(channel.next_deadline_ns(_now_ns()) / 1_000_000_000):
                batch = await self.endpoint.receive_batch(self._batch)
                now = _now_ns()
                for datagram, source in batch:
                    channel.on_datagram(datagram, source, now)
            self.flush()
            self._arrived.set()
            self._arrived = trio.Event()
