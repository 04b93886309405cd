"""The drain-rate estimator, the coarse age and the time thresholds (policies/drain.py), sans IO: a fake
clock in integer nanoseconds advanced one flow tick at a time."""

from __future__ import annotations

import math
import sys

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from flowbroker.policies.credit import PolicyConfigError
from flowbroker.policies.drain import (
    MIN_BACKLOG,
    RATE_TIME_CONSTANT,
    TICK_SECONDS,
    DrainEstimator,
    TimeThresholds,
    drain_limits,
    evaluate,
)
from flowbroker.policies.overflow import Thresholds

TICK = int(TICK_SECONDS * 1e9)


class Sim:
    """A queue seen only through what the estimator reads: settled count, ready count, offsets."""

    def __init__(self) -> None:
        self.est = DrainEstimator()
        self.now = 0
        self.dequeued = 0
        self.next_offset = 0
        self.head = 0  # the oldest ready offset
        self.subscribed = True
        self.consumers = 0  # the queue's consumer-set generation

    @property
    def ready(self) -> int:
        return self.next_offset - self.head

    def tick(self, arrive: int = 0, settle: int = 0) -> None:
        """One flow tick in which `arrive` messages were enqueued and `settle` settled (at most the ready)."""
        self.now += TICK
        self.next_offset += arrive
        settle = min(settle, self.ready)
        self.head += settle
        self.dequeued += settle
        self.est.update(self.now, self.dequeued, self.ready, self.subscribed, self.next_offset,
                        self.head if self.ready else None, self.consumers)


def test_the_rate_converges_to_the_consumers_rate() -> None:
    s = Sim()
    s.tick(arrive=10_000)
    for _ in range(50):  # 5 s at 2,000 msgs/s (200 per tick), the backlog never empties
        s.tick(arrive=200, settle=200)
    assert s.est.rate == pytest.approx(2000, rel=1e-6)
    assert s.est.drain_time(s.ready) == pytest.approx(s.ready / 2000, rel=1e-6)


def test_a_step_change_moves_the_estimate_by_the_time_constant() -> None:
    s = Sim()
    s.tick(arrive=100_000)
    for _ in range(30):
        s.tick(settle=100)  # 1,000 msgs/s
    assert s.est.rate == pytest.approx(1000)
    ticks = int(RATE_TIME_CONSTANT / TICK_SECONDS)
    for _ in range(ticks):
        s.tick(settle=300)  # 3,000 msgs/s
    assert s.est.rate == pytest.approx(1000 + 2000 * (1 - math.exp(-1)), rel=1e-6)  # 63 % of the way


def test_an_idle_queue_is_not_a_slow_consumer() -> None:
    s = Sim()
    s.tick(arrive=1000)
    for _ in range(20):
        s.tick(settle=100)
    rate = s.est.rate
    assert s.ready == 0
    for _ in range(50):
        s.tick()  # nothing ready, nothing settled: the estimate stays
    assert s.est.rate == rate
    s.tick(arrive=50)
    assert s.est.drain_time(s.ready) == pytest.approx(50 / rate)


def test_a_stalled_consumer_decays_the_rate_and_no_consumer_zeroes_it() -> None:
    s = Sim()
    s.tick(arrive=1000)
    for _ in range(20):
        s.tick(settle=10)
    before = s.est.rate
    for _ in range(10):
        s.tick()  # a backlog and nothing settled: the consumer is slow now
    assert s.est.rate == pytest.approx(before * math.exp(-1), rel=1e-6)
    s.subscribed = False
    s.tick()
    assert s.est.rate == 0 and s.est.drain_time(s.ready) == math.inf


