"""Producer credit policies: how big a byte buffer each flow-controlled producer connection gets.

The broker plays the DCP *consumer's* role (see docs/policies.md): it tells each producer connection how
many unacknowledged bytes it may have in flight. How those buffers are sized from the broker's memory
quota Q is the credit policy. Everything here is pure: no I/O, no clock, no locks. The broker owns one
:class:`CreditAllocator` and pushes the sizes it returns to the clients.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from fractions import Fraction
from typing import Final, Generic, TypeVar

MiB: Final = 1024 * 1024

#: Hard ceiling for any buffer: Couchbase had to cap DCP buffers at UINT32_MAX after >4 GiB buffers
#: overflowed the wire field and caused disconnects (MB-72330). A single producer with more than 4 GiB
#: in flight is a misconfiguration anyway, so every size is validated and clamped against this.
MAX_BUFFER_SIZE: Final = 2**32 - 1


class PolicyError(Exception):
    """Root of every error raised by flowbroker.policies."""


class PolicyConfigError(PolicyError, ValueError):
    """A policy setting is invalid; names the offending key and value so config errors are actionable."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}={value!r}: {reason}")


class UnknownConnectionError(PolicyError, LookupError):
    """The allocator was asked about a connection id it never saw (or already forgot)."""


class DuplicateConnectionError(PolicyError, ValueError):
    """connect() was called twice for the same id: the broker's bookkeeping is wrong, so fail loudly."""


class CreditPolicy(StrEnum):
    """The four DCP policies. ``aggressive`` is the default: Couchbase found production never used others."""

    NONE = "none"
    STATIC = "static"
    DYNAMIC = "dynamic"
    AGGRESSIVE = "aggressive"


def _check_size(key: str, value: object, *, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PolicyConfigError(key, value, "must be an integer number of bytes")
    if not low <= value <= MAX_BUFFER_SIZE:
        raise PolicyConfigError(key, value, f"must be in [{low}, {MAX_BUFFER_SIZE}]")
    return value


def _percent_of(key: str, value: object, quota: int) -> int:
    """Exact floor(quota * value / 100); str() round-trip so 0.1 means one tenth, not a binary approximation."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise PolicyConfigError(key, value, "must be a number")
    if not 0 < value <= 100:
        raise PolicyConfigError(key, value, "must be in (0, 100]")
    return int(quota * Fraction(str(value)) // 100)


@dataclass(frozen=True, slots=True)
class CreditPolicyConfig:
    """Every knob of the producer credit policies. Frozen: to change settings, build a new one and
    call :meth:`CreditAllocator.reconfigure`. Byte amounts derived from the percentages are computed
    once here, exactly, so the allocator's hot path is integer arithmetic only."""

    quota: int
    policy: CreditPolicy = CreditPolicy.AGGRESSIVE
    static_size: int = 10 * MiB
    min_size: int = 10 * MiB
    max_size: int = 50 * MiB
    dynamic_percent: float = 1.0
    dynamic_threshold_percent: float = 10.0
    aggressive_percent: float = 5.0
    override_size: int = 0
    dynamic_bytes: int = field(init=False, repr=False, compare=False)
    dynamic_threshold_bytes: int = field(init=False, repr=False, compare=False)
    aggressive_pool_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.quota, int) or isinstance(self.quota, bool) or self.quota <= 0:
            raise PolicyConfigError("quota", self.quota, "must be an integer number of bytes > 0")
        try:
            object.__setattr__(self, "policy", CreditPolicy(self.policy))
        except ValueError:
            known = ", ".join(p.value for p in CreditPolicy)
            raise PolicyConfigError("policy", self.policy, f"unknown policy; known: {known}") from None
        _check_size("static_size", self.static_size, low=1)
        # min >= 1: a computed 0 would silently mean "not paced" to the client.
        _check_size("min_size", self.min_size, low=1)
        _check_size("max_size", self.max_size, low=1)
        if self.min_size > self.max_size:
            raise PolicyConfigError("min_size", self.min_size, f"must be <= max_size={self.max_size}")
        _check_size("override_size", self.override_size, low=0)
        q = self.quota
        object.__setattr__(self, "dynamic_bytes", _percent_of("dynamic_percent", self.dynamic_percent, q))
        object.__setattr__(
            self,
            "dynamic_threshold_bytes",
            _percent_of("dynamic_threshold_percent", self.dynamic_threshold_percent, q),
        )
        object.__setattr__(
            self, "aggressive_pool_bytes", _percent_of("aggressive_percent", self.aggressive_percent, q)
        )

    @classmethod
    def from_mapping(cls, settings: Mapping[str, object]) -> CreditPolicyConfig:
        """Build from a TOML table (or any mapping); unknown keys are errors, not silently ignored."""
        known = {f.name for f in fields(cls) if f.init}
        for key in settings:
            if key not in known:
                raise PolicyConfigError(key, settings[key], f"unknown key; known: {', '.join(sorted(known))}")
        if "quota" not in settings:
            raise PolicyConfigError("quota", None, "is required")
        return cls(**settings)  # type: ignore[arg-type]  # values are type-checked in __post_init__


def clamp(value: int, low: int, high: int) -> int:
    return low if value < low else high if value > high else value


def static_size(config: CreditPolicyConfig) -> int:
    """``static``: the same fixed size for everyone, independent of Q."""
    return config.static_size


