"""The transport's I/O: UDP sockets (``sockets``), the trio tasks that drive publications and receive
channels over them, with the shells' clock ``now_ns`` (``tasks``). The only part of ``flowbroker.transport`` that
imports trio or socket; everything else takes datagrams and ``now_ns`` and returns datagrams to send."""

from flowbroker.transport.udp.sockets import (
    DEFAULT_BATCH,
    MAX_UDP_PAYLOAD,
    Address,
    UdpCounters,
    UdpEndpoint,
    UdpEndpointStatistics,
    open_publication_endpoint,
    open_subscription_endpoint,
    open_udp,
    resolve,
)
from flowbroker.transport.udp.tasks import PublicationDriver, SubscriptionDriver, now_ns

__all__ = [
    "DEFAULT_BATCH",
    "MAX_UDP_PAYLOAD",
    "Address",
    "PublicationDriver",
    "SubscriptionDriver",
    "UdpCounters",
    "UdpEndpoint",
    "UdpEndpointStatistics",
    "now_ns",
    "open_publication_endpoint",
    "open_subscription_endpoint",
    "open_udp",
    "resolve",
]
