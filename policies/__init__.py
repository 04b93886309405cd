"""Credit policies and queue overflow policies: pure functions of quota, connections and usage.

No I/O and no clock here: the broker owns the state and calls these on every connect, enqueue and
dequeue. See docs/policies.md for the formulas and every config key.
"""

from __future__ import annotations

from flowbroker.policies.credit import (
    MAX_BUFFER_SIZE,
    CreditAllocator,
    CreditPolicy,
    CreditPolicyConfig,
    WAIT_GRANT,
    DuplicateConnectionError,
    MiB,
    PolicyConfigError,
    PolicyError,
    PoolExhaustedError,
    UnknownConnectionError,
    aggressive_size,
    clamp,
    dynamic_size,
    reserve_for,
    share_target,
    static_size,
)
from flowbroker.policies.overflow import (
    ACCEPTED,
    DEFAULT_THRESHOLD_DEFAULTS,
    Admission,
    Limit,
    OverflowPolicy,
    QueueLimits,
    ThresholdDefaults,
    Thresholds,
    Verdict,
    admit,
    is_over_stop,
    is_under_resume,
)

__all__ = [
    "ACCEPTED",
    "DEFAULT_THRESHOLD_DEFAULTS",
    "MAX_BUFFER_SIZE",
    "Admission",
    "CreditAllocator",
    "CreditPolicy",
    "CreditPolicyConfig",
    "DuplicateConnectionError",
    "Limit",
    "MiB",
    "OverflowPolicy",
    "PolicyConfigError",
    "PolicyError",
    "PoolExhaustedError",
    "QueueLimits",
    "ThresholdDefaults",
    "Thresholds",
    "UnknownConnectionError",
    "Verdict",
    "WAIT_GRANT",
    "admit",
    "aggressive_size",
    "clamp",
    "dynamic_size",
    "is_over_stop",
    "is_under_resume",
    "reserve_for",
    "share_target",
    "static_size",
]