def dynamic_size(config: CreditPolicyConfig, granted_dynamic: int) -> int:
    """``dynamic``: clamp(dynamic_percent of Q, min, max) at connect, or just min once the dynamic
    buffers already granted (``granted_dynamic``, excluding this connection) exceed the threshold.
    The threshold bounds memory only loosely: it is checked before granting, as in Couchbase."""
    if granted_dynamic > config.dynamic_threshold_bytes:
        return config.min_size
    return clamp(config.dynamic_bytes, config.min_size, config.max_size)


def aggressive_size(config: CreditPolicyConfig, connections: int) -> int:
    """``aggressive``: the pool (aggressive_percent of Q) split evenly over all ``connections``
    flow-controlled producers, clamped to [min, max]. The sum exceeds the pool only by the clamp's floor."""
    if connections < 1:
        raise ValueError(f"connections must be >= 1, got {connections}")
    return clamp(config.aggressive_pool_bytes // connections, config.min_size, config.max_size)


K = TypeVar("K", bound=Hashable)


class CreditAllocator(Generic[K]):
    """Sans-IO bookkeeping of producer buffer sizes. Each method returns ``{conn_id: new_size}`` for
    exactly the connections whose size changed, in connect order, which is what the broker must push.

    Only flow-controlled producer connections are registered; the others are not paced and must not
    count towards ``aggressive``'s N. With ``override_size`` > 0 (and any policy but ``none``) every
    connection gets exactly that size: an absolute escape hatch, deliberately not bounded by the pool.
    """

    __slots__ = ("_config", "_sizes", "_total")

    def __init__(self, config: CreditPolicyConfig) -> None:
        self._config = config
        self._sizes: dict[K, int] = {}
        self._total = 0

    @property
    def config(self) -> CreditPolicyConfig:
        return self._config

    def connect(self, conn_id: K) -> dict[K, int]:
        if conn_id in self._sizes:
            raise DuplicateConnectionError(f"connection {conn_id!r} is already registered")
        cfg = self._config
        if cfg.policy is CreditPolicy.AGGRESSIVE and not cfg.override_size:
            self._sizes[conn_id] = 0  # min_size >= 1, so the new connection is always in the result
            return self._share_pool()
        size = self._size_for_new(self._total)
        self._sizes[conn_id] = size
        self._total += size
        return {conn_id: size}

    def disconnect(self, conn_id: K) -> dict[K, int]:
        try:
            size = self._sizes.pop(conn_id)
        except KeyError:
            raise UnknownConnectionError(f"connection {conn_id!r} is not registered") from None
        self._total -= size
        cfg = self._config
        if cfg.policy is CreditPolicy.AGGRESSIVE and not cfg.override_size and self._sizes:
            return self._share_pool()
        return {}

    def reconfigure(self, config: CreditPolicyConfig) -> dict[K, int]:
        """Apply a new policy or quota to every live connection. ``dynamic`` replays the connects in
        their original order, so the result is what a fresh start with these connections would give."""
        self._config = config
        if config.policy is CreditPolicy.AGGRESSIVE and not config.override_size:
            return self._share_pool() if self._sizes else {}
        changed: dict[K, int] = {}
        total = 0
        for conn_id, old in self._sizes.items():
            size = self._size_for_new(total)
            total += size
            if size != old:
                self._sizes[conn_id] = size
                changed[conn_id] = size
        self._total = total
        return changed

    def provisional_size(self) -> int:
        """What a flow-controlled connection gets before it registers (the broker registers it on its
        first transfer, so connections that only consume never dilute the producers' share). Never more
        than a registered connection would get: the floor under dynamic/aggressive, so provisional grants
        add at most N x min_size, which the aggressive bound already allows for."""
        cfg = self._config
        if cfg.policy in (CreditPolicy.DYNAMIC, CreditPolicy.AGGRESSIVE) and not cfg.override_size:
            return cfg.min_size
        return self._size_for_new(self._total)

    def size_of(self, conn_id: K) -> int:
        try:
            return self._sizes[conn_id]
        except KeyError:
            raise UnknownConnectionError(f"connection {conn_id!r} is not registered") from None

    def total_granted(self) -> int:
        return self._total

    def connections(self) -> tuple[K, ...]:
        return tuple(self._sizes)

    def sizes(self) -> dict[K, int]:
        """A snapshot of every size, for periodic re-advertising (a lost grant must not stall anyone)."""
        return dict(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, conn_id: object) -> bool:
        return conn_id in self._sizes

    def _size_for_new(self, granted: int) -> int:
        cfg = self._config
        if cfg.policy is CreditPolicy.NONE:
            return 0
        if cfg.override_size:
            return cfg.override_size
        if cfg.policy is CreditPolicy.STATIC:
            return static_size(cfg)
        if cfg.policy is CreditPolicy.DYNAMIC:
            return dynamic_size(cfg, granted)
        raise AssertionError("aggressive sizes are shared, not per connection")  # pragma: no cover

    def _share_pool(self) -> dict[K, int]:
        size = aggressive_size(self._config, len(self._sizes))
        changed = {c: size for c, old in self._sizes.items() if old != size}
        for conn_id in changed:
            self._sizes[conn_id] = size
        self._total = size * len(self._sizes)
        return changed
