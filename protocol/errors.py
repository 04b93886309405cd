"""Error codes carried on the wire and the exceptions of the sans-IO protocol layer.

Two families, as in h11: a `LocalProtocolError` means *we* tried to do something the protocol forbids
(a bug in the caller); a `RemoteProtocolError` means the peer sent something we cannot accept. The
shell answers a remote error with an ERROR frame built from `code` and `frame_seq` and closes the
connection; msgpack's own exceptions never escape the codec.
"""

from __future__ import annotations

import enum

__all__ = [
    "ErrorCode",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "FrameTooLarge",
]


class ErrorCode(enum.IntEnum):
    """Codes in ERROR and CLOSE frames. Stable: clients match on them. Compared and encoded as integers;
    printed by name (`print(error.code)` printed 15 where the docs say UNAUTHORIZED, a tester)."""

    def __str__(self) -> str:
        return self.name

    NORMAL = 0  # CLOSE only: an orderly close
    MALFORMED_FRAME = 1  # not msgpack, wrong shape or wrong field type
    FRAME_TOO_LARGE = 2  # length prefix above the negotiated maximum
    UNEXPECTED_FRAME = 3  # valid frame, wrong state or wrong direction
    UNSUPPORTED_VERSION = 4
    MESSAGE_TOO_LARGE = 5  # one message body above max_message_size
    NOT_FOUND = 6  # unknown queue, exchange or subscription
    ALREADY_EXISTS = 7  # redeclared with different arguments
    INVALID_ARGUMENT = 8  # a declare/bind/subscribe argument is out of range
    QUEUE_FULL = 9  # hard limit reached with overflow policy `reject`
    CREDIT_VIOLATION = 10  # sent beyond granted byte credit by more than one message
    TRANSFER_ID_GAP = 11  # transfer ids must be contiguous on a connection
    UNKNOWN_DELIVERY = 12  # settle of a delivery tag that is not outstanding
    IDLE_TIMEOUT = 13  # the peer stopped answering noops
    SHUTDOWN = 14  # the broker is stopping
    UNAUTHORIZED = 15  # authentication or access control refused the operation
    INTERNAL_ERROR = 16
    RESOURCE_EXHAUSTED = 17  # the broker is over a broker-wide bound (memory watermark, connection limit)
    KEY_TOO_LONG = 18  # a routing or binding key over MAX_KEY_BYTES (protocol/limits.py)
    LIMIT_EXCEEDED = 19  # a frame over a per-frame limit of protocol/limits.py (entries, ranges, headers)
    UNROUTABLE = 20  # a transfer reached no queue, on a connection whose HELLO asked for it (CAPABILITY_MANDATORY)
    SEQUENCE_GAP = 21  # an idempotent producer's sequence above the next one the broker expects from its producer id
    CONNECTION_FORCED = 22  # an operator closed the connection (DELETE /api/connections/ID)


class ProtocolError(Exception):
    """Base of protocol errors; not raised directly."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.MALFORMED_FRAME, frame_seq: int | None = None):
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract: raise LocalProtocolError or RemoteProtocolError")
        super().__init__(message)
        self.code = code
        self.frame_seq = frame_seq


class LocalProtocolError(ProtocolError):
    """We attempted something the protocol forbids (wrong state, wrong direction, bad field)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something we cannot accept. `frame_seq` is its 1-based position on the connection."""


class FrameTooLarge(RemoteProtocolError):
    """A length prefix announced a frame above the maximum; raised before any of its body is buffered."""

    def __init__(self, length: int, limit: int, frame_seq: int | None = None):
        super().__init__(
            f"frame of {length} bytes exceeds max_frame_size {limit}", ErrorCode.FRAME_TOO_LARGE, frame_seq
        )
        self.length = length
        self.limit = limit
