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

from collections.abc import Mapping

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_ENTRIES_PER_FRAME",
    "MAX_RANGES_PER_FRAME",
    "MAX_HEADERS",
    "MAX_MAP_ITEMS",
    "MAX_CONTROL_FRAME",
    "MAX_ERROR_TEXT",
    "message_wire_size",
    "text_bytes_bound",
    "utf8_len",
]

MAX_KEY_BYTES = 256
"""Routing keys (TRANSFER entries) and binding keys (BIND, UNBIND), in UTF-8 bytes."""

MAX_ENTRIES_PER_FRAME = 1024
"""Messages in one TRANSFER or DELIVER frame (the SDK batches at most 256)."""

MAX_RANGES_PER_FRAME = 1024
"""Ranges in one SETTLE or COMPLETE frame; a sender with more splits them over several frames."""

MAX_HEADERS = 64
"""Headers on one message."""

MAX_CONTROL_FRAME = 64 * 1024
"""Bytes in any frame but TRANSFER and DELIVER (refused from its first six bytes, before it is buffered)."""

MAX_MAP_ITEMS = 256
"""Items, at every depth together, in a map argument (DECLARE_QUEUE arguments, HELLO auth, OK result)."""

MAX_ERROR_TEXT = 1024
"""Characters of an ERROR's text and destination (and a CLOSE's reason): a longer one is cut, ending with "...". Texts
quote what the peer sent (a bad argument's value, a name), so without it a client that never reads
could have its connection hold 10,000 pending ERRORs of 64 KiB each."""


def utf8_len(text: str) -> int:
    """Bytes of `text` in UTF-8, without encoding it when it is ASCII-short enough to tell."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def text_bytes_bound(text: str) -> int:
    """`text`'s bytes from above, without encoding it: its length when ASCII, else 4 a character, a bound
    on its UTF-8 bytes and on what CPython keeps of each character alike (the journal's live-bytes
    estimate, the route cache's entries)."""
    return len(text) if text.isascii() else 4 * len(text)


def message_wire_size(exchange: str, routing_key: str, body: bytes, headers: Mapping[str, object] | None) -> int:
    """The bytes a message's own fields take on the wire: body, exchange, routing key, header keys and
    values (strings in UTF-8, 9 bytes for any other value, the most msgpack spends on a scalar).

    `max_message_size` bounds this, not only the body: a DELIVER carries every one of these fields, so a
    message whose headers filled its TRANSFER up to `max_frame_size` became a DELIVER 2 bytes over it,
    which every consumer of the queue refused, forever (it was requeued each time). With the whole
    message under `max_message_size` <= `max_frame_size` / 2, a DELIVER of it always fits.
    """
    size = len(body) + utf8_len(exchange) + utf8_len(routing_key)
    if headers:
        for key, value in headers.items():
            size += utf8_len(key) + (
                utf8_len(value) if type(value) is str else len(value) if type(value) is bytes else 9
            )
    return size
