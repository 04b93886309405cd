"""`build_deliveries=False` (what the SDK's reader uses) decodes exactly what the default decodes and refuses
exactly what it refuses: only the type of a DELIVER's entries differs (the decoded lists, not
`DeliveryEntry`s), so the SDK's consumer is as protected from a malformed DELIVER as before."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from tests.protocol.protocol_strategies import (
    assert_spoiled_entries_refused_alike,
    any_frame,
    decode_frames,
    delivery_entries,
    plain,
)

from flowbroker.protocol import (
    Deliver,
    DeliveryEntry,
    Frame,
    Role,
    encode_frame,
)
from flowbroker.protocol import Connection as ProtocolConnection


def decode(data: bytes, build: bool) -> tuple[list[Frame], tuple[str, int | None] | None]:
    return decode_frames(data, build_deliveries=build)


@given(any_frame)
def test_valid_frames_decode_alike(frame: Frame) -> None:
    built, error = decode(encode_frame(frame), True)
    kept, kept_error = decode(encode_frame(frame), False)
    assert error is kept_error is None
    assert [plain(f) for f in built] == [plain(f) for f in kept]
    assert [type(f) for f in built] == [type(f) for f in kept]
    if isinstance(frame, Deliver):
        built_deliver, kept_deliver = built[0], kept[0]
        assert isinstance(built_deliver, Deliver) and isinstance(kept_deliver, Deliver)
        assert all(type(e) is DeliveryEntry for e in built_deliver.entries)
        kept_entries: list[Any] = kept_deliver.entries  # msgpack's lists, whatever the annotation says
        assert all(type(e) is list and len(e) == 6 for e in kept_entries)
        assert [tuple(e) for e in kept_entries] == list(frame.entries)


@given(st.lists(delivery_entries, min_size=1, max_size=4), st.data())
def test_malformed_delivery_entries_are_refused_alike(entries: list[DeliveryEntry], data: st.DataObject) -> None:
    assert_spoiled_entries_refused_alike(Deliver(1, entries), data, "build_deliveries")


def test_the_protocol_connection_switch_reaches_its_decoder() -> None:
    """`Connection.build_deliveries` (what the SDK sets) is the decoder's."""
    client = ProtocolConnection(Role.CLIENT)
    assert client.build_deliveries
    client.build_deliveries = False
    assert client._decoder.build_deliveries is False
