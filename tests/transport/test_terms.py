"""Term buffers: append, fragment, pad and rotate; rebuild, gap scan, read and reassemble."""

from __future__ import annotations

import random
import struct

import pytest

from flowbroker.transport import frames as f
from flowbroker.transport.frames import DataFrame, FrameType, decode_datagram
from flowbroker.transport.terms import (
    FragmentAssembler,
    Gap,
    TermAppender,
    TermRebuilder,
    check_mtu,
    scan_for_availability,
)

TERM = 64 * 1024
MTU = 1408
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def appender(initial: int = 5, **kw: int) -> TermAppender:
    return TermAppender(TERM, initial, session_id=77, stream_id=1001, mtu=kw.pop("mtu", MTU), **kw)


def headers(term: memoryview, offset: int) -> tuple[int, ...]:
    return struct.unpack_from("<iBBHiiiiq", term, offset)


def sender_datagrams(app: TermAppender, position: int, end: int, mtu: int = MTU) -> tuple[list[bytes], int]:
    """What a sender would transmit from ``position`` up to ``end`` (never across a term)."""
    out: list[bytes] = []
    while position < end:
        term = app.partition_for_position(position)
        offset = app.term_offset_for_position(position)
        available, padding = scan_for_availability(term, offset, min(mtu, end - position))
        if available == 0:
            break
        out.append(bytes(term[offset:offset + available]))
        position += available + padding
    return out, position


def test_single_frame_layout() -> None:
    app = appender()
    assert app.append(b"hello world!!!", reserved_value=9) == 64
    assert headers(app.partitions[0], 0) == (46, 0, 0xC0, 1, 0, 77, 1001, 5, 9)
    assert bytes(app.partitions[0][32:46]) == b"hello world!!!"
    datagrams, pos = sender_datagrams(app, 0, app.position)
    assert pos == 64 and len(datagrams) == 1 and len(datagrams[0]) == 64
    (frame,), reason = decode_datagram(datagrams[0], TERM)
    assert reason is None
    assert frame == DataFrame(46, 0xC0, 0, 77, 1001, 5, 9, b"hello world!!!")


def test_several_frames_per_datagram_up_to_mtu() -> None:
    app = appender()
    for i in range(6):
        app.append(bytes([i]) * 300)  # 332 -> 352 each, four per 1408 MTU
    datagrams, pos = sender_datagrams(app, 0, app.position)
    assert [len(d) for d in datagrams] == [1408, 704]
    assert pos == app.position == 6 * 352
    frames = [fr for d in datagrams for fr in decode_datagram(d, TERM)[0]]
    assert [fr.payload for fr in frames if isinstance(fr, DataFrame)] == [bytes([i]) * 300 for i in range(6)]


def test_fragmentation_flags_and_lengths() -> None:
    app = appender()
    message = bytes(range(256)) * 12  # 3072 bytes: 1376 + 1376 + 320
    assert app.frame_space(len(message)) == 1408 + 1408 + 352
    assert app.append(message) == 1408 + 1408 + 352
    term = app.partitions[0]
    assert headers(term, 0)[:3] == (1408, 0, f.BEGIN_FLAG)
    assert headers(term, 1408)[:3] == (1408, 0, 0)
    assert headers(term, 2816)[:3] == (352, 0, f.END_FLAG)
    assert [headers(term, o)[4] for o in (0, 1408, 2816)] == [0, 1408, 2816]  # term offsets


