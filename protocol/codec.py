"""Length-prefixed msgpack framing: a 4-byte big-endian length, then the msgpack body.

The decoder checks the length prefix against `max_frame_size` *before* buffering the body, so an
oversize frame costs four bytes of memory, not the frame. Its buffer never holds more than one
partial frame plus what the last read returned, and once `next_frame()` has returned None it holds
only the partial frame (`buffered` bytes of `next_frame_size`): decoded frames are released at once,
so a connection that sent one large frame and went quiet holds nothing. msgpack's exceptions are
caught here and turned into `RemoteProtocolError`; nothing else leaves this module.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import msgpack

from flowbroker.protocol.errors import ErrorCode, FrameTooLarge, LocalProtocolError, RemoteProtocolError
from flowbroker.protocol.frames import Frame, decode_body, frame_to_wire
from flowbroker.protocol.limits import (
    MAX_CONTROL_FRAME,
    MAX_ENTRIES_PER_FRAME,
    MAX_MAP_ITEMS,
    MAX_RANGES_PER_FRAME,
)

__all__ = ["FrameDecoder", "encode_frame", "encode_frames", "LENGTH_PREFIX", "DEFAULT_MAX_FRAME_SIZE"]

LENGTH_PREFIX = struct.Struct(">I")
_MAX_ARRAY_LEN = max(MAX_ENTRIES_PER_FRAME, MAX_RANGES_PER_FRAME)  # no frame has a longer array
DEFAULT_MAX_FRAME_SIZE = 8 * 1024 * 1024


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def encode_frame(frame: Frame) -> bytes:
    """One frame with its length prefix. Raises LocalProtocolError for values msgpack cannot carry."""
    try:
        body: bytes = msgpack.packb(frame_to_wire(frame), use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise LocalProtocolError(f"cannot encode {type(frame).__name__}: {exc}") from None
    return LENGTH_PREFIX.pack(len(body)) + body


def encode_frames(frames: list[Frame]) -> bytes:
    """Several frames in one buffer, for a single socket write."""
    return b"".join(encode_frame(f) for f in frames)


_DATA_FRAME_TYPES = frozenset({10, 18})  # TRANSFER, DELIVER: [fixarray header, type, ...]
_LARGE_FRAME = 1 << 20
"""Frames above this are decoded with a budget of containers: msgpack builds every object before
`decode_body` can look at them, so 8 MiB of nested empty arrays would cost ~240 ms of decoding. A
valid frame has at most 2 + MAX_ENTRIES_PER_FRAME arrays and one map per entry; with the budget, the
worst frame costs about what a 1 MiB one does (~30 ms). Small frames skip the hooks (0.24 us a message)."""
_CONTAINER_BUDGET = MAX_ENTRIES_PER_FRAME + 64


def _limit(text: str, seq: int) -> RemoteProtocolError:
    return RemoteProtocolError(f"{text} (protocol/limits.py)", ErrorCode.LIMIT_EXCEEDED, seq)


def _unpack(view: memoryview, seq: int) -> Any:
    """msgpack-decode one frame body, within the limits of protocol/limits.py."""
    hooks: dict[str, Any] = {}
    if len(view) > _LARGE_FRAME:
        spent = [0, 0]

        def budget(kind: int) -> Any:
            def hook(value: Any) -> Any:
                spent[kind] += 1
                if spent[kind] > _CONTAINER_BUDGET:
                    raise _ContainerBudget
                return value

            return hook

        hooks = {"list_hook": budget(0), "object_hook": budget(1)}
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_array_len=_MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_ITEMS,
            **hooks,
        )
    except _ContainerBudget:
        raise _limit(f"frame {seq} has more than {_CONTAINER_BUDGET} arrays or maps", seq) from None
    except ValueError as exc:
        over = _MSGPACK_LIMIT.search(str(exc))
        if over is not None:
            # A container longer than any frame may carry: refused while decoding, before the rest
            # of it is built. Said with the limits' names, not msgpack's words.
            count, kind = over.group(1), over.group(2)
            names = (f"the limit of {_MAX_ARRAY_LEN} (MAX_ENTRIES_PER_FRAME, MAX_RANGES_PER_FRAME)" if kind == "array"
                     else f"the limit of {MAX_MAP_ITEMS} (MAX_MAP_ITEMS)")
            raise _limit(f"frame {seq}: a{'n' if kind == 'array' else ''} {kind} of {count} items exceeds {names}",
                         seq) from None
        raise RemoteProtocolError(
            f"frame {seq} is not valid msgpack: {_why(exc)}", ErrorCode.MALFORMED_FRAME, seq
        ) from None
    except Exception as exc:  # msgpack raises many types: ExtraData, FormatError, StackError, ...
        raise RemoteProtocolError(
            f"frame {seq} is not valid msgpack: {_why(exc)}", ErrorCode.MALFORMED_FRAME, seq
        ) from None


_MSGPACK_SILENT = {
    "FormatError": "a byte that starts no msgpack object (0xc1, or a reserved type)",
    "StackError": "containers nested deeper than the decoder allows",
}
"""msgpack's exceptions that come without a text: the ERROR said "FormatError: " and nothing more."""


