"""A member of a multicast group: a fanout exchange's UDP consumer sharing one broker publication with the
group's other members (docs/client.md, "Multicast groups").

`conn.consumer(exchange=..., transport="udp", group=..., multicast="239.x.y.z:port")` returns one. It is a
`UdpConsumer` (same iteration, statistics and closing; each message held in the image until the application
has processed it) whose image is read from the multicast group:

- its socket is bound to the group's port and joined to the group (so several members may share a host);
  its status messages and NAKs go to the control group (the next address up), as an Aeron multicast
  receiver's do;
- joining sends JOIN_GROUP with the receiver id of its status messages: only members' count;
- the broker settles a message once every live member has processed it, so `ack`, `reject` and `requeue`
  only say "processed" here (nothing goes over TCP), and a member cannot requeue a message for the group.
  The slowest member paces the group; the group's queue's watermarks pace the producers.
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from flowbroker.client.consumer import ConsumerStatistics
from flowbroker.client.errors import check_timeout
from flowbroker.client.udpconsumer import UdpConsumer
from flowbroker.protocol import Frame
from flowbroker.protocol.frames import JoinGroup
from flowbroker.transport.subscription import ReceiverConfig
from flowbroker.transport.udp import UdpEndpoint, now_ns, open_udp

if TYPE_CHECKING:
    from flowbroker.client.connection import Connection

__all__ = ["GroupConsumer", "DEFAULT_GROUP_STREAM", "open_group_endpoint"]

DEFAULT_GROUP_STREAM = 1003
"""The Aeron stream id a multicast group is delivered on unless its first member names one."""


def parse_group_address(multicast: str) -> tuple[str, int]:
    """"239.1.2.3:40457" -> ("239.1.2.3", 40457); ValueError unless an odd IPv4 multicast address and a port."""
    host, sep, port = multicast.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"multicast={multicast!r}: expected group-address:port, e.g. 239.1.2.3:40457")
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"multicast={multicast!r}: {host!r} is not an IPv4 address (e.g. 239.1.2.3:40457)") from None
    if not ip.is_multicast or int(ip) % 2 == 0:
        raise ValueError(f"multicast={multicast!r}: the group address must be an odd IPv4 multicast address")
    return str(ip), int(port)


def open_group_endpoint(group: tuple[str, int], interface: str | None, so_rcvbuf: int) -> UdpEndpoint:
    """A member's socket: bound to the group's address and port (shared with other members on this host),
    joined to the group on `interface` (None: the kernel's route for it), multicast sent with TTL 1."""
    endpoint = open_udp(group, so_rcvbuf=so_rcvbuf, reuse_address=True)
    try:
        endpoint.join_multicast(group[0], interface)
        endpoint.set_multicast_send(interface, 1)
    except BaseException:
        endpoint.close()
        raise
    return endpoint


class GroupConsumer(UdpConsumer):
    """A multicast group member (see the module docstring). Create it with `conn.consumer(exchange=...,
    transport="udp", group=..., multicast=...)`."""

    _settles_over_tcp = False

    def __init__(self, conn: Connection, group: str, subscription_id: int, *, exchange: str, multicast: str,
                 fc: str = "min", buffer_size: int = 0, stream_id: int = DEFAULT_GROUP_STREAM,
                 interface: str | None = None) -> None:
        if fc not in ("min", "tagged"):
            raise ValueError(f"fc must be \"min\" or \"tagged\", not {fc!r}")
        self.group_address = parse_group_address(multicast)
        self.exchange = exchange
        self.fc = fc
        self.interface = interface
        self.receiver_id = random.randrange(1, 2**31)
        """The receiver id of this member's status messages (registered with the broker by JOIN_GROUP)."""
        self.group_tag: int | None = None
        self.channel_uri: str | None = None
        """The group's Aeron channel, from the broker's answer."""
        self._leaving = False
        super().__init__(conn, group, subscription_id, prefetch=0, buffer_size=buffer_size, stream_id=stream_id)

    def _open_endpoint(self) -> UdpEndpoint:
        # By default the group is joined, and status messages sent, on the TCP connection's local address: the
        # broker takes a member's status messages only from the host its connection comes from.
        if self.interface is None:
            local = self._conn._local_host()
            self.interface = local if ":" not in local else None
        return open_group_endpoint(self.group_address, self.interface, max(self.window, 1 << 20))

    def _subscribe_frame(self, request_id: int) -> Frame:
        host, port = self.group_address
        return JoinGroup(request_id, self.subscription_id, self.exchange, self.queue, f"{host}:{port}", self.fc,
                         self.window, self.receiver_id, self.stream_id)

    async def aclose(self, timeout: float | None = None) -> None:
        """Leave the group. For a member, processing is settlement, so leaving must report exactly what was
        processed: the messages it received and never handed out are not (the group keeps them for the
        members that stay, or the queue for the next), and one last status message says how far it got
        before the broker hears CANCEL, which it reads first (else what it processed would be offered to
        the others again or, if it was the last, requeued)."""
        check_timeout("consumer close", timeout, "close_timeout")  # before anything is closed
        if not self._closed:
            self._mark_current_processed()
            self._buffered.clear()  # never handed out: not processed (Consumer.aclose would count them)
            image, channel = self._image, self._channel
            if image is not None and channel is not None:
                image.report_now()
                self._send(channel.do_work(now_ns()))
            self._leaving = True  # no status message after that one: what a poll takes now is not processed
        await super().aclose(timeout)

    def statistics(self) -> ConsumerStatistics:
        """`UdpConsumer.statistics()`, with `unsettled` a member's: processing is settlement, so only the
        message in hand and not yet processed is (it read every message received and never acked, a tester)."""
        current = self._current
        return replace(super().statistics(), unsettled=1 if current is not None and current._unprocessed else 0)

    def _send(self, out: list[tuple[bytes, Any]]) -> None:
        if not self._leaving:
            super()._send(out)

    def _receiver_config(self, session_id: int, result: dict[str, Any]) -> ReceiverConfig:
        tag = result.get("group_tag")
        self.group_tag = tag if type(tag) is int else None
        channel = result.get("channel")
        self.channel_uri = channel if isinstance(channel, str) else None
        host, port = self.group_address
        control = (str(ipaddress.IPv4Address(host) + 1), port)
        window = min(self.window, 1 << 30)
        return ReceiverConfig(receiver_id=self.receiver_id, receiver_window=window, session_id=session_id,
                              so_rcvbuf=max(window, 1 << 20), max_images=1, multicast=True,
                              control_address=control, group_tag=self.group_tag)