def test_slow_start_stops_past_a_minimum_backlog_then_at_stop_times_the_seeded_rate() -> None:
    t = TimeThresholds(flow_stop_drain_time=0.5, flow_resume_drain_time=0.25)
    s = Sim()
    s.subscribed = False
    s.tick(arrive=5000)  # a backlog with no consumer: drain time is off (age, count, size are for that)
    assert drain_limits(t, s.est, False) == (sys.maxsize, sys.maxsize)
    assert not evaluate(t, s.est, s.now, s.ready, s.head, subscribed=False).over_stop
    s.subscribed = True
    s.tick()  # the consumer arrives, not measured yet: only a backlog over MIN_BACKLOG counts as slow
    assert not s.est.measured and drain_limits(t, s.est, True) == (MIN_BACKLOG, MIN_BACKLOG // 2)
    verdict = evaluate(t, s.est, s.now, s.ready, s.head)
    assert verdict.over_stop and verdict.threshold == "flow_stop_drain_time" and verdict.value_ms == 2**62
    s.tick(settle=200)  # one busy interval seeds the estimate (not blended with 0)
    assert s.est.measured and s.est.rate == pytest.approx(2000)
    assert drain_limits(t, s.est, True) == (1000, 500)  # 0.5 s and 0.25 s at 2,000 msgs/s
    verdict = evaluate(t, s.est, s.now, 900, s.head)  # a depth of 900: under stop, not under resume
    assert not verdict.over_stop and not verdict.under_resume
    assert evaluate(t, s.est, s.now, 1001, s.head).over_stop
    assert evaluate(t, s.est, s.now, 499, s.head).under_resume


def test_a_change_of_consumers_starts_the_measurement_over() -> None:
    """A fast consumer replaced by a slow one (a rolling restart) kept the fast one's rate: a 0.5 s stop
    let 24,000 messages in, 1,000 s at the slow one's 20 msgs/s, and the rate took 10 s to decay (a
    tester). Any join or leave is slow start again; the first interval of the new set seeds the rate."""
    t = TimeThresholds(flow_stop_drain_time=0.5)
    s = Sim()
    s.tick(arrive=10_000)
    for _ in range(30):  # 50,000 msgs/s
        s.tick(arrive=5000, settle=5000)
    assert drain_limits(t, s.est, True) == (25_000, 25_000)
    s.consumers += 2  # the slow one subscribes, the fast one leaves, within one tick
    s.tick(arrive=5000, settle=2500)  # (an interval across the change: no sample of either)
    assert not s.est.measured and drain_limits(t, s.est, True) == (MIN_BACKLOG, MIN_BACKLOG)
    s.tick(arrive=2, settle=2)  # 20 msgs/s
    assert s.est.measured and s.est.rate == pytest.approx(20)
    assert drain_limits(t, s.est, True) == (10, 10)
    s.consumers += 1  # one more joins: measured afresh too
    s.tick(settle=2)
    assert not s.est.measured


def test_an_empty_queue_is_under_resume_even_when_its_consumer_measured_0() -> None:
    """A stalled consumer's rate is 0 (resume x rate = 0 messages): the queue must still clear once empty."""
    t = TimeThresholds(flow_stop_drain_time=0.5)
    est = DrainEstimator()
    est.rate, est.measured = 0.0, True
    assert drain_limits(t, est, True) == (0, 0)
    assert evaluate(t, est, 0, 1, 0).over_stop
    assert evaluate(t, est, 0, 0, None).under_resume


def test_age_is_known_to_one_tick() -> None:
    s = Sim()
    s.tick()
    s.tick(arrive=10)  # these ten were enqueued in (t1, t2]
    enqueued_by = s.now
    for _ in range(7):
        s.tick(arrive=1)
    age = s.est.oldest_age(s.now, s.head)
    assert age == pytest.approx((s.now - enqueued_by) / 1e9)
    assert (s.now - enqueued_by) / 1e9 <= age + 1e-9 <= (s.now - enqueued_by + TICK) / 1e9
    s.tick(settle=10)  # the head moves to the first single arrival (the next tick's)
    assert s.est.oldest_age(s.now, s.head) == pytest.approx((s.now - enqueued_by - TICK) / 1e9)
    s.tick(settle=100)
    assert s.est.oldest_age(s.now, None) == 0.0


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500), st.booleans()), max_size=200))
def test_properties_over_any_traffic(steps: list[tuple[int, int, bool]]) -> None:
    """Whatever the traffic: the rate is finite, >= 0 and never above the fastest interval's rate; the age
    never exceeds the true age of the oldest ready message (one tick late at most); the marks stay
    bounded by the ticks a backlog spans."""
    s = Sim()
    enqueued_at: dict[int, int] = {}
    fastest = 0.0
    for arrive, settle, subscribed in steps:
        s.subscribed = subscribed
        for o in range(s.next_offset, s.next_offset + arrive):
            enqueued_at[o] = s.now + TICK  # they arrive during the tick that ends at now + TICK
        before = s.dequeued
        s.tick(arrive, settle if subscribed else 0)
        fastest = max(fastest, (s.dequeued - before) / TICK_SECONDS)
        assert 0 <= s.est.rate <= fastest + 1e-6
        if s.ready:
            true_age = (s.now - (enqueued_at[s.head] - TICK)) / 1e9
            age = s.est.oldest_age(s.now, s.head)
            assert true_age - TICK_SECONDS - 1e-9 <= age <= true_age + 1e-9
        assert len(s.est._marks) <= len(steps) + 1