def test_max_message_length() -> None:
    app = appender()
    assert app.max_message_length == TERM // 8
    app.append(bytes(TERM // 8))
    with pytest.raises(ValueError, match="max message length"):
        app.append(bytes(TERM // 8 + 1))


def test_padding_and_rotation() -> None:
    app = appender()
    message = bytes(1000)  # 1032 -> 1056
    per_term = TERM // 1056  # 62 messages, 64 KiB - 62*1056 = 64 bytes left
    for _ in range(per_term):
        app.append(message)
    assert app.term_offset == per_term * 1056 and app.term_id == 5
    assert app.space_needed(len(message)) == TERM - per_term * 1056 + 1056
    before = app.position
    needed = app.space_needed(len(message))
    after = app.append(message)
    assert after - before == needed and after == TERM + 1056
    assert app.term_id == 6 and app.term_offset == 1056
    pad = headers(app.partitions[0], per_term * 1056)
    assert pad[:5] == (TERM - per_term * 1056, 0, 0xC0, FrameType.PAD, per_term * 1056)
    assert headers(app.partitions[1], 0)[4:7] == (0, 77, 1001)
    assert headers(app.partitions[1], 0)[7] == 6
    # The sender sends the PAD as 32 bytes and skips the rest of the term.
    datagrams, pos = sender_datagrams(app, per_term * 1056, app.position)
    assert len(datagrams[0]) == 32 and pos == app.position
    frames, reason = decode_datagram(datagrams[0], TERM)
    assert reason is None and isinstance(frames[0], DataFrame) and frames[0].is_pad


def test_exact_fill_rotates_without_pad() -> None:
    app = appender(mtu=4096)
    for _ in range(TERM // 2048):
        app.append(bytes(2016))  # exactly 2048 each, unfragmented at this MTU
    assert app.term_offset == TERM and app.term_id == 5
    app.append(b"x")
    assert app.term_id == 6 and app.position == TERM + 64
    assert headers(app.partitions[0], TERM - 2048)[3] == FrameType.DATA


def test_term_id_wrap_and_partition_reuse_is_cleaned() -> None:
    app = appender(initial=INT32_MAX - 1)
    seen_term_ids = []
    for i in range(5 * (TERM // 4096)):
        app.append(bytes([i % 251]) * 4000)
        seen_term_ids.append(app.term_id)
    assert seen_term_ids[-1] == INT32_MIN + 2  # 5 terms: MAX-1, MAX, MIN, MIN+1, MIN+2
    assert app.position == 5 * TERM
    # Term MIN+1 (term count 3) reused partition 0: its old frames must be gone, not stale.
    term = app.partition_for_term(INT32_MIN + 1)
    assert headers(term, 0)[7] == INT32_MIN + 1
    assert app.clean_position >= 2 * TERM


def test_start_at_active_term_and_offset() -> None:
    app = appender(initial=-3, active_term_id=-1, term_offset=4096)
    assert app.position == 2 * TERM + 4096
    app.append(b"abc")
    assert headers(app.partition_for_term(-1), 4096)[4:8] == (4096, 77, 1001, -1)
    with pytest.raises(ValueError):
        appender(initial=0, active_term_id=-1)
    with pytest.raises(ValueError):
        appender(term_offset=33)


def test_check_mtu() -> None:
    check_mtu(1408)
    check_mtu(65504)
    for bad in (0, 16, 1400, 65536):
        with pytest.raises(ValueError, match="mtu"):
            check_mtu(bad)


def test_rebuild_gap_scan_and_read() -> None:
    app = appender()
    for i in range(10):
        app.append(bytes([i]) * 100)  # 132 -> 160 each
    datagrams, end = sender_datagrams(app, 0, app.position, mtu=320)  # two frames per datagram
    assert len(datagrams) == 5
    image = TermRebuilder(TERM, 5)
    for k in (0, 2, 4):
        assert image.insert(5, k * 320, datagrams[k])
    assert not image.insert(5, 0, datagrams[0])  # duplicate
    pos, gap = image.scan_for_gap(0, end)
    assert pos == 320 and gap == Gap(5, 320, 320)
    got: list[bytes] = []
    new_pos, n = image.read(0, pos, lambda payload, flags: got.append(bytes(payload)))
    assert (new_pos, n) == (320, 2) and got == [bytes([0]) * 100, bytes([1]) * 100]
    image.insert(5, 320, datagrams[1])
    pos, gap = image.scan_for_gap(pos, end)
    assert pos == 960 and gap == Gap(5, 960, 320)
    image.insert(5, 960, datagrams[3])
    assert image.scan_for_gap(pos, end) == (end, None)
    new_pos, n = image.read(new_pos, end, lambda payload, flags: got.append(bytes(payload)), fragment_limit=3)
    assert n == 3 and new_pos == 320 + 3 * 160
    new_pos, n = image.read(new_pos, end, lambda payload, flags: got.append(bytes(payload)))
    assert new_pos == end and got == [bytes([i]) * 100 for i in range(10)]


def test_heartbeat_position_gap_is_bounded_by_hwm() -> None:
    image = TermRebuilder(TERM, 0)
    assert image.scan_for_gap(0, 96) == (0, Gap(0, 0, 96))


def test_fragment_assembler() -> None:
    out: list[bytes] = []
    asm = FragmentAssembler(lambda m: out.append(bytes(m)))
    asm(memoryview(b"orphan"), 0)  # middle fragment without a BEGIN: dropped
    asm(memoryview(b"ab"), f.BEGIN_FLAG)
    assert asm.in_progress
    asm(memoryview(b"cd"), 0)
    asm(memoryview(b"ef"), f.END_FLAG)
    asm(memoryview(b"whole"), f.UNFRAGMENTED)
    asm(memoryview(b"x"), f.END_FLAG)  # END without BEGIN: dropped
    assert out == [b"abcdef", b"whole"] and not asm.in_progress


def test_a_message_over_max_length_is_never_buffered_past_it_and_its_length_is_told_in_its_place() -> None:
    """A peer writing its own frames could send one fragmented message of any length (a tester's 1.9 MB
    in a 2 MiB term), held whole while it arrived and then handed up. Over `max_length` the assembler
    lets go of it, counts its later fragments, and tells `on_oversized` its length at its END (or at the
    next BEGIN when the END never comes); the messages around it are whole."""
    out: list[bytes | int] = []
    most = 0
    asm = FragmentAssembler(lambda m: out.append(bytes(m)), 10, out.append)

    def feed(payload: bytes, flags: int) -> None:
        nonlocal most
        asm(memoryview(payload), flags)
        most = max(most, asm.buffered)

    feed(b"abcd", f.BEGIN_FLAG)
    feed(b"efghij", f.END_FLAG)  # exactly max_length: whole
    feed(b"abcd", f.BEGIN_FLAG)
    feed(b"efgh", 0)
    checkpoint = asm.checkpoint()
    feed(b"ijk", 0)  # 11 bytes: let go
    assert not asm.in_progress
    feed(b"l" * 1000, 0)
    asm.rollback(checkpoint)  # (a handler raised: the image reads these fragments again)
    assert asm.buffered == 8
    feed(b"ijk", 0)
    feed(b"l" * 1000, 0)
    feed(b"mn", f.END_FLAG)
    feed(b"x" * 11, f.BEGIN_FLAG)  # its BEGIN alone is over: never buffered
    feed(b"y", f.BEGIN_FLAG)  # the one before never ended: told here
    feed(b"z", f.END_FLAG)
    feed(b"whole", f.UNFRAGMENTED)
    assert out == [b"abcdefghij", 1013, 11, b"yz", b"whole"]
    assert most <= 10  # (the 1,013-byte one was never held past 8)


def test_clean_to_zeroes_across_terms() -> None:
    app = appender()
    for _ in range(3 * (TERM // 1056)):
        app.append(bytes([1]) * 1000)
    app.clean_to(TERM + 100)
    assert bytes(app.partitions[0]) == bytes(TERM)
    assert app.partitions[1][99] == 0 and any(app.partitions[1][100:])
    assert app.clean_position == TERM + 100
    app.clean_to(50)  # never moves backwards
    assert app.clean_position == TERM + 100


def test_lossy_round_trip_across_rotations_and_wrap() -> None:
    """Drop, duplicate and reorder datagrams; NAK-like re-sends from gaps; all messages once, in order."""
    rng = random.Random(1234)
    app = TermAppender(TERM, INT32_MAX - 1, 9, 10, MTU)
    image = TermRebuilder(TERM, INT32_MAX - 1)
    sent = [rng.randbytes(rng.choice([0, 1, 31, 100, 1000, 1376, 1377, 3000, 8192])) for _ in range(400)]
    received: list[bytes] = []
    reader = FragmentAssembler(lambda m: received.append(bytes(m)))
    snd_pos = rebuild = sub_pos = hwm = 0

    def deliver(datagram: bytes) -> None:
        nonlocal hwm
        frames, reason = decode_datagram(datagram, TERM)
        assert reason is None
        first = frames[0]
        assert isinstance(first, DataFrame)
        image.insert(first.term_id, first.term_offset, datagram)
        pos = image.position_of(first.term_id, first.term_offset)
        hwm = max(hwm, pos + (len(datagram) if not first.is_pad else first.frame_length))

    for chunk_start in range(0, len(sent), 20):
        for message in sent[chunk_start:chunk_start + 20]:
            app.append(message)
        datagrams, snd_pos = sender_datagrams(app, snd_pos, app.position)
        rng.shuffle(datagrams)
        for d in datagrams:
            roll = rng.random()
            if roll < 0.2:
                continue
            deliver(d)
            if roll > 0.9:
                deliver(d)
        for _ in range(200):  # loss recovery: rebuild, NAK gaps, read
            rebuild, gap = image.scan_for_gap(rebuild, hwm)
            while sub_pos < rebuild:
                sub_pos, _ = image.read(sub_pos, rebuild, reader)
            if gap is None and rebuild >= snd_pos:
                break
            if gap is None:  # tail loss: a heartbeat would tell us the sender position
                hwm = snd_pos
                continue
            begin = image.position_of(gap.term_id, gap.term_offset)
            resend, _ = sender_datagrams(app, begin, begin + gap.length)
            for d in resend:
                if rng.random() > 0.3:
                    deliver(d)
        image.clean_to(sub_pos - TERM)
    assert sub_pos == app.position
    assert received == sent
    assert app.term_id < 0  # wrapped past INT32_MAX


def test_needs_rotation_and_explicit_pad_and_rotate() -> None:
    app = appender()
    app.append(bytes(TERM // 8 - 32))  # fragmented, lands well inside the term
    assert not app.needs_rotation(100)
    while not app.needs_rotation(TERM // 8):
        app.append(bytes(TERM // 8))
    tail = app.term_offset
    assert app.pad_and_rotate() == TERM and app.term_id == 6
    assert headers(app.partitions[0], tail)[:4] == (TERM - tail, 0, 0xC0, FrameType.PAD)
    assert not app.needs_rotation(TERM // 8)


def test_gap_scan_walks_across_a_term_end() -> None:
    """A rebuild that ends exactly at a term end continues into the next term before reporting a gap."""
    app = appender(mtu=4096)
    for _ in range(TERM // 2048 + 2):
        app.append(bytes(2016))  # exactly fills the first term, then two frames in the second
    datagrams, end = sender_datagrams(app, 0, app.position, mtu=2048)  # one frame per datagram
    assert end == TERM + 4096
    image = TermRebuilder(TERM, 5)
    for d in datagrams:
        first = decode_datagram(d, TERM)[0][0]
        assert isinstance(first, DataFrame)
        if image.position_of(first.term_id, first.term_offset) != TERM + 2048:  # lose the last frame only
            image.insert(first.term_id, first.term_offset, d)
    assert image.scan_for_gap(TERM - 4096, end) == (TERM + 2048, Gap(6, 2048, 2048))
    assert image.scan_for_gap(0, TERM + 2048) == (TERM + 2048, None)
    empty = TermRebuilder(TERM, 5)
    assert empty.scan_for_gap(TERM, TERM + 64) == (TERM, Gap(6, 0, 64))
