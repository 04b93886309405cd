"""The journal's record framing (broker/journalrecord.py): what the scan keeps and where it stops."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker.journalrecord import HEADER, MESSAGE, SETTLED, encode, scan


def _records(n: int) -> list[list[object]]:
    return [[MESSAGE, 1, i, "", "q", b"x" * i, None, 512 + i, None, None] if i % 2 else [SETTLED, 1, i]
            for i in range(n)]


def test_every_intact_record_comes_back_in_order() -> None:
    records = _records(20)
    data = b"".join(encode(r) for r in records)
    result = scan(data)
    assert result.error is None and result.good_length == len(data)
    assert result.records == records


@given(cut=st.integers(min_value=0, max_value=10_000))
def test_a_torn_tail_stops_the_scan_at_the_last_whole_record(cut: int) -> None:
    encoded = [encode(r) for r in _records(30)]
    data = b"".join(encoded)
    cut %= len(data) + 1
    result = scan(data[:cut])
    whole, end = 0, 0
    for e in encoded:
        if end + len(e) > cut:
            break
        end += len(e)
        whole += 1
    assert result.good_length == end and len(result.records) == whole
    assert (result.error is None) == (cut == end)


@given(index=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_a_flipped_bit_is_caught_and_nothing_after_it_is_trusted(index: int, bit: int) -> None:
    encoded = [encode(r) for r in _records(10)]
    data = bytearray(b"".join(encoded))
    index %= len(data)
    data[index] ^= 1 << bit
    result = scan(bytes(data))
    start = 0
    for n, e in enumerate(encoded):  # the record the flipped byte is in
        if index < start + len(e):
            break
        start += len(e)
    assert result.error is not None
    assert result.good_length == start and len(result.records) == n
    assert result.records == _records(10)[:n]


def test_a_huge_length_is_corruption_not_an_allocation() -> None:
    data = encode([SETTLED, 1, 1]) + HEADER.pack(0xFFFFFFFF, 0) + b"junk"
    result = scan(data)
    assert len(result.records) == 1 and result.error is not None and "torn record" in result.error
