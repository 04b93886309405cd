"""Frame codecs: exact bytes, round trips, and every reject reason."""

from __future__ import annotations

import struct

import pytest

from flowbroker.transport import frames as f
from flowbroker.transport.frames import (
    DataFrame,
    ErrorFrame,
    FrameType,
    Nak,
    RejectReason,
    ResponseSetup,
    RttMeasurement,
    Setup,
    StatusMessage,
    decode_datagram,
    encode_frame,
)

SESSION, STREAM, TERM = -1_234_567, 1001, 0x7BED8897


def data(term_offset: int, payload: bytes, flags: int = f.UNFRAGMENTED, term_id: int = TERM) -> DataFrame:
    return DataFrame(32 + len(payload), flags, term_offset, SESSION, STREAM, term_id, 0, payload)


ALL_CONTROL: list[f.Frame] = [
    Nak(SESSION, STREAM, TERM, 29184, 1280),
    StatusMessage(SESSION, STREAM, TERM, 4096, 128 * 1024, -(2**63)),
    StatusMessage(SESSION, STREAM, TERM, 0, 0, 5, group_tag=7, flags=f.SM_SETUP_FLAG),
    StatusMessage(SESSION, STREAM, TERM, 64, 1024, 2**63 - 1, flags=f.SM_EOS_FLAG),
    ErrorFrame(SESSION, STREAM, 99, 13, "image rejected"),
    ErrorFrame(SESSION, STREAM, 99, 13, "", group_tag=-3),
    Setup(1024, SESSION, STREAM, TERM - 5, TERM, 16 * 1024 * 1024, 1408, 0),
    Setup(0, SESSION, STREAM, 2**31 - 1, -(2**31), 64 * 1024, 65504, 8, flags=f.SETUP_SEND_RESPONSE_FLAG),
    RttMeasurement(SESSION, STREAM, 123_456_789_000, 0, 42, flags=f.RTTM_REPLY_FLAG),
    RttMeasurement(SESSION, STREAM, -1, 2**63 - 1, 0),
    ResponseSetup(SESSION, STREAM, 77),
]


@pytest.mark.parametrize("frame", ALL_CONTROL, ids=lambda fr: type(fr).__name__)
def test_control_frames_round_trip(frame: f.Frame) -> None:
    wire = encode_frame(frame)
    assert decode_datagram(wire) == ([frame], None)


def test_exact_sizes_and_common_header() -> None:
    sizes = {
        Nak: 28, Setup: 40, RttMeasurement: 40, ResponseSetup: 20,
    }
    for frame in ALL_CONTROL:
        wire = encode_frame(frame)
        length, version, flags, ftype = struct.unpack_from("<iBBH", wire)
        assert length == len(wire)
        assert version == 0
        if type(frame) in sizes:
            assert len(wire) == sizes[type(frame)]
    assert len(encode_frame(ALL_CONTROL[1])) == 36
    assert len(encode_frame(ALL_CONTROL[2])) == 44
    assert len(encode_frame(ALL_CONTROL[4])) == 40 + len("image rejected")


def test_status_message_layout_matches_reference() -> None:
    # receiver_id at byte 28 (not 8-aligned), group tag at 36, as StatusMessageFlyweight.
    sm = StatusMessage(1, 2, 3, 4, 5, 0x0102030405060708, group_tag=7, flags=0x80)
    wire = f.encode_status_message(sm)
    assert wire[:8] == struct.pack("<iBBH", 44, 0, 0x80, 3)
    assert struct.unpack_from("<iiiii", wire, 8) == (1, 2, 3, 4, 5)
    assert wire[28:36] == bytes.fromhex("0807060504030201")
    assert wire[36:44] == bytes.fromhex("0700000000000000")


def test_error_frame_layout_and_group_tag_flag() -> None:
    wire = f.encode_error(ErrorFrame(1, 2, 3, 13, "abc", group_tag=9, flags=0x01))
    assert struct.unpack_from("<iBBHiiqqii", wire) == (43, 0, 0x09, 4, 1, 2, 3, 9, 13, 3)
    assert wire[40:] == b"abc"
    (decoded,), reason = decode_datagram(wire)
    assert reason is None
    assert decoded == ErrorFrame(1, 2, 3, 13, "abc", group_tag=9, flags=0x01)
    long_text = f.encode_error(ErrorFrame(1, 2, 3, 13, "x" * 5000))
    assert len(long_text) == f.MAX_ERROR_FRAME_LENGTH