@given(st.floats(0, 100), st.floats(0, 100), st.floats(0, 100), st.floats(0, 100), st.floats(0, 10),
       st.integers(0, 10_000), st.floats(0, 5000))
@example(1.0, 0.0, 0.0, 0.0, 0.0, 227, 1.259544693488292e-303)  # a rate decayed near 0: drain time 1e305 s
def test_hysteresis_stop_and_resume_are_never_both_true(
    stop_d: float, resume_d: float, stop_a: float, resume_a: float, age_s: float, ready: int, rate: float
) -> None:
    try:
        t = TimeThresholds(stop_d, resume_d, stop_a, resume_a)
    except PolicyConfigError:
        assert resume_d > stop_d or resume_a > stop_a
        return
    est = DrainEstimator()
    est.rate, est.measured = rate, True
    now = int(10e9)
    est._marks.append((now - int(age_s * 1e9), 1))
    verdict = evaluate(t, est, now, ready, 0)
    assert not (verdict.over_stop and verdict.under_resume)
    drain = est.drain_time(ready)
    if t.flow_stop_drain_time and drain > t.flow_stop_drain_time * (1 + 1e-9):
        assert verdict.over_stop  # measured: the count limit is exactly the drain time's
    if verdict.threshold == "flow_stop_drain_time":
        assert drain > t.flow_stop_drain_time * (1 - 1e-9)
    if verdict.over_stop:
        assert verdict.threshold in ("flow_stop_drain_time", "flow_stop_age")
    # the age alone, as the queue keeps it between ticks; the drain-time half is its resume count
    resume_count = drain_limits(t, est, True)[1]
    assert verdict.age_under_resume == (not t.flow_stop_age or est.oldest_age(now, 0) < t.flow_resume_age
                                        or est.oldest_age(now, 0) == 0.0)
    if not verdict.over_stop:
        assert verdict.under_resume == (verdict.age_under_resume and (ready < resume_count or ready == 0))


def test_thresholds_validate_and_default_resume_to_stop() -> None:
    t = Thresholds(flow_stop_drain_time=0.5)
    assert (t.flow_stop_drain_time, t.flow_resume_drain_time, t.flow_stop_age, t.flow_resume_age) == (0.5, 0.5, 0, 0)
    assert t.flow_control and t.time.enabled
    assert Thresholds(flow_stop_age=2, flow_resume_age=1).time.flow_resume_age == 1.0
    assert not Thresholds(max_size=0).flow_control
    for bad in ({"flow_stop_age": -1}, {"flow_stop_drain_time": "1s"}, {"flow_stop_age": math.inf},
                {"flow_stop_drain_time": True}, {"flow_stop_age": 1e300}, {"flow_stop_drain_time": math.nan}):
        with pytest.raises(PolicyConfigError) as err:
            Thresholds(**bad)
        assert err.value.key in bad
    with pytest.raises(PolicyConfigError) as err:
        Thresholds(flow_stop_drain_time=0.5, flow_resume_drain_time=1)
    assert err.value.key == "flow_resume_drain_time"
    assert Thresholds(flow_stop_age=1) != Thresholds(flow_stop_age=2)  # a redeclare with other times differs
