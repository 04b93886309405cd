"""Aeron wire frames: exact little-endian layouts, encode and validating decode.

Layouts follow what the reference driver (1.47/1.48) puts on the wire, not the 2017 spec where they differ
(36-byte SM with a 64-bit receiver id, the 1.47 ERR frame, RSP_SETUP). See docs/transport.md and
../shared/reference/aeron-wire.md.

Why this shape:

* Every codec is a precompiled ``struct.Struct`` so a frame costs one C call to pack or unpack.
* The DATA path has ``write_data_header`` (``pack_into`` a term buffer at an offset) because the
  publication writes headers in place; nothing on that path allocates a frame object.
* ``decode_datagram`` never raises on bad input: a receiver must survive any datagram, so every problem is a
  ``RejectReason`` the caller counts, and a rejected datagram yields no frames at all (all or nothing, so
  a half-valid datagram never reaches a term buffer).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Final, TypeAlias

from flowbroker.transport.positions import TERM_MAX_LENGTH, is_valid_term_length

__all__ = [
    "BEGIN_END_AND_EOS_FLAGS",
    "BEGIN_FLAG",
    "CURRENT_VERSION",
    "DATA_HEADER",
    "DATA_HEADER_LENGTH",
    "END_FLAG",
    "EOS_FLAG",
    "ERROR_CODE_GENERIC_ERROR",
    "ERROR_CODE_IMAGE_REJECTED",
    "ERR_HAS_GROUP_TAG_FLAG",
    "ERR_HEADER_LENGTH",
    "FRAME_ALIGNMENT",
    "HEADER_LENGTH",
    "MAX_ERROR_FRAME_LENGTH",
    "MAX_ERROR_MESSAGE_LENGTH",
    "MAX_MTU",
    "MIN_MTU",
    "NAK_LENGTH",
    "RSP_SETUP_LENGTH",
    "RTTM_LENGTH",
    "RTTM_REPLY_FLAG",
    "SETUP_GROUP_FLAG",
    "SETUP_LENGTH",
    "SETUP_SEND_RESPONSE_FLAG",
    "SM_EOS_FLAG",
    "SM_LENGTH",
    "SM_LENGTH_WITH_GROUP_TAG",
    "SM_SETUP_FLAG",
    "UNFRAGMENTED",
    "Buffer",
    "DataFrame",
    "ErrorFrame",
    "Frame",
    "FrameType",
    "Nak",
    "RejectReason",
    "ResponseSetup",
    "RttMeasurement",
    "Setup",
    "StatusMessage",
    "align",
    "check_data_datagram",
    "decode_datagram",
    "encode_data",
    "encode_error",
    "encode_frame",
    "encode_heartbeat",
    "encode_nak",
    "encode_response_setup",
    "encode_rttm",
    "encode_setup",
    "encode_status_message",
    "frame_type_of",
    "write_data_header",
]

FRAME_ALIGNMENT: Final = 32
CURRENT_VERSION: Final = 0

HEADER_LENGTH: Final = 8
DATA_HEADER_LENGTH: Final = 32
NAK_LENGTH: Final = 28
SM_LENGTH: Final = 36
SM_LENGTH_WITH_GROUP_TAG: Final = 44
ERR_HEADER_LENGTH: Final = 40
MAX_ERROR_MESSAGE_LENGTH: Final = 1023
MAX_ERROR_FRAME_LENGTH: Final = ERR_HEADER_LENGTH + MAX_ERROR_MESSAGE_LENGTH
SETUP_LENGTH: Final = 40
RTTM_LENGTH: Final = 40
RSP_SETUP_LENGTH: Final = 20

MIN_MTU: Final = DATA_HEADER_LENGTH
MAX_MTU: Final = 65504

# DATA / PAD flags.
BEGIN_FLAG: Final = 0x80
END_FLAG: Final = 0x40
EOS_FLAG: Final = 0x20
UNFRAGMENTED: Final = BEGIN_FLAG | END_FLAG
BEGIN_END_AND_EOS_FLAGS: Final = BEGIN_FLAG | END_FLAG | EOS_FLAG
# SM flags.
SM_SETUP_FLAG: Final = 0x80
SM_EOS_FLAG: Final = 0x40
# SETUP flags.
SETUP_SEND_RESPONSE_FLAG: Final = 0x80
SETUP_GROUP_FLAG: Final = 0x40
# RTTM flags: "please reply".
RTTM_REPLY_FLAG: Final = 0x80
# ERR flags.
ERR_HAS_GROUP_TAG_FLAG: Final = 0x08

# ERR error codes (aeron_control_protocol.h / ErrorCode.java); a receiver refusing an image sends 13.
ERROR_CODE_GENERIC_ERROR: Final = 11
ERROR_CODE_IMAGE_REJECTED: Final = 13


class FrameType(enum.IntEnum):
    """Header type field values (HeaderFlyweight / aeron_udp_protocol.h)."""

    PAD = 0x00
    DATA = 0x01
    NAK = 0x02
    SM = 0x03
    ERR = 0x04
    SETUP = 0x05
    RTTM = 0x06
    RES = 0x07
    ATS_DATA = 0x08
    ATS_SETUP = 0x09  # C numbering; Java swaps 0x09/0x0A. Reserved either way.
    ATS_SM = 0x0A
    RSP_SETUP = 0x0B
    EXT = 0xFFFF


# Plain ints for the hot paths: an IntEnum attribute lookup costs more than the comparison.
_DATA_TYPE: Final = 0x01
_PAD_TYPE: Final = 0x00

# Known types this transport does not speak (name resolution, ATS, extension headers).
_UNSUPPORTED_TYPES: Final = frozenset(
    {FrameType.RES, FrameType.ATS_DATA, FrameType.ATS_SETUP, FrameType.ATS_SM, FrameType.EXT}
)


class RejectReason(enum.Enum):
    """Why a received datagram was dropped; one per rejected datagram, for counters."""

    TOO_SHORT = "too_short"  # shorter than the header its type needs
    BAD_VERSION = "bad_version"
    UNKNOWN_TYPE = "unknown_type"
    UNSUPPORTED_TYPE = "unsupported_type"  # RES, ATS, EXT: valid Aeron, not spoken here
    BAD_FRAME_LENGTH = "bad_frame_length"  # negative (R bit), below the header, not the type's size
    FRAME_LONGER_THAN_DATAGRAM = "frame_longer_than_datagram"
    TRAILING_BYTES = "trailing_bytes"  # bytes after the last frame that are no frame
    TERM_OFFSET_OUT_OF_BOUNDS = "term_offset_out_of_bounds"
    TERM_OFFSET_MISALIGNED = "term_offset_misaligned"
    INCONSISTENT_FRAMES = "inconsistent_frames"  # later frame not contiguous / other stream / not DATA-PAD
    BAD_FIELD = "bad_field"  # negative window or NAK length, invalid SETUP parameters


def align(value: int, alignment: int = FRAME_ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (a power of two), as Aeron's BitUtil.align."""
    return (value + alignment - 1) & ~(alignment - 1)


