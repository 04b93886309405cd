"""Queue limits: watermark thresholds (flow stop / resume) and the hard limit with its overflow policy.

Watermarks pace flow-controlled producers; the hard limit protects the broker from producers that do
not do flow control. Both are pure and cheap: the broker calls :func:`is_over_stop`,
:func:`is_under_resume` and :func:`admit` on every enqueue/dequeue, so everything that can be
derived is derived once, when the frozen dataclasses are built.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Flag, StrEnum, auto
from fractions import Fraction
from typing import Final

from flowbroker.policies.credit import MiB, PolicyConfigError
from flowbroker.policies.drain import TimeThresholds
from flowbroker.protocol.names import OVERFLOW_DROP_HEAD, OVERFLOW_REJECT

__all__ = [
    "ACCEPTED",
    "DEFAULT_THRESHOLD_DEFAULTS",
    "Admission",
    "Limit",
    "OverflowPolicy",
    "QueueLimits",
    "ThresholdDefaults",
    "Thresholds",
    "Verdict",
    "admit",
    "is_over_stop",
    "is_under_resume",
]

_OFF: Final = sys.maxsize  # an "off" threshold compares as never reached, so predicates need no branches


MAX_THRESHOLD = 2**50
"""A count or size limit's largest, as the admin API's and the TOML's byte keys: past it a figure is a
typo, not a queue (a declare took max_count 2**60 that the admin API would have refused, a tester)."""


def _non_negative(key: str, value: object) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_THRESHOLD:
        raise PolicyConfigError(key, value, "must be an integer in [0, 2^50] (0 = off)")
    return value


class OverflowPolicy(StrEnum):
    """What a full queue does with one more message (Qpid ``reject``; RabbitMQ/Qpid-ring ``drop-head``).
    The names travel in DECLARE_QUEUE, so they are defined in ``protocol.names``."""

    REJECT = OVERFLOW_REJECT
    DROP_HEAD = OVERFLOW_DROP_HEAD

    @classmethod
    def parse(cls, value: object, key: str = "overflow_policy") -> OverflowPolicy:
        """From config text; an unknown name is a PolicyConfigError naming ``key``."""
        if isinstance(value, str) and value in cls._value2member_map_:
            return cls(value)
        known = ", ".join(p.value for p in cls)
        raise PolicyConfigError(key, value, f"unknown overflow policy; known: {known}")


@dataclass(frozen=True, slots=True, init=False)
class QueueLimits:
    """A queue's hard limit. 0 (or None when building) means unlimited in that dimension."""

    max_count: int
    max_size: int

    def __init__(self, max_count: int | None = None, max_size: int | None = None) -> None:
        object.__setattr__(self, "max_count", _non_negative("max_count", max_count))
        object.__setattr__(self, "max_size", _non_negative("max_size", max_size))

    @property
    def unlimited(self) -> bool:
        return not (self.max_count or self.max_size)


class Verdict(StrEnum):
    ACCEPT = "accept"
    REJECT = "reject"
    DROP_HEAD = "drop-head"


