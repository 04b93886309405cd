"""The flowbroker client SDK.

Trio: `async with await flowbroker.client.connect(url) as conn:` then `conn.producer(...)` and
`conn.consumer(...)`. Plain Python (threads, scripts, Spark executors): `flowbroker.client.blocking`.
Every wait takes a deadline; every error is a `FlowbrokerError`. See docs/client.md.
"""

from flowbroker.client.connection import Connection, ConnectionStatistics
from flowbroker.client.handshake import connect
from flowbroker.client.credentials import Credentials
from flowbroker.client.consumer import Consumer, ConsumerStatistics, ConsumerStats, Message
from flowbroker.client.errors import (
    AuthenticationError,
    AlreadySettled,
    BrokerConnectionError,
    ConnectionClosed,
    FlowbrokerError,
    FlowControlled,
    FlowControlTimeout,
    HandshakeError,
    InvalidCredentials,
    KeyTooLong,
    MessageTooLarge,
    NotFound,
    ProtocolViolation,
    PublishError,
    PublishFailures,
    QueueFull,
    ReceiveTimeout,
    ConsumerClosed,
    RequestError,
    RequestTimeout,
    TooManyHeaders,
    SequenceGap,
    Unroutable,
)
from flowbroker.client.flow import ALL_DESTINATIONS, FlowEvent, FlowEvents, FlowState, FlowStop
from flowbroker.client.producer import Producer, ProducerStatistics, ProducerStats
from flowbroker.client.url import DEFAULT_URL, BrokerAddress, parse_url
from flowbroker.protocol import ErrorCode, Outcome

__all__ = [
    "connect",
    "Credentials",
    "Connection",
    "ConnectionStatistics",
    "Producer",
    "ProducerStatistics",
    "ProducerStats",
    "Consumer",
    "ConsumerStatistics",
    "ConsumerStats",
    "Message",
    "FlowState",
    "FlowStop",
    "FlowEvent",
    "FlowEvents",
    "ALL_DESTINATIONS",
    "DEFAULT_URL",
    "BrokerAddress",
    "parse_url",
    "ErrorCode",
    "Outcome",
    "FlowbrokerError",
    "BrokerConnectionError",
    "HandshakeError",
    "InvalidCredentials",
    "AuthenticationError",
    "ConnectionClosed",
    "ProtocolViolation",
    "FlowControlled",
    "FlowControlTimeout",
    "PublishError",
    "QueueFull",
    "MessageTooLarge",
    "KeyTooLong",
    "TooManyHeaders",
    "NotFound",
    "Unroutable",
    "SequenceGap",
    "PublishFailures",
    "RequestError",
    "RequestTimeout",
    "ReceiveTimeout",
    "ConsumerClosed",
    "AlreadySettled",
]
