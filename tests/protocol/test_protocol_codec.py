"""Frame codec: round trips, byte-by-byte decoding, framing errors (empty, truncated, oversize)."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.protocol.protocol_strategies import FRAME_STRATEGIES, SAMPLES, any_frame, raw_body, raw_frame

from flowbroker.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    Close,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    Hello,
    LocalProtocolError,
    Noop,
    RemoteProtocolError,
    Transfer,
    TransferEntry,
    encode_frame,
    encode_frames,
)
from flowbroker.protocol.codec import LENGTH_PREFIX


def decode_all(data: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> list[Frame]:
    decoder = FrameDecoder(max_frame_size)
    decoder.feed(data)
    frames = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    assert decoder.buffered == 0
    return frames


def test_every_frame_type_has_a_strategy_and_a_sample() -> None:
    assert set(FRAME_STRATEGIES) == set(FrameType)
    assert set(SAMPLES) == set(FrameType)
    for ftype, frame in SAMPLES.items():
        assert frame.TYPE is ftype


@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
def test_sample_round_trips(ftype: FrameType) -> None:
    frame = SAMPLES[ftype]
    data = encode_frame(frame)
    (length,) = LENGTH_PREFIX.unpack_from(data)
    assert length == len(data) - 4
    # The wire shape is a msgpack array [type, fields in dataclass order].
    wire = msgpack.unpackb(data[4:], raw=False)
    assert wire[0] == int(ftype)
    assert decode_all(data) == [frame]


@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
@given(data=st.data())
def test_every_frame_type_round_trips(ftype: FrameType, data: st.DataObject) -> None:
    frame = data.draw(FRAME_STRATEGIES[ftype])
    decoded = decode_all(encode_frame(frame))
    assert decoded == [frame]
    assert type(decoded[0]) is type(frame)


@given(st.lists(any_frame, max_size=8))
def test_byte_at_a_time_gives_the_same_frames(frames: list[Frame]) -> None:
    data = encode_frames(frames)
    decoder = FrameDecoder()
    out = []
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
        # Never more than one partial frame is held.
        assert decoder.buffered < 4 + max((len(encode_frame(f)) for f in frames), default=0)
    assert out == frames
    assert decoder.buffered == 0
    assert decoder.frames_decoded == len(frames)


@given(st.lists(any_frame, min_size=1, max_size=6), st.data())
def test_any_split_gives_the_same_frames(frames: list[Frame], data: st.DataObject) -> None:
    blob = encode_frames(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=10)))
    decoder = FrameDecoder()
    out = []
    for start, end in zip([0, *cuts], [*cuts, len(blob)]):
        if start == end:
            continue  # b"" means EOF, not "no data"
        decoder.feed(blob[start:end])
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
    assert out == frames


def test_every_split_point_of_a_two_frame_stream() -> None:
    frames: list[Frame] = [SAMPLES[FrameType.TRANSFER], SAMPLES[FrameType.DELIVER]]
    blob = encode_frames(frames)
    for cut in range(1, len(blob)):
        decoder = FrameDecoder()
        decoder.feed(blob[:cut])
        out = []
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
        decoder.feed(blob[cut:])
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
        assert out == frames, cut


def test_encode_frames_concatenates() -> None:
    frames = list(SAMPLES.values())
    assert encode_frames(frames) == b"".join(encode_frame(f) for f in frames)
    assert decode_all(encode_frames(frames)) == frames
    assert encode_frames([]) == b""


def test_many_transfers_in_one_frame() -> None:
    entries = [TransferEntry("ex", f"key.{i}", bytes([i % 256]) * i) for i in range(100)]
    frame = Transfer(1, entries)
    (decoded,) = decode_all(encode_frame(frame))
    assert isinstance(decoded, Transfer)
    assert decoded.entries == entries
    assert all(e.headers is None and e.producer_id is None and e.sequence is None for e in decoded.entries)


def test_optional_trailing_fields_may_be_omitted_on_the_wire() -> None:
    # HELLO without auth, DECLARE_QUEUE without durable/arguments, transfer entries of 3 fields,
    # ERROR without frame_seq/ref_id/destination: all decode to the dataclass defaults.
    data = (
        raw_frame([1, 1, "c", True, []])
        + raw_frame([3, 9, "q"])
        + raw_frame([10, 5, [["x", "k", b"b"]]])
        + raw_frame([21, 8, "bad"])
    )
    hello, declare, transfer, error = decode_all(data)
    assert hello == Hello(1, "c", True, [], None)
    assert declare.durable is False and declare.arguments is None  # type: ignore[union-attr]
    assert transfer == Transfer(5, [TransferEntry("x", "k", b"b", None, None, None)])
    assert error.frame_seq is None and error.ref_id is None and error.destination is None  # type: ignore[union-attr]


def test_frames_decoded_counts_frames() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frames([Noop(1, False), Noop(2, True)]))
    assert decoder.frames_decoded == 0
    decoder.next_frame()
    assert decoder.frames_decoded == 1
    decoder.next_frame()
    assert decoder.frames_decoded == 2
    assert decoder.next_frame() is None


# --- framing errors -----------------------------------------------------------------------------


def test_empty_frame_is_malformed_with_its_sequence_number() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(Noop(1, False)) + LENGTH_PREFIX.pack(0))
    assert decoder.next_frame() == Noop(1, False)
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.code is ErrorCode.MALFORMED_FRAME
    assert info.value.frame_seq == 2


@pytest.mark.parametrize("keep", [1, 2, 3, 4, 5, -1])
def test_truncated_frame_at_eof(keep: int) -> None:
    good = encode_frame(Noop(1, False))
    bad = encode_frame(Close(ErrorCode.NORMAL, "bye"))[:keep]
    decoder = FrameDecoder()
    decoder.feed(good + bad)
    assert decoder.next_frame() == Noop(1, False)
    assert decoder.next_frame() is None  # more may still come
    decoder.feed(b"")
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.code is ErrorCode.MALFORMED_FRAME
    assert info.value.frame_seq == 2


def test_clean_eof_between_frames_is_not_an_error() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(Noop(1, False)))
    decoder.feed(b"")
    assert decoder.next_frame() == Noop(1, False)  # frames before EOF are still delivered
    assert decoder.next_frame() is None
    assert decoder.next_frame() is None


@pytest.mark.parametrize("announced", [1025, 4096, 2**31, 2**32 - 1])
def test_oversize_length_prefix_rejected_before_the_body_is_buffered(announced: int) -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    decoder.feed(encode_frame(Noop(1, False)))
    assert decoder.next_frame() == Noop(1, False)
    decoder.feed(LENGTH_PREFIX.pack(announced))  # only the prefix: the body has not arrived
    with pytest.raises(FrameTooLarge) as info:
        decoder.next_frame()
    err = info.value
    assert isinstance(err, RemoteProtocolError)
    assert err.code is ErrorCode.FRAME_TOO_LARGE
    assert err.frame_seq == 2
    assert err.length == announced and err.limit == 1024
    assert decoder.buffered == 4


def test_oversize_rejected_with_the_first_read_of_its_body() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    decoder.feed(LENGTH_PREFIX.pack(10 * 1024 * 1024) + b"\x00" * 100)
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()
    assert decoder.buffered <= 104


def test_frame_of_exactly_max_size_is_accepted() -> None:
    limit = 256
    base = encode_frame(Close(ErrorCode.NORMAL, ""))
    reason = "r" * (limit - (len(base) - 4) - 1)  # one str8 length byte more once reason >= 32 chars
    frame = Close(ErrorCode.NORMAL, reason)
    data = encode_frame(frame)
    assert len(data) - 4 == limit
    assert decode_all(data, max_frame_size=limit) == [frame]
    with pytest.raises(FrameTooLarge):
        decode_all(data, max_frame_size=limit - 1)


def test_max_frame_size_has_a_floor() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_size=63)
    FrameDecoder(max_frame_size=64)


def test_body_bigger_than_its_declared_length_is_malformed() -> None:
    body = msgpack.packb([20, 1, False])
    decoder = FrameDecoder()
    decoder.feed(raw_body(body + b"\xc0"))  # a valid array followed by a stray nil inside the frame
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.code is ErrorCode.MALFORMED_FRAME
    assert info.value.frame_seq == 1


# --- encoding errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        Noop(2**64, False),  # above uint64
        Close(ErrorCode.NORMAL, "\ud800"),  # a lone surrogate is not encodable UTF-8
        Transfer(1, [TransferEntry("x", "k", object())]),  # type: ignore[arg-type]
    ],
    ids=["int-too-big", "surrogate", "not-serialisable"],
)
def test_unencodable_frames_raise_local_protocol_error(frame: Frame) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(frame)


def test_an_error_text_or_close_reason_is_cut_to_max_error_text() -> None:
    """Texts quote what the peer sent (a 60,000-character bad argument was echoed in full): a client that
    never reads could have 10,000 such ERRORs pending on its connection, 600 MiB (a tester)."""
    from flowbroker.protocol.frames import Close, Error
    from flowbroker.protocol.limits import MAX_ERROR_TEXT

    long = "overflow must be 'reject' or 'drop-head', got " + "x" * 60_000
    error = Error(ErrorCode.INVALID_ARGUMENT, long, None, 7)
    assert len(error.text) == MAX_ERROR_TEXT and error.text.endswith("...") and error.text.startswith(long[:100])
    assert len(Close(ErrorCode.SHUTDOWN, long).reason) == MAX_ERROR_TEXT
    assert Error(ErrorCode.NOT_FOUND, "short").text == "short"


def test_an_error_destination_is_cut_as_its_text_is() -> None:
    """A TRANSFER to a 60,000-character exchange was answered NOT_FOUND with the text cut and the
    destination whole: 10,000 pending such ERRORs held 600 MiB for a client that never reads (a tester)."""
    from flowbroker.protocol.frames import Error
    from flowbroker.protocol.limits import MAX_ERROR_TEXT

    name = "e" * 60_000
    error = Error(ErrorCode.NOT_FOUND, f"no exchange named {name!r}", 3, 1, name)
    assert error.destination is not None and len(error.destination) == MAX_ERROR_TEXT
    assert error.destination.endswith("...") and error.destination.startswith("e" * 100)
    assert Error(ErrorCode.NOT_FOUND, "t", destination="orders").destination == "orders"


@pytest.mark.parametrize(("body", "reason"), [(b"\xc1", "starts no msgpack object"), (b"\x91" * 2000, "nested deeper")])
def test_a_malformed_frame_whose_msgpack_error_has_no_text_still_says_why(body: bytes, reason: str) -> None:
    """msgpack's FormatError and StackError come without a text: the ERROR ended "FormatError: " (a tester)."""
    decoder = FrameDecoder()
    decoder.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError, match=reason):
        decoder.next_frame()


def test_an_error_code_prints_by_name_and_is_encoded_as_its_number() -> None:
    """client.md names codes (`RequestError` code `ALREADY_EXISTS`); print(error.code) printed 15 (a tester)."""
    import json

    from flowbroker.protocol.errors import ErrorCode

    code = ErrorCode.UNAUTHORIZED
    assert (str(code), f"{code}", "%s" % code) == ("UNAUTHORIZED",) * 3
    assert code == int(code) and json.dumps({"code": code}) == f'{{"code": {int(code)}}}' and "%d" % code == str(int(code))