def test_setup_and_rttm_layout() -> None:
    wire = f.encode_setup(Setup(64, 10, 20, 30, 31, 65536, 1408, 0, flags=0x40))
    assert struct.unpack("<iBBHiiiiiiii", wire) == (40, 0, 0x40, 5, 64, 10, 20, 30, 31, 65536, 1408, 0)
    wire = f.encode_rttm(RttMeasurement(1, 2, 3, 4, 5, flags=0x80))
    assert struct.unpack("<iBBHiiqqq", wire) == (40, 0, 0x80, 6, 1, 2, 3, 4, 5)
    assert RttMeasurement(1, 2, 3, 4, 5, flags=0x80).is_reply_requested


def test_data_frame_is_aligned_with_zero_fill() -> None:
    frame = data(0, b"hello world!!!")  # 14 bytes -> frame_length 46, occupies 64
    wire = f.encode_data(frame)
    assert len(wire) == 64
    assert struct.unpack_from("<i", wire)[0] == 46
    assert wire[46:] == bytes(18)
    assert decode_datagram(wire) == ([frame], None)


def test_several_data_frames_then_pad_in_one_datagram() -> None:
    # The reference capture: Data(332->352), Data(332->352), Pad(frame_length 64) = 736 bytes.
    term_length = 64 * 1024
    base = term_length - 2 * 352 - 64
    frames: list[f.Frame] = [data(base, b"a" * 300), data(base + 352, b"b" * 300)]
    pad = DataFrame(64, f.UNFRAGMENTED, base + 704, SESSION, STREAM, TERM, frame_type=FrameType.PAD)
    wire = b"".join(f.encode_data(fr) for fr in frames) + f.encode_data(pad)  # type: ignore[arg-type]
    assert len(wire) == 736
    assert decode_datagram(wire, term_length) == (frames + [pad], None)
    assert pad.is_pad and pad.aligned_length == 64


def test_heartbeat_and_eos() -> None:
    hb = f.encode_heartbeat(4096, SESSION, STREAM, TERM)
    assert len(hb) == 32 and hb[5] == 0xC0
    (frame,), reason = decode_datagram(hb)
    assert reason is None and isinstance(frame, DataFrame)
    assert frame.is_heartbeat and not frame.is_eos and frame.term_offset == 4096
    eos = f.encode_heartbeat(4096, SESSION, STREAM, TERM, eos=True)
    assert eos[5] == 0xE0
    (frame,), _ = decode_datagram(eos)
    assert isinstance(frame, DataFrame) and frame.is_eos and frame.is_heartbeat


def test_fragment_flags() -> None:
    b = data(0, b"x", flags=f.BEGIN_FLAG)
    e = data(0, b"x", flags=f.END_FLAG)
    assert b.is_begin and not b.is_end and e.is_end and not e.is_begin


def test_write_data_header_in_place() -> None:
    buf = bytearray(128)
    f.write_data_header(buf, 32, 40, f.UNFRAGMENTED, 32, 1, 2, 3, 4)
    assert struct.unpack_from("<iBBHiiiiq", buf, 32) == (40, 0, 0xC0, 1, 32, 1, 2, 3, 4)
    assert buf[:32] == bytes(32)


def test_frame_type_of() -> None:
    assert f.frame_type_of(f.encode_nak(Nak(1, 2, 3, 0, 32))) == FrameType.NAK
    assert f.frame_type_of(b"short") is None


def test_align() -> None:
    assert [f.align(x) for x in (0, 1, 31, 32, 33, 46, 332)] == [0, 32, 32, 32, 64, 64, 352]
    assert f.align(5, 8) == 8


# ---------------------------------------------------------------------------------------- rejects


def header(length: int, ftype: int, flags: int = 0, version: int = 0) -> bytes:
    return struct.pack("<iBBH", length, version, flags, ftype)


def data_bytes(frame_length: int, term_offset: int, ftype: int = 1, **kw: int) -> bytes:
    return struct.pack(
        "<iBBHiiiiq", frame_length, kw.get("version", 0), 0xC0, ftype, term_offset,
        kw.get("session", SESSION), kw.get("stream", STREAM), kw.get("term", TERM), 0,
    )


GOOD_DATA = f.encode_data(data(0, b"z" * 40))  # frame_length 72, 96 bytes on the wire
SM_WIRE = f.encode_status_message(StatusMessage(1, 2, 3, 4, 5, 6))