_HEADER: Final = struct.Struct("<iBBH")
DATA_HEADER: Final = struct.Struct("<iBBHiiiiq")
# A later frame's header as check_data_datagram reads it: without flags and reserved value, which it
# does not check (two fields fewer to build per frame).
_NEXT_HEADER: Final = struct.Struct("<iBxHiiii")
_NAK: Final = struct.Struct("<iBBHiiiii")
_SM: Final = struct.Struct("<iBBHiiiiiq")
_SM_GTAG: Final = struct.Struct("<iBBHiiiiiqq")
_ERR: Final = struct.Struct("<iBBHiiqqii")
_SETUP: Final = struct.Struct("<iBBHiiiiiiii")
_RTTM: Final = struct.Struct("<iBBHiiqqq")
_RSP_SETUP: Final = struct.Struct("<iBBHiii")

assert DATA_HEADER.size == DATA_HEADER_LENGTH and _NAK.size == NAK_LENGTH
assert _SM.size == SM_LENGTH and _SM_GTAG.size == SM_LENGTH_WITH_GROUP_TAG
assert _ERR.size == ERR_HEADER_LENGTH and _SETUP.size == SETUP_LENGTH
assert _RTTM.size == RTTM_LENGTH and _RSP_SETUP.size == RSP_SETUP_LENGTH