class Limit(Flag):
    """Which hard limit(s) a message ran into; both can be hit at once."""

    NONE = 0
    COUNT = auto()
    SIZE = auto()


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of :func:`admit`. ``drop_count``/``drop_bytes``: how many of the oldest messages the
    broker must drop first (drop-head only). ``oversized``: the message alone exceeds max_size."""

    verdict: Verdict
    limit: Limit = Limit.NONE
    drop_count: int = 0
    drop_bytes: int = 0
    oversized: bool = False

    @property
    def enqueue(self) -> bool:
        """True if the message goes into the queue (after dropping ``drop_count`` head messages)."""
        return self.verdict is not Verdict.REJECT


ACCEPTED: Final = Admission(Verdict.ACCEPT)


def admit(
    policy: OverflowPolicy,
    depth_count: int,
    depth_bytes: int,
    limits: QueueLimits,
    message_size: int,
    head_sizes: Iterable[int] = (),
) -> Admission:
    """Decide whether a message of ``message_size`` bytes fits a queue holding ``depth_count`` messages
    of ``depth_bytes``. After admission the queue must satisfy count <= max_count and bytes <= max_size.

    ``head_sizes`` yields the sizes of the droppable messages, oldest first; it is consumed lazily and
    only under drop-head when the queue is full, so pass a generator and the accept path costs nothing.
    If it runs out before the message fits (e.g. the rest are delivered but unacknowledged), the message
    is rejected and nothing is dropped. A message larger than max_size on its own is rejected under
    either policy: dropping the whole queue would still not make room.
    """
    max_count = limits.max_count
    max_size = limits.max_size
    hit = Limit.NONE
    if max_count and depth_count >= max_count:
        hit = Limit.COUNT
    if max_size and depth_bytes + message_size > max_size:
        hit |= Limit.SIZE
    if not hit:
        return ACCEPTED
    if max_size and message_size > max_size:
        return Admission(Verdict.REJECT, hit, oversized=True)
    if policy is OverflowPolicy.REJECT:
        return Admission(Verdict.REJECT, hit)
    budget = max_size - message_size if max_size else _OFF
    cap = max_count - 1 if max_count else _OFF
    count, size, dropped, dropped_bytes = depth_count, depth_bytes, 0, 0
    heads = iter(head_sizes)
    while count > cap or size > budget:
        head = next(heads, None)
        if head is None:
            return Admission(Verdict.REJECT, hit)
        count -= 1
        size -= head
        dropped += 1
        dropped_bytes += head
    return Admission(Verdict.DROP_HEAD, hit, dropped, dropped_bytes)


@dataclass(frozen=True, slots=True)
class ThresholdDefaults:
    """Broker-wide defaults for queues that do not set their own thresholds (Qpid's
    --default-queue-limit / --default-flow-stop-threshold / --default-flow-resume-threshold).
    Both percentages 0 turns default flow control off."""

    max_size: int = 100 * MiB
    stop_percent: float = 80.0
    resume_percent: float = 70.0

    def __post_init__(self) -> None:
        _non_negative("default_max_size", self.max_size)
        for key, value in (("stop_percent", self.stop_percent), ("resume_percent", self.resume_percent)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 100:
                raise PolicyConfigError(key, value, "must be a number in [0, 100]")
        if self.resume_percent > self.stop_percent:
            raise PolicyConfigError("resume_percent", self.resume_percent, "must be <= stop_percent")


DEFAULT_THRESHOLD_DEFAULTS: Final = ThresholdDefaults()


def _derive(maximum: int, stop_percent: float, resume_percent: float) -> tuple[int, int]:
    """Qpid's createLimit: stop rounded half up, resume truncated, exact decimal arithmetic."""
    stop = int(maximum * Fraction(str(stop_percent)) / 100 + Fraction(1, 2))
    resume = int(maximum * Fraction(str(resume_percent)) // 100)
    return stop, resume


def _pair(kind: str, stop: int, resume: int, maximum: int) -> tuple[int, int]:
    """Validate one dimension's stop/resume; resume 0 means resume = stop (no hysteresis)."""
    if resume == 0:
        resume = stop
    if resume > stop:
        raise PolicyConfigError(f"flow_resume_{kind}", resume, f"must be <= flow_stop_{kind}={stop}")
    if maximum and stop > maximum:
        raise PolicyConfigError(f"flow_stop_{kind}", stop, f"must be <= max_{kind}={maximum}")
    return stop, resume


@dataclass(frozen=True, slots=True, init=False)
class Thresholds:
    """A queue's watermarks and hard limit, resolved and validated. Pass only what the queue declares;
    the rest follows Qpid. max_size not given: the default 100 MiB (explicit 0 = unlimited). A
    stop/resume pair not given at all is derived from the max (stop 80 % rounded, resume 70 %
    truncated; counts only when max_count is set). A stop given without its resume gets resume = stop
    (no hysteresis, as Qpid's resume 0); a resume given alone keeps the derived stop. 0 = off for a
    stop; 0 for a resume means "= stop". All fields hold the effective values afterwards.
    """

    max_count: int
    max_size: int
    flow_stop_count: int
    flow_resume_count: int
    flow_stop_size: int
    flow_resume_size: int
    flow_stop_drain_time: float
    flow_resume_drain_time: float
    flow_stop_age: float
    flow_resume_age: float
    limits: QueueLimits = field(init=False, repr=False, compare=False)
    time: TimeThresholds = field(init=False, repr=False, compare=False)
    _stop_count: int = field(init=False, repr=False, compare=False)
    _resume_count: int = field(init=False, repr=False, compare=False)
    _stop_size: int = field(init=False, repr=False, compare=False)
    _resume_size: int = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        max_count: int | None = None,
        max_size: int | None = None,
        flow_stop_count: int | None = None,
        flow_resume_count: int | None = None,
        flow_stop_size: int | None = None,
        flow_resume_size: int | None = None,
        flow_stop_drain_time: float | None = None,
        flow_resume_drain_time: float | None = None,
        flow_stop_age: float | None = None,
        flow_resume_age: float | None = None,
        *,
        defaults: ThresholdDefaults = DEFAULT_THRESHOLD_DEFAULTS,
    ) -> None:
        max_c = _non_negative("max_count", max_count)
        max_s = defaults.max_size if max_size is None else _non_negative("max_size", max_size)
        stop_c, resume_c = self._resolve(
            "count", max_c, flow_stop_count, flow_resume_count, defaults
        )
        stop_s, resume_s = self._resolve("size", max_s, flow_stop_size, flow_resume_size, defaults)
        stop_c, resume_c = _pair("count", stop_c, resume_c, max_c)
        stop_s, resume_s = _pair("size", stop_s, resume_s, max_s)
        # the time thresholds (policies/drain.py): no max to derive from, so off unless given
        time = TimeThresholds(flow_stop_drain_time, flow_resume_drain_time, flow_stop_age, flow_resume_age)
        for name, value in (
            ("max_count", max_c),
            ("max_size", max_s),
            ("flow_stop_count", stop_c),
            ("flow_resume_count", resume_c),
            ("flow_stop_size", stop_s),
            ("flow_resume_size", resume_s),
            ("flow_stop_drain_time", time.flow_stop_drain_time),
            ("flow_resume_drain_time", time.flow_resume_drain_time),
            ("flow_stop_age", time.flow_stop_age),
            ("flow_resume_age", time.flow_resume_age),
            ("limits", QueueLimits(max_c, max_s)),
            ("time", time),
            ("_stop_count", stop_c or _OFF),
            ("_resume_count", resume_c or _OFF),
            ("_stop_size", stop_s or _OFF),
            ("_resume_size", resume_s or _OFF),
        ):
            object.__setattr__(self, name, value)

    @staticmethod
    def _resolve(
        kind: str, maximum: int, stop: int | None, resume: int | None, defaults: ThresholdDefaults
    ) -> tuple[int, int]:
        derived_stop, derived_resume = _derive(maximum, defaults.stop_percent, defaults.resume_percent)
        stop_v = derived_stop if stop is None else _non_negative(f"flow_stop_{kind}", stop)
        if resume is not None:
            resume_v = _non_negative(f"flow_resume_{kind}", resume)
        else:
            resume_v = derived_resume if stop is None else 0
        return stop_v, resume_v

    @property
    def flow_control(self) -> bool:
        """False when no dimension has a stop threshold: the queue never saturates."""
        return bool(self.flow_stop_count or self.flow_stop_size or self.time.enabled)


def is_over_stop(count: int, size: int, t: Thresholds) -> bool:
    """Saturate when either dimension is over its stop threshold (checked after an enqueue)."""
    return count > t._stop_count or size > t._stop_size


def is_under_resume(count: int, size: int, t: Thresholds) -> bool:
    """Clear only when both dimensions are under their resume thresholds (checked after a dequeue)."""
    return count < t._resume_count and size < t._resume_size
