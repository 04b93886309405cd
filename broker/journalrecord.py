"""The journal's records on disk: framing, checksum and the scan that recovery trusts.

A record is `length` (u32, little-endian) + `crc32` (u32, of the payload) + `payload`, a msgpack array
whose first item is the record's kind. The checksum covers the payload only and the length is checked
against what is left of the file, so a torn write (the process killed mid-`write`, a power cut with
the tail not yet on disk) and a flipped bit both stop the scan at the first bad record: everything
before it is intact, and the caller cuts the file there. Sans-IO: bytes in, records out; the file
handling is broker/journal.py's.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "HEADER",
    "MAX_RECORD",
    "QUEUE",
    "QUEUE_DELETED",
    "EXCHANGE",
    "EXCHANGE_DELETED",
    "BIND",
    "UNBIND",
    "MESSAGE",
    "DELIVERED",
    "SETTLED",
    "SETTLED_MANY",
    "MESSAGE_MOVED",
    "PRODUCER_FORGOTTEN",
    "PRODUCERS",
    "encode",
    "encode_payload",
    "pack",
    "pack_array_header",
    "Scan",
    "scan",
]

HEADER = struct.Struct("<II")
MAX_RECORD = 1 << 30
"""A length over this is corruption, not a record (max_message_size is at most 512 MiB)."""

# Kinds. Topology records are upserts keyed by queue id or name, so a segment's opening snapshot
# (broker/journal.py) can repeat them.
QUEUE = 1  # [kind, qid, name, arguments, next_offset, owner]; owner (the declaring identity, or nil) is
# absent from records written before per-user max_queues, and readers before it ignore it
QUEUE_DELETED = 2  # [kind, qid]
EXCHANGE = 3  # [kind, name, exchange kind]
EXCHANGE_DELETED = 4  # [kind, name]
BIND = 5  # [kind, exchange, qid, binding key]
UNBIND = 6  # [kind, exchange, qid, binding key]
MESSAGE = 7  # [kind, qid, offset, exchange, routing key, body, headers, size, producer id, sequence]
DELIVERED = 8  # [kind, qid, offset]: handed to a consumer at least once (comes back redelivered)
SETTLED = 9  # [kind, qid, offset]: gone for good (acked, rejected, dropped, purged)
PRODUCERS = 10  # [kind, {producer id: highest sequence}]: the idempotent-producer seam
SETTLED_MANY = 11  # [kind, qid, [offset, ...]]: SETTLED for each (a purge's ready messages, in one record)
PRODUCER_FORGOTTEN = 12  # [kind, producer id]: forgotten (idle for producer_id_ttl): what earlier records
# said of it no longer holds (without it, a restart brought the id back from its messages' records, and a
# new stream under it was taken for duplicates, a tester)
MESSAGE_MOVED = 13  # MESSAGE's fields, then delivered (bool): a live message copied forward by compaction, so
# its old segment can go; recovery takes it as the MESSAGE it repeats, without its producer's sequence


_packer = msgpack.Packer(use_bin_type=True)
_packb = _packer.pack
_pack_header = HEADER.pack
_crc32 = zlib.crc32


def encode(record: list[Any]) -> bytes:
    """One record's bytes: header, then the msgpack payload."""
    payload: bytes = _packb(record)
    return _pack_header(len(payload), _crc32(payload)) + payload


def encode_payload(payload: bytes) -> bytes:
    """A record's bytes from its payload packed already (`pack_array_header` and `pack` of each item, in
    order: the bytes `encode` packs for the list)."""
    return _pack_header(len(payload), _crc32(payload)) + payload


def pack(item: Any) -> bytes:
    """One item of a record's payload, packed as `encode` packs it."""
    data: bytes = _packb(item)
    return data


def pack_array_header(n: int) -> bytes:
    """The start of a payload of `n` items."""
    data: bytes = _packer.pack_array_header(n)
    return data


@dataclass(frozen=True, slots=True)
class Scan:
    """What a segment's bytes hold: the intact records, the length they span, and why the scan
    stopped early (None when every byte was a good record)."""

    records: list[list[Any]]
    good_length: int
    error: str | None


def scan(data: bytes | memoryview) -> Scan:
    """Every intact record from the start of `data`, up to the first torn or corrupt one."""
    view = memoryview(data)
    records: list[list[Any]] = []
    pos, end = 0, len(view)
    while pos < end:
        if end - pos < HEADER.size:
            return Scan(records, pos, f"torn header at byte {pos} ({end - pos} bytes)")
        length, crc = HEADER.unpack_from(view, pos)
        start = pos + HEADER.size
        if length > MAX_RECORD or start + length > end:
            return Scan(records, pos, f"torn record at byte {pos} (length {length}, {end - start} bytes left)")
        payload = view[start:start + length]
        if _crc32(payload) != crc:
            return Scan(records, pos, f"checksum mismatch at byte {pos}")
        try:
            record = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # a checksum collision over garbage: still corruption
            return Scan(records, pos, f"undecodable record at byte {pos}: {exc}")
        if not isinstance(record, list) or not record or not isinstance(record[0], int):
            return Scan(records, pos, f"malformed record at byte {pos}")
        records.append(record)
        pos = start + length
    return Scan(records, pos, None)
