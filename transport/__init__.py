"""Aeron-compatible UDP transport (docs/transport.md).

Sans-IO except for the ``flowbroker.transport.udp`` package (sockets, the trio tasks, the clock), which is
not imported here: importing ``flowbroker.transport`` costs no trio and no socket. The public surface is the
channel URI, the publication (sender) and the receive channel with its subscriptions and images (receiver),
the sans-IO duty cycles that drive them, their ``statistics()`` snapshots and the errors. Frames, term
buffers, positions, flow and congestion control are importable from their modules for those who need the
wire itself.
"""

from flowbroker.transport.channel import ChannelUri, parse_channel
from flowbroker.transport.drivers import OfferVerdict, ReceiverDuty, SenderDuty, offer_verdict
from flowbroker.transport.errors import ChannelUriError, EndpointClosedError, TransportError
from flowbroker.transport.image import Image, ImageState, ImageStatistics, MessageHandler
from flowbroker.transport.publication import (
    OfferResult,
    Publication,
    PublicationConfig,
    PublicationStatistics,
)
from flowbroker.transport.subscription import (
    ReceiveChannel,
    ReceiveChannelStatistics,
    ReceiverConfig,
    Subscription,
    SubscriptionStatistics,
)

__all__ = [
    "ChannelUri",
    "ChannelUriError",
    "EndpointClosedError",
    "Image",
    "ImageState",
    "ImageStatistics",
    "MessageHandler",
    "OfferResult",
    "OfferVerdict",
    "Publication",
    "PublicationConfig",
    "PublicationStatistics",
    "ReceiveChannel",
    "ReceiveChannelStatistics",
    "ReceiverConfig",
    "ReceiverDuty",
    "SenderDuty",
    "Subscription",
    "SubscriptionStatistics",
    "TransportError",
    "offer_verdict",
    "parse_channel",
]
