"""Gap scanning and NAK timing."""

from __future__ import annotations

import random
import struct

from flowbroker.transport.loss import Gap, LossDetector, scan_for_gap

TERM = 64 * 1024


def term_with(frames: list[tuple[int, int]]) -> bytearray:
    """A term holding frames given as (offset, frame_length); everything else zero."""
    term = bytearray(TERM)
    for offset, length in frames:
        struct.pack_into("<i", term, offset, length)
    return term


def test_no_gap_in_contiguous_frames() -> None:
    term = term_with([(0, 40), (64, 33), (128, 32)])
    assert scan_for_gap(term, 5, 0, 160) is None


def test_gap_between_frames_is_reported_from_rebuild_to_next_frame() -> None:
    term = term_with([(0, 64), (64, 64), (256, 64)])
    assert scan_for_gap(term, 5, 0, 320) == Gap(5, 128, 128)


def test_gap_at_the_tail_runs_to_the_limit() -> None:
    term = term_with([(0, 64)])
    assert scan_for_gap(term, -7, 0, 1024) == Gap(-7, 64, 960)


def test_pad_jumps_to_end_of_term() -> None:
    term = term_with([(TERM - 96, 32), (TERM - 64, 64)])
    assert scan_for_gap(term, 1, TERM - 96, TERM) is None


def test_unicast_nak_after_delay_then_retry_every_ten_ms() -> None:
    detector = LossDetector()
    gap = Gap(3, 1024, 512)
    assert detector.on_scan(gap, 0) == (None, True)  # new gap, NAK not yet due
    assert detector.on_scan(gap, 99_999) == (None, False)
    assert detector.on_scan(gap, 100_000) == (gap, False)
    assert detector.on_scan(gap, 5_000_000) == (None, False)
    assert detector.on_scan(gap, 10_100_000) == (gap, False)
    assert detector.naks_sent == 2 and detector.gaps_found == 1


def test_a_new_gap_restarts_the_timer_and_a_filled_gap_clears_it() -> None:
    detector = LossDetector()
    detector.on_scan(Gap(3, 1024, 512), 0)
    assert detector.on_scan(Gap(3, 1536, 64), 50_000).loss_found
    assert detector.on_scan(Gap(3, 1536, 64), 120_000).nak is None
    assert detector.on_scan(Gap(3, 1536, 64), 150_000).nak == Gap(3, 1536, 64)
    assert detector.on_scan(None, 200_000) == (None, False)
    assert detector.deadline_ns() is None
    # the same offset after it was filled counts as a new loss
    assert detector.on_scan(Gap(3, 1536, 64), 300_000).loss_found


def test_immediate_feedback_with_zero_delay() -> None:
    detector = LossDetector(nak_delay_ns=0, retry_delay_ns=1_000)
    assert detector.on_scan(Gap(1, 0, 32), 7) == (Gap(1, 0, 32), True)


def test_multicast_backoff_is_random_but_bounded_and_seeded() -> None:
    delays = []
    for seed in range(20):
        detector = LossDetector(nak_delay_ns=10_000_000, multicast=True, rng=random.Random(seed))
        detector.on_scan(Gap(1, 0, 32), 0)
        deadline = detector.deadline_ns()
        assert deadline is not None
        delays.append(deadline)
    assert all(0 <= d < 10_000_000 for d in delays)
    assert len(set(delays)) > 10
