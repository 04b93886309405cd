"""The UDP envelope (protocol/envelope.py): what goes in comes out, and nothing malformed gets through."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.protocol.envelope import (
    DELIVER_BATCH,
    PUBLISH_BATCH,
    EnvelopeError,
    array_head_length,
    bin_length,
    decode_publish_batch,
    encode_publish_batch,
    decode_delivery,
    decode_delivery_batch,
    decode_publish,
    delivery_entry_bound,
    delivery_head,
    encode_delivery,
    encode_delivery_batch,
    encode_delivery_of,
    encode_publish,
    envelope_overhead,
)
from flowbroker.protocol.frames import DeliveryEntry
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from tests.protocol.protocol_strategies import delivery_entries, headers, text

bodies = st.binary(max_size=2000)


@settings(max_examples=300, deadline=None)
@given(bodies, st.one_of(st.none(), text), headers)
def test_a_publish_round_trips(body: bytes, routing_key: str | None, hdrs: dict[str, object] | None) -> None:
    payload = encode_publish(body, routing_key, hdrs)  # type: ignore[arg-type]
    assert decode_publish(payload) == (routing_key, hdrs or None, body)
    assert len(payload) == len(body) + envelope_overhead(routing_key, hdrs)  # type: ignore[arg-type]


def test_a_bare_body_costs_one_byte() -> None:
    assert encode_publish(b"abc") == b"\x00abc"
    assert envelope_overhead() == 1


@settings(max_examples=300, deadline=None)
@given(delivery_entries)
def test_a_delivery_round_trips(entry: DeliveryEntry) -> None:
    assert decode_delivery(encode_delivery(entry)) == entry


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_envelope_error_only(payload: bytes) -> None:
    for decode in (decode_publish, decode_delivery, decode_delivery_batch, decode_publish_batch):
        try:
            decode(payload)
        except EnvelopeError:
            pass


@pytest.mark.parametrize(
    "payload, problem",
    [
        (b"", "empty payload"),
        (b"\x07body", "kind 0x07 is not a publish"),
        (b"\x01\x00", "shorter than its envelope header"),
        (b"\x01\x00\x09ab", "overruns the payload"),
        (b"\x01\x00\x01\xc1", "not valid msgpack"),
        (encode_publish(b"x", "k", {"a": [1]}), "headers"),  # type: ignore[dict-item]
        (b"\x01\x00\x02\x91\x01", "must be [routing_key, headers]"),
        (b"\x01\x00\x03\x92\x01\xc0", "routing_key must be a string"),
    ],
)
def test_a_bad_publish_names_what_is_wrong(payload: bytes, problem: str) -> None:
    with pytest.raises(EnvelopeError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        decode_publish(payload)


def test_a_bad_delivery_names_what_is_wrong() -> None:
    with pytest.raises(EnvelopeError, match="not a delivery"):
        decode_delivery(encode_publish(b"x"))
    good = encode_delivery(DeliveryEntry(1, "", "q", b"x", None, False))
    bad_tag = good[:3] + good[3:].replace(b"\x95\x01", b"\x95\x00", 1)
    with pytest.raises(EnvelopeError, match="delivery_tag"):
        decode_delivery(bad_tag)


@settings(max_examples=300, deadline=None)
@given(delivery_entries)
def test_a_delivery_encoded_from_its_fields_is_byte_for_byte_encode_delivery(entry: DeliveryEntry) -> None:
    """The broker's hot path (encode_delivery_of: cached exchange and routing key, no headers) writes the
    same bytes as packing the whole entry, and the decoder's fast path gives back the same entry."""
    payload = encode_delivery_of(entry.delivery_tag, entry.exchange, entry.routing_key, entry.body, entry.headers,
                                 entry.redelivered)
    assert payload == encode_delivery(entry)
    assert decode_delivery(payload) == entry


@pytest.mark.parametrize("tag", [1, 127, 128, 255, 256, 65535, 65536, 65537, 2**32 - 1, 2**32, 2**63])
@pytest.mark.parametrize("redelivered", [False, True])
def test_the_delivery_head_is_msgpacks_at_every_tag_width(tag: int, redelivered: bool) -> None:
    """`delivery_head` packs tags in [256, 2**32) with structs of its own: the bytes msgpack writes there,
    and msgpack's own everywhere else (fixint, uint8, uint64)."""
    entry = DeliveryEntry(tag, "amq.direct", "orders", b"body", None, redelivered)
    assert delivery_head(tag, entry.exchange, entry.routing_key, None, redelivered) + b"body" == encode_delivery(entry)
    assert decode_delivery(encode_delivery(entry)) == entry


