"""The compact envelope of a message carried over UDP (the Aeron data path), inside the DATA frame's payload.

A UDP publication is registered over TCP with an exchange and a default routing key
(REGISTER_PUBLICATION), so most messages need nothing but their body. The first byte of every payload
says what follows:

- ``0x00`` PUBLISH: the body alone; exchange and routing key are the registration's, no headers.
- ``0x01`` PUBLISH_ENVELOPED: a big-endian u16 length, a msgpack array ``[routing_key, headers]`` of that
  length (``routing_key`` nil for the registration's, ``headers`` nil or a map), then the body.
- ``0x02`` DELIVER (broker -> UDP consumer): a u16 length, a msgpack array
  ``[delivery_tag, exchange, routing_key, headers, redelivered]``, then the body.
- ``0x04`` PUBLISH_BATCH (producer -> broker, when REGISTER_PUBLICATION's answer says ``publish_batch``):
  a msgpack array of 1 to MAX_ENTRIES_PER_FRAME bodies (bin), each a message to the registration's
  exchange and routing key without headers; the SDK fills one unfragmented Aeron message (a datagram)
  with a burst of sends, so the broker walks and decodes one term frame per batch.
- ``0x03`` DELIVER_BATCH (broker -> UDP consumer whose connection asked for capability
  ``"deliver-batch"``): a msgpack array of deliveries, each a DELIVER frame's entry
  ``[delivery_tag, exchange, routing_key, body, headers, redelivered]``, tags consecutive and ascending. The
  broker fills one unfragmented Aeron message (a datagram) with as many as fit, so a consumer decodes,
  walks and checks one payload per batch instead of one per message, as a TCP consumer does one DELIVER
  frame.

The same field checks as the TCP frames apply (protocol/frames.py): a payload that fails them raises
``EnvelopeError`` naming what was wrong; the broker counts and drops it (completing its bytes, so the
producer's window keeps moving), never lets it reach a queue. Pure functions, no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

import msgpack

from flowbroker.protocol.frames import (
    DeliveryEntry,
    Headers,
    check_delivery_entries,
    check_delivery_entry,
    check_headers,
)
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME

__all__ = [
    "BATCH_HEAD_BOUND",
    "PUBLISH_BATCH",
    "PUBLISH_BATCH_KIND",
    "array_head_length",
    "bin_length",
    "decode_publish_batch",
    "encode_publish_batch",
    "DELIVER",
    "DELIVER_BATCH",
    "DELIVER_BATCH_KIND",
    "EnvelopeError",
    "PUBLISH",
    "PUBLISH_ENVELOPED",
    "decode_delivery",
    "decode_delivery_batch",
    "decode_publish",
    "delivery_entry_bound",
    "delivery_head",
    "encode_delivery",
    "encode_delivery_batch",
    "encode_delivery_of",
    "encode_publish",
    "envelope_overhead",
    "pack_delivery_entries",
    "pack_publish_bodies",
]

PUBLISH = 0x00
PUBLISH_ENVELOPED = 0x01
DELIVER = 0x02
DELIVER_BATCH = 0x03
PUBLISH_BATCH = 0x04
PUBLISH_BATCH_KIND = b"\x04"
"""The first byte of a PUBLISH_BATCH payload; the packed bodies follow (`encode_publish_batch`)."""
DELIVER_BATCH_KIND = b"\x03"
"""The first byte of a DELIVER_BATCH payload; the packed entries follow (`encode_delivery_batch`)."""

_LENGTH = struct.Struct(">BH")
_MAX_ENVELOPE = 0xFFFF


class EnvelopeError(ValueError):
    """A UDP payload that is not a valid envelope; the message says which part."""


def encode_publish(body: bytes, routing_key: str | None = None, headers: Headers | None = None) -> bytes:
    """The payload for one message: bare when it uses the registration's routing key and no headers."""
    if routing_key is None and not headers:
        return b"\x00" + body
    meta: bytes = msgpack.packb([routing_key, headers or None], use_bin_type=True)
    if len(meta) > _MAX_ENVELOPE:
        raise EnvelopeError(f"routing key and headers take {len(meta)} bytes, over {_MAX_ENVELOPE}")
    return _LENGTH.pack(PUBLISH_ENVELOPED, len(meta)) + meta + body