# ---------------------------------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class DataFrame:
    """A DATA or PAD frame (``frame_type``), a heartbeat when DATA with ``frame_length == 0``.

    ``payload`` holds the bytes after the header that are inside ``frame_length`` (always empty for PAD and
    heartbeats: on the wire a PAD is only its header, its length covers the rest of the term).
    """

    frame_length: int
    flags: int
    term_offset: int
    session_id: int
    stream_id: int
    term_id: int
    reserved_value: int = 0
    payload: bytes = b""
    frame_type: int = FrameType.DATA

    @property
    def is_pad(self) -> bool:
        return self.frame_type == FrameType.PAD

    @property
    def is_heartbeat(self) -> bool:
        return self.frame_type == FrameType.DATA and self.frame_length == 0

    @property
    def is_eos(self) -> bool:
        return bool(self.flags & EOS_FLAG)

    @property
    def is_begin(self) -> bool:
        return bool(self.flags & BEGIN_FLAG)

    @property
    def is_end(self) -> bool:
        return bool(self.flags & END_FLAG)

    @property
    def aligned_length(self) -> int:
        """Bytes the frame occupies in the term (PAD: up to the end of the term)."""
        return align(self.frame_length)


@dataclass(frozen=True, slots=True)
class Nak:
    """Receiver asks for ``length`` bytes from ``term_offset`` of ``term_id`` to be sent again."""

    session_id: int
    stream_id: int
    term_id: int
    term_offset: int
    length: int
    flags: int = 0


@dataclass(frozen=True, slots=True)
class StatusMessage:
    """Receiver's consumption position and window; ``group_tag`` makes it the 44-byte form."""

    session_id: int
    stream_id: int
    consumption_term_id: int
    consumption_term_offset: int
    receiver_window: int
    receiver_id: int
    group_tag: int | None = None
    flags: int = 0

    @property
    def is_setup_request(self) -> bool:
        return bool(self.flags & SM_SETUP_FLAG)

    @property
    def is_eos(self) -> bool:
        return bool(self.flags & SM_EOS_FLAG)


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """1.47+ ERR frame: a receiver telling the publication it rejected the image.

    ``flags`` excludes HAS_GROUP_TAG; that bit is derived from ``group_tag is not None``.
    """

    session_id: int
    stream_id: int
    receiver_id: int
    error_code: int
    message: str
    group_tag: int | None = None
    flags: int = 0


@dataclass(frozen=True, slots=True)
class Setup:
    """Publication announces its stream: where it is now and the term geometry."""

    term_offset: int
    session_id: int
    stream_id: int
    initial_term_id: int
    active_term_id: int
    term_length: int
    mtu: int
    ttl: int = 0
    flags: int = 0


@dataclass(frozen=True, slots=True)
class RttMeasurement:
    """RTT probe; REPLY flag set means "please reply" (the C driver's reading of the bit)."""

    session_id: int
    stream_id: int
    echo_timestamp: int
    reception_delta: int
    receiver_id: int
    flags: int = 0

    @property
    def is_reply_requested(self) -> bool:
        return bool(self.flags & RTTM_REPLY_FLAG)


@dataclass(frozen=True, slots=True)
class ResponseSetup:
    """Response-channel setup (``control-mode=response``), decoded for completeness."""

    session_id: int
    stream_id: int
    response_session_id: int
    flags: int = 0


Frame: TypeAlias = DataFrame | Nak | StatusMessage | ErrorFrame | Setup | RttMeasurement | ResponseSetup


# ---------------------------------------------------------------------------------------------- encode