@pytest.mark.parametrize("meta", [
    [0, "", "q", None, False],  # tag 0
    [1, b"", "q", None, False],  # exchange not a string
    [1, "", 7, None, False],  # routing key not a string
    [1, "", "q", None, 0],  # redelivered not a bool
    [True, "", "q", None, False],  # a bool is not a tag
])
def test_the_decoders_fast_path_refuses_what_the_full_check_refuses(meta: list[object]) -> None:
    import msgpack

    packed = msgpack.packb(meta, use_bin_type=True)
    payload = bytes([2]) + len(packed).to_bytes(2, "big") + packed + b"body"
    with pytest.raises(EnvelopeError):
        decode_delivery(payload)


@settings(max_examples=300, deadline=None)
@given(st.lists(delivery_entries, min_size=1, max_size=20))
def test_a_delivery_batch_round_trips_as_the_entries_of_a_deliver_frame(entries: list[DeliveryEntry]) -> None:
    payload = encode_delivery_batch(entries)
    assert payload[0] == DELIVER_BATCH
    assert [DeliveryEntry(*e) for e in decode_delivery_batch(payload)] == entries
    assert [DeliveryEntry(*e) for e in decode_delivery_batch(memoryview(payload))] == entries


@settings(max_examples=500, deadline=None)
@given(delivery_entries)
def test_an_entry_bound_is_never_below_the_bytes_the_entry_takes(entry: DeliveryEntry) -> None:
    """The broker fills a datagram by these bounds without packing each entry apart: a bound under the
    real size would make a batch overrun its datagram (a fragment)."""
    packed = msgpack.packb(tuple(entry), use_bin_type=True)
    assert delivery_entry_bound(entry.body, entry.exchange, entry.routing_key, entry.headers) >= len(packed)


@pytest.mark.parametrize(
    "payload, problem",
    [
        (b"", "not a delivery batch envelope"),
        (b"\x02", "not a delivery batch envelope"),
        (b"\x03\xc1", "not valid msgpack"),
        (b"\x03" + msgpack.packb([]), "non-empty list"),
        (b"\x03" + msgpack.packb({"a": 1}), "non-empty list"),
        (b"\x03" + msgpack.packb([[1, "", "k", b"b", None]]), "each entry must be"),
        (b"\x03" + msgpack.packb([[0, "", "k", b"b", None, False]], use_bin_type=True), "positive integer"),
        (b"\x03" + msgpack.packb([[1, "", "k", "str body", None, False]], use_bin_type=True), "wrong type"),
        (b"\x03" + msgpack.packb([[1, "", "k", b"b", None, False]] * (MAX_ENTRIES_PER_FRAME + 1),
                                  use_bin_type=True), "MAX_ENTRIES_PER_FRAME"),
        (b"\x03" + msgpack.packb([[1, "", "k", b"b", None, False]], use_bin_type=True) + b"\x00", "not valid msgpack"),
    ],
)
def test_a_bad_delivery_batch_names_what_is_wrong(payload: bytes, problem: str) -> None:
    with pytest.raises(EnvelopeError, match=problem):
        decode_delivery_batch(payload)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 300), st.integers(65530, 65540)), min_size=1, max_size=40))
def test_a_publish_batch_round_trips_and_its_length_is_what_the_producer_claims(lengths: list[int]) -> None:
    """The SDK's UDP producer claims each body's place in a batch from these lengths, before packing it:
    the payload must be exactly that long, or its append would not end where the claims said (the
    lengths cross msgpack's bin 8/16/32 and fixarray/array 16 boundaries)."""
    bodies = [bytes([i % 256]) * n for i, n in enumerate(lengths)]
    payload = encode_publish_batch(bodies)
    assert payload[0] == PUBLISH_BATCH
    assert len(payload) == 1 + array_head_length(len(bodies)) + sum(bin_length(len(b)) for b in bodies)
    assert decode_publish_batch(payload) == bodies
    assert decode_publish_batch(memoryview(payload)) == bodies


@pytest.mark.parametrize(
    "payload, problem",
    [
        (b"", "not a publish batch envelope"),
        (b"\x00body", "not a publish batch envelope"),
        (b"\x04\xc1", "not valid msgpack"),
        (b"\x04" + msgpack.packb([]), "non-empty array"),
        (b"\x04" + msgpack.packb(b"x", use_bin_type=True), "non-empty array"),
        (b"\x04" + msgpack.packb(["str"], use_bin_type=True), "must be bin"),
        (b"\x04" + msgpack.packb([b"x"] * (MAX_ENTRIES_PER_FRAME + 1), use_bin_type=True), "MAX_ENTRIES_PER_FRAME"),
        (encode_publish_batch([b"abc"])[:-1], "not valid msgpack"),
    ],
)
def test_a_bad_publish_batch_names_what_is_wrong(payload: bytes, problem: str) -> None:
    with pytest.raises(EnvelopeError, match=problem):
        decode_publish_batch(payload)
