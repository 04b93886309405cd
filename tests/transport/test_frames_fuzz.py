"""Hypothesis: the receive-side decoder survives anything and accounts for every datagram."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowbroker.transport import frames as f
from flowbroker.transport.frames import RejectReason, decode_datagram
from flowbroker.transport.terms import FragmentAssembler, TermRebuilder

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
NON_NEG32 = st.integers(0, 2**31 - 1)
FLAGS = st.integers(0, 255)
TERM_LENGTHS = st.sampled_from([1 << s for s in range(16, 31)])
SMALL_TERM = 64 * 1024


@st.composite
def data_frames(draw: st.DrawFn) -> f.DataFrame:
    payload = draw(st.binary(max_size=300))
    offset = draw(st.integers(0, (SMALL_TERM - 400) // 32)) * 32
    return f.DataFrame(32 + len(payload), draw(FLAGS), offset, draw(INT32), draw(INT32), draw(INT32),
                       draw(INT64), payload)


@st.composite
def setups(draw: st.DrawFn) -> f.Setup:
    term_length = draw(TERM_LENGTHS)
    offset = draw(st.integers(0, term_length // 32 - 1)) * 32
    mtu = draw(st.integers(1, 65504 // 32)) * 32
    return f.Setup(offset, draw(INT32), draw(INT32), draw(INT32), draw(INT32), term_length, mtu,
                   draw(st.integers(0, 255)), draw(FLAGS))


CONTROL = st.one_of(
    st.builds(f.Nak, INT32, INT32, INT32, st.integers(0, SMALL_TERM - 32), NON_NEG32, FLAGS),
    st.builds(f.StatusMessage, INT32, INT32, INT32, st.integers(0, SMALL_TERM), NON_NEG32, INT64,
              st.none() | INT64, FLAGS),
    st.builds(f.ErrorFrame, INT32, INT32, INT64, INT32,
              st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=200),
              st.none() | INT64, FLAGS.map(lambda x: x & ~f.ERR_HAS_GROUP_TAG_FLAG)),
    setups(),
    st.builds(f.RttMeasurement, INT32, INT32, INT64, INT64, INT64, FLAGS),
    st.builds(f.ResponseSetup, INT32, INT32, INT32, FLAGS),
)
ANY_FRAME = st.one_of(CONTROL, data_frames())


@given(ANY_FRAME)
def test_every_valid_frame_round_trips(frame: f.Frame) -> None:
    assert decode_datagram(f.encode_frame(frame), SMALL_TERM) == ([frame], None)


@st.composite
def valid_datagrams(draw: st.DrawFn) -> bytes:
    """A control frame, a heartbeat, or a run of contiguous DATA frames optionally ending in PAD."""
    kind = draw(st.sampled_from(["control", "heartbeat", "run"]))
    if kind == "control":
        return f.encode_frame(draw(CONTROL))
    session, stream, term = draw(INT32), draw(INT32), draw(INT32)
    offset = draw(st.integers(0, 1000)) * 32
    if kind == "heartbeat":
        return f.encode_heartbeat(offset, session, stream, term, eos=draw(st.booleans()))
    out = b""
    for payload in draw(st.lists(st.binary(max_size=200), min_size=1, max_size=5)):
        frame = f.DataFrame(32 + len(payload), draw(FLAGS), offset, session, stream, term, 0, payload)
        out += f.encode_data(frame)
        offset += frame.aligned_length
    if draw(st.booleans()):
        out += f.encode_data(f.DataFrame(SMALL_TERM - offset, 0xC0, offset, session, stream, term,
                                         frame_type=f.FrameType.PAD))
    return out


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(valid_datagrams()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "extend", "int"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif op == "extend":
            data += draw(st.binary(max_size=64))
        elif op == "int" and len(data) >= 4:
            # Overwrite a 4-byte field at a 4-aligned spot with an edge value (lengths, offsets, ids).
            i = draw(st.integers(0, len(data) // 4 - 1)) * 4
            value = draw(st.sampled_from([0, 1, 31, 32, -1, -32, 2**31 - 1, -(2**31), 28, 36, 40, 44, 1063]))
            data[i:i + 4] = value.to_bytes(4, "little", signed=True)
    return bytes(data)


def check_accounting(datagrams: list[bytes], term_length: int) -> None:
    accepted = 0
    rejected: Counter[RejectReason] = Counter()
    for datagram in datagrams:
        frames, reason = decode_datagram(datagram, term_length)
        if reason is None:
            assert frames, "an accepted datagram carries at least one frame"
            accepted += 1
            check_accepted(datagram, frames, term_length)
        else:
            assert frames == [], "a rejected datagram yields no frames"
            assert isinstance(reason, RejectReason)
            rejected[reason] += 1
        if f.frame_type_of(datagram) in (f.FrameType.DATA, f.FrameType.PAD) and datagram[4] == 0:
            assert f.check_data_datagram(datagram, term_length) is reason
    assert accepted + sum(rejected.values()) == len(datagrams)


def check_accepted(datagram: bytes, frames: list[f.Frame], term_length: int) -> None:
    """Accepted means canonical: every header byte re-encodes identically, and it fits in its term."""
    first = frames[0]
    if isinstance(first, f.ErrorFrame):
        # Without HAS_GROUP_TAG the tag bytes are ignored (as Aeron does); text is decoded leniently.
        expected = bytearray(datagram)
        if first.group_tag is None:
            expected[24:32] = bytes(8)
        assert len(frames) == 1 and f.encode_frame(first) == expected
        return
    if not isinstance(first, f.DataFrame):
        assert len(frames) == 1 and f.encode_frame(first) == datagram
        return
    offset = 0
    for frame in frames:
        assert isinstance(frame, f.DataFrame)
        wire = f.encode_data(frame)
        end = offset + (32 if frame.is_pad or frame.is_heartbeat else frame.frame_length)
        assert datagram[offset:end] == wire[:end - offset]
        assert frame.term_offset % 32 == 0 and 0 <= frame.term_offset < term_length
        assert frame.term_offset + frame.aligned_length <= term_length
        offset += frame.aligned_length
    # The image would insert it and read it without raising or looping.
    if term_length == SMALL_TERM and not first.is_heartbeat:
        image = TermRebuilder(SMALL_TERM, first.term_id)
        assert first.term_offset + len(datagram) <= SMALL_TERM or first.is_pad
        image.insert(first.term_id, first.term_offset, datagram)
        position = first.term_offset
        end_position = min(position + len(datagram), image.term_length)
        image.scan_for_gap(position, end_position)
        image.read(position, end_position, FragmentAssembler(lambda m: None))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=120), max_size=20), TERM_LENGTHS)
def test_random_bytes_never_raise_and_are_accounted(datagrams: list[bytes], term_length: int) -> None:
    check_accounting(datagrams, term_length)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated(), min_size=1, max_size=10), st.sampled_from([SMALL_TERM, 1 << 30]))
def test_mutated_datagrams_never_raise_and_are_accounted(datagrams: list[bytes], term_length: int) -> None:
    check_accounting(datagrams, term_length)


@settings(max_examples=200, deadline=None)
@given(st.lists(valid_datagrams(), min_size=1, max_size=10))
def test_valid_datagrams_are_accepted(datagrams: list[bytes]) -> None:
    for datagram in datagrams:
        frames, reason = decode_datagram(datagram, SMALL_TERM)
        assert reason is None and frames


def test_mutations_reach_many_reject_reasons() -> None:
    """The fuzzer is not vacuous: mutated input lands under most of the reasons."""
    seen: set[RejectReason] = set()

    @settings(max_examples=1500, database=None, derandomize=True)
    @given(mutated())
    def collect(datagram: bytes) -> None:
        reason = decode_datagram(datagram, SMALL_TERM)[1]
        if reason is not None:
            seen.add(reason)

    collect()
    assert len(seen) >= 8, seen


def _reference_check_data_datagram(buf: bytes, term_length: int) -> RejectReason | None:
    """check_data_datagram as it was before it stopped re-checking a later frame's offset (implied by
    the consistency check) and unpacking its flags and reserved value: the reasons must not change."""
    n = len(buf)
    if n < f.DATA_HEADER_LENGTH:
        return RejectReason.TOO_SHORT
    unpack = f.DATA_HEADER.unpack_from
    frame_length, version, _flags, ftype, term_offset, session_id, stream_id, term_id, _rv = unpack(buf, 0)
    if version != f.CURRENT_VERSION:
        return RejectReason.BAD_VERSION
    if ftype == 0x01 and frame_length == 0:
        if n != f.DATA_HEADER_LENGTH:
            return RejectReason.BAD_FRAME_LENGTH
        if term_offset < 0 or term_offset >= term_length:
            return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
        if term_offset & (f.FRAME_ALIGNMENT - 1):
            return RejectReason.TERM_OFFSET_MISALIGNED
        return None
    offset = 0
    expected_offset = term_offset
    while True:
        if frame_length < f.DATA_HEADER_LENGTH:
            return RejectReason.BAD_FRAME_LENGTH
        if term_offset < 0:
            return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
        if term_offset & (f.FRAME_ALIGNMENT - 1):
            return RejectReason.TERM_OFFSET_MISALIGNED
        if ftype == 0x00:
            if frame_length & (f.FRAME_ALIGNMENT - 1):
                return RejectReason.BAD_FRAME_LENGTH
            if term_offset + frame_length > term_length:
                return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
            if n > offset + frame_length:
                return RejectReason.TRAILING_BYTES
            return None
        aligned = (frame_length + f.FRAME_ALIGNMENT - 1) & ~(f.FRAME_ALIGNMENT - 1)
        if term_offset + aligned > term_length:
            return RejectReason.TERM_OFFSET_OUT_OF_BOUNDS
        if offset + frame_length > n:
            return RejectReason.FRAME_LONGER_THAN_DATAGRAM
        offset += aligned
        if offset >= n:
            return None
        if n - offset < f.DATA_HEADER_LENGTH:
            return RejectReason.TRAILING_BYTES
        expected_offset += aligned
        (frame_length, version, _flags, ftype, term_offset, s2, st2, t2, _rv) = unpack(buf, offset)
        if version != f.CURRENT_VERSION:
            return RejectReason.BAD_VERSION
        if (
            (ftype != 0x01 and ftype != 0x00)
            or term_offset != expected_offset
            or s2 != session_id
            or st2 != stream_id
            or t2 != term_id
        ):
            return RejectReason.INCONSISTENT_FRAMES


@st.composite
def later_frame_mutated(draw: st.DrawFn) -> bytes:
    """A run of DATA frames (maybe ending in PAD) with one header field of a later frame set to an edge
    value: what the check looks at per later frame (length, version, type, offset, ids)."""
    session, stream, term = draw(INT32), draw(INT32), draw(INT32)
    offset = draw(st.integers(0, 2040)) * 32
    data = bytearray()
    starts = []
    for payload in draw(st.lists(st.binary(max_size=100), min_size=2, max_size=6)):
        frame = f.DataFrame(32 + len(payload), draw(FLAGS), offset, session, stream, term, 0, payload)
        starts.append(len(data))
        data += f.encode_data(frame)
        offset += frame.aligned_length
    if draw(st.booleans()):
        starts.append(len(data))
        data += f.encode_data(f.DataFrame(SMALL_TERM - offset, 0xC0, offset, session, stream, term,
                                          frame_type=f.FrameType.PAD))
    start = draw(st.sampled_from(starts[1:]))
    field, size = draw(st.sampled_from([(0, 4), (4, 1), (5, 1), (6, 2), (8, 4), (12, 4), (16, 4), (20, 4)]))
    value = draw(st.sampled_from([0, 1, 28, 31, 32, 33, 64, 2**15, SMALL_TERM, -1, -32, 2**31 - 1]))
    data[start + field:start + field + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    if draw(st.booleans()):
        del data[draw(st.integers(start, len(data))):]
    return bytes(data)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mutated(), valid_datagrams(), later_frame_mutated(), st.binary(max_size=300)),
       TERM_LENGTHS | st.just(SMALL_TERM))
def test_the_data_check_gives_the_reference_reason_for_any_datagram(datagram: bytes, term_length: int) -> None:
    if f.frame_type_of(datagram) in (f.FrameType.DATA, f.FrameType.PAD):
        assert f.check_data_datagram(datagram, term_length) is _reference_check_data_datagram(datagram, term_length)
