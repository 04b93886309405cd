"""Latency-bounded flow control: a queue's drain-rate estimate, its oldest ready message's age, and
the time thresholds that compare them (issue 16 item 3).

Count and size watermarks bound memory, not latency: the default 80 MiB stop holds 27 s of backlog
for a consumer doing 2,000 msgs/s. A queue may also saturate on *time*:

- ``flow_stop_drain_time`` / ``flow_resume_drain_time``: the queue's depth (ready + delivered but
  unsettled, what the count watermark compares; less what stalled consumers hold, ``STALL_SECONDS``)
  divided by the consumers' measured rate (an EWMA of settled messages per second): about how long a
  message enqueued now waits to be settled;
- ``flow_stop_age`` / ``flow_resume_age``: how long the oldest ready message has waited already.

The estimate is updated on the broker's flow timer (every ``TICK_SECONDS``), never per message: it reads
the queue's existing ``dequeued`` counter. At each tick the drain-time thresholds become message counts
(``drain_limits``: stop x rate), which the queue folds into its count watermark, so a burst between
ticks is stopped at the enqueue that crosses it with the comparison the enqueue path already makes.
The age is evaluated on the tick only, and is coarse for the same reason: instead of stamping every
message, each tick records ``(now, next_offset)``; the oldest ready message (the lowest ready offset) was
enqueued after the last mark at or below its offset, so its age is known to one tick (it is reported as
the age since the first mark above its offset: at most one tick too young, never too old).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass
from typing import Final

from flowbroker.policies.credit import PolicyConfigError
from flowbroker.protocol.names import THRESHOLD_FLOW_STOP_AGE, THRESHOLD_FLOW_STOP_DRAIN_TIME

__all__ = [
    "MIN_BACKLOG",
    "RATE_TIME_CONSTANT",
    "STALL_SECONDS",
    "TICK_SECONDS",
    "DrainEstimator",
    "TimeThresholds",
    "TimeVerdict",
    "drain_limits",
    "drain_reason",
    "evaluate",
]

TICK_SECONDS: Final = 0.1
"""The broker's flow timer: estimates are updated and the age threshold evaluated this often. It is
also the age's resolution. (The drain-time threshold is also checked on every enqueue, as a count.)"""
RATE_TIME_CONSTANT: Final = 1.0
"""The EWMA's time constant in seconds: after a step change in the consumers' rate the estimate has
moved 63 % of the way in 1 s, 95 % in 3 s. Shorter follows a jittery consumer's every pause; longer
keeps producers stopped (or running) too long after the consumers change pace."""
STALL_SECONDS: Final = RATE_TIME_CONSTANT
"""A subscription that holds unsettled messages and settles none for this long is *stalled*: what it
holds leaves the depth drain time is computed over (`Queue.stalled_held`). Slowing the producers cannot
speed up a consumer that holds messages without settling them, and a consumer that never acks would
otherwise keep the depth over the limit as the rate decays to 0, stopping the queue for everyone."""
MIN_BACKLOG: Final = 100
"""Slow start: until the consumers' rate is measured (a new consumer, or one that has not been busy for
a whole tick yet), drain time is taken as over its stop only past this many messages: a cold estimate
stops producers after a small backlog for a tick or two, not at the first message nor never."""
_NS: Final = 1_000_000_000
_OFF: Final = sys.maxsize


MAX_SECONDS: Final = 1e8
"""The longest time threshold (about three years), as for the configuration's durations: beyond it a
figure is a typo, and its nanoseconds would overflow."""


def _seconds(key: str, value: object) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS:
        raise PolicyConfigError(key, value, f"must be a number of seconds in [0, {MAX_SECONDS:g}] (0 = off)")
    return float(value)


