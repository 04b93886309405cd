"""Malformed input of every kind becomes RemoteProtocolError with the right code and frame_seq.

The field kinds below are written out by hand from docs/protocol.md, independently of the
validators in protocol/frames.py, so a validator that accepts the wrong type fails here.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tests.protocol.protocol_strategies import SAMPLES, any_frame, raw_body, raw_frame

from flowbroker.protocol import (
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameType,
    RemoteProtocolError,
    encode_frame,
    frame_to_wire,
)
from flowbroker.protocol.limits import (
    MAX_CONTROL_FRAME,
    MAX_ENTRIES_PER_FRAME,
    MAX_HEADERS,
    MAX_MAP_ITEMS,
    MAX_RANGES_PER_FRAME,
)

# --- the wire schema, by hand -------------------------------------------------------------------

FIELDS: dict[FrameType, list[tuple[str, str]]] = {
    FrameType.HELLO: [
        ("version", "uint"),
        ("client_name", "str"),
        ("flow_control", "bool"),
        ("capabilities", "strlist"),
        ("auth", "optmap"),
    ],
    FrameType.WELCOME: [
        ("version", "uint"),
        ("connection_id", "uint"),
        ("server_name", "str"),
        ("max_frame_size", "uint"),
        ("max_message_size", "uint"),
        ("idle_timeout_ms", "uint"),
        ("buffer_size", "uint"),
        ("identity", "str"),
        ("auth_data", "optauth"),
        ("run_id", "optstr"),
    ],
    FrameType.DECLARE_QUEUE: [("request_id", "uint"), ("queue", "name"), ("durable", "bool"), ("arguments", "optmap")],
    FrameType.DECLARE_EXCHANGE: [("request_id", "uint"), ("exchange", "name"), ("kind", "name")],
    # binding keys are bounded in bytes by the broker (KEY_TOO_LONG), not at decoding
    FrameType.BIND: [("request_id", "uint"), ("queue", "name"), ("exchange", "name"), ("binding_key", "str")],
    FrameType.UNBIND: [("request_id", "uint"), ("queue", "name"), ("exchange", "name"), ("binding_key", "str")],
    FrameType.DELETE_QUEUE: [("request_id", "uint"), ("queue", "name")],
    FrameType.PURGE_QUEUE: [("request_id", "uint"), ("queue", "name")],
    FrameType.DELETE_EXCHANGE: [("request_id", "uint"), ("exchange", "name")],
    FrameType.OK: [("request_id", "uint"), ("result", "map")],
    FrameType.TRANSFER: [("first_id", "pos"), ("entries", "transfer_entries")],
    FrameType.COMPLETE: [("cumulative_id", "uint"), ("ranges", "ranges")],
    FrameType.BUFFER_CONTROL: [("opaque", "uint"), ("buffer_size", "uint")],
    FrameType.BUFFER_ACK: [("opaque", "uint"), ("freed", "uint"), ("acked_position", "uint")],
    FrameType.BUFFER_LIMIT: [("control", "pos"), ("size", "pos"), ("limit", "uint")],
    FrameType.FLOW_STOPPED: [
        ("destination", "name"),
        ("threshold", "str"),
        ("limit", "uint"),
        ("value", "uint"),
        ("reason", "str"),
    ],
    FrameType.FLOW_RESUMED: [("destination", "name")],
    FrameType.SUBSCRIBE: [
        ("request_id", "uint"),
        ("subscription_id", "uint"),
        ("queue", "name"),
        ("prefetch", "uint"),
        ("buffer_size", "uint"),
    ],
    FrameType.CANCEL: [("request_id", "uint"), ("subscription_id", "uint")],
    FrameType.DELIVER: [("subscription_id", "uint"), ("entries", "delivery_entries")],
    FrameType.SETTLE: [("outcome", "outcome"), ("ranges", "ranges")],
    FrameType.NOOP: [("nonce", "uint"), ("reply", "bool")],
    FrameType.ERROR: [
        ("code", "error_code"),
        ("text", "str"),
        ("frame_seq", "optuint"),
        ("ref_id", "optuint"),
        ("destination", "optstr"),
        ("session_id", "optint32"),
    ],
    FrameType.CLOSE: [("code", "error_code"), ("reason", "str")],
    FrameType.REGISTER_PUBLICATION: [
        ("request_id", "uint"),
        ("exchange", "name"),
        ("routing_key", "str"),
        ("stream_id", "int32"),
        ("source_port", "port"),
    ],
    FrameType.CLOSE_PUBLICATION: [("request_id", "uint"), ("session_id", "int32")],
    FrameType.SUBSCRIBE_UDP: [
        ("request_id", "uint"),
        ("subscription_id", "uint"),
        ("queue", "name"),
        ("prefetch", "uint"),
        ("buffer_size", "uint"),
        ("port", "port"),
        ("stream_id", "int32"),
    ],
    FrameType.JOIN_GROUP: [
        ("request_id", "uint"),
        ("subscription_id", "uint"),
        ("exchange", "name"),
        ("group", "name"),
        ("endpoint", "str"),
        ("fc", "str"),
        ("buffer_size", "uint"),
        ("receiver_id", "int32"),
        ("stream_id", "int32"),
    ],
    FrameType.AUTH_CHALLENGE: [("data", "auth")],
    FrameType.AUTH_RESPONSE: [("data", "auth")],
}

# Required field counts (fields with a default may be left off the end of the array).
REQUIRED = {FrameType.HELLO: 4, FrameType.WELCOME: 8, FrameType.DECLARE_QUEUE: 2, FrameType.ERROR: 2}

_NOT_INT = [1.0, True, "1", b"1", None, [1], {"a": 1}]
BAD: dict[str, list[Any]] = {
    "uint": [-1, -(2**63), *_NOT_INT],
    "pos": [0, -1, *_NOT_INT],
    "str": [1, b"x", None, True, ["x"], {"a": "b"}],
    "name": [1, b"x", None, True, "n" * 256],
    "bool": [0, 1, "true", None, b"\x01"],
    "strlist": ["abc", [1], [b"x"], ["a", None], {"a": 1}, None],
    "map": [None, [], "x", {b"k": 1}, {"k": msgpack.Timestamp(1, 0)}, {"k": [{"n": msgpack.Timestamp(0, 1)}]}],
    "optmap": [[], "x", 0, {b"k": 1}, {"k": msgpack.Timestamp(1, 0)}],
    "error_code": [99, -1, True, 1.0, "1", None],
    "outcome": [3, -1, True, 0.0, "ack", None],
    "optuint": [-1, "x", True, 1.5],
    "optstr": [1, b"x", True],
    "int32": [2**31, -(2**31) - 1, *_NOT_INT],
    "optint32": [2**31, "x", True, 1.5],
    "port": [0, 65536, -1, *_NOT_INT],
    "auth": [None, "text", 1, b"x" * 1025, [b"x"]],
    "optauth": ["text", 1, b"x" * 1025, [b"x"]],
    "ranges": [
        None,
        "x",
        [1],
        [[0, 1]],
        [[2, 1]],
        [[-1, 2]],
        [[1]],
        [[1, 2, 3]],
        [[1, "2"]],
        [[True, 2]],
        [[1, 2.0]],
    ],
    "transfer_entries": [
        None,
        [],
        "x",
        [["e", "k"]],
        [["e", "k", b"", None, None, None, None]],
        [[1, "k", b""]],
        [["e", None, b""]],
        [["e", "k", "body as str"]],
        [["e", "k", b"", "not a map"]],
        [["e", "k", b"", {"h": [1]}]],
        [["e", "k", b"", {"h": {"nested": 1}}]],
        [["e", "k", b"", {b"h": 1}]],
        [["e", "k", b"", None, 7]],
        [["e", "k", b"", None, "p", -1]],
        [["e", "k", b"", None, "p", True]],
        [["e", "k", b"", None, "p", 1.0]],
        [["e", "k", b""], "not an entry"],
    ],
    "delivery_entries": [
        None,
        [],
        [[0, "e", "k", b"", None, False]],
        [[-1, "e", "k", b"", None, False]],
        [["1", "e", "k", b"", None, False]],
        [[True, "e", "k", b"", None, False]],
        [[1, 2, "k", b"", None, False]],
        [[1, "e", "k", "s", None, False]],
        [[1, "e", "k", b"", None, 0]],
        [[1, "e", "k", b"", [], False]],
        [[1, "e", "k", b"", {"h": [1]}, False]],
        [[1, "e", "k", b"", None]],
        [[1, "e", "k", b"", None, False, "extra"]],
    ],
}
BAD["optmap"] += [v for v in BAD["map"] if v is not None and v not in BAD["optmap"]]

GOOD: dict[str, list[Any]] = {
    "uint": [0, 1, 2**64 - 1],
    "pos": [1, 2**64 - 1],
    "str": ["", "héllo", "n" * 1000],
    "name": ["", "q", "n" * 255],
    "bool": [True, False],
    "strlist": [[], ["a", "b"]],
    "map": [{}, {"k": [1, {"n": None}], "b": b"x", "f": 1.5}],
    "optmap": [None, {}, {"k": 1}],
    "error_code": [0, 16],
    "outcome": [0, 1, 2],
    "optuint": [None, 0, 2**64 - 1],
    "optstr": [None, "", "q"],
    "int32": [0, -(2**31), 2**31 - 1],
    "optint32": [None, -(2**31), 2**31 - 1],
    "port": [1, 65535],
    "auth": [b"", b"x" * 1024],
    "optauth": [b"", b"x" * 1024],  # None: the WELCOME samples
    "ranges": [[], [[1, 1]], [[1, 5], [7, 2**64 - 1]]],
    "transfer_entries": [
        [["e", "k", b"", None, "p", 2**64 - 1]],
        [["e", "k", b"", None, None, None]],
        [["e", "k", b"b", {"a": 1, "b": b"x", "c": None, "d": 1.5, "e": True, "f": "s"}, "p", 0]],
    ],
    "delivery_entries": [[[1, "e", "k", b"", None, False]], [[2**64 - 1, "", "", b"b", {"h": "v"}, True]]],
}


def test_schema_table_matches_every_frame_type() -> None:
    assert set(FIELDS) == set(FrameType)
    for ftype, frame in SAMPLES.items():
        # (a WELCOME without auth_data and run_id leaves those last, optional fields off the wire)
        assert len(frame_to_wire(frame)) - 1 == len(FIELDS[ftype]) - 2 * (ftype is FrameType.WELCOME)


def full_wire(frame: Frame) -> list[Any]:
    """Every field of `frame` on the wire, the optional ones its encoding leaves off included."""
    wire = frame_to_wire(frame)
    return wire + [None] * (len(FIELDS[frame.TYPE]) + 1 - len(wire))


def decode_one(data: bytes, after: int = 0) -> Frame | None:
    """Decode `data` after `after` valid NOOP frames; returns the one frame it holds."""
    decoder = FrameDecoder()
    decoder.feed(b"".join(encode_frame(SAMPLES[FrameType.NOOP]) for _ in range(after)) + data)
    for _ in range(after):
        assert decoder.next_frame() == SAMPLES[FrameType.NOOP]
    return decoder.next_frame()


def assert_malformed(
    data: bytes, *, after: int = 0, mentions: str | None = None, code: ErrorCode = ErrorCode.MALFORMED_FRAME
) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        decode_one(data, after)
    err = info.value
    assert err.code is code
    assert err.frame_seq == after + 1
    if mentions is not None:
        assert mentions in str(err)
    return err


FIELD_CASES = [
    pytest.param(ftype, i, bad, id=f"{ftype.name}-{name}-{j}")
    for ftype, fields in FIELDS.items()
    for i, (name, kind) in enumerate(fields)
    for j, bad in enumerate(BAD[kind])
]


@pytest.mark.parametrize("ftype, index, bad", FIELD_CASES)
def test_each_field_of_the_wrong_type_or_range(ftype: FrameType, index: int, bad: Any) -> None:
    wire = full_wire(SAMPLES[ftype])
    wire[index + 1] = bad
    name = FIELDS[ftype][index][0]
    assert_malformed(raw_frame(wire), after=2, mentions=f"field {name}")


GOOD_CASES = [
    pytest.param(ftype, i, good, id=f"{ftype.name}-{name}-{j}")
    for ftype, fields in FIELDS.items()
    for i, (name, kind) in enumerate(fields)
    for j, good in enumerate(GOOD[kind])
]


@pytest.mark.parametrize("ftype, index, good", GOOD_CASES)
def test_each_field_accepts_its_whole_range(ftype: FrameType, index: int, good: Any) -> None:
    wire = full_wire(SAMPLES[ftype])
    wire[index + 1] = good
    frame = decode_one(raw_frame(wire))
    assert frame is not None and frame.TYPE is ftype
    # Normalise through msgpack: ranges and entries come back as tuples. (WELCOME's trailing nil
    # optional fields are left off the wire.)
    again = msgpack.unpackb(msgpack.packb(frame_to_wire(frame)), raw=False)
    assert (again[index + 1] if index + 1 < len(again) else None) == good


@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
def test_wrong_field_count(ftype: FrameType) -> None:
    wire = full_wire(SAMPLES[ftype])
    required = REQUIRED.get(ftype, len(FIELDS[ftype]))
    assert_malformed(raw_frame(wire[: 1 + required - 1]), after=1, mentions="fields")
    assert_malformed(raw_frame([*wire, None]), after=1, mentions="fields")
    assert_malformed(raw_frame([int(ftype)]), after=1)


@pytest.mark.parametrize("type_code", [0, 30, 99, -1, 2**64 - 1, True, 1.0, "1", None, b"\x01", [1]])
def test_unknown_frame_type(type_code: Any) -> None:
    assert_malformed(raw_frame([type_code, 1, False]), after=3, mentions="type")


@pytest.mark.parametrize("obj", [5, "x", b"bytes", None, True, 1.5, {}, {"type": 20}, []])
def test_msgpack_that_is_not_a_non_empty_array(obj: Any) -> None:
    assert_malformed(raw_frame(obj), after=1)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # the one byte msgpack never uses
        b"\x93\x14",  # array of 3 with only the type
        b"\x93\x14\x01",
        b"\xdd\xff\xff\xff\xff",  # array32 announcing 4 billion items
        b"\xdb\xff\xff\xff\xff",  # str32 announcing 4 GiB
        b"\x93\x16\x00\xa2\xff\xfe",  # CLOSE whose reason is invalid UTF-8
        b"\x93\x14\x01\xc2\xc0",  # a valid NOOP followed by a stray nil in the same frame
        b"\x92\x09\x81\x01\x02",  # OK whose result map has an integer key
        b"\x91" * 5000 + b"\xc0",  # nested deeper than msgpack's stack
    ],
    ids=["reserved-c1", "short-array", "short-array-2", "array32", "str32", "utf8", "extra-data", "int-key", "deep"],
)
def test_not_msgpack(body: bytes) -> None:
    # An array announcing more items than any frame carries is refused as over a limit, before decoding it.
    code = ErrorCode.LIMIT_EXCEEDED if body.startswith(b"\xdd") else ErrorCode.MALFORMED_FRAME
    assert_malformed(raw_body(body), after=4, code=code)


@pytest.mark.parametrize(
    "value",
    [msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 0), msgpack.ExtType(127, b"")],
    ids=["ext5", "timestamp", "ext127"],
)
def test_ext_types_are_rejected_anywhere(value: Any) -> None:
    # As a field, inside a map argument, inside headers.
    assert_malformed(raw_frame([20, value, False]), after=1)
    assert_malformed(raw_frame([9, 1, {"k": value}]), after=1)
    assert_malformed(raw_frame([9, 1, {"k": [1, {"j": value}]}]), after=1)
    assert_malformed(raw_frame([10, 1, [["e", "k", b"", {"h": value}]]]), after=1)


def test_integers_beyond_the_field_range() -> None:
    # msgpack carries int64 and uint64; negative values for unsigned fields are out of range,
    # and so are transfer ids and delivery tags of 0.
    body = b"\x93\x14\xd3" + struct.pack(">q", -(2**63)) + b"\xc2"  # NOOP nonce = int64 min
    assert_malformed(raw_body(body), mentions="field nonce")
    body = b"\x93\x14\xcf" + struct.pack(">Q", 2**64 - 1) + b"\xc2"  # NOOP nonce = uint64 max: fine
    frame = decode_one(raw_body(body))
    assert frame is not None and frame.nonce == 2**64 - 1  # type: ignore[union-attr]


def test_nested_map_argument_within_the_item_limit_is_accepted_and_beyond_it_refused() -> None:
    def nested(levels: int) -> Any:
        value: Any = None
        for _ in range(levels):
            value = {"k": value}
        return value

    # every value at every depth is an item, a nested map too (the argument map itself is not)
    frame = decode_one(raw_frame([9, 1, nested(MAX_MAP_ITEMS)]))
    assert frame is not None and frame.TYPE is FrameType.OK
    assert_malformed(raw_frame([9, 1, nested(MAX_MAP_ITEMS + 1)]), mentions="MAX_MAP_ITEMS",
                     code=ErrorCode.LIMIT_EXCEEDED)


def test_a_flat_map_argument_of_max_map_items_keys_is_accepted() -> None:
    """docs/protocol.md: MAX_MAP_ITEMS (256) items; 256 keys used to be refused, the map counted as one."""
    frame = decode_one(raw_frame([9, 1, {f"k{i}": i for i in range(MAX_MAP_ITEMS)}]))
    assert frame is not None and frame.TYPE is FrameType.OK
    assert_malformed(raw_frame([9, 1, {f"k{i}": i for i in range(MAX_MAP_ITEMS + 1)}]), mentions="MAX_MAP_ITEMS",
                     code=ErrorCode.LIMIT_EXCEEDED)


# --- fuzzing: only RemoteProtocolError may leave the decoder ------------------------------------


def drain(data: bytes, chunk: int, eof: bool) -> list[Frame]:
    decoder = FrameDecoder(max_frame_size=4096)
    frames: list[Frame] = []
    try:
        for i in range(0, len(data), chunk):
            decoder.feed(data[i : i + chunk])
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
        if eof:
            decoder.feed(b"")
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
    except RemoteProtocolError as err:
        assert err.code in (ErrorCode.MALFORMED_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.LIMIT_EXCEEDED)
        assert err.frame_seq == len(frames) + 1  # the bad frame's 1-based position
    for frame in frames:
        # Whatever got through validation is a well-typed frame: it encodes and decodes again.
        again = FrameDecoder()
        again.feed(encode_frame(frame))
        assert type(again.next_frame()) is type(frame)
    return frames


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000), st.integers(1, 64), st.booleans())
def test_random_bytes(data: bytes, chunk: int, eof: bool) -> None:
    drain(data, chunk, eof)


@given(st.binary(max_size=500), st.integers(1, 64), st.booleans())
def test_random_bodies_behind_a_valid_length_prefix(body: bytes, chunk: int, eof: bool) -> None:
    assume(body)
    drain(raw_body(body) * 2, chunk, eof)


@given(any_frame, st.data())
def test_mutated_valid_frames(frame: Frame, data: st.DataObject) -> None:
    blob = bytearray(encode_frame(frame))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if not blob:
            break
        i = data.draw(st.integers(0, len(blob) - 1))
        if op == "flip":
            blob[i] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            blob.insert(i, data.draw(st.integers(0, 255)))
        elif op == "delete":
            del blob[i]
        else:
            del blob[i:]
    if data.draw(st.booleans()) and len(blob) >= 4:
        blob[:4] = struct.pack(">I", len(blob) - 4)  # keep the prefix consistent: only the body is bad
    drain(bytes(blob), data.draw(st.integers(1, 64)), data.draw(st.booleans()))


wire_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=10),
        st.binary(max_size=10),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
        st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999)),
    ),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=8,
)


@given(any_frame, st.data())
def test_structurally_mutated_frames(frame: Frame, data: st.DataObject) -> None:
    """Replace one element anywhere in the frame's msgpack tree by an arbitrary msgpack value."""
    wire: Any = frame_to_wire(frame)
    wire = msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)  # tuples -> lists
    # Collect every (container, index-or-key) in the tree.
    slots: list[tuple[Any, Any]] = []
    stack = [wire]
    while stack:
        node = stack.pop()
        keys = range(len(node)) if isinstance(node, list) else list(node)
        for k in keys:
            slots.append((node, k))
            if isinstance(node[k], (list, dict)):
                stack.append(node[k])
    container, key = data.draw(st.sampled_from(slots))
    container[key] = data.draw(wire_values)
    try:
        packed = msgpack.packb(wire, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        assume(False)
    drain(raw_body(packed), 4096, True)


# --- per-frame limits (protocol/limits.py) -------------------------------------------------------


@pytest.mark.parametrize(
    "over, under, mentions",
    [
        (
            [10, 1, [["", "q", b""]] * (MAX_ENTRIES_PER_FRAME + 1)],
            [10, 1, [["", "q", b""]] * MAX_ENTRIES_PER_FRAME],
            "MAX_ENTRIES_PER_FRAME",
        ),
        (
            [18, 1, [[1, "", "q", b"", None, False]] * (MAX_ENTRIES_PER_FRAME + 1)],
            [18, 1, [[1, "", "q", b"", None, False]] * MAX_ENTRIES_PER_FRAME],
            "MAX_ENTRIES_PER_FRAME",
        ),
        ([19, 0, [[1, 1]] * (MAX_RANGES_PER_FRAME + 1)], [19, 0, [[1, 1]] * MAX_RANGES_PER_FRAME], "MAX_RANGES_PER_FRAME"),
        (
            [10, 1, [["", "q", b"", {f"h{i}": i for i in range(MAX_HEADERS + 1)}]]],
            [10, 1, [["", "q", b"", {f"h{i}": i for i in range(MAX_HEADERS)}]]],
            "MAX_HEADERS",
        ),
    ],
    ids=["transfer-entries", "deliver-entries", "settle-ranges", "headers"],
)
def test_a_frame_over_a_per_frame_limit_is_refused_with_limit_exceeded(over: Any, under: Any, mentions: str) -> None:
    """One frame may not make its receiver do work out of proportion to its size (932k empty messages
    in one 8 MiB TRANSFER took the broker 6.1 s)."""
    assert decode_one(raw_frame(under)) is not None
    assert_malformed(raw_frame(over), mentions=mentions, code=ErrorCode.LIMIT_EXCEEDED)


def test_a_large_frame_that_is_not_data_is_refused_from_its_first_bytes() -> None:
    decoder = FrameDecoder(max_frame_size=8 * 1024 * 1024)
    decoder.feed(struct.pack(">I", MAX_CONTROL_FRAME + 1) + b"\x93\x09\x01")  # an OK frame, 64 KiB + 1
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED and "MAX_CONTROL_FRAME" in str(info.value)


def test_nested_junk_in_a_large_transfer_is_refused_within_a_container_budget() -> None:
    """msgpack builds every object before validation; a large frame decodes with a budget of containers."""
    junk = {f"k{i}": [[None] * 1000] * 1000 for i in range(2)}  # 2,000 arrays in one header value
    body = msgpack.packb([10, 1, [["", "q", b"x" * (1 << 20), {"h": junk}]]], use_bin_type=True)
    decoder = FrameDecoder(max_frame_size=8 * 1024 * 1024)
    decoder.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED and "arrays or maps" in str(info.value)
