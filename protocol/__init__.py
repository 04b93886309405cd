"""The flowbroker wire protocol without I/O: frames, codec, connection state machine, byte credit, and
the session protocol (the producer's ledger, the broker's transfer and delivery rules).

Nothing here reads a socket or a clock; the broker and the client SDK are trio shells around it.
See docs/protocol.md for every frame and field.
"""

from flowbroker.protocol.codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame, encode_frames
from flowbroker.protocol.connection import Connection, Role, State
from flowbroker.protocol.credit import (
    ACK_BYTES,
    ACK_INTERVAL_NS,
    ACK_RATIO,
    ReceiverWindow,
    SenderWindow,
    BufferState,
    CreditError,
    message_size,
)
from flowbroker.protocol.capabilities import CAPABILITY_DELIVER_BATCH, CAPABILITY_MANDATORY
from flowbroker.protocol.producer import ProducerLedger, ProducerLedgerStatistics
from flowbroker.protocol.resend import ResendLedger
from flowbroker.protocol.session import TransferReceiver, TransferReceiverStatistics
from flowbroker.protocol.delivery import DeliveryLedger, DeliveryLedgerStatistics
from flowbroker.protocol.errors import (
    ErrorCode,
    FrameTooLarge,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from flowbroker.protocol.frames import *  # noqa: F403
from flowbroker.protocol.frames import __all__ as _frames_all
from flowbroker.protocol.names import (
    ALL_DESTINATIONS,
    BUILTIN_EXCHANGES,
    DEFAULT_EXCHANGE,
    EXCHANGE_KINDS,
    QUEUE_ARGUMENTS,
    STOP_THRESHOLDS,
)
from flowbroker.protocol.ranges import IdSet, to_ranges

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "FrameDecoder",
    "encode_frame",
    "encode_frames",
    "Connection",
    "Role",
    "State",
    "ACK_BYTES",
    "ACK_INTERVAL_NS",
    "ACK_RATIO",
    "ReceiverWindow",
    "SenderWindow",
    "BufferState",
    "CreditError",
    "message_size",
    "CAPABILITY_DELIVER_BATCH",
    "CAPABILITY_MANDATORY",
    "ProducerLedger",
    "ProducerLedgerStatistics",
    "ResendLedger",
    "TransferReceiver",
    "TransferReceiverStatistics",
    "DeliveryLedger",
    "DeliveryLedgerStatistics",
    "ErrorCode",
    "FrameTooLarge",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    *_frames_all,
]

# The wire's names (protocol/names.py has them all, one by one) and the id ranges of COMPLETE and SETTLE.
__all__ += [
    "ALL_DESTINATIONS",
    "BUILTIN_EXCHANGES",
    "DEFAULT_EXCHANGE",
    "EXCHANGE_KINDS",
    "QUEUE_ARGUMENTS",
    "STOP_THRESHOLDS",
    "IdSet",
    "to_ranges",
]