def envelope_overhead(routing_key: str | None = None, headers: Headers | None = None) -> int:
    """Bytes the envelope adds to a body (1 for a bare message)."""
    return len(encode_publish(b"", routing_key, headers))


def _meta(payload: bytes | memoryview, what: str) -> tuple[Any, int]:
    if len(payload) < 3:
        raise EnvelopeError(f"{what}: payload of {len(payload)} bytes is shorter than its envelope header")
    _, length = _LENGTH.unpack_from(payload, 0)
    end = 3 + length
    if end > len(payload):
        raise EnvelopeError(f"{what}: envelope of {length} bytes overruns the payload of {len(payload)}")
    try:
        meta = msgpack.unpackb(payload[3:end], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise EnvelopeError(f"{what}: envelope is not valid msgpack ({type(exc).__name__})") from None
    return meta, end


def decode_publish(payload: bytes | memoryview) -> tuple[str | None, Headers | None, bytes]:
    """(routing_key or None for the registration's, headers or None, body) of a PUBLISH payload."""
    if not len(payload):
        raise EnvelopeError("empty payload: a UDP message starts with its envelope byte")
    kind = payload[0]
    if kind == PUBLISH:
        return None, None, bytes(payload[1:])
    if kind != PUBLISH_ENVELOPED:
        raise EnvelopeError(f"envelope kind {kind:#04x} is not a publish (0x00 or 0x01)")
    meta, end = _meta(payload, "publish")
    if not isinstance(meta, list) or len(meta) != 2:
        raise EnvelopeError("publish envelope must be [routing_key, headers]")
    routing_key, headers = meta
    if routing_key is not None and type(routing_key) is not str:
        raise EnvelopeError("publish envelope: routing_key must be a string or nil")
    try:
        checked = check_headers(headers)
    except ValueError as exc:
        raise EnvelopeError(f"publish envelope: headers: {exc}") from None
    return routing_key, checked, bytes(payload[end:])


def encode_delivery(entry: DeliveryEntry) -> bytes:
    """The payload for one delivery to a UDP consumer."""
    meta: bytes = msgpack.packb(
        [entry.delivery_tag, entry.exchange, entry.routing_key, entry.headers, entry.redelivered], use_bin_type=True
    )
    return _LENGTH.pack(DELIVER, len(meta)) + meta + entry.body


_NIL_FALSE = b"\xc0\xc2"  # msgpack: headers nil, redelivered false
_NIL_TRUE = b"\xc0\xc3"


@lru_cache(maxsize=1024)
def _packed_names(exchange: str, routing_key: str) -> bytes:
    """msgpack of exchange then routing key: the same for every delivery of a queue's common messages."""
    packed: bytes = msgpack.packb(exchange, use_bin_type=True) + msgpack.packb(routing_key, use_bin_type=True)
    return packed


_pack_int: Callable[[int], bytes] = msgpack.Packer().pack
"""One packer for the tags (msgpack.packb builds a Packer per call); it returns the bytes and resets."""

_HEAD_UINT32 = struct.Struct(">BHBBI")
"""kind, meta length, then msgpack's fixarray of 5 and a uint32 tag: the head of every delivery whose tag
is in [65536, 2**32) (msgpack packs those, and only those, as 0xce + 4 bytes)."""
_HEAD_UINT16 = struct.Struct(">BHBBH")
"""The same for tags in [256, 65536) (0xcd + 2 bytes)."""


@lru_cache(maxsize=1024)
def _tail(exchange: str, routing_key: str, redelivered: bool) -> bytes:
    """What follows the tag in the meta of a delivery without headers: names, nil headers, redelivered."""
    return _packed_names(exchange, routing_key) + (_NIL_TRUE if redelivered else _NIL_FALSE)


def delivery_head(delivery_tag: int, exchange: str, routing_key: str, headers: Headers | None,
                  redelivered: bool) -> bytes:
    """The bytes of a DELIVER payload before its body: ``delivery_head(...) + body`` is
    `encode_delivery_of`'s payload. The broker writes head and body into its term one after the other
    (`Publication.offer_parts`), so a delivery's body is copied once, into the term, not first into a
    payload of its own."""
    if headers is not None:
        meta: bytes = msgpack.packb([delivery_tag, exchange, routing_key, headers, redelivered], use_bin_type=True)
    else:
        tail = _tail(exchange, routing_key, redelivered)
        if 0xFFFF < delivery_tag <= 0xFFFF_FFFF:  # a connection's tags after its first 65,535 deliveries
            return _HEAD_UINT32.pack(DELIVER, 6 + len(tail), 0x95, 0xCE, delivery_tag) + tail
        if 0xFF < delivery_tag <= 0xFFFF:
            return _HEAD_UINT16.pack(DELIVER, 4 + len(tail), 0x95, 0xCD, delivery_tag) + tail
        meta = b"\x95" + _pack_int(delivery_tag) + tail
    return _LENGTH.pack(DELIVER, len(meta)) + meta


def encode_delivery_of(delivery_tag: int, exchange: str, routing_key: str, body: bytes, headers: Headers | None,
                       redelivered: bool) -> bytes:
    """`encode_delivery` from the fields, byte for byte the same, without building a DeliveryEntry: a
    message without headers packs only its tag (exchange and routing key come packed from a small cache;
    msgpack packs an array as its elements one after another, so the bytes are those of packb(list))."""
    return delivery_head(delivery_tag, exchange, routing_key, headers, redelivered) + body


_unpackb = msgpack.unpackb
_make_entry: Callable[[Any], DeliveryEntry] = partial(tuple.__new__, DeliveryEntry)
"""tuple.__new__ in C: a DeliveryEntry without the NamedTuple's Python __new__ (the consumer's per-message path)."""


def decode_delivery(payload: bytes | memoryview) -> DeliveryEntry:
    """The delivery a DELIVER payload carries (checked as a DELIVER frame's entry is).

    The common delivery (no headers, its envelope well formed) is decoded and checked inline, in one
    call; anything else takes the general path, which names what is wrong. (Reading a uint32 tag and
    looking its tail up in a cache of names, without msgpack, took more instructions, not fewer: 13,603
    against 11,772 per decode under callgrind.)"""
    n = len(payload)
    if n >= 3 and payload[0] == DELIVER:
        end = 3 + ((payload[1] << 8) | payload[2])
        if end <= n:
            try:
                meta = _unpackb(payload[3:end], raw=False, strict_map_key=True)
            except Exception:  # the general path below names it
                meta = None
            if type(meta) is list and len(meta) == 5:
                tag, exchange, key, headers, redelivered = meta
                if (headers is None and type(tag) is int and tag >= 1 and type(exchange) is str
                        and type(key) is str and type(redelivered) is bool):
                    return _make_entry((tag, exchange, key, bytes(payload[end:]), None, redelivered))
    return _decode_delivery_checked(payload)


def _decode_delivery_checked(payload: bytes | memoryview) -> DeliveryEntry:
    """`decode_delivery`'s general path: every check, an `EnvelopeError` naming the first that fails."""
    if not len(payload) or payload[0] != DELIVER:
        raise EnvelopeError("not a delivery envelope (kind 0x02)")
    meta, end = _meta(payload, "deliver")
    if not isinstance(meta, list) or len(meta) != 5:
        raise EnvelopeError("deliver envelope must be [delivery_tag, exchange, routing_key, headers, redelivered]")
    tag, exchange, key, headers, redelivered = meta
    if (headers is None and type(tag) is int and tag >= 1 and type(exchange) is str and type(key) is str
            and type(redelivered) is bool):
        return DeliveryEntry(tag, exchange, key, bytes(payload[end:]), None, redelivered)  # checked: as below
    entry = DeliveryEntry(tag, exchange, key, bytes(payload[end:]), headers, redelivered)
    try:
        check_delivery_entry(entry)
    except ValueError as exc:
        raise EnvelopeError(f"deliver envelope: {exc}") from None
    return entry


# ---------------------------------------------------------------------------------------- batches

_pack_entries: Callable[[Any], bytes] = msgpack.Packer().pack
"""One packer for the batches' entries (the default use_bin_type=True: bodies as bin, names as str)."""

BATCH_HEAD_BOUND = 6
"""The most a DELIVER_BATCH payload adds around its entries: the kind byte and msgpack's array header."""

_ENTRY_FIXED_BOUND = 32
"""The most an entry's msgpack takes beyond its body and names' characters: array header 1, tag up to 9,
three str/bin headers of up to 5, nil or packed headers' own bytes counted apart, redelivered 1."""


def delivery_entry_bound(body: bytes, exchange: str, routing_key: str, headers: Headers | None) -> int:
    """At least the bytes a delivery's entry takes in a DELIVER_BATCH (never fewer, so a batch filled by
    these bounds fits where it must): the body, four bytes per character of the names (UTF-8's most), and
    the packed headers. The broker sums them to fill a datagram without packing each entry apart."""
    bound = len(body) + ((len(exchange) + len(routing_key)) << 2) + _ENTRY_FIXED_BOUND
    if headers:
        bound += len(msgpack.packb(headers, use_bin_type=True))
    return bound


def _unpack_batch(payload: bytes | memoryview, kind: int, what: str) -> Any:
    """What follows a batch envelope's kind byte, unpacked; EnvelopeError for another kind or bad msgpack."""
    if not len(payload) or payload[0] != kind:
        raise EnvelopeError(f"not a {what} envelope (kind {kind:#04x})")
    try:
        return _unpackb(payload[1:], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise EnvelopeError(f"{what}: not valid msgpack ({type(exc).__name__})") from None


def encode_delivery_batch(entries: list[Any]) -> bytes:
    """The DELIVER_BATCH payload of `entries` (DELIVER frame entries, tuples or lists of six fields). The
    broker writes `DELIVER_BATCH_KIND` and `pack_delivery_entries(entries)` into its term as two parts."""
    return DELIVER_BATCH_KIND + _pack_entries(entries)


pack_delivery_entries = _pack_entries
"""The bytes of a DELIVER_BATCH after its kind byte: msgpack of the entries."""


def decode_delivery_batch(payload: bytes | memoryview) -> list[Any]:
    """The deliveries of a DELIVER_BATCH payload: lists of a `DeliveryEntry`'s six fields, checked as a
    DELIVER frame's entries are (at most MAX_ENTRIES_PER_FRAME, each field's type, headers). Raises
    `EnvelopeError` naming what is wrong."""
    entries = _unpack_batch(payload, DELIVER_BATCH, "delivery batch")
    try:
        check_delivery_entries(entries)
    except ValueError as exc:
        raise EnvelopeError(f"delivery batch: {exc}") from None
    return entries  # type: ignore[no-any-return]


def bin_length(body_length: int) -> int:
    """The bytes msgpack packs a body of `body_length` bytes into (bin 8, 16 or 32: its header and the body):
    the SDK's UDP producer sizes a PUBLISH_BATCH as it fills it, without packing it."""
    if body_length < 0x100:
        return body_length + 2
    if body_length < 0x10000:
        return body_length + 3
    return body_length + 5


def array_head_length(count: int) -> int:
    """The bytes of msgpack's header for an array of `count` items (fixarray, array 16, array 32)."""
    return 1 if count < 16 else 3 if count < 0x10000 else 5


def encode_publish_batch(bodies: list[bytes]) -> bytes:
    """The PUBLISH_BATCH payload of `bodies`: its length is 1 + array_head_length(n) + the bin_lengths."""
    return PUBLISH_BATCH_KIND + _pack_entries(bodies)


pack_publish_bodies = _pack_entries
"""The bytes of a PUBLISH_BATCH after its kind byte: msgpack of the list of bodies."""


def decode_publish_batch(payload: bytes | memoryview) -> list[bytes]:
    """The bodies of a PUBLISH_BATCH payload (1 to MAX_ENTRIES_PER_FRAME, each bin). Raises `EnvelopeError`
    naming what is wrong."""
    bodies = _unpack_batch(payload, PUBLISH_BATCH, "publish batch")
    if type(bodies) is not list or not bodies:
        raise EnvelopeError("publish batch: must be a non-empty array of bodies")
    if len(bodies) > MAX_ENTRIES_PER_FRAME:
        raise EnvelopeError(f"publish batch: {len(bodies)} bodies, over MAX_ENTRIES_PER_FRAME {MAX_ENTRIES_PER_FRAME}")
    for body in bodies:
        if type(body) is not bytes:
            raise EnvelopeError("publish batch: every body must be bin (bytes)")
    return bodies