@dataclass(frozen=True, slots=True, init=False)
class TimeThresholds:
    """A queue's time thresholds in seconds, validated; 0 = off. As for count and size, a stop given
    without its resume (or a resume of 0) gets resume = stop, and resume must be <= stop."""

    flow_stop_drain_time: float
    flow_resume_drain_time: float
    flow_stop_age: float
    flow_resume_age: float

    def __init__(
        self,
        flow_stop_drain_time: float | None = None,
        flow_resume_drain_time: float | None = None,
        flow_stop_age: float | None = None,
        flow_resume_age: float | None = None,
    ) -> None:
        for kind, stop_v, resume_v in (
            ("drain_time", flow_stop_drain_time, flow_resume_drain_time),
            ("age", flow_stop_age, flow_resume_age),
        ):
            stop = _seconds(f"flow_stop_{kind}", stop_v)
            resume = _seconds(f"flow_resume_{kind}", resume_v) or stop
            if resume > stop:
                raise PolicyConfigError(f"flow_resume_{kind}", resume, f"must be <= flow_stop_{kind}={stop}")
            object.__setattr__(self, f"flow_stop_{kind}", stop)
            object.__setattr__(self, f"flow_resume_{kind}", resume)

    @property
    def enabled(self) -> bool:
        return bool(self.flow_stop_drain_time or self.flow_stop_age)


@dataclass(frozen=True, slots=True)
class TimeVerdict:
    """What the tick found: ``over_stop`` (with the threshold name, limit and value in milliseconds, as
    FLOW_STOPPED carries them) or ``under_resume`` (both time dimensions under their resume marks).
    ``age_under_resume`` is the age dimension alone: the queue re-checks drain time as a count on every
    settlement (``drain_limits``), but the age only on the tick."""

    over_stop: bool
    under_resume: bool
    threshold: str = ""
    limit_ms: int = 0
    value_ms: int = 0
    age_under_resume: bool = True


_QUIET: Final = TimeVerdict(False, True)


class DrainEstimator:
    """One queue's drain rate (settled messages per second, an EWMA) and enqueue-time marks.

    The rate is "how fast the consumers drain this queue while it has work": only an interval that
    starts and ends with messages in the queue (its depth, ready or unsettled) and consumers is a sample, so an idle
    or half-idle queue (idle is not slow; arrivals would cap the count) leaves the estimate alone, and
    a stalled consumer with a backlog drives it down. With no subscription the rate is 0 and unmeasured,
    and so it is again whenever the set of consumers changes (one subscribes or leaves): the old set's
    rate says nothing of the new one's. A fast consumer replaced by a slow one kept its rate, so the queue
    took 24,000 messages, 1,000 s of the slow one's pace, under a 0.5 s drain-time stop (a tester). The
    first sample after that seeds the estimate instead of being blended with the old rate (slow start).
    """

    __slots__ = ("rate", "measured", "_last_ns", "_last_dequeued", "_last_depth", "_subscribed", "_marks",
                 "_consumers")

    def __init__(self) -> None:
        self.rate = 0.0  # messages/s
        self.measured = False  # a busy interval has been seen since consumers (re)appeared
        self._last_ns: int | None = None
        self._last_dequeued = 0
        self._last_depth = 0
        self._subscribed = False  # at the last tick
        self._consumers = 0  # the queue's consumer-set generation at the last tick
        self._marks: deque[tuple[int, int]] = deque()  # (tick time, next_offset then), oldest first

    def update(self, now_ns: int, dequeued: int, depth: int, subscribed: bool, next_offset: int,
               head_offset: int | None, consumers: int = 0) -> None:
        """One tick: fold the settlements since the last tick into the rate, record an enqueue mark.
        `depth`: the queue's messages (ready + unsettled); `head_offset`: the oldest ready one's;
        `consumers`: a number the queue changes whenever a subscription joins or leaves it."""
        last_ns = self._last_ns
        delta = dequeued - self._last_dequeued
        self._last_ns, self._last_dequeued = now_ns, dequeued
        was_subscribed, self._subscribed = self._subscribed, subscribed
        changed, self._consumers = consumers != self._consumers, consumers
        if not subscribed or changed:  # (an interval across the change is no sample of either set)
            self.rate, self.measured = 0.0, False
        elif was_subscribed and last_ns is not None and now_ns > last_ns and self._last_depth > 0 and depth > 0:
            sample = delta * _NS / (now_ns - last_ns)
            if self.measured:
                alpha = 1.0 - math.exp(-(now_ns - last_ns) / (RATE_TIME_CONSTANT * _NS))
                self.rate += alpha * (sample - self.rate)
            else:
                self.rate, self.measured = sample, True
        self._last_depth = depth
        marks = self._marks
        if head_offset is None:
            marks.clear()
        else:
            # keep the last mark at or below the head (it bounds the head's enqueue time from below)
            while len(marks) > 1 and marks[1][1] <= head_offset:
                marks.popleft()
        if not marks or marks[-1][1] != next_offset:
            marks.append((now_ns, next_offset))

    @property
    def last_ns(self) -> int:
        """When the last tick was (0 before the first)."""
        return self._last_ns or 0

    def drain_time(self, depth: int) -> float:
        """Seconds to drain `depth` messages at the estimated rate (inf when there are some and the rate
        is 0: no consumer, or a stalled one)."""
        if depth <= 0:
            return 0.0
        return depth / self.rate if self.rate > 0 else math.inf

    def oldest_age(self, now_ns: int, head_offset: int | None) -> float:
        """Seconds since the message at `head_offset` (the oldest ready one) was enqueued, to one tick:
        the time of the first mark taken after it (0 if none yet)."""
        if head_offset is None:
            return 0.0
        for t_ns, offset in self._marks:
            if offset > head_offset:
                return max(0, now_ns - t_ns) / _NS
        return 0.0


