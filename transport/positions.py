"""Aeron's LogBufferDescriptor arithmetic: stream positions, term ids and term offsets.

A stream position is a 64-bit byte count since the initial term. Term ids are int32 and wrap: the
reference computes ``activeTermId - initialTermId`` in 32-bit arithmetic, so a stream whose term id
passes 2**31 - 1 and continues at -2**31 keeps growing positions. Every function here reproduces that
int32 behaviour explicitly (Python ints do not overflow), so a term id returned by this module is always a
valid int32 that goes straight into a frame header.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MAX_MESSAGE_LENGTH_CAP",
    "PAGE_MAX_SIZE",
    "PAGE_MIN_SIZE",
    "PARTITION_COUNT",
    "TERM_MAX_LENGTH",
    "TERM_MIN_LENGTH",
    "check_term_length",
    "compute_fragmented_frame_length",
    "compute_max_message_length",
    "compute_position",
    "compute_term_begin_position",
    "compute_term_id_from_position",
    "compute_term_offset_from_position",
    "index_by_position",
    "index_by_term",
    "index_by_term_count",
    "is_valid_page_size",
    "is_valid_term_length",
    "max_possible_position",
    "pack_tail",
    "position_bits_to_shift",
    "tail_term_id",
    "tail_term_offset",
    "term_count",
    "wrap_int32",
]

PARTITION_COUNT: Final = 3
TERM_MIN_LENGTH: Final = 64 * 1024
TERM_MAX_LENGTH: Final = 1024 * 1024 * 1024
PAGE_MIN_SIZE: Final = 4 * 1024
PAGE_MAX_SIZE: Final = 1024 * 1024 * 1024
MAX_MESSAGE_LENGTH_CAP: Final = 16 * 1024 * 1024

_INT32_MASK: Final = 0xFFFF_FFFF


def wrap_int32(value: int) -> int:
    """``value`` reduced to a signed 32-bit int, as Java/C int arithmetic would leave it."""
    value &= _INT32_MASK
    return value - (1 << 32) if value & 0x8000_0000 else value


def is_valid_term_length(term_length: int) -> bool:
    """A power of two in [64 KiB, 1 GiB]."""
    return TERM_MIN_LENGTH <= term_length <= TERM_MAX_LENGTH and term_length & (term_length - 1) == 0


def check_term_length(term_length: int) -> None:
    """Raise ValueError naming the rule a bad term length breaks."""
    if term_length & (term_length - 1) or term_length <= 0:
        raise ValueError(f"term length {term_length} is not a power of two")
    if term_length < TERM_MIN_LENGTH:
        raise ValueError(f"term length {term_length} is less than the minimum {TERM_MIN_LENGTH}")
    if term_length > TERM_MAX_LENGTH:
        raise ValueError(f"term length {term_length} is greater than the maximum {TERM_MAX_LENGTH}")


def is_valid_page_size(page_size: int) -> bool:
    return PAGE_MIN_SIZE <= page_size <= PAGE_MAX_SIZE and page_size & (page_size - 1) == 0


def position_bits_to_shift(term_length: int) -> int:
    """log2(term_length): how far a term count is shifted to make a position."""
    check_term_length(term_length)
    return term_length.bit_length() - 1


def term_count(active_term_id: int, initial_term_id: int) -> int:
    """Terms since the initial one, int32 subtraction (copes with the term id wrap)."""
    return wrap_int32(active_term_id - initial_term_id)


def compute_position(
    active_term_id: int, term_offset: int, position_bits_to_shift: int, initial_term_id: int
) -> int:
    """Stream position of ``term_offset`` in term ``active_term_id``."""
    return (term_count(active_term_id, initial_term_id) << position_bits_to_shift) + term_offset


def compute_term_begin_position(
    active_term_id: int, position_bits_to_shift: int, initial_term_id: int
) -> int:
    return term_count(active_term_id, initial_term_id) << position_bits_to_shift


def compute_term_id_from_position(
    position: int, position_bits_to_shift: int, initial_term_id: int
) -> int:
    """``(int)(position >>> bits) + initialTermId`` with Java's int32 truncation and wrap."""
    return wrap_int32(((position & 0xFFFF_FFFF_FFFF_FFFF) >> position_bits_to_shift) + initial_term_id)


def compute_term_offset_from_position(position: int, position_bits_to_shift: int) -> int:
    return position & ((1 << position_bits_to_shift) - 1)


def index_by_term(initial_term_id: int, active_term_id: int) -> int:
    """Partition (0..2) holding term ``active_term_id``."""
    return term_count(active_term_id, initial_term_id) % PARTITION_COUNT


def index_by_term_count(count: int) -> int:
    return count % PARTITION_COUNT


def index_by_position(position: int, position_bits_to_shift: int) -> int:
    """Partition (0..2) holding ``position``."""
    return (position >> position_bits_to_shift) % PARTITION_COUNT


def pack_tail(term_id: int, term_offset: int) -> int:
    """Raw tail counter value ``(termId << 32) | termOffset`` as the log metadata keeps it."""
    return (wrap_int32(term_id) << 32) | (term_offset & _INT32_MASK)


def tail_term_id(raw_tail: int) -> int:
    return wrap_int32(raw_tail >> 32)


def tail_term_offset(raw_tail: int, term_length: int) -> int:
    """Tail offset clamped to the term length (a tail may run past the end when a claim overflowed)."""
    return min(raw_tail & _INT32_MASK, term_length)


def compute_max_message_length(term_length: int) -> int:
    """Largest message a publication accepts: min(term_length / 8, 16 MiB)."""
    return min(term_length // 8, MAX_MESSAGE_LENGTH_CAP)


def max_possible_position(term_length: int) -> int:
    """Position after 2**31 terms: beyond it a publication reports MAX_POSITION_EXCEEDED."""
    return term_length * (1 << 31)


def compute_fragmented_frame_length(length: int, max_payload_length: int) -> int:
    """Term bytes a message of ``length`` occupies when fragmented at ``max_payload_length``."""
    full, last = divmod(length, max_payload_length)
    aligned_full = full * (max_payload_length + 32)
    if last > 0:
        aligned_full += (last + 32 + 31) & ~31
    return aligned_full


def frame_space(length: int, mtu: int) -> int:
    """Term bytes a message of ``length`` occupies as DATA frames of at most ``mtu`` bytes (headers and
    alignment included, end-of-term padding not): what its publication's position moves by, and so what
    a receiver that holds the message back from its consumption position holds (``Image.hold``)."""
    header = 32  # DATA_HEADER_LENGTH (transport/frames.py)
    max_payload = mtu - header
    if length <= max_payload:
        return (length + header + 31) & ~31
    full, last = divmod(length, max_payload)
    return int(full * mtu + ((last + header + 31) & ~31 if last else 0))
