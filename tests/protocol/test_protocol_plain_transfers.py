"""`build_transfers=False` (what the broker's reader uses) decodes exactly what the default decodes and refuses
exactly what it refuses: only the type of a TRANSFER's entries differs (the decoded lists, each padded to
its six fields, not `TransferEntry`s), so the broker is as protected from a malformed TRANSFER as before."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st
from tests.protocol.protocol_strategies import (
    assert_spoiled_entries_refused_alike,
    any_frame,
    decode_frames,
    plain,
    raw_body,
    transfer_entries,
)

from flowbroker.protocol import (
    Frame,
    Role,
    Transfer,
    TransferEntry,
    encode_frame,
)
from flowbroker.protocol import Connection as ProtocolConnection


def decode(data: bytes, build: bool) -> tuple[list[Frame], tuple[str, int | None] | None]:
    return decode_frames(data, build_transfers=build)


def kept_entries(frames: list[Frame]) -> list[tuple[Any, ...]]:
    assert len(frames) == 1 and isinstance(frames[0], Transfer)
    entries: list[Any] = frames[0].entries  # msgpack's lists, whatever the annotation says
    assert all(type(e) is list and len(e) == 6 for e in entries)
    return [tuple(e) for e in entries]


@given(any_frame)
def test_valid_frames_decode_alike(frame: Frame) -> None:
    built, error = decode(encode_frame(frame), True)
    kept, kept_error = decode(encode_frame(frame), False)
    assert error is kept_error is None
    assert [plain(f) for f in built] == [plain(f) for f in kept]
    assert [type(f) for f in built] == [type(f) for f in kept]
    if isinstance(frame, Transfer):
        built_transfer = built[0]
        assert isinstance(built_transfer, Transfer)
        assert all(type(e) is TransferEntry for e in built_transfer.entries)
        assert kept_entries(kept) == list(frame.entries)


@given(st.lists(transfer_entries, min_size=1, max_size=4), st.data())
def test_short_entries_are_padded_as_built_ones_are(entries: list[TransferEntry], data: st.DataObject) -> None:
    """An entry of three to five fields (the optional ones left out) is given its six, None for each absent."""
    wire: Any = plain(Transfer(1, entries))
    for entry in wire[2]:
        keep = data.draw(st.integers(3, 6))
        if all(v is None for v in entry[keep:]):
            del entry[keep:]
    body = raw_body(msgpack.packb(wire, use_bin_type=True))
    built, built_error = decode(body, True)
    kept, kept_error = decode(body, False)
    assert built_error is kept_error is None
    assert isinstance(built[0], Transfer)
    assert kept_entries(kept) == list(built[0].entries) == entries


@given(st.lists(transfer_entries, min_size=1, max_size=4), st.data())
def test_malformed_transfer_entries_are_refused_alike(entries: list[TransferEntry], data: st.DataObject) -> None:
    assert_spoiled_entries_refused_alike(Transfer(1, entries), data, "build_transfers")


def test_the_protocol_connection_switch_reaches_its_decoder() -> None:
    """`Connection.build_transfers` (what the broker sets) is the decoder's."""
    broker = ProtocolConnection(Role.BROKER)
    assert broker.build_transfers
    broker.build_transfers = False
    assert broker._decoder.build_transfers is False