def _why(exc: Exception) -> str:
    name = type(exc).__name__
    return f"{name}: {str(exc) or _MSGPACK_SILENT.get(name, 'no reason given')}"


_MSGPACK_LIMIT = re.compile(r"(\d+) exceeds max_(array|map)_len")


class _ContainerBudget(Exception):
    pass


class FrameDecoder:
    """Incremental decoder: `feed()` bytes, then `next_frame()` until it returns None."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        if max_frame_size < 64:
            raise ValueError(f"max_frame_size must be at least 64 bytes, got {max_frame_size}")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._pos = 0
        self.frames_decoded = 0
        self._eof = False
        self.build_deliveries = True
        """False: DELIVER entries stay the validated msgpack lists (`decode_body`)."""
        self.build_transfers = True
        """False: TRANSFER entries stay the validated msgpack lists, six fields each (`decode_body`)."""

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded."""
        return len(self._buf) - self._pos

    @property
    def next_frame_size(self) -> int | None:
        """Bytes (length prefix included) of the frame at the head of the buffer; None before its prefix is in."""
        if len(self._buf) - self._pos < 4:
            return None
        return 4 + int(LENGTH_PREFIX.unpack_from(self._buf, self._pos)[0])

    def feed(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        if self._pos:
            # Compact before growing: keeps the buffer bounded by one partial frame plus one read.
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def discard(self) -> None:
        """Drop what the buffer holds: the transport is gone. The buffer still held the last read (up to
        a whole large frame, decoded or not) for as long as the decoder lived, and a connection's objects
        can outlive it in reference cycles until a full garbage collection (a tester: 6 MB per connection
        closed for a protocol error)."""
        self._buf = bytearray()
        self._pos = 0

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more data is needed.

        Raises FrameTooLarge or RemoteProtocolError (MALFORMED_FRAME, naming the frame's sequence
        number); after an error the decoder must not be used again.
        """
        buf, pos = self._buf, self._pos
        available = len(buf) - pos
        if available < 4:
            self._check_truncated(available)
            self._compact()
            return None
        (length,) = LENGTH_PREFIX.unpack_from(buf, pos)
        seq = self.frames_decoded + 1
        if length > self.max_frame_size:
            raise FrameTooLarge(length, self.max_frame_size, seq)
        if length == 0:
            raise RemoteProtocolError("empty frame", ErrorCode.MALFORMED_FRAME, seq)
        if length > MAX_CONTROL_FRAME and available >= 6 and buf[pos + 5] not in _DATA_FRAME_TYPES:
            raise _limit(f"frame {seq}: a frame of {length} bytes other than TRANSFER or DELIVER (over "
                         f"MAX_CONTROL_FRAME, {MAX_CONTROL_FRAME})", seq)
        if available < 4 + length:
            self._check_truncated(available)
            self._compact()
            return None
        start = pos + 4
        self._pos = start + length
        self.frames_decoded = seq
        view = memoryview(buf)[start : start + length]
        try:
            obj = _unpack(view, seq)
        finally:
            view.release()  # an exception's traceback must not keep the buffer exported (feed() resizes it)
        return decode_body(obj, seq, self.build_deliveries, self.build_transfers)

    def _compact(self) -> None:
        """Drop the frames already decoded (bytearray gives the memory back once it shrinks by half)."""
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0

    def _check_truncated(self, available: int) -> None:
        if self._eof and available:
            raise RemoteProtocolError(
                f"connection closed inside a frame ({available} bytes of it received)",
                ErrorCode.MALFORMED_FRAME,
                self.frames_decoded + 1,
            )