REJECTS: list[tuple[str, bytes, RejectReason]] = [
    ("empty", b"", RejectReason.TOO_SHORT),
    ("7 bytes", b"\x00" * 7, RejectReason.TOO_SHORT),
    ("data header cut", GOOD_DATA[:31], RejectReason.TOO_SHORT),
    ("sm cut", SM_WIRE[:35], RejectReason.TOO_SHORT),
    ("nak cut", f.encode_nak(Nak(1, 2, 3, 0, 32))[:27], RejectReason.TOO_SHORT),
    ("setup cut", f.encode_setup(ALL_CONTROL[6])[:39], RejectReason.TOO_SHORT),  # type: ignore[arg-type]
    ("err cut", f.encode_error(ErrorFrame(1, 2, 3, 4, "x"))[:39], RejectReason.TOO_SHORT),
    ("version 1", header(8, 3, version=1), RejectReason.BAD_VERSION),
    ("data version 2", bytes([*GOOD_DATA[:4], 2, *GOOD_DATA[5:]]), RejectReason.BAD_VERSION),
    ("second frame bad version",
     data_bytes(32, 0) + data_bytes(32, 32, version=1), RejectReason.BAD_VERSION),
    ("type 0x0C", header(8, 0x0C), RejectReason.UNKNOWN_TYPE),
    ("type 0x1234", header(8, 0x1234), RejectReason.UNKNOWN_TYPE),
    ("RES", header(8, 7), RejectReason.UNSUPPORTED_TYPE),
    ("EXT", header(8, 0xFFFF), RejectReason.UNSUPPORTED_TYPE),
    ("ATS", header(8, 9), RejectReason.UNSUPPORTED_TYPE),
    ("data frame_length 10", data_bytes(10, 0), RejectReason.BAD_FRAME_LENGTH),
    ("data R bit", data_bytes(-100, 0), RejectReason.BAD_FRAME_LENGTH),
    ("heartbeat with tail", data_bytes(0, 0) + bytes(32), RejectReason.BAD_FRAME_LENGTH),
    ("pad unaligned length", data_bytes(70, 0, ftype=0), RejectReason.BAD_FRAME_LENGTH),
    ("sm length 40", struct.pack("<i", 40) + SM_WIRE[4:] + bytes(4), RejectReason.BAD_FRAME_LENGTH),
    ("nak length 30", struct.pack("<i", 30) + f.encode_nak(Nak(1, 2, 3, 0, 32))[4:], RejectReason.BAD_FRAME_LENGTH),
    ("ctrl negative length", struct.pack("<i", -1) + SM_WIRE[4:], RejectReason.BAD_FRAME_LENGTH),
    ("err text length mismatch",
     f.encode_error(ErrorFrame(1, 2, 3, 4, "xy"))[:36] + struct.pack("<i", 5) + b"xy", RejectReason.BAD_FRAME_LENGTH),
    ("err too long", struct.pack("<i", 2000) + f.encode_error(ErrorFrame(1, 2, 3, 4, ""))[4:], RejectReason.BAD_FRAME_LENGTH),
    ("data longer than datagram", GOOD_DATA[:64], RejectReason.FRAME_LONGER_THAN_DATAGRAM),
    ("sm gtag cut", f.encode_status_message(StatusMessage(1, 2, 3, 4, 5, 6, 7))[:40],
     RejectReason.FRAME_LONGER_THAN_DATAGRAM),
    ("err text cut", f.encode_error(ErrorFrame(1, 2, 3, 4, "hello"))[:42], RejectReason.FRAME_LONGER_THAN_DATAGRAM),
    ("data + 8 bytes", GOOD_DATA + bytes(8), RejectReason.TRAILING_BYTES),
    ("pad + body beyond length", data_bytes(32, 0, ftype=0) + bytes(32), RejectReason.TRAILING_BYTES),
    ("sm + 1", SM_WIRE + b"\x00", RejectReason.TRAILING_BYTES),
    ("rsp setup + 4", f.encode_response_setup(ResponseSetup(1, 2, 3)) + bytes(4), RejectReason.TRAILING_BYTES),
    ("data negative offset", data_bytes(64, -32) + bytes(32), RejectReason.TERM_OFFSET_OUT_OF_BOUNDS),
    ("data beyond max term", data_bytes(64, (1 << 30) - 32) + bytes(32), RejectReason.TERM_OFFSET_OUT_OF_BOUNDS),
    ("heartbeat negative offset", data_bytes(0, -64), RejectReason.TERM_OFFSET_OUT_OF_BOUNDS),
    ("nak negative offset", f.encode_nak(Nak(1, 2, 3, -32, 32)), RejectReason.TERM_OFFSET_OUT_OF_BOUNDS),
    ("sm negative offset", f.encode_status_message(StatusMessage(1, 2, 3, -4, 5, 6)),
     RejectReason.TERM_OFFSET_OUT_OF_BOUNDS),
    ("setup offset past term", f.encode_setup(Setup(65536, 1, 2, 3, 3, 65536, 1408)),
     RejectReason.TERM_OFFSET_OUT_OF_BOUNDS),
    ("data offset 16", data_bytes(32, 16), RejectReason.TERM_OFFSET_MISALIGNED),
    ("heartbeat offset 8", data_bytes(0, 8), RejectReason.TERM_OFFSET_MISALIGNED),
    ("setup offset 48", f.encode_setup(Setup(48, 1, 2, 3, 3, 65536, 1408)), RejectReason.TERM_OFFSET_MISALIGNED),
    ("second frame gap", data_bytes(32, 0) + data_bytes(32, 64), RejectReason.INCONSISTENT_FRAMES),
    ("second frame other session", data_bytes(32, 0) + data_bytes(32, 32, session=5), RejectReason.INCONSISTENT_FRAMES),
    ("second frame other term", data_bytes(32, 0) + data_bytes(32, 32, term=5), RejectReason.INCONSISTENT_FRAMES),
    ("second frame is sm", data_bytes(32, 0) + SM_WIRE[:32], RejectReason.INCONSISTENT_FRAMES),
    ("trailing 16 after data", GOOD_DATA + bytes(16), RejectReason.TRAILING_BYTES),
    ("negative window", f.encode_status_message(StatusMessage(1, 2, 3, 4, -5, 6)), RejectReason.BAD_FIELD),
    ("negative nak length", f.encode_nak(Nak(1, 2, 3, 0, -1)), RejectReason.BAD_FIELD),
    ("setup term 1000", f.encode_setup(Setup(0, 1, 2, 3, 3, 1000, 1408)), RejectReason.BAD_FIELD),
    ("setup mtu 1400", f.encode_setup(Setup(0, 1, 2, 3, 3, 65536, 1400)), RejectReason.BAD_FIELD),
    ("setup mtu 65536", f.encode_setup(Setup(0, 1, 2, 3, 3, 65536, 65536)), RejectReason.BAD_FIELD),
]


