"""Three-partition term buffers: the publication's appender and the image's rebuilder and reader.

A stream lives in a log of three terms of ``term_length`` bytes each, used round-robin (term id modulo 3).
The bytes in a term are exactly the bytes on the wire: frames at 32-byte aligned term offsets, each
``align(frame_length)`` long, a PAD frame filling the end of a term a message did not fit in. So the
sender transmits straight out of the term (``scan_for_availability``), the receiver copies a datagram in
at its term offset (``TermRebuilder.insert``), and "frame_length == 0" means "not here yet": that is how
the receiver finds gaps to NAK and where a reader stops.

A partition is reused for term N+3, so it must be zeroed before that. Both classes zero the partition they
move into (everything two terms behind the new term) and offer ``clean_to(position)`` for the owner to clean
earlier, behind its sender or slowest subscriber, as Aeron's conductor does.

Sans-IO: no sockets, no clock. The publication/image state machines (flow control, NAK timing) live in
their own modules and call these.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from flowbroker.transport.frames import (
    BEGIN_FLAG,
    CURRENT_VERSION,
    DATA_HEADER,
    DATA_HEADER_LENGTH,
    END_FLAG,
    FRAME_ALIGNMENT,
    MAX_MTU,
    MIN_MTU,
    UNFRAGMENTED,
    FrameType,
    write_data_header,
)
from flowbroker.transport.positions import (
    PARTITION_COUNT,
    check_term_length,
    compute_max_message_length,
    compute_term_id_from_position,
    term_count,
    wrap_int32,
)

__all__ = [
    "Buffer",
    "FragmentAssembler",
    "FragmentHandler",
    "Gap",
    "MessageHandler",
    "TermAppender",
    "TermLog",
    "TermRebuilder",
    "check_mtu",
    "scan_for_availability",
]

_INT32: Final = struct.Struct("<i")
_TYPE: Final = struct.Struct("<H")
_HEADER: Final = struct.Struct("<iBBH")
_TYPE_OFFSET: Final = 6
_ALIGN_MASK: Final = FRAME_ALIGNMENT - 1
_ZEROS: Final = memoryview(bytes(64 * 1024))  # slices of a view copy nothing (bytes slices would)
_PAD_TYPE: Final = int(FrameType.PAD)  # plain ints: enum attribute lookups cost on the hot path
_DATA_TYPE: Final = int(FrameType.DATA)
_DATA_HEADER_PACK: Final = DATA_HEADER.pack_into
_DATA_HEADER_AND_BYTE: Final = struct.Struct(DATA_HEADER.format + "B")  # a header and a one-byte envelope
_UNFRAGMENTED: Final = int(UNFRAGMENTED)

Buffer = bytes | bytearray | memoryview
FragmentHandler = Callable[[memoryview, int], None]
"""Called with (payload, flags) per DATA fragment; the payload aliases the term until it is cleaned."""
MessageHandler = Callable[[memoryview | bytes], object]
"""Called with each whole message; a true result stops the read after it (Aeron's controlled poll, BREAK)."""


def _aligned(length: int) -> int:
    return (length + _ALIGN_MASK) & ~_ALIGN_MASK


def check_mtu(mtu: int) -> None:
    """Raise ValueError unless ``mtu`` is a multiple of 32 in [32, 65504] (the driver's rule)."""
    if not MIN_MTU <= mtu <= MAX_MTU or mtu % FRAME_ALIGNMENT:
        raise ValueError(f"mtu {mtu} must be a multiple of {FRAME_ALIGNMENT} in [{MIN_MTU}, {MAX_MTU}]")


class TermLog:
    """Three partitions of one stream plus the geometry to find a position in them."""

    __slots__ = ("term_length", "initial_term_id", "position_bits_to_shift", "_log", "partitions",
                 "clean_position")

    def __init__(self, term_length: int, initial_term_id: int, clean_position: int = 0) -> None:
        check_term_length(term_length)
        self.term_length = term_length
        self.initial_term_id = wrap_int32(initial_term_id)
        self.position_bits_to_shift = term_length.bit_length() - 1
        self._log = bytearray(PARTITION_COUNT * term_length)
        view = memoryview(self._log)
        self.partitions: tuple[memoryview, ...] = tuple(
            view[i * term_length:(i + 1) * term_length] for i in range(PARTITION_COUNT)
        )
        # Everything below clean_position is known to be zero or already reusable.
        self.clean_position = clean_position

    def partition_for_term(self, term_id: int) -> memoryview:
        return self.partitions[term_count(term_id, self.initial_term_id) % PARTITION_COUNT]

    def partition_for_position(self, position: int) -> memoryview:
        return self.partitions[(position >> self.position_bits_to_shift) % PARTITION_COUNT]

    def term_id_for_position(self, position: int) -> int:
        return compute_term_id_from_position(position, self.position_bits_to_shift, self.initial_term_id)

    def term_offset_for_position(self, position: int) -> int:
        return position & (self.term_length - 1)

    def position_of(self, term_id: int, term_offset: int) -> int:
        return (term_count(term_id, self.initial_term_id) << self.position_bits_to_shift) + term_offset

    def clean_to(self, position: int) -> None:
        """Zero the log from ``clean_position`` up to ``position`` so its partitions can be reused."""
        position = max(position, self.clean_position)
        start = self.clean_position
        # More than a whole log behind: only the last PARTITION_COUNT terms matter.
        start = max(start, position - PARTITION_COUNT * self.term_length)
        mask = self.term_length - 1
        while start < position:
            term = self.partition_for_position(start)
            offset = start & mask
            length = min(position - start, self.term_length - offset)
            end = offset + length
            while offset < end:
                chunk = min(end - offset, len(_ZEROS))
                term[offset:offset + chunk] = _ZEROS[:chunk]
                offset += chunk
            start += length
        self.clean_position = position


@dataclass(frozen=True, slots=True)
class Gap:
    """A hole in the rebuilt term: what a NAK asks for."""

    term_id: int
    term_offset: int
    length: int


class TermAppender(TermLog):
    """Publication side: writes messages as DATA frames at the tail, fragmenting and padding as needed.

    ``position`` is the tail: where the next frame will start. The caller (the publication) bounds how far
    the tail may run ahead of the sender with ``space_needed`` before it appends.
    """

    __slots__ = ("session_id", "stream_id", "mtu", "max_payload_length", "max_message_length",
                 "term_id", "term_offset", "_term_count", "_term")

    def __init__(
        self,
        term_length: int,
        initial_term_id: int,
        session_id: int,
        stream_id: int,
        mtu: int,
        active_term_id: int | None = None,
        term_offset: int = 0,
    ) -> None:
        check_mtu(mtu)
        active = initial_term_id if active_term_id is None else active_term_id
        count = term_count(active, initial_term_id)
        if count < 0:
            raise ValueError(f"active term id {active} is before initial term id {initial_term_id}")
        if not 0 <= term_offset <= term_length or term_offset & _ALIGN_MASK:
            raise ValueError(f"term offset {term_offset} is not an aligned offset inside the term")
        begin = count * term_length
        super().__init__(term_length, initial_term_id, clean_position=begin)
        self.session_id = session_id
        self.stream_id = stream_id
        self.mtu = mtu
        self.max_payload_length = mtu - DATA_HEADER_LENGTH
        self.max_message_length = compute_max_message_length(term_length)
        self.term_id = wrap_int32(active)
        self.term_offset = term_offset
        self._term_count = count
        self._term = self.partition_for_term(self.term_id)

    @property
    def position(self) -> int:
        return (self._term_count << self.position_bits_to_shift) + self.term_offset

    def frame_space(self, length: int) -> int:
        """Term bytes a message of ``length`` occupies as frames (without any end-of-term padding)."""
        if length <= self.max_payload_length:
            return _aligned(length + DATA_HEADER_LENGTH)
        full, last = divmod(length, self.max_payload_length)
        space = full * self.mtu
        if last:
            space += _aligned(last + DATA_HEADER_LENGTH)
        return space

    def space_needed(self, length: int) -> int:
        """How far ``append(length)`` will move the tail, padding to the next term included."""
        space = self.frame_space(length)
        if self.term_offset + space > self.term_length:
            return self.term_length - self.term_offset + space
        return space

    def append(self, message: Buffer, reserved_value: int = 0) -> int:
        """Write ``message`` at the tail and return the new tail position.

        A message that does not fit in the rest of the term makes the term end with a PAD frame and goes
        at the start of the next term (all fragments of a message stay in one term, as in Aeron).
        Raises ValueError for a message over ``max_message_length`` (a caller error, not back pressure).
        """
        length = len(message)
        if length > self.max_message_length:
            raise ValueError(
                f"message length {length} exceeds max message length {self.max_message_length}"
            )
        if self.term_offset + self.frame_space(length) > self.term_length:
            self.pad_and_rotate()
        term = self._term
        offset = self.term_offset
        if length <= self.max_payload_length:
            frame_length = length + DATA_HEADER_LENGTH
            term[offset + DATA_HEADER_LENGTH:offset + frame_length] = message
            write_data_header(term, offset, frame_length, UNFRAGMENTED, offset,
                              self.session_id, self.stream_id, self.term_id, reserved_value)
            self.term_offset = offset + ((frame_length + _ALIGN_MASK) & ~_ALIGN_MASK)
            return (self._term_count << self.position_bits_to_shift) + self.term_offset
        view = memoryview(message)
        chunk_size = self.max_payload_length
        remaining = length
        src = 0
        flags = BEGIN_FLAG
        while remaining > 0:
            chunk = min(remaining, chunk_size)
            remaining -= chunk
            if remaining == 0:
                flags |= END_FLAG
            frame_length = chunk + DATA_HEADER_LENGTH
            term[offset + DATA_HEADER_LENGTH:offset + frame_length] = view[src:src + chunk]
            write_data_header(term, offset, frame_length, flags, offset,
                              self.session_id, self.stream_id, self.term_id, reserved_value)
            src += chunk
            offset += _aligned(frame_length)
            flags = 0
        self.term_offset = offset
        return self.position

    def append_unfragmented(self, message: Buffer, limit_position: int, max_position: int,
                            reserved_value: int = 0) -> int:
        """The hot path of ``append``: a message that fits in one frame and in the rest of the active term,
        appended only if the tail is below ``limit_position`` and its frame ends below ``max_position``;
        returns the new tail, or 0 when it is not that case (the caller then takes the general path, which
        fragments, pads, refuses or reports back pressure).

        One header write (a single ``pack_into``) and one payload copy; the bytes are exactly ``append``'s.
        """
        length = len(message)
        if length > self.max_payload_length:
            return 0
        offset = self.term_offset
        start = (self._term_count << self.position_bits_to_shift) + offset
        frame_length = length + DATA_HEADER_LENGTH
        aligned = (frame_length + _ALIGN_MASK) & ~_ALIGN_MASK
        if start >= limit_position or offset + aligned > self.term_length or start + frame_length >= max_position:
            return 0
        term = self._term
        term[offset + DATA_HEADER_LENGTH:offset + frame_length] = message
        _DATA_HEADER_PACK(term, offset, frame_length, CURRENT_VERSION, _UNFRAGMENTED, _DATA_TYPE, offset,
                          self.session_id, self.stream_id, self.term_id, reserved_value)
        self.term_offset = offset + aligned
        return start + aligned

    def append_unfragmented_parts(self, head: Buffer, body: Buffer, limit_position: int, max_position: int,
                                  reserved_value: int = 0) -> int:
        """``append_unfragmented`` of the message ``head + body`` without joining them first: each part is
        copied once, straight into the term (a broker's delivery is a small envelope and a large body;
        joining them copied the body twice). Same conditions, same return, same bytes."""
        head_length = len(head)
        length = head_length + len(body)
        if length > self.max_payload_length:
            return 0
        offset = self.term_offset
        start = (self._term_count << self.position_bits_to_shift) + offset
        frame_length = length + DATA_HEADER_LENGTH
        aligned = (frame_length + _ALIGN_MASK) & ~_ALIGN_MASK
        if start >= limit_position or offset + aligned > self.term_length or start + frame_length >= max_position:
            return 0
        term = self._term
        body_offset = offset + DATA_HEADER_LENGTH + head_length
        term[offset + DATA_HEADER_LENGTH:body_offset] = head
        term[body_offset:offset + frame_length] = body
        _DATA_HEADER_PACK(term, offset, frame_length, CURRENT_VERSION, _UNFRAGMENTED, _DATA_TYPE, offset,
                          self.session_id, self.stream_id, self.term_id, reserved_value)
        self.term_offset = offset + aligned
        return start + aligned

    def append_many(self, messages: list[bytes], head: bytes, limit_position: int, max_position: int,
                    reserved_value: int = 0) -> int:
        """Append each of ``messages`` behind ``head`` (its first bytes: an envelope), one unfragmented
        frame each, all or none: the batch must fit in the rest of the active term, every frame in one
        frame, the last one must start below ``limit_position`` (the rule ``offer`` applies to each
        message) and end below ``max_position``. Returns the new tail, or 0 when that is not the case
        (nothing written: the caller appends them one by one on the general path).

        The bytes are exactly those of ``append(head + message)`` for each in turn: a producer's burst
        claimed once and written in one loop (a 33-byte header and envelope byte in one ``pack_into``
        when ``head`` is one byte), without a call and a concatenated copy per message."""
        if not messages:
            return self.position
        hlen = len(head)
        max_payload = self.max_payload_length - hlen
        offset = self.term_offset
        total = 0
        last = 0
        for message in messages:
            length = len(message)
            if length > max_payload:
                return 0
            last = total
            total += (length + hlen + DATA_HEADER_LENGTH + _ALIGN_MASK) & ~_ALIGN_MASK
        start = (self._term_count << self.position_bits_to_shift) + offset
        last_length = len(messages[-1]) + hlen + DATA_HEADER_LENGTH
        if (offset + total > self.term_length or start + last >= limit_position
                or start + last + last_length >= max_position):
            return 0
        term = self._term
        session_id, stream_id, term_id = self.session_id, self.stream_id, self.term_id
        if hlen == 1:
            pack = _DATA_HEADER_AND_BYTE.pack_into
            byte = head[0]
            for message in messages:
                frame_length = len(message) + 33
                pack(term, offset, frame_length, CURRENT_VERSION, _UNFRAGMENTED, _DATA_TYPE, offset,
                     session_id, stream_id, term_id, reserved_value, byte)
                term[offset + 33:offset + frame_length] = message
                offset += (frame_length + _ALIGN_MASK) & ~_ALIGN_MASK
        else:
            pack = _DATA_HEADER_PACK
            body_at = DATA_HEADER_LENGTH + hlen
            for message in messages:
                frame_length = len(message) + body_at
                pack(term, offset, frame_length, CURRENT_VERSION, _UNFRAGMENTED, _DATA_TYPE, offset,
                     session_id, stream_id, term_id, reserved_value)
                term[offset + DATA_HEADER_LENGTH:offset + body_at] = head
                term[offset + body_at:offset + frame_length] = message
                offset += (frame_length + _ALIGN_MASK) & ~_ALIGN_MASK
        self.term_offset = offset
        return start + total

    def needs_rotation(self, length: int) -> bool:
        """True if a message of ``length`` does not fit in the rest of the active term.

        A publication that wants Aeron's ADMIN_ACTION behaviour calls ``pad_and_rotate`` itself when this is
        true and reports ADMIN_ACTION; ``append`` would otherwise pad and rotate on its own.
        """
        return self.term_offset + self.frame_space(length) > self.term_length

    def pad_and_rotate(self) -> int:
        """End the active term with a PAD frame (if any room is left), move to the next; return the tail."""
        offset = self.term_offset
        if offset < self.term_length:
            write_data_header(self._term, offset, self.term_length - offset, UNFRAGMENTED, offset,
                              self.session_id, self.stream_id, self.term_id, 0, FrameType.PAD)
        self._term_count += 1
        self.term_id = wrap_int32(self.term_id + 1)
        self.term_offset = 0
        # The partition we move into last held the term two before the previous one: zero it.
        begin = self._term_count * self.term_length
        self.clean_to(begin - 2 * self.term_length)
        self._term = self.partition_for_term(self.term_id)
        return self.position


def scan_for_availability(term: memoryview, term_offset: int, max_length: int) -> tuple[int, int]:
    """Bytes the sender may put in one datagram from ``term_offset``, and the padding it then skips.

    Walks whole frames while they fit in ``max_length`` (the MTU, or less of a window); stops after a PAD,
    of which only the 32-byte header is sent (the receiver learns the rest from its frame_length). Returns
    ``(available, padding)``: send ``term[term_offset:term_offset + available]``, then advance the sender
    position by ``available + padding``.
    """
    limit = min(max_length, len(term) - term_offset)
    available = 0
    padding = 0
    unpack = _HEADER.unpack_from
    while available < limit:
        frame_length, _version, _flags, frame_type = unpack(term, term_offset + available)
        if frame_length <= 0:
            break
        aligned = (frame_length + _ALIGN_MASK) & ~_ALIGN_MASK
        if frame_type == _PAD_TYPE:
            padding = aligned - DATA_HEADER_LENGTH
            aligned = DATA_HEADER_LENGTH
        if available + aligned > limit:
            padding = 0
            break
        available += aligned
        if padding:
            break
    return available, padding


class TermRebuilder(TermLog):
    """Image side: datagrams inserted at their term offset rebuild the publication's log.

    The log holds the positions ``[clean_position, clean_position + 3 * term_length)``: below
    ``clean_position`` the partitions have been zeroed for reuse, and a byte further ahead would land on
    data of three terms earlier that nobody has released. ``insert`` refuses (and counts in
    ``out_of_range``) any datagram outside that range; it never cleans on its own, so a datagram however
    far ahead cannot zero data a subscriber has not read. The owner cleans with ``clean_to`` behind its
    slowest reader (the image: one term behind the consumption position), and its window (Aeron's
    ``term_length / 2`` past the last SM) keeps every legitimate datagram inside the range.
    """

    __slots__ = ("out_of_range",)

    def __init__(self, term_length: int, initial_term_id: int, join_position: int = 0) -> None:
        mask = term_length - 1
        super().__init__(term_length, initial_term_id, clean_position=join_position & ~mask)
        self.out_of_range = 0

    def insert(self, term_id: int, term_offset: int, datagram: Buffer) -> bool:
        """Copy a validated DATA/PAD datagram into its term; False if that slot was already filled.

        Like Aeron, a slot whose frame_length is non-zero is not overwritten: duplicates and retransmits of
        data already here cost nothing. (One copy, frame_length included: nothing reads concurrently.)
        A datagram outside the log's range (see the class) is refused: False, counted in ``out_of_range``.
        """
        count = (term_id - self.initial_term_id) & 0xFFFF_FFFF
        if count & 0x8000_0000:
            count -= 1 << 32
        n = len(datagram)
        position = (count << self.position_bits_to_shift) + term_offset
        if (
            count < 0
            or position < self.clean_position
            or position + n > self.clean_position + PARTITION_COUNT * self.term_length
            or term_offset + n > self.term_length
        ):
            self.out_of_range += 1
            return False
        term = self.partitions[count % PARTITION_COUNT]
        if n < 4 or term[term_offset] or _INT32.unpack_from(term, term_offset)[0] != 0:
            return False
        term[term_offset:term_offset + n] = datagram
        return True

    def rebuild_position(self, position: int, limit_position: int) -> int:
        """Advance ``position`` over contiguous frames up to ``limit_position`` (within its term)."""
        term = self.partition_for_position(position)
        mask = self.term_length - 1
        offset = position & mask
        limit = min(offset + (limit_position - position), self.term_length)
        unpack = _INT32.unpack_from
        start = offset
        while offset < limit:
            frame_length = unpack(term, offset)[0]
            if frame_length <= 0:
                break
            offset += (frame_length + _ALIGN_MASK) & ~_ALIGN_MASK
        return position + (offset - start)

    def scan_for_gap(self, rebuild_position: int, hwm_position: int) -> tuple[int, Gap | None]:
        """New rebuild position, and the first gap before ``hwm_position`` in the rebuild term, if any.

        The contiguous walk continues across term ends, so a gap is only reported where a slot is empty.
        """
        mask = self.term_length - 1
        new_position = rebuild_position
        while True:
            walked = self.rebuild_position(new_position, hwm_position)
            crossed_term_end = walked > new_position and walked & mask == 0
            new_position = walked
            if new_position >= hwm_position or not crossed_term_end:
                break
        if new_position >= hwm_position:
            return new_position, None
        gap_offset = new_position & mask
        term_end_position = new_position - gap_offset + self.term_length
        limit = min(hwm_position, term_end_position) - new_position + gap_offset
        term = self.partition_for_position(new_position)
        offset = gap_offset + FRAME_ALIGNMENT
        unpack = _INT32.unpack_from
        while offset < limit and unpack(term, offset)[0] == 0:
            offset += FRAME_ALIGNMENT
        end = min(offset, limit)
        return new_position, Gap(self.term_id_for_position(new_position), gap_offset, end - gap_offset)

    def read(
        self, position: int, limit_position: int, handler: FragmentHandler, fragment_limit: int = 1 << 30
    ) -> tuple[int, int]:
        """Deliver contiguous DATA fragments from ``position``; return (new position, fragments read).

        Stops at the first missing frame, at ``limit_position``, at the end of the term, or after
        ``fragment_limit`` fragments. PAD frames are skipped (they advance the position, deliver nothing).
        """
        new_position, fragments, _, _ = self.read_messages(position, limit_position, None, handler, fragment_limit)
        return new_position, fragments

    def read_messages(
        self, position: int, limit_position: int, whole: MessageHandler | None, fragment: FragmentHandler,
        fragment_limit: int = 1 << 30,
    ) -> tuple[int, int, int, bool]:
        """``read``, with unfragmented messages handed straight to ``whole`` and only the fragments of
        fragmented ones to ``fragment`` (the assembler): one call per message on the hot path instead of
        three. ``whole`` None hands every fragment to ``fragment`` (that is ``read``). A true result from
        ``whole`` stops the read after that message (a handler that bounds what one poll takes by what the
        messages hold, not by their count: the broker's ingress). Returns (new position, fragments read,
        messages handed to ``whole``, stopped by ``whole``)."""
        term = self.partition_for_position(position)
        mask = self.term_length - 1
        offset = position & mask
        start = offset
        limit = min(offset + (limit_position - position), self.term_length)
        fragments = 0
        wholes = 0
        header = _HEADER.unpack_from
        while offset < limit and fragments < fragment_limit:
            frame_length, _v, flags, ftype = header(term, offset)
            if frame_length <= 0:
                break
            aligned = (frame_length + _ALIGN_MASK) & ~_ALIGN_MASK
            if ftype != _PAD_TYPE:
                if offset + aligned > limit:
                    break
                fragments += 1
                if whole is not None and flags & _UNFRAGMENTED == _UNFRAGMENTED:
                    wholes += 1
                    if whole(term[offset + DATA_HEADER_LENGTH:offset + frame_length]):
                        offset += aligned
                        return position + (offset - start), fragments, wholes, True
                else:
                    fragment(term[offset + DATA_HEADER_LENGTH:offset + frame_length], flags)
            offset += aligned
        return position + (offset - start), fragments, wholes, False


class FragmentAssembler:
    """Joins B..E fragments into whole messages for one subscription (Aeron's FragmentAssembler).

    An unfragmented message is passed on without a copy (a memoryview into the term); a fragmented one as
    bytes. Fragments seen without their BEGIN (joined mid-message) are dropped.

    A message whose fragments pass ``max_length`` payload bytes (the image's: what a publication of its
    term length may send) is not reassembled further: its buffer goes at once, its later fragments are
    only counted, and at its END (or a new BEGIN) ``on_oversized`` gets its payload length instead of the
    handler getting the message. A peer writing its own frames could otherwise make one message as large
    as it liked, held whole in memory: a tester's 1,900,000 bytes in a 2 MiB term reached a queue.
    """

    __slots__ = ("_handler", "_buffer", "_max_length", "_on_oversized", "_skipped")

    def __init__(self, handler: MessageHandler, max_length: int | None = None,
                 on_oversized: Callable[[int], object] | None = None) -> None:
        self._handler = handler
        self._buffer: bytearray | None = None
        self._max_length = (1 << 62) if max_length is None else max_length
        self._on_oversized = on_oversized
        self._skipped = -1  # payload bytes so far of the oversized message being skipped; -1: none

    def checkpoint(self) -> tuple[bytearray | None, int, int]:
        """The reassembly state now, for ``rollback`` (no copy: the buffer is only ever appended to)."""
        buffer = self._buffer
        return buffer, 0 if buffer is None else len(buffer), self._skipped

    def rollback(self, checkpoint: tuple[bytearray | None, int, int]) -> None:
        """Return to a ``checkpoint``: the message in progress then is in progress again, as far as it was.

        The owner re-reads the fragments from the position it had at the checkpoint. A message completed
        since was handed over as a copy, and a message begun since used a new buffer, so the checkpoint's
        buffer still holds what it held, plus fragments appended since, which are cut off here.
        """
        buffer, length, self._skipped = checkpoint
        if buffer is not None:
            del buffer[length:]
        self._buffer = buffer

    def __call__(self, payload: memoryview, flags: int) -> None:
        if flags & UNFRAGMENTED == UNFRAGMENTED:
            self._handler(payload)
            return
        buffer = self._buffer
        if flags & BEGIN_FLAG:
            if self._skipped >= 0:  # the oversized message before never ended: dropped all the same
                self._oversized()
            if len(payload) > self._max_length:
                self._buffer, self._skipped = None, len(payload)
            else:
                self._buffer = bytearray(payload)
        elif buffer is not None:
            if len(buffer) + len(payload) > self._max_length:
                self._buffer, self._skipped = None, len(buffer) + len(payload)
            else:
                buffer += payload
                if flags & END_FLAG:
                    self._buffer = None
                    self._handler(bytes(buffer))
                return
        elif self._skipped >= 0:
            self._skipped += len(payload)
        if flags & END_FLAG and self._skipped >= 0:
            self._oversized()

    def _oversized(self) -> None:
        length, self._skipped = self._skipped, -1
        if self._on_oversized is not None:
            self._on_oversized(length)

    @property
    def in_progress(self) -> bool:
        return self._buffer is not None

    @property
    def buffered(self) -> int:
        """Payload bytes of the message in progress (0 if none)."""
        return 0 if self._buffer is None else len(self._buffer)
