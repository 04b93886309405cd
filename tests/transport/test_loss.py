"""NAK timing for the gaps the term scan reports (unicast delay and retry, multicast backoff)."""

from __future__ import annotations

import random

from flowbroker.transport.loss import Gap, LossDetector


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