def write_data_header(
    buf: bytearray | memoryview,
    offset: int,
    frame_length: int,
    flags: int,
    term_offset: int,
    session_id: int,
    stream_id: int,
    term_id: int,
    reserved_value: int = 0,
    frame_type: int = FrameType.DATA,
) -> None:
    """Write a DATA/PAD header in place (the publication's hot path: no allocation)."""
    DATA_HEADER.pack_into(
        buf, offset, frame_length, CURRENT_VERSION, flags, frame_type,
        term_offset, session_id, stream_id, term_id, reserved_value,
    )


def encode_data(frame: DataFrame) -> bytes:
    """One DATA/PAD frame as it goes on the wire: header, payload, zero fill to the 32-byte boundary.

    A PAD goes out as its 32-byte header only, whatever its ``frame_length``, as the reference driver does.
    """
    header = DATA_HEADER.pack(
        frame.frame_length, CURRENT_VERSION, frame.flags, frame.frame_type,
        frame.term_offset, frame.session_id, frame.stream_id, frame.term_id, frame.reserved_value,
    )
    if frame.frame_type == FrameType.PAD or frame.frame_length == 0:
        return header
    body = header + frame.payload
    return body + bytes(align(len(body)) - len(body))


def encode_heartbeat(
    term_offset: int, session_id: int, stream_id: int, term_id: int, *, eos: bool = False
) -> bytes:
    """The 32-byte heartbeat (frame_length 0) at the sender position; flags 0xE0 at end of stream."""
    flags = BEGIN_END_AND_EOS_FLAGS if eos else UNFRAGMENTED
    return DATA_HEADER.pack(
        0, CURRENT_VERSION, flags, FrameType.DATA, term_offset, session_id, stream_id, term_id, 0
    )


def encode_nak(nak: Nak) -> bytes:
    return _NAK.pack(
        NAK_LENGTH, CURRENT_VERSION, nak.flags, FrameType.NAK,
        nak.session_id, nak.stream_id, nak.term_id, nak.term_offset, nak.length,
    )


def encode_status_message(sm: StatusMessage) -> bytes:
    if sm.group_tag is None:
        return _SM.pack(
            SM_LENGTH, CURRENT_VERSION, sm.flags, FrameType.SM, sm.session_id, sm.stream_id,
            sm.consumption_term_id, sm.consumption_term_offset, sm.receiver_window, sm.receiver_id,
        )
    return _SM_GTAG.pack(
        SM_LENGTH_WITH_GROUP_TAG, CURRENT_VERSION, sm.flags, FrameType.SM, sm.session_id, sm.stream_id,
        sm.consumption_term_id, sm.consumption_term_offset, sm.receiver_window, sm.receiver_id,
        sm.group_tag,
    )


def encode_error(err: ErrorFrame) -> bytes:
    """ERR frame; the text is truncated to 1023 bytes as the driver does (MAX_ERROR_FRAME_LENGTH)."""
    try:  # surrogateescape: a received text that was not UTF-8 goes back out byte for byte
        text = err.message.encode("utf-8", "surrogateescape")[:MAX_ERROR_MESSAGE_LENGTH]
    except UnicodeEncodeError:
        text = err.message.encode("utf-8", "replace")[:MAX_ERROR_MESSAGE_LENGTH]
    flags = err.flags & ~ERR_HAS_GROUP_TAG_FLAG
    if err.group_tag is not None:
        flags |= ERR_HAS_GROUP_TAG_FLAG
    header = _ERR.pack(
        ERR_HEADER_LENGTH + len(text), CURRENT_VERSION, flags, FrameType.ERR, err.session_id,
        err.stream_id, err.receiver_id, 0 if err.group_tag is None else err.group_tag,
        err.error_code, len(text),
    )
    return header + text


def encode_setup(setup: Setup) -> bytes:
    return _SETUP.pack(
        SETUP_LENGTH, CURRENT_VERSION, setup.flags, FrameType.SETUP, setup.term_offset,
        setup.session_id, setup.stream_id, setup.initial_term_id, setup.active_term_id,
        setup.term_length, setup.mtu, setup.ttl,
    )


