"""Byte credit in the manner of Couchbase DCP, with absolute positions so credit cannot stall.

Two halves of one buffer:

- `SenderWindow` lives with the *sender* of data (a producer client; the broker delivering to a
  consumer). It counts bytes sent (`position`) and bytes the receiver has acknowledged
  (`acked_position`), and says whether it may send: while the position is under its `limit`
  (acked_position + window), one message may overflow it (DCP's rule, so a message larger than the
  whole window still goes through when nothing is outstanding).
- `ReceiverWindow` lives with the *receiver*. It counts bytes received (`position`) and *consumed*
  (`consumed_position`: a transfer completed, a delivery settled or handled) and decides when to send a
  BUFFER_ACK: after 20 % of the window or 50 KiB, whichever is less, and every 5 s when anything is
  freed. It also re-advertises the absolute position periodically, so a lost acknowledgement costs at
  most one interval.

The vocabulary is Aeron's (position, limit, window) over DCP's mechanism, and every package uses
it: all positions are absolute byte counts since the connection opened. The acknowledgement carries
`acked_position`, the consumed position so far. `SenderWindow` takes the maximum of what it has seen,
so acknowledgements are idempotent and may be duplicated or reordered freely. No clocks: time
arrives as `now_ns`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from flowbroker.protocol.frames import BufferAck, Headers

__all__ = [
    "BufferState",
    "SenderWindow",
    "CreditError",
    "ReceiverWindow",
    "message_size",
    "ACK_RATIO",
    "ACK_BYTES",
    "ACK_INTERVAL_NS",
    "HEADER_OVERHEAD",
    "MESSAGE_OVERHEAD",
    "text_size",
]

ACK_RATIO = 0.2
ACK_BYTES = 50 * 1024
ACK_INTERVAL_NS = 5_000_000_000
MESSAGE_OVERHEAD = 512
"""Bytes charged per message beyond its body and header bytes, so that the bytes that credit, consumer
buffers and queue watermarks count approximate the broker's memory, even for small messages.

It covers what a queued message costs the broker beyond its body: its `Message` object, the object
headers of its body and routing key, its slot in the queue and, while it is delivered-but-unsettled or
holds its producer's completion, the unsettled-map entry or the `HeldTransfer`. Measured with
tracemalloc on the in-memory core (`benchmarks/message_cost.py`, bodies of 16 B to 64 KiB, no
headers): about 270 bytes ready, 385-420 unsettled or held (RSS growth 220-290 and 350-440). Headers
have their own charge, `HEADER_OVERHEAD`.

Part of protocol version 1: both ends must compute the same `message_size`, or they disagree about
every credit position (a CREDIT_VIOLATION, or an acknowledgement of bytes never sent)."""


HEADER_OVERHEAD = 128
"""Bytes charged per header beyond its key and value lengths, and once more for the headers' dict.

