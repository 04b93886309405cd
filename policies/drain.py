"""Latency-bounded flow control: a queue's drain-rate estimate, its oldest ready message's age, and
the time thresholds that compare them (issue 16 item 3).

Count and size watermarks bound memory, not latency: the default 80 MiB stop holds 27 s of backlog
for a consumer doing 2,000 msgs/s. A queue may also saturate on *time*:

- ``flow_stop_drain_time`` / ``flow_resume_drain_time``: the ready backlog divided by the consumers'
  measured rate (an EWMA of settled messages per second), i.e. how long a message enqueued now waits;
- ``flow_stop_age`` / ``flow_resume_age``: how long the oldest ready message has waited already.

Everything here is sans-IO and evaluated on the broker's flow timer (every ``TICK_SECONDS``), never per
message: the estimator reads the queue's existing ``dequeued`` counter and its ``next_offset``, so the
enqueue and settle paths do not grow. The age is coarse for the same reason: instead of stamping every
message, each tick records ``(now, next_offset)``; the oldest ready message (the lowest ready offset) was
enqueued after the last mark at or below its offset, so its age is known to one tick (it is reported as
the age since the first mark above its offset: at most one tick too young, never too old).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final

from flowbroker.policies.credit import PolicyConfigError
from flowbroker.protocol.names import THRESHOLD_FLOW_STOP_AGE, THRESHOLD_FLOW_STOP_DRAIN_TIME

__all__ = [
    "RATE_TIME_CONSTANT",
    "TICK_SECONDS",
    "WARMUP_SECONDS",
    "DrainEstimator",
    "TimeThresholds",
    "TimeVerdict",
    "evaluate",
]

TICK_SECONDS: Final = 0.1
"""The broker's flow timer: estimates are updated and time thresholds evaluated this often. It is also
the age's resolution and how late a time threshold may trip (at 2,000 msgs/s, 200 messages)."""
RATE_TIME_CONSTANT: Final = 1.0
"""The EWMA's time constant in seconds: after a step change in the consumers' rate the estimate has
moved 63 % of the way in 1 s, 95 % in 3 s. Shorter follows a jittery consumer's every pause; longer
keeps producers stopped (or running) too long after the consumers change pace."""
WARMUP_SECONDS: Final = 1.0
"""Slow start: drain time does not trip until consumers have been subscribed and measured this long."""
_NS: Final = 1_000_000_000


def _seconds(key: str, value: object) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PolicyConfigError(key, value, "must be a number of seconds >= 0 (0 or None = off)")
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
    FLOW_STOPPED carries them) or ``under_resume`` (both time dimensions under their resume marks)."""

    over_stop: bool
    under_resume: bool
    threshold: str = ""
    limit_ms: int = 0
    value_ms: int = 0


_QUIET: Final = TimeVerdict(False, True)


class DrainEstimator:
    """One queue's drain rate (settled messages per second, an EWMA) and enqueue-time marks.

    The rate is "how fast the consumers drain this queue while it has work": an interval in which the
    queue had no ready message at its start and settled nothing says nothing about the consumers (idle
    is not slow) and leaves the estimate alone. With no subscription the rate is 0. When the first
    subscription arrives the estimate restarts: it is seeded with the first interval's rate rather than
    blended with 0, and drain time does not trip for ``WARMUP_SECONDS`` (slow start of a new consumer).
    """

    __slots__ = ("rate", "_last_ns", "_last_dequeued", "_last_ready", "_since_ns", "_seeded", "_marks")

    def __init__(self) -> None:
        self.rate = 0.0  # messages/s
        self._last_ns: int | None = None
        self._last_dequeued = 0
        self._last_ready = 0
        self._since_ns: int | None = None  # since when the queue has had subscriptions
        self._seeded = False
        self._marks: deque[tuple[int, int]] = deque()  # (tick time, next_offset then), oldest first

    def update(self, now_ns: int, dequeued: int, ready: int, subscribed: bool, next_offset: int,
               head_offset: int | None) -> None:
        """One tick: fold the settlements since the last tick into the rate, record an enqueue mark."""
        last_ns = self._last_ns
        delta = dequeued - self._last_dequeued
        self._last_ns, self._last_dequeued = now_ns, dequeued
        if not subscribed:
            self.rate, self._since_ns, self._seeded = 0.0, None, False
        elif self._since_ns is None:
            self._since_ns = now_ns  # a consumer arrived: measure from here
        elif last_ns is not None and now_ns > last_ns and (self._last_ready > 0 or delta > 0):
            sample = delta * _NS / (now_ns - last_ns)
            if self._seeded:
                alpha = 1.0 - math.exp(-(now_ns - last_ns) / (RATE_TIME_CONSTANT * _NS))
                self.rate += alpha * (sample - self.rate)
            else:
                self.rate, self._seeded = sample, True
        self._last_ready = ready
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

    def warm(self, now_ns: int) -> bool:
        """Consumers have been measured long enough for the rate to mean something."""
        since = self._since_ns
        return since is not None and self._seeded and now_ns - since >= WARMUP_SECONDS * _NS

    def drain_time(self, ready: int) -> float:
        """Seconds to drain `ready` messages at the estimated rate (inf when there are some and the rate
        is 0: no consumer, or a stalled one)."""
        if ready <= 0:
            return 0.0
        return ready / self.rate if self.rate > 0 else math.inf

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
    """Milliseconds for FLOW_STOPPED, clamped: a rate decayed near 0 makes a drain time of 1e300 s."""
    ms = seconds * 1000
    return int(ms) if ms < _MAX_MS else _MAX_MS


def evaluate(t: TimeThresholds, est: DrainEstimator, now_ns: int, ready: int, head_offset: int | None) -> TimeVerdict:
    """Compare a queue's drain time and oldest age with its time thresholds. Drain time counts only once
    the estimate is warm (slow start) and only while consumers are subscribed: with none, a backlog's
    drain time is infinite and says nothing new, so the age threshold (or count/size) handles that
    queue. Whichever time threshold is over its stop trips; both must be under their resumes to clear."""
    if not t.enabled:
        return _QUIET
    over = ""
    limit = value = 0.0
    under = True
    if t.flow_stop_drain_time:
        drain = est.drain_time(ready) if est.warm(now_ns) else 0.0
        if drain > t.flow_stop_drain_time:
            over, limit, value = THRESHOLD_FLOW_STOP_DRAIN_TIME, t.flow_stop_drain_time, drain
        under = drain < t.flow_resume_drain_time or drain == 0.0
    if t.flow_stop_age:
        age = est.oldest_age(now_ns, head_offset)
        if not over and age > t.flow_stop_age:
            over, limit, value = THRESHOLD_FLOW_STOP_AGE, t.flow_stop_age, age
        under = under and (age < t.flow_resume_age or age == 0.0)
    return TimeVerdict(bool(over), under and not over, over, _ms(limit), _ms(value))