def encode_rttm(rttm: RttMeasurement) -> bytes:
    return _RTTM.pack(
        RTTM_LENGTH, CURRENT_VERSION, rttm.flags, FrameType.RTTM, rttm.session_id, rttm.stream_id,
        rttm.echo_timestamp, rttm.reception_delta, rttm.receiver_id,
    )


def encode_response_setup(rsp: ResponseSetup) -> bytes:
    return _RSP_SETUP.pack(
        RSP_SETUP_LENGTH, CURRENT_VERSION, rsp.flags, FrameType.RSP_SETUP,
        rsp.session_id, rsp.stream_id, rsp.response_session_id,
    )


def encode_frame(frame: Frame) -> bytes:
    """Encode any frame (convenience for control paths and tests; DATA hot paths use write_data_header)."""
    if isinstance(frame, DataFrame):
        return encode_data(frame)
    if isinstance(frame, StatusMessage):
        return encode_status_message(frame)
    if isinstance(frame, Nak):
        return encode_nak(frame)
    if isinstance(frame, Setup):
        return encode_setup(frame)
    if isinstance(frame, RttMeasurement):
        return encode_rttm(frame)
    if isinstance(frame, ErrorFrame):
        return encode_error(frame)
    return encode_response_setup(frame)


# ---------------------------------------------------------------------------------------------- decode

Buffer: TypeAlias = bytes | bytearray | memoryview

def _reject(reason: RejectReason) -> tuple[list[Frame], RejectReason | None]:
    return [], reason


def frame_type_of(buf: Buffer) -> int | None:
    """The type field of the first header, or None if the datagram is too short to have one."""
    if len(buf) < HEADER_LENGTH:
        return None
    return int(_HEADER.unpack_from(buf, 0)[3])


def check_data_datagram(buf: Buffer, term_length: int = TERM_MAX_LENGTH) -> RejectReason | None:
    """Validate a DATA/PAD datagram without building frame objects (the receiver's hot path).

    Rules (all from the reference sender's term scanner, so a valid Aeron sender always passes):
    the datagram is a run of frames copied from one term, each at ``align(frame_length)`` from the previous,
    with consecutive term offsets and the same session, stream and term id; a 32-byte DATA with
    frame_length 0 is a heartbeat; a PAD is the last frame and only its header needs to be present.
    """
    n = len(buf)
    if n < DATA_HEADER_LENGTH:
        return RejectReason.TOO_SHORT
    unpack = DATA_HEADER.unpack_from
    frame_length, version, _flags, ftype, term_offset, session_id, stream_id, term_id, _rv = unpack(buf, 0)
    if version != CURRENT_VERSION:
        return RejectReason.BAD_VERSION
    if ftype == _DATA_TYPE and frame_length == 0:
        # Heartbeat: exactly 32 bytes, at an aligned offset inside the term.
        if n != DATA_HEADER_LENGTH:
            return RejectReason.BAD_FRAME_LENGTH
        if term_offset < 0 or term_offset >= term_length:
            return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
        if term_offset & (FRAME_ALIGNMENT - 1):
            return RejectReason.TERM_OFFSET_MISALIGNED
        return None
    # The first frame's offset is checked here; each later one must be at the end of the one before
    # (INCONSISTENT_FRAMES otherwise), so it is aligned and in range too: only its length is checked.
    if frame_length < DATA_HEADER_LENGTH:
        return RejectReason.BAD_FRAME_LENGTH
    if term_offset < 0:
        return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
    if term_offset & (FRAME_ALIGNMENT - 1):
        return RejectReason.TERM_OFFSET_MISALIGNED
    next_header = _NEXT_HEADER.unpack_from
    offset = 0
    while True:
        if ftype == _PAD_TYPE:
            if frame_length & (FRAME_ALIGNMENT - 1):
                return RejectReason.BAD_FRAME_LENGTH
            if term_offset + frame_length > term_length:
                return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
            if n > offset + frame_length:
                return RejectReason.TRAILING_BYTES
            return None
        aligned = (frame_length + FRAME_ALIGNMENT - 1) & ~(FRAME_ALIGNMENT - 1)
        expected_offset = term_offset + aligned
        if expected_offset > term_length:
            return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
        if offset + frame_length > n:
            return RejectReason.FRAME_LONGER_THAN_DATAGRAM
        offset += aligned
        if offset >= n:
            return None
        if n - offset < DATA_HEADER_LENGTH:
            return RejectReason.TRAILING_BYTES
        frame_length, version, ftype, term_offset, s2, st2, t2 = next_header(buf, offset)
        if version != CURRENT_VERSION:
            return RejectReason.BAD_VERSION
        if (
            (ftype != _DATA_TYPE and ftype != _PAD_TYPE)
            or term_offset != expected_offset
            or s2 != session_id
            or st2 != stream_id
            or t2 != term_id
        ):
            return RejectReason.INCONSISTENT_FRAMES
        if frame_length < DATA_HEADER_LENGTH:
            return RejectReason.BAD_FRAME_LENGTH