@pytest.mark.parametrize(("wire", "reason"), [(w, r) for _, w, r in REJECTS], ids=[n for n, _, _ in REJECTS])
def test_reject_reasons(wire: bytes, reason: RejectReason) -> None:
    assert decode_datagram(wire) == ([], reason)
    assert decode_datagram(bytearray(wire)) == ([], reason)
    assert decode_datagram(memoryview(wire)) == ([], reason)


def test_every_reject_reason_is_exercised() -> None:
    assert {r for _, _, r in REJECTS} == set(RejectReason)


def test_term_length_tightens_bounds() -> None:
    wire = f.encode_data(data(65536 - 64, b"q" * 40))  # occupies 96 bytes: past a 64 KiB term
    assert decode_datagram(wire)[1] is None
    assert decode_datagram(wire, 65536) == ([], RejectReason.TERM_OFFSET_OUT_OF_BOUNDS)
    pad = data_bytes(128, 65536 - 64, ftype=0)
    assert decode_datagram(pad, 65536) == ([], RejectReason.TERM_OFFSET_OUT_OF_BOUNDS)
    assert decode_datagram(f.encode_nak(Nak(1, 2, 3, 65536 - 32, 32)), 65536)[1] is None
    assert decode_datagram(f.encode_nak(Nak(1, 2, 3, 65536, 32)), 65536)[1] is RejectReason.TERM_OFFSET_OUT_OF_BOUNDS


def test_check_data_datagram_agrees_with_decode() -> None:
    for _, wire, reason in REJECTS:
        if f.frame_type_of(wire) in (FrameType.DATA, FrameType.PAD) and len(wire) >= 8 and wire[4] == 0:
            assert f.check_data_datagram(wire) is reason
    assert f.check_data_datagram(GOOD_DATA) is None


def test_last_frame_may_omit_alignment_fill() -> None:
    wire = f.encode_data(data(0, b"z" * 40))[:72]
    (frame,), reason = decode_datagram(wire)
    assert reason is None and isinstance(frame, DataFrame) and frame.payload == b"z" * 40


def test_error_text_that_is_not_utf8_survives_a_round_trip() -> None:
    wire = f.encode_error(ErrorFrame(1, 2, 3, 13, "")) [:36] + struct.pack("<i", 3) + b"\xff\xfeA"
    wire = struct.pack("<i", 43) + wire[4:]
    (frame,), reason = decode_datagram(wire)
    assert reason is None and isinstance(frame, ErrorFrame)
    assert f.encode_error(frame) == wire
