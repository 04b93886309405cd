"""Per-frame and per-message limits of protocol version 1: what one frame may ask of its receiver.

A frame must cost its receiver time in proportion to its own size, and a small frame must not be able
to make the receiver walk state the sender built up. The frame size bounds bytes; these bound the
number of *items* a frame carries, because a broker's cost is per item (an empty message, a header, a
settle range) far more than per byte. Both ends check them: `decode_body` refuses a frame over a
limit with `LIMIT_EXCEEDED` (the connection closes), and a sender splits its work so that it never
builds such a frame (`Connection.send()` refuses one locally).

`MAX_KEY_BYTES` bounds routing and binding keys, as AMQP 0-9-1's shortstr does: a key over it is
refused with `KEY_TOO_LONG` (that message or request only; the connection stays open).
"""

from __future__ import annotations

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_ENTRIES_PER_FRAME",
    "MAX_RANGES_PER_FRAME",
    "MAX_HEADERS",
    "MAX_MAP_ITEMS",
]

MAX_KEY_BYTES = 256
"""Routing keys (TRANSFER entries) and binding keys (BIND, UNBIND), in UTF-8 bytes."""

MAX_ENTRIES_PER_FRAME = 1024
"""Messages in one TRANSFER or DELIVER frame (the SDK batches at most 256)."""

MAX_RANGES_PER_FRAME = 1024
"""Ranges in one SETTLE or COMPLETE frame; a sender with more splits them over several frames."""

MAX_HEADERS = 64
"""Headers on one message."""

MAX_MAP_ITEMS = 256
"""Items, at every depth together, in a map argument (DECLARE_QUEUE arguments, HELLO auth, OK result)."""
