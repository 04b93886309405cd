"""Queue hard limits (reject / drop-head), watermark thresholds and the hysteresis predicates."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowbroker.policies import (
    ACCEPTED,
    Admission,
    Limit,
    MiB,
    OverflowPolicy,
    PolicyConfigError,
    QueueLimits,
    ThresholdDefaults,
    Thresholds,
    Verdict,
    admit,
    is_over_stop,
    is_under_resume,
)

REJECT, DROP = OverflowPolicy.REJECT, OverflowPolicy.DROP_HEAD


def untouchable() -> Iterator[int]:
    raise AssertionError("head sizes must not be read on this path")
    yield 0  # pragma: no cover - makes this a generator


# --- QueueLimits and policy names ------------------------------------------------------------------------


def test_limits_none_and_zero_mean_unlimited() -> None:
    assert QueueLimits() == QueueLimits(0, 0) == QueueLimits(None, None)
    assert QueueLimits().unlimited and not QueueLimits(max_size=1).unlimited


@pytest.mark.parametrize(("key", "value"), [("max_count", -1), ("max_size", -5), ("max_size", 1.5), ("max_count", True)])
def test_limits_validation(key: str, value: object) -> None:
    with pytest.raises(PolicyConfigError) as info:
        QueueLimits(**{key: value})  # type: ignore[arg-type]
    assert info.value.key == key


def test_overflow_policy_parse() -> None:
    assert OverflowPolicy.parse("drop-head") is DROP
    assert OverflowPolicy.parse("reject") is REJECT
    for bad in ("ring", "drop_head", 1, None):
        with pytest.raises(PolicyConfigError) as info:
            OverflowPolicy.parse(bad, key="queues.orders.overflow")
        assert info.value.key == "queues.orders.overflow"


# --- admit -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [REJECT, DROP])
def test_unlimited_always_accepts_without_reading_heads(policy: OverflowPolicy) -> None:
    assert admit(policy, 10**9, 10**15, QueueLimits(), 10**9, untouchable()) is ACCEPTED


@pytest.mark.parametrize("policy", [REJECT, DROP])
def test_accept_up_to_the_limits_exactly(policy: OverflowPolicy) -> None:
    limits = QueueLimits(max_count=5, max_size=100)
    assert admit(policy, 4, 60, limits, 40, untouchable()) is ACCEPTED  # ends at 5 messages, 100 bytes
    assert ACCEPTED.enqueue and ACCEPTED.drop_count == 0


def test_reject_at_count_limit() -> None:
    a = admit(REJECT, 5, 0, QueueLimits(max_count=5), 1)
    assert a == Admission(Verdict.REJECT, Limit.COUNT)
    assert not a.enqueue


def test_reject_at_size_limit() -> None:
    a = admit(REJECT, 1, 60, QueueLimits(max_size=100), 41)
    assert a == Admission(Verdict.REJECT, Limit.SIZE)


def test_reject_names_both_limits_when_both_are_hit() -> None:
    a = admit(REJECT, 5, 100, QueueLimits(max_count=5, max_size=100), 1)
    assert a.limit == Limit.COUNT | Limit.SIZE
    assert Limit.COUNT in a.limit and Limit.SIZE in a.limit


@pytest.mark.parametrize("policy", [REJECT, DROP])
@pytest.mark.parametrize("depth", [0, 3])
def test_message_larger_than_max_size_is_rejected_even_under_drop_head(policy: OverflowPolicy, depth: int) -> None:
    a = admit(policy, depth, depth * 10, QueueLimits(max_size=100), 101, untouchable())
    assert a == Admission(Verdict.REJECT, Limit.SIZE, oversized=True)


def test_drop_head_at_count_limit_drops_one() -> None:
    a = admit(DROP, 5, 50, QueueLimits(max_count=5), 7, iter([11, 12, 13, 14]))
    assert a == Admission(Verdict.DROP_HEAD, Limit.COUNT, drop_count=1, drop_bytes=11)
    assert a.enqueue


def test_drop_head_at_size_limit_drops_until_it_fits() -> None:
    # 60 bytes queued, max 70, a 25-byte message needs the queue at <= 45: drop 10 (50), then 20 (30)
    heads = iter([10, 20, 30])
    a = admit(DROP, 3, 60, QueueLimits(max_size=70), 25, heads)
    assert a == Admission(Verdict.DROP_HEAD, Limit.SIZE, drop_count=2, drop_bytes=30)
    assert list(heads) == [30]  # consumed lazily: only what was needed


def test_drop_head_satisfies_both_limits() -> None:
    # count needs one drop, size needs three
    a = admit(DROP, 4, 40, QueueLimits(max_count=4, max_size=45), 30, iter([10] * 4))
    assert a == Admission(Verdict.DROP_HEAD, Limit.COUNT | Limit.SIZE, drop_count=3, drop_bytes=30)


def test_drop_head_can_empty_the_queue() -> None:
    a = admit(DROP, 2, 90, QueueLimits(max_size=100), 100, iter([40, 50]))
    assert (a.verdict, a.drop_count, a.drop_bytes) == (Verdict.DROP_HEAD, 2, 90)


def test_drop_head_rejects_when_droppable_heads_run_out() -> None:
    # 3 messages queued but only one is droppable (the others are delivered, unacknowledged)
    a = admit(DROP, 3, 90, QueueLimits(max_size=100), 50, iter([30]))
    assert a == Admission(Verdict.REJECT, Limit.SIZE)


queues = st.lists(st.integers(0, 50), max_size=30)


@given(
    policy=st.sampled_from(list(OverflowPolicy)),
    queue=queues,
    max_count=st.integers(0, 35),
    max_size=st.integers(0, 800),
    size=st.integers(0, 120),
)
def test_admit_agrees_with_a_simulated_queue(
    policy: OverflowPolicy, queue: list[int], max_count: int, max_size: int, size: int
) -> None:
    def fits(q: list[int]) -> bool:
        return (not max_count or len(q) + 1 <= max_count) and (not max_size or sum(q) + size <= max_size)

    # the model's premise: the queue is within its limits before the message arrives
    while (max_count and len(queue) > max_count) or (max_size and sum(queue) > max_size):
        queue = queue[1:]
    limits = QueueLimits(max_count, max_size)
    a = admit(policy, len(queue), sum(queue), limits, size, iter(queue))
    if fits(queue):
        assert a is ACCEPTED
        return
    assert a.limit != Limit.NONE
    if policy is REJECT or (max_size and size > max_size):
        assert a.verdict is Verdict.REJECT and a.drop_count == 0
        assert a.oversized == bool(max_size and size > max_size)
        return
    k = a.drop_count
    assert a.verdict is Verdict.DROP_HEAD and k >= 1
    assert a.drop_bytes == sum(queue[:k])
    assert fits(queue[k:]) and not fits(queue[k - 1 :])  # enough, and no more than enough


# --- thresholds ----------------------------------------------------------------------------------------------


def test_threshold_defaults_are_qpids() -> None:
    t = Thresholds()
    assert (t.max_count, t.max_size) == (0, 100 * MiB)
    assert (t.flow_stop_size, t.flow_resume_size) == (83886080, 73400320)  # 80 % and 70 % of 100 MiB
    assert (t.flow_stop_count, t.flow_resume_count) == (0, 0)  # counts only with a max count
    assert t.limits == QueueLimits(0, 100 * MiB)
    assert t.flow_control


def test_thresholds_derived_from_given_maxima() -> None:
    t = Thresholds(max_count=1000, max_size=1001)
    assert (t.flow_stop_count, t.flow_resume_count) == (800, 700)
    assert (t.flow_stop_size, t.flow_resume_size) == (801, 700)  # 800.8 rounds up, 700.7 truncates
    t = Thresholds(max_count=7)
    assert (t.flow_stop_count, t.flow_resume_count) == (6, 4)  # 5.6 -> 6, 4.9 -> 4


def test_stop_rounds_half_up_and_resume_truncates() -> None:
    half = ThresholdDefaults(stop_percent=50, resume_percent=50)
    t = Thresholds(max_count=3, defaults=half)
    assert (t.flow_stop_count, t.flow_resume_count) == (2, 1)  # 1.5 -> 2 and 1.5 -> 1


def test_threshold_arithmetic_is_exact() -> None:
    # 90 * 0.7 is 62.999... in binary floating point; 70 % of 90 messages is 63.
    assert Thresholds(max_count=90).flow_resume_count == 63


def test_broker_wide_threshold_defaults() -> None:
    d = ThresholdDefaults(max_size=1000, stop_percent=90, resume_percent=50)
    t = Thresholds(max_count=10, defaults=d)
    assert (t.max_size, t.flow_stop_size, t.flow_resume_size) == (1000, 900, 500)
    assert (t.flow_stop_count, t.flow_resume_count) == (9, 5)
    off = Thresholds(defaults=ThresholdDefaults(stop_percent=0, resume_percent=0))
    assert not off.flow_control and off.max_size == 100 * MiB


def test_explicit_thresholds_override_derived_ones() -> None:
    t = Thresholds(max_size=1000, flow_stop_size=500)
    assert (t.flow_stop_size, t.flow_resume_size) == (500, 500)  # stop alone: resume = stop
    t = Thresholds(max_size=1000, flow_resume_size=100)
    assert (t.flow_stop_size, t.flow_resume_size) == (800, 100)  # resume alone: derived stop kept
    t = Thresholds(max_size=1000, flow_stop_size=600, flow_resume_size=0)
    assert t.flow_resume_size == 600  # resume 0 means resume = stop
    t = Thresholds(flow_stop_count=10, flow_resume_count=4)
    assert (t.max_count, t.flow_stop_count, t.flow_resume_count) == (0, 10, 4)  # no max: stop unbounded
    t = Thresholds(max_size=1000, flow_stop_size=0)
    assert (t.flow_stop_size, t.flow_resume_size) == (0, 0)


def test_explicit_zero_max_size_is_unlimited_and_never_saturates() -> None:
    t = Thresholds(max_size=0)
    assert t.limits.unlimited and not t.flow_control
    assert not is_over_stop(10**9, 10**15, t)
    assert is_under_resume(10**9, 10**15, t)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_size": 1000, "flow_stop_size": 500, "flow_resume_size": 501}, "flow_resume_size"),
        ({"max_count": 10, "flow_stop_count": 5, "flow_resume_count": 6}, "flow_resume_count"),
        ({"max_size": 1000, "flow_stop_size": 1001}, "flow_stop_size"),
        ({"max_count": 10, "flow_stop_count": 11}, "flow_stop_count"),
        ({"max_size": 1000, "flow_resume_size": 900}, "flow_resume_size"),  # above the derived stop 800
        ({"max_size": 1000, "flow_stop_size": 0, "flow_resume_size": 10}, "flow_resume_size"),
        ({"max_count": -1}, "max_count"),
        ({"max_size": -1}, "max_size"),
        ({"flow_stop_count": -1}, "flow_stop_count"),
        ({"flow_resume_size": 2.5}, "flow_resume_size"),
    ],
)
def test_threshold_validation_names_the_field(kwargs: dict[str, int], key: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        Thresholds(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == key


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"stop_percent": 101}, "stop_percent"),
        ({"resume_percent": -1}, "resume_percent"),
        ({"stop_percent": 60, "resume_percent": 70}, "resume_percent"),
        ({"max_size": -1}, "default_max_size"),
    ],
)
def test_threshold_defaults_validation(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        ThresholdDefaults(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == key


def test_replace_revalidates_and_recomputes() -> None:
    t = Thresholds(max_size=1000)
    raised = dataclasses.replace(t, flow_stop_size=900)
    assert (raised.flow_stop_size, raised.flow_resume_size) == (900, 700)
    assert is_over_stop(0, 850, t) and not is_over_stop(0, 850, raised)  # precomputed values follow
    with pytest.raises(PolicyConfigError):
        dataclasses.replace(t, flow_stop_size=600)  # resume 700 would exceed it


# --- hysteresis predicates ------------------------------------------------------------------------------------


def test_over_stop_is_either_dimension_strictly_above() -> None:
    t = Thresholds(max_count=100, max_size=1000)  # stop 80 / 800, resume 70 / 700
    assert not is_over_stop(80, 800, t)
    assert is_over_stop(81, 0, t)
    assert is_over_stop(0, 801, t)


def test_under_resume_needs_both_dimensions_strictly_below() -> None:
    t = Thresholds(max_count=100, max_size=1000)
    assert is_under_resume(69, 699, t)
    assert not is_under_resume(70, 0, t)
    assert not is_under_resume(0, 700, t)


def test_a_zero_threshold_is_off() -> None:
    sizes_only = Thresholds(max_size=1000)  # no max count: count thresholds are 0 = off
    assert not is_over_stop(10**9, 0, sizes_only)
    assert is_under_resume(10**9, 699, sizes_only)
    counts_only = Thresholds(max_count=10, max_size=0)
    assert is_over_stop(9, 0, counts_only) and not is_over_stop(8, 10**15, counts_only)
    assert is_under_resume(6, 10**15, counts_only) and not is_under_resume(7, 0, counts_only)


def test_saturation_cycle_with_hysteresis() -> None:
    t = Thresholds(max_count=10, max_size=0)  # stop 8, resume 7
    saturated, history = False, []
    for count in [*range(0, 10), *range(10, -1, -1)]:
        if not saturated and is_over_stop(count, 0, t):
            saturated = True
        elif saturated and is_under_resume(count, 0, t):
            saturated = False
        history.append((count, saturated))
    rising, falling = history[:10], history[10:]
    assert [c for c, s in rising if s] == [9]
    assert [c for c, s in falling if s] == [10, 9, 8, 7]  # stays saturated down to the resume point


@given(
    max_count=st.integers(0, 1000),
    max_size=st.integers(0, 10**6),
    count=st.integers(0, 2000),
    size=st.integers(0, 2 * 10**6),
)
def test_over_stop_and_under_resume_are_exclusive(max_count: int, max_size: int, count: int, size: int) -> None:
    t = Thresholds(max_count=max_count, max_size=max_size)
    assert not (is_over_stop(count, size, t) and is_under_resume(count, size, t))
    assert is_over_stop(count, size, t) == (
        (t.flow_stop_count > 0 and count > t.flow_stop_count) or (t.flow_stop_size > 0 and size > t.flow_stop_size)
    )


@pytest.mark.parametrize("key", ["max_count", "max_size", "flow_stop_count", "flow_resume_count",
                                 "flow_stop_size", "flow_resume_size"])
def test_a_limit_past_2_to_the_50_is_refused_naming_it(key: str) -> None:
    """The admin API refused such a figure and DECLARE_QUEUE took it (a tester: max_count 2**60 shown as
    922337203685477581/... in the queue's view): the one rule is the thresholds'."""
    too_large: dict[str, Any] = {key: 2**50 + 1}
    with pytest.raises(PolicyConfigError, match=key):
        Thresholds(**too_large)
    if key.startswith("max"):
        largest: dict[str, Any] = {key: 2**50}
        assert getattr(Thresholds(**largest), key) == 2**50  # the largest is taken