_MAX_MS: Final = 2**62  # what FLOW_STOPPED carries for an infinite (or absurd) drain time


def _ms(seconds: float) -> int:
    """Milliseconds for FLOW_STOPPED, rounded up (a value just over its limit must not read as equal to
    it), clamped: a rate decayed near 0 makes a drain time of 1e300 s."""
    ms = seconds * 1000
    return math.ceil(ms) if ms < _MAX_MS else _MAX_MS


def drain_limits(t: TimeThresholds, est: DrainEstimator, subscribed: bool) -> tuple[int, int]:
    """The drain-time thresholds as message counts at the current estimate, for the queue to compare its
    depth with on every enqueue (one comparison, folded into the count watermark's): (stop, resume).
    Measured: depth > stop x rate is exactly "drain time over stop" for a whole number of messages, and
    depth < resume x rate is under resume. Unmeasured (slow start): MIN_BACKLOG and MIN_BACKLOG x
    resume/stop. Off (sys.maxsize, never reached) without a drain-time threshold or without consumers:
    with none, every backlog's drain time is infinite and says nothing new; age, count and size handle that."""
    stop_s = t.flow_stop_drain_time
    if not stop_s or not subscribed:
        return _OFF, _OFF
    resume_s = t.flow_resume_drain_time
    if not est.measured:
        return MIN_BACKLOG, int(MIN_BACKLOG * resume_s / stop_s)
    rate = est.rate
    return min(_OFF, int(stop_s * rate)), min(_OFF, math.ceil(resume_s * rate))


def drain_reason(t: TimeThresholds, est: DrainEstimator, depth: int) -> tuple[str, int, int]:
    """FLOW_STOPPED's threshold, limit and value (ms) for a queue over its drain-time limit."""
    return THRESHOLD_FLOW_STOP_DRAIN_TIME, _ms(t.flow_stop_drain_time), _ms(est.drain_time(depth))


def evaluate(t: TimeThresholds, est: DrainEstimator, now_ns: int, depth: int, head_offset: int | None,
             subscribed: bool = True) -> TimeVerdict:
    """Compare a queue's depth with the drain-time limits (`drain_limits`) and its oldest ready message's
    age with the age thresholds. Whichever is over its stop trips; both must be under their resumes to
    clear. Limit and value are in milliseconds (the drain time: depth / rate)."""
    if not t.enabled:
        return _QUIET
    over = ""
    limit = value = 0.0
    under = True
    if t.flow_stop_drain_time:
        stop, resume = drain_limits(t, est, subscribed)
        if depth > stop:
            over, limit, value = THRESHOLD_FLOW_STOP_DRAIN_TIME, t.flow_stop_drain_time, est.drain_time(depth)
        under = depth < resume or depth == 0  # an empty queue drains in no time, whatever the rate
    age_under = True
    if t.flow_stop_age:
        age = est.oldest_age(now_ns, head_offset)
        if not over and age > t.flow_stop_age:
            over, limit, value = THRESHOLD_FLOW_STOP_AGE, t.flow_stop_age, age
        age_under = age < t.flow_resume_age or age == 0.0
    return TimeVerdict(bool(over), under and age_under and not over, over, _ms(limit), _ms(value), age_under)