def _decode_data(buf: Buffer, term_length: int) -> tuple[list[Frame], RejectReason | None]:
    reason = check_data_datagram(buf, term_length)
    if reason is not None:
        return [], reason
    frames: list[Frame] = []
    n = len(buf)
    offset = 0
    mv = memoryview(buf)
    while offset < n:
        fl, _v, flags, ftype, to, sid, stid, tid, rv = DATA_HEADER.unpack_from(buf, offset)
        if ftype == FrameType.PAD or fl == 0:
            frames.append(DataFrame(fl, flags, to, sid, stid, tid, rv, b"", ftype))
            break
        frames.append(
            DataFrame(fl, flags, to, sid, stid, tid, rv, bytes(mv[offset + DATA_HEADER_LENGTH:offset + fl]), ftype)
        )
        offset += align(fl)
    return frames, None


def _check_control_length(n: int, frame_length: int, exact: int) -> RejectReason | None:
    if n < exact:
        return RejectReason.TOO_SHORT
    if frame_length != exact:
        return RejectReason.BAD_FRAME_LENGTH
    if n > exact:
        return RejectReason.TRAILING_BYTES
    return None


def decode_datagram(
    buf: Buffer, term_length: int = TERM_MAX_LENGTH
) -> tuple[list[Frame], RejectReason | None]:
    """Decode every frame of one received datagram, or none of them and the reason.

    ``term_length`` (when the receiver knows the stream's) tightens the term offset bounds; the default
    bounds by the largest legal term. Control frames (NAK, SM, ERR, SETUP, RTTM, RSP_SETUP) travel one per
    datagram, as the reference driver sends them. Never raises for any content of ``buf``.
    """
    n = len(buf)
    if n < HEADER_LENGTH:
        return _reject(RejectReason.TOO_SHORT)
    frame_length, version, flags, ftype = _HEADER.unpack_from(buf, 0)
    if version != CURRENT_VERSION:
        return _reject(RejectReason.BAD_VERSION)
    if ftype == FrameType.DATA or ftype == FrameType.PAD:
        return _decode_data(buf, term_length)
    if frame_length < 0:
        return _reject(RejectReason.BAD_FRAME_LENGTH)
    if ftype == FrameType.SM:
        if n < SM_LENGTH:
            return _reject(RejectReason.TOO_SHORT)
        if frame_length not in (SM_LENGTH, SM_LENGTH_WITH_GROUP_TAG):
            return _reject(RejectReason.BAD_FRAME_LENGTH)
        if frame_length > n:
            return _reject(RejectReason.FRAME_LONGER_THAN_DATAGRAM)
        if n > frame_length:
            return _reject(RejectReason.TRAILING_BYTES)
        if frame_length == SM_LENGTH:
            _l, _v, _f, _t, sid, stid, tid, to, wnd, rid = _SM.unpack_from(buf, 0)
            gtag: int | None = None
        else:
            _l, _v, _f, _t, sid, stid, tid, to, wnd, rid, gtag = _SM_GTAG.unpack_from(buf, 0)
        if to < 0 or to > term_length:
            return _reject(RejectReason.TERM_OFFSET_OUT_OF_BOUNDS)
        if wnd < 0:
            return _reject(RejectReason.BAD_FIELD)
        return [StatusMessage(sid, stid, tid, to, wnd, rid, gtag, flags)], None
    if ftype == FrameType.NAK:
        reason = _check_control_length(n, frame_length, NAK_LENGTH)
        if reason is not None:
            return _reject(reason)
        _l, _v, _f, _t, sid, stid, tid, to, length = _NAK.unpack_from(buf, 0)
        if to < 0 or to > term_length - DATA_HEADER_LENGTH:
            return _reject(RejectReason.TERM_OFFSET_OUT_OF_BOUNDS)
        if length < 0:
            return _reject(RejectReason.BAD_FIELD)
        return [Nak(sid, stid, tid, to, length, flags)], None
    if ftype == FrameType.SETUP:
        reason = _check_control_length(n, frame_length, SETUP_LENGTH)
        if reason is not None:
            return _reject(reason)
        _l, _v, _f, _t, to, sid, stid, itid, atid, tlen, mtu, ttl = _SETUP.unpack_from(buf, 0)
        if not is_valid_term_length(tlen) or not (MIN_MTU <= mtu <= MAX_MTU) or mtu % FRAME_ALIGNMENT or ttl < 0:
            return _reject(RejectReason.BAD_FIELD)
        if to < 0 or to > tlen - DATA_HEADER_LENGTH:
            return _reject(RejectReason.TERM_OFFSET_OUT_OF_BOUNDS)
        if to & (FRAME_ALIGNMENT - 1):
            return _reject(RejectReason.TERM_OFFSET_MISALIGNED)
        return [Setup(to, sid, stid, itid, atid, tlen, mtu, ttl, flags)], None
    if ftype == FrameType.RTTM:
        reason = _check_control_length(n, frame_length, RTTM_LENGTH)
        if reason is not None:
            return _reject(reason)
        _l, _v, _f, _t, sid, stid, echo, delta, rid = _RTTM.unpack_from(buf, 0)
        return [RttMeasurement(sid, stid, echo, delta, rid, flags)], None
    if ftype == FrameType.RSP_SETUP:
        reason = _check_control_length(n, frame_length, RSP_SETUP_LENGTH)
        if reason is not None:
            return _reject(reason)
        _l, _v, _f, _t, sid, stid, rsid = _RSP_SETUP.unpack_from(buf, 0)
        return [ResponseSetup(sid, stid, rsid, flags)], None
    if ftype == FrameType.ERR:
        if n < ERR_HEADER_LENGTH:
            return _reject(RejectReason.TOO_SHORT)
        if frame_length < ERR_HEADER_LENGTH or frame_length > MAX_ERROR_FRAME_LENGTH:
            return _reject(RejectReason.BAD_FRAME_LENGTH)
        if frame_length > n:
            return _reject(RejectReason.FRAME_LONGER_THAN_DATAGRAM)
        if n > frame_length:
            return _reject(RejectReason.TRAILING_BYTES)
        _l, _v, _f, _t, sid, stid, rid, gtag_raw, code, text_length = _ERR.unpack_from(buf, 0)
        if text_length != frame_length - ERR_HEADER_LENGTH:
            return _reject(RejectReason.BAD_FRAME_LENGTH)
        text = bytes(buf[ERR_HEADER_LENGTH:frame_length]).decode("utf-8", "surrogateescape")
        has_tag = bool(flags & ERR_HAS_GROUP_TAG_FLAG)
        return [
            ErrorFrame(sid, stid, rid, code, text, gtag_raw if has_tag else None, flags & ~ERR_HAS_GROUP_TAG_FLAG)
        ], None
    if ftype in _UNSUPPORTED_TYPES:
        return _reject(RejectReason.UNSUPPORTED_TYPE)
    return _reject(RejectReason.UNKNOWN_TYPE)