Each header is two more objects in the broker (its key and value: ~50 bytes of object header each) and
a slot in a dict, which itself costs ~100-200 bytes. Measured with `benchmarks/message_cost.py`: two
short headers cost 206-231 bytes beyond their key and value lengths; charged 3 x 128 = 384. Part of
protocol version 1, like `MESSAGE_OVERHEAD`."""


def text_size(text: str) -> int:
    """What a header's string is charged: its length when ASCII (a byte a character in memory and on the
    wire), else four bytes a character plus its UTF-8 bytes. CPython keeps a string at 1, 2 or 4 bytes a
    character, set by its widest one, and a string encoded for a DELIVER keeps its UTF-8 copy too: 5 bytes
    a character for ASCII with one emoji in it, which twice the UTF-8 bytes (the rule of session 39)
    charged 2 (a tester: 1.9 times the memory bound). Counted by code points before that, a header of 10^6
    emoji charged 1 MB took 8 MB."""
    return len(text) if text.isascii() else 4 * len(text) + len(text.encode("utf-8", "surrogatepass"))


def message_size(body: bytes, headers: Headers | None = None) -> int:
    """The bytes a message is charged against credit and queue size, on both ends of a connection."""
    size = len(body) + MESSAGE_OVERHEAD
    if headers:
        size += HEADER_OVERHEAD  # the dict
        for key, value in headers.items():
            size += HEADER_OVERHEAD + text_size(key) + (
                text_size(value) if isinstance(value, str) else len(value) if isinstance(value, bytes) else 8)
    return size


class CreditError(ValueError):
    """An acknowledgement or size that cannot be right (acknowledging bytes never sent, a negative size)."""


class BufferState(enum.Enum):
    DISABLED = "disabled"  # buffer size 0: no flow control
    SPACE_AVAILABLE = "space-available"
    FULL = "full"


class SenderWindow:
    """Sender side of a byte buffer: the position sent vs the position the receiver acknowledged."""

    __slots__ = ("window", "position", "acked_position")

    def __init__(self, window: int = 0):
        if window < 0:
            raise CreditError(f"window must be >= 0, got {window}")
        self.window = window
        self.position = 0
        self.acked_position = 0

    @property
    def outstanding(self) -> int:
        """Bytes sent and not yet acknowledged. Never negative."""
        return self.position - self.acked_position

    @property
    def state(self) -> BufferState:
        if self.window == 0:
            return BufferState.DISABLED
        return BufferState.SPACE_AVAILABLE if self.outstanding < self.window else BufferState.FULL

    @property
    def limit(self) -> int:
        """The absolute position the sender may start a message below (acked + buffer size)."""
        return self.acked_position + self.window

    def may_send(self) -> bool:
        """True while any space is left (or flow control is off): the next message may overflow."""
        return self.window == 0 or self.position < self.acked_position + self.window

    def on_sent(self, nbytes: int) -> None:
        self.position += nbytes

    def on_ack(self, acked_position: int) -> int:
        """Apply an acknowledgement; returns the bytes it newly freed (0 for a stale or duplicate one)."""
        if acked_position > self.position:
            raise CreditError(f"acknowledged position {acked_position} is beyond the {self.position} bytes sent")
        freed = acked_position - self.acked_position
        if freed <= 0:
            return 0
        self.acked_position = acked_position
        return freed

    def resize(self, window: int) -> None:
        """Change the buffer size. Shrinking below what is in flight loses nothing: the sender just
        waits until acknowledgements bring it under the new size. 0 turns flow control off."""
        if window < 0:
            raise CreditError(f"window must be >= 0, got {window}")
        self.window = window


@dataclass(slots=True)
class ReceiverWindow:
    """Receiver side: the positions received and consumed, and when to return a BUFFER_ACK.

    `opaque` is 0 for the connection-level buffer or a subscription id. `window` is the size the
    sender was told; 0 means flow control is off and no acknowledgements are due. `position` counts
    bytes received and `limit` is the highest limit ever granted (acked_position + window, never
    lowered by a shrink, which cannot turn bytes the sender was already allowed into a violation; only the
sender's BUFFER_LIMIT lowers it, see protocol/session.py); the shell
    that checks incoming data against them keeps them up to date.
    """

    window: int
    opaque: int = 0
    ack_ratio: float = ACK_RATIO
    ack_bytes: int = ACK_BYTES
    interval_ns: int = ACK_INTERVAL_NS
    position: int = 0
    consumed_position: int = 0
    acked_position: int = 0
    limit: int = -1
    last_sent_ns: int = 0

    def __post_init__(self) -> None:
        if self.limit < 0:
            self.limit = self.window

    @property
    def pending(self) -> int:
        """Consumed bytes not yet acknowledged to the sender."""
        return self.consumed_position - self.acked_position

    def threshold(self) -> int:
        return max(1, min(int(self.window * self.ack_ratio), self.ack_bytes))

    def on_consumed(self, nbytes: int, now_ns: int) -> BufferAck | None:
        """Count consumed bytes; returns an acknowledgement when one is due."""
        self.consumed_position += nbytes
        if self.window and self.pending >= self.threshold():
            return self._ack(now_ns)
        return None

    def poll(self, now_ns: int) -> BufferAck | None:
        """Timer tick: acknowledge anything pending after the interval, and re-advertise the absolute
        position once per interval even when nothing changed (a lost ack then cannot stall the sender)."""
        if not self.window or now_ns - self.last_sent_ns < self.interval_ns:
            return None
        return self._ack(now_ns)

    def flush(self, now_ns: int) -> BufferAck | None:
        """Acknowledge whatever is pending now (used when the buffer is resized or a sender is blocked)."""
        if not self.window or not self.pending:
            return None
        return self._ack(now_ns)

    def _ack(self, now_ns: int) -> BufferAck:
        freed = self.pending
        self.acked_position = self.consumed_position
        self.last_sent_ns = now_ns
        return BufferAck(self.opaque, freed, self.consumed_position)
