"""LogBufferDescriptor arithmetic, including the int32 term-id wrap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowbroker.transport import positions as p

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def test_wrap_int32() -> None:
    assert p.wrap_int32(INT32_MAX + 1) == INT32_MIN
    assert p.wrap_int32(INT32_MIN - 1) == INT32_MAX
    assert p.wrap_int32(-1) == -1
    assert p.wrap_int32(2**32 + 5) == 5


@pytest.mark.parametrize(
    ("term_length", "bits"), [(64 * 1024, 16), (16 * 1024 * 1024, 24), (1 << 30, 30)]
)
def test_position_bits_to_shift(term_length: int, bits: int) -> None:
    assert p.position_bits_to_shift(term_length) == bits


@pytest.mark.parametrize(
    ("term_length", "message"),
    [(1000, "power of two"), (32 * 1024, "minimum"), (1 << 31, "maximum"), (0, "power of two"), (-65536, "power of two")],
)
def test_term_length_validation(term_length: int, message: str) -> None:
    assert not p.is_valid_term_length(term_length)
    with pytest.raises(ValueError, match=message):
        p.check_term_length(term_length)


def test_valid_term_lengths() -> None:
    for shift in range(16, 31):
        assert p.is_valid_term_length(1 << shift)
    assert p.is_valid_page_size(4096) and not p.is_valid_page_size(2048) and not p.is_valid_page_size(5000)


def test_compute_position_across_term_id_wrap() -> None:
    bits = 16
    initial = INT32_MAX - 1
    # INT32_MAX - 1, INT32_MAX, INT32_MIN, INT32_MIN + 1 are terms 0..3.
    assert p.compute_position(initial, 0, bits, initial) == 0
    assert p.compute_position(INT32_MAX, 64, bits, initial) == 65536 + 64
    assert p.compute_position(INT32_MIN, 0, bits, initial) == 2 * 65536
    assert p.compute_position(INT32_MIN + 1, 96, bits, initial) == 3 * 65536 + 96
    assert p.compute_term_begin_position(INT32_MIN + 1, bits, initial) == 3 * 65536
    assert p.compute_term_id_from_position(2 * 65536 + 5, bits, initial) == INT32_MIN
    assert p.compute_term_id_from_position(3 * 65536, bits, initial) == INT32_MIN + 1
    assert p.compute_term_offset_from_position(3 * 65536 + 96, bits) == 96
    assert p.index_by_term(initial, INT32_MIN + 1) == 0
    assert p.index_by_term(initial, INT32_MIN) == 2
    assert p.index_by_position(2 * 65536 + 7, bits) == 2
    assert p.index_by_term_count(4) == 1


def test_negative_initial_term_id() -> None:
    assert p.compute_position(-5, 32, 16, -7) == 2 * 65536 + 32
    assert p.compute_term_id_from_position(2 * 65536 + 32, 16, -7) == -5


def test_tail_packing() -> None:
    raw = p.pack_tail(-2, 4096)
    assert raw == ((-2) << 32) | 4096
    assert p.tail_term_id(raw) == -2
    assert p.tail_term_offset(raw, 65536) == 4096
    assert p.tail_term_offset(p.pack_tail(3, 70000), 65536) == 65536


def test_max_message_and_fragmented_length() -> None:
    assert p.compute_max_message_length(16 * 1024 * 1024) == 2 * 1024 * 1024
    assert p.compute_max_message_length(1 << 30) == 16 * 1024 * 1024
    assert p.compute_max_message_length(65536) == 8192
    assert p.compute_fragmented_frame_length(1376, 1376) == 1408
    assert p.compute_fragmented_frame_length(3000, 1376) == 2 * 1408 + 288
    assert p.compute_fragmented_frame_length(14, 1376) == 64
    assert p.max_possible_position(65536) == 65536 << 31


@given(
    initial=st.integers(INT32_MIN, INT32_MAX),
    count=st.integers(0, 2**31 - 1),
    offset_words=st.integers(0, 65536 // 32 - 1),
    shift=st.integers(16, 30),
)
def test_position_round_trip(initial: int, count: int, offset_words: int, shift: int) -> None:
    term_id = p.wrap_int32(initial + count)
    offset = offset_words * 32
    pos = p.compute_position(term_id, offset, shift, initial)
    assert pos == (count << shift) + offset
    assert p.compute_term_id_from_position(pos, shift, initial) == term_id
    assert p.compute_term_offset_from_position(pos, shift) == offset
    assert p.index_by_position(pos, shift) == p.index_by_term(initial, term_id) == count % 3
    assert INT32_MIN <= term_id <= INT32_MAX
