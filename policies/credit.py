"""Producer credit policies: how big a byte buffer each flow-controlled connection gets, out of one pool.

The broker plays the DCP *consumer's* role (see docs/policies.md): it tells each producer connection how
many unacknowledged bytes it may have in flight. Every policy has a pool carved out of the broker's
memory quota Q, and the sum of what the broker has granted and promised never exceeds it: that is what
makes the memory bound true however many clients connect. How the pool is shared is the credit policy.
Everything here is pure: no I/O, no clock, no locks. The broker owns one :class:`CreditAllocator` and
pushes the sizes it returns to the clients.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, KeysView, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from fractions import Fraction
from typing import Final, Generic, TypeVar

__all__ = [
    "MAX_BUFFER_SIZE",
    "MAX_QUOTA",
    "MiB",
    "WAIT_GRANT",
    "CreditAllocator",
    "CreditPolicy",
    "CreditPolicyConfig",
    "DuplicateConnectionError",
    "PolicyConfigError",
    "PolicyError",
    "PoolExhaustedError",
    "UnknownConnectionError",
    "aggressive_size",
    "clamp",
    "dynamic_size",
    "reserve_for",
    "share_fraction",
    "share_target",
    "static_size",
]

MiB: Final = 1024 * 1024

#: Hard ceiling for any buffer: Couchbase had to cap DCP buffers at UINT32_MAX after >4 GiB buffers
#: overflowed the wire field and caused disconnects (MB-72330). A single producer with more than 4 GiB
#: in flight is a misconfiguration anyway, so every size is validated and clamped against this.
MAX_BUFFER_SIZE: Final = 2**32 - 1
#: The largest quota: what `[server] memory_quota` allows (1 PiB). Past it a figure is a typo, and the
#: metrics (floats) cannot carry it: PUT /api/policy {"quota": 2**1030} was taken, then every /metrics
#: scrape answered 500 (OverflowError) until the quota was put back (a tester).
MAX_QUOTA: Final = 2**50


class PolicyError(Exception):
    """Root of every error raised by flowbroker.policies."""


class PolicyConfigError(PolicyError, ValueError):
    """A policy setting is invalid; names the offending key and value so config errors are actionable."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}={self.shown}: {reason}")

    @property
    def shown(self) -> str:
        """The value as an error message shows it: a figure of thousands of digits is cut short."""
        text = repr(self.value)
        return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


class UnknownConnectionError(PolicyError, LookupError):
    """The allocator was asked about a connection id it never saw (or already forgot)."""


class DuplicateConnectionError(PolicyError, ValueError):
    """connect() was called twice for the same id: the broker's bookkeeping is wrong, so fail loudly."""


class PoolExhaustedError(PolicyError, RuntimeError):
    """connect() found no byte of the pool's reserve left for one more connection's wait grant."""


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


def _pool_of(config: CreditPolicyConfig) -> int:
    """The bytes a policy may grant and promise in all: ``none`` grants nothing (it does not pace),
    ``static`` and the override share the quota, ``dynamic`` its threshold, ``aggressive`` its percentage."""
    if config.policy is CreditPolicy.NONE:
        return 0
    if config.override_size or config.policy is CreditPolicy.STATIC:
        return config.quota
    if config.policy is CreditPolicy.DYNAMIC:
        return config.dynamic_threshold_bytes
    return config.aggressive_pool_bytes


def _pool_key(config: CreditPolicyConfig, connections: int) -> tuple[str, object]:
    """The key that made the pool too small for `connections` (`_pool_of`), and its value: the quota,
    unless half of it would hold them and a percentage cut it (the error named the quota, "got
    1073741824", for an aggressive_percent of 1e-30, a tester)."""
    if config.override_size or config.policy is CreditPolicy.STATIC or config.quota // 2 < connections:
        return "quota", config.quota
    if config.policy is CreditPolicy.DYNAMIC:
        return "dynamic_threshold_percent", config.dynamic_threshold_percent
    return "aggressive_percent", config.aggressive_percent


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
    pool_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.quota, int) or isinstance(self.quota, bool) or not 0 < self.quota <= MAX_QUOTA:
            raise PolicyConfigError("quota", self.quota, f"must be an integer number of bytes in [1, 2^50 = {MAX_QUOTA}]")
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
            # (a max_size lowered alone named this key, at its default, a tester: say to change both)
            raise PolicyConfigError("min_size", self.min_size, f"must be <= max_size={self.max_size}: raise "
                                    "max_size or lower min_size (min_size is 10 MiB and max_size 50 MiB unless set)")
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
        object.__setattr__(self, "pool_bytes", _pool_of(self))

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


WAIT_GRANT: Final = 1
"""The grant of a connection that holds no share of the pool: a provisional one (connected, no TRANSFER
yet) or a producer waiting for a share. A buffer of 0 means "not paced" on the wire, so the smallest
paced grant is 1 byte. By DCP's overflow rule it lets exactly one message go while nothing is
outstanding: a provisional connection's first message (which makes it a producer), or a waiting
producer's one message, after which the broker withholds its BUFFER_ACKs until it gets a share."""


def static_size(config: CreditPolicyConfig) -> int:
    """``static``: the same fixed size for every producer, while the pool (the quota) has room."""
    return config.static_size


def dynamic_size(config: CreditPolicyConfig) -> int:
    """``dynamic``: clamp(dynamic_percent of Q, min, max) for every producer, while the pool (the
    threshold) has room; first come, first served."""
    return clamp(config.dynamic_bytes, config.min_size, config.max_size)


def aggressive_size(config: CreditPolicyConfig, connections: int, pool: int | None = None) -> int:
    """``aggressive``: ``pool`` (by default aggressive_percent of Q) split evenly over ``connections``
    producers, at most ``max_size``. ``min_size`` lifts the share only while the pool holds it for every
    producer, which an even split already does: below it the split stays even (at least 1 byte), so
    every producer gets a share and none waits for an earlier one to leave. (Couchbase lifts it above
    the pool and overcommits; lifting within the pool made the producers past pool / min_size wait, for
    as long as the first ones stayed connected: with a 64 MiB quota, every producer but the first.)"""
    if connections < 1:
        raise ValueError(f"connections must be >= 1, got {connections}")
    share = (config.aggressive_pool_bytes if pool is None else pool) // connections
    if share < config.min_size:
        # Rounded down to a step of 2^(1/4) (19 %): a change of the share is pushed to every producer,
        # so an exact split would cost N BUFFER_CONTROLs at each of N registrations (N^2); in steps the
        # share changes about 40 times from 10 MiB to 10 KB, and at least 84 % of the pool is handed out.
        return _stepped(share)
    return min(share, config.max_size)


def _stepped(size: int) -> int:
    """The largest whole 2^(k/4) (k whole) not above `size`, at least 1."""
    if size < 2:
        return 1
    k = int(math.log2(size) * 4)
    while int(2 ** ((k + 1) / 4)) <= size:  # (float rounding either way)
        k += 1
    while int(2 ** (k / 4)) > size:
        k -= 1
    return int(2 ** (k / 4))


def share_target(config: CreditPolicyConfig, shareable: int, producers: int) -> int:
    """What every producer should get under ``config`` when the pool has room (0 under ``none``)."""
    if config.policy is CreditPolicy.NONE:
        return 0
    if config.override_size:
        return config.override_size
    if config.policy is CreditPolicy.STATIC:
        return static_size(config)
    if config.policy is CreditPolicy.DYNAMIC:
        return dynamic_size(config)
    return aggressive_size(config, max(producers, 1), shareable)


def reserve_for(pool: int, slots: int) -> int:
    """Bytes of the pool kept back for wait grants: one per connection slot, at most half the pool."""
    return min(slots, pool // 2)


K = TypeVar("K", bound=Hashable)


@dataclass(slots=True, eq=False)
class _Owner:
    """One owner's (a user's) connections together: ``cap`` bytes of S at most for the shares of all its
    producers (``share`` percent of S; None: no cap of its own). Kept while it has a connection."""

    key: Hashable
    share: Fraction | None
    cap: int = 0  # floor(S * share / 100), recomputed when S changes
    used: int = 0  # sum over its producers of (grant - 1): what of S they hold
    promised: int = 0  # sum over its producers of (window - 1): what of S they may have in flight
    conns: int = 0
    short: bool = False  # one of its producers holds less than the target because of the cap
    room: int = 0  # scratch of _share: what the cap leaves for grants
    promise_room: int = 0  # scratch of _share: what the cap leaves for windows beyond the current ones


@dataclass(slots=True)
class _Grant:
    size: int  # the buffer size the connection was told
    window: int  # what it may have unacknowledged: max(size, credit limit - acknowledged position)
    producer: bool = False  # registered as a producer (first TRANSFER); provisional until then
    waiting: bool = False  # a producer holding WAIT_GRANT because the pool has no share for it
    owner: _Owner | None = None  # the user whose share caps it, if any


def share_fraction(value: object) -> Fraction | None:
    """A per-owner share in percent of S, exact (0 or None: no cap); PolicyConfigError when out of range."""
    if value is None or value == 0:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 100:
        raise PolicyConfigError("credit_share_percent", value, "must be a number in [0, 100] (0: no cap)")
    return Fraction(str(value))


class CreditAllocator(Generic[K]):
    """Sans-IO bookkeeping of every flow-controlled connection's grant, bounded by one pool.

    The pool P is ``config.pool_bytes``. A reserve R (:func:`reserve_for`: one byte per connection slot,
    at most P/2) holds the first byte of every connection's grant, so a newcomer can always be given
    WAIT_GRANT; the rest, S = P - R, is shared among producers. A connection is charged its *window*,
    max(grant, credit limit - acknowledged position): a grant that shrank leaves the old, larger limit
    with the client (it may not have seen the shrink yet), so the difference stays promised until the
    client's BUFFER_LIMIT answer lowers the limit (at once, for an idle producer) or the broker's
    acknowledgements overtake it; the broker reports either with :meth:`set_window`.

    Owners (users): a connection may name its owner and the owner's share of S in percent. The shares
    its producers hold of S together (each grant minus its reserve byte) never exceed the cap, floor(S *
    share / 100), and neither do their windows (each window minus its byte): a shrunk producer's old
    window stays charged to its owner as to the pool, or an owner whose producers' transfers a stopped
    queue holds got new grants beside windows that could not drain (a tester: 2.08x its cap with
    churn). One user's many connections take at most its share, and the rest of S stays for the others.
    A producer an owner's cap leaves without a share waits until one of the owner's frees bytes.

    Invariants (tests/policies/test_credit_pool.py): the sum of grants never exceeds P, nor an owner's
    shares its cap; the sum of windows never exceeds P, nor an owner's its cap, except while promises made
    under a larger pool or cap drain after :meth:`reconfigure` or :meth:`set_owner_share`; every live connection has a grant >= 1 (0 under ``none``); and no producer
    waits while the pool could give it a share.

    Every mutating method returns ``{conn_id: new_size}`` for exactly the connections whose grant
    changed: what the broker must push (BUFFER_CONTROL).
    """

    __slots__ = ("_config", "_floor", "_slots", "_reserve", "_shareable", "_grants", "_producers",
                 "_granted", "_committed", "_producer_sizes", "_producer_windows", "_short", "_owners")

    def __init__(self, config: CreditPolicyConfig, *, floor: int = 1, slots: int = 1024) -> None:
        """``floor``: the least grant that counts as a share (the broker passes one maximum message);
        ``slots``: the most connections it must hold at once (the broker's max_connections)."""
        self._floor = _check_size("floor", floor, low=1)
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise PolicyConfigError("slots", slots, "must be an integer >= 1")
        self._slots = slots
        self._grants: dict[K, _Grant] = {}  # every connection, in connect order
        self._producers: dict[K, _Grant] = {}  # the producers, in registration order (first come first served)
        self._granted = 0
        self._committed = 0
        self._producer_sizes = 0  # sums over producers only: what of S they use is these minus one each
        self._producer_windows = 0
        self._short = False  # a producer holds less than the target: freed bytes must be handed out
        self._owners: dict[Hashable, _Owner] = {}  # owners with a live connection
        self._config = config
        self._reserve, self._shareable = self._split(config)

    # -- what the pool is ---------------------------------------------------------------------

    @property
    def config(self) -> CreditPolicyConfig:
        return self._config

    @property
    def pool(self) -> int:
        return self._config.pool_bytes

    @property
    def reserve(self) -> int:
        return self._reserve

    @property
    def shareable(self) -> int:
        return self._shareable

    @property
    def floor(self) -> int:
        return self._floor

    def target(self) -> int:
        """The share every producer gets when the pool has room for it."""
        return share_target(self._config, self._shareable, len(self._producers))

    def need(self) -> int:
        """The least grant that counts as a share: one maximum message, or less if the target or the
        shareable pool is smaller. A producer that cannot be given this much waits."""
        return max(1, min(self._floor, self._shareable + 1, self.target()))

    # -- connections --------------------------------------------------------------------------

    def connect(self, conn_id: K, owner: Hashable | None = None, share_percent: float = 0) -> dict[K, int]:
        """A flow-controlled connection opened: it gets WAIT_GRANT (0 under ``none``) until
        :meth:`register_producer`. Raises PoolExhaustedError when the reserve is used up. ``owner``
        (a user) and its ``share_percent`` of S (0: no cap) cap its producers' shares together; an owner
        that already has a connection keeps its share (:meth:`set_owner_share` changes it)."""
        if conn_id in self._grants:
            raise DuplicateConnectionError(f"connection {conn_id!r} is already registered")
        share = share_fraction(share_percent)
        size = 0
        if self._config.policy is not CreditPolicy.NONE:
            if len(self._grants) >= self._reserve:
                raise PoolExhaustedError(
                    f"the credit pool ({self.pool} bytes) has no byte left for connection {conn_id!r}: "
                    f"{len(self._grants)} connections hold its reserve of {self._reserve}"
                )
            size = WAIT_GRANT
        record: _Owner | None = None
        if owner is not None:
            record = self._owners.get(owner)
            if record is None:
                record = self._owners[owner] = _Owner(owner, share, self._cap(share))
            record.conns += 1
        self._grants[conn_id] = _Grant(size, size, owner=record)
        self._granted += size
        self._committed += size
        return {conn_id: size}

    def set_owner_share(self, owner: Hashable, share_percent: float) -> dict[K, int]:
        """A new share for a live owner (its users-file entry changed): every grant is recomputed."""
        share = share_fraction(share_percent)
        record = self._owners.get(owner)
        if record is None or record.share == share:
            return {}
        record.share, record.cap = share, self._cap(share)
        return self._share()

    def owner_share_used(self, owner: Hashable) -> int:
        """What the owner's producers hold of S together (grants minus their reserve bytes)."""
        record = self._owners.get(owner)
        return record.used if record is not None else 0

    def owner_cap(self, owner: Hashable) -> int | None:
        """The most the owner's producers may hold of S together; None when it has no cap."""
        record = self._owners.get(owner)
        return record.cap if record is not None and record.share is not None else None

    def owners(self) -> list[tuple[Hashable, float | None, int | None, int, int]]:
        """Every owner with a live connection: (owner, share percent or None, cap or None, used, connections),
        in the order they first connected (at most one per connection: bounded as the connections are)."""
        return [(o.key, None if o.share is None else float(o.share), None if o.share is None else o.cap,
                 o.used, o.conns) for o in self._owners.values()]

    def register_producer(self, conn_id: K) -> dict[K, int]:
        """The connection sent its first TRANSFER: it now shares the pool (or waits for a share).
        Connections that only consume never get here, so they never dilute the producers' shares."""
        grant = self._get(conn_id)
        if grant.producer:
            return {}
        target = self.target()
        grant.producer = True
        self._producers[conn_id] = grant
        self._producer_sizes += grant.size
        self._producer_windows += grant.window
        if grant.owner is not None:
            grant.owner.used += grant.size - 1
            grant.owner.promised += grant.window - 1
        if len(self._producers) > 1 and self.target() == target:
            # Nobody else's grant moves: a full pass would repeat the last one for everyone before
            # the newcomer, which comes last. O(1) once the aggressive share is clamped.
            return self._share_last(conn_id, grant)
        return self._share()

    def disconnect(self, conn_id: K) -> dict[K, int]:
        target = self.target()
        grant = self._grants.pop(conn_id, None)
        if grant is None:
            raise UnknownConnectionError(f"connection {conn_id!r} is not registered")
        self._granted -= grant.size
        self._committed -= grant.window
        owner = grant.owner
        if owner is not None:
            owner.conns -= 1
            if not owner.conns:
                del self._owners[owner.key]
        if self._producers.pop(conn_id, None) is None:
            return {}  # a provisional connection frees only its reserve byte
        self._producer_sizes -= grant.size
        self._producer_windows -= grant.window
        if owner is not None:
            owner.used -= grant.size - 1
            owner.promised -= grant.window - 1
        if not self._short and self.target() == target and (owner is None or not owner.short):
            return {}  # everyone already has the (unchanged) target: the freed bytes are not wanted
        return self._share()

    def set_window(self, conn_id: K, window: int) -> dict[K, int]:
        """The broker's acknowledgements, or the client's BUFFER_LIMIT, moved this connection's window
        (credit limit - acknowledged position): a promise left by a shrink is spent or drained, and its
        bytes return to the pool, to whoever is short first."""
        grant = self._get(conn_id)
        if self._config.policy is CreditPolicy.NONE:
            return {}
        window = max(window, grant.size)
        if window == grant.window:
            return {}
        grown = window > grant.window
        self._resize(grant, grant.size, window=window)
        owner_short = grant.owner is not None and grant.owner.short
        return {} if grown or not (self._short or owner_short) else self._share()

    def reconfigure(self, config: CreditPolicyConfig) -> dict[K, int]:
        """A new policy, quota or bound while connections are live: every grant is recomputed. Promises
        made under the old config stay charged until they drain; nothing new is promised meanwhile.
        Raises PolicyConfigError (changing nothing) if the new pool cannot hold the live connections."""
        reserve, shareable = self._split(config)
        paced = config.policy is not CreditPolicy.NONE
        if paced and reserve < 1:
            # (accepted with no connection live, it left a broker that refused every client after it:
            # "the credit pool (0 bytes) has no byte left for connection 1", a tester)
            key, value = _pool_key(config, 1)
            raise PolicyConfigError(
                key, value,
                f"a pool of {config.pool_bytes} bytes cannot hold a single connection (one byte each, at most "
                f"half the pool): raise {key}",
            )
        if paced and len(self._grants) > reserve:
            key, value = _pool_key(config, len(self._grants))
            raise PolicyConfigError(
                key, value,
                f"a pool of {config.pool_bytes} bytes cannot hold {len(self._grants)} connections "
                f"(one byte each, at most half the pool): raise {key}",
            )
        old = {conn_id: g.size for conn_id, g in self._grants.items()}
        self._config, self._reserve, self._shareable = config, reserve, shareable
        for owner in self._owners.values():
            owner.cap = self._cap(owner.share)
        for grant in self._grants.values():
            if not paced:
                self._resize(grant, 0, window=0)
            elif grant.size == 0 or not grant.producer:
                self._resize(grant, WAIT_GRANT, window=max(grant.window, WAIT_GRANT))
        if paced:
            self._share()
        else:
            self._short = False
            for grant in self._producers.values():
                grant.waiting = False
            for owner in self._owners.values():
                owner.short = False
        return {c: g.size for c, g in self._grants.items() if g.size != old[c]}

    # -- reading ------------------------------------------------------------------------------

    def size_of(self, conn_id: K) -> int:
        return self._get(conn_id).size

    def window_of(self, conn_id: K) -> int:
        return self._get(conn_id).window

    def is_producer(self, conn_id: K) -> bool:
        return self._get(conn_id).producer

    def is_waiting(self, conn_id: K) -> bool:
        return self._get(conn_id).waiting

    def total_granted(self) -> int:
        """Every grant, provisional and waiting ones included."""
        return self._granted

    def total_committed(self) -> int:
        """Every connection's window: its grant, or the larger limit a shrink left it. The pool bounds this."""
        return self._committed

    def waiting(self) -> int:
        return sum(1 for g in self._producers.values() if g.waiting)

    def connections(self) -> tuple[K, ...]:
        """Every connection, in connect order."""
        return tuple(self._grants)

    def producers(self) -> tuple[K, ...]:
        """The registered producers, in registration order."""
        return tuple(self._producers)

    @property
    def producer_ids(self) -> KeysView[K]:
        """The registered producers, as a live view (a cheap membership test for the broker's hot path)."""
        return self._producers.keys()

    def sizes(self) -> dict[K, int]:
        """A snapshot of every grant, for the management views."""
        return {conn_id: g.size for conn_id, g in self._grants.items()}

    def __len__(self) -> int:
        return len(self._grants)

    def __contains__(self, conn_id: object) -> bool:
        return conn_id in self._grants

    # -- sharing ------------------------------------------------------------------------------

    def _split(self, config: CreditPolicyConfig) -> tuple[int, int]:
        reserve = reserve_for(config.pool_bytes, self._slots)
        return reserve, config.pool_bytes - reserve

    def _cap(self, share: Fraction | None) -> int:
        return 0 if share is None else int(self._shareable * share // 100)

    def _get(self, conn_id: K) -> _Grant:
        try:
            return self._grants[conn_id]
        except KeyError:
            raise UnknownConnectionError(f"connection {conn_id!r} is not registered") from None

    def _resize(self, grant: _Grant, size: int, *, window: int | None = None) -> None:
        new_window = max(grant.window, size) if window is None else window
        self._granted += size - grant.size
        self._committed += new_window - grant.window
        if grant.producer:
            self._producer_sizes += size - grant.size
            self._producer_windows += new_window - grant.window
            if grant.owner is not None:
                grant.owner.used += size - grant.size
                grant.owner.promised += new_window - grant.window
        grant.size, grant.window = size, new_window

    def _fit(self, grant: _Grant, target: int, need: int, grant_room: int, promise_room: int) -> int:
        """One producer's grant, given what is left of S for grants and for promises."""
        window = grant.window
        size = target if target <= window else window + max(0, min(target - window, promise_room))
        size = min(size, grant_room + 1)
        return WAIT_GRANT if size < need else size

    def _share_last(self, conn_id: K, grant: _Grant) -> dict[K, int]:
        """The newest producer's grant out of what the others leave (they keep theirs)."""
        if self._config.policy is CreditPolicy.NONE:
            return {}
        n = len(self._producers)
        grant_room = self._shareable - (self._producer_sizes - n)
        promise_room = self._shareable - (self._producer_windows - n)
        target = self.target()
        need = self.need()
        size = self._fit(grant, target, need, grant_room, promise_room)
        owner = grant.owner
        if owner is not None and owner.share is not None:
            capped = self._fit(grant, target, need, min(grant_room, owner.cap - (owner.used - (grant.size - 1))),
                               min(promise_room, owner.cap - owner.promised))
            if capped < size:  # the owner's cap, not the pool, holds it back
                size = capped
                owner.short = True
                target = size
        self._short = self._short or size < target
        grant.waiting = size == WAIT_GRANT and need > WAIT_GRANT
        if size == grant.size:
            return {}
        self._resize(grant, size)
        return {conn_id: size}

    def _share(self) -> dict[K, int]:
        """Recompute every producer's grant, in registration order: each gets the target if the pool
        has room, else what is left if that is at least :meth:`need`, else WAIT_GRANT (it waits).

        A producer's first byte comes from the reserve; the rest of its grant and of its window from
        S. Two budgets: ``grant_room`` keeps the sum of grants within S, ``promise_room`` the sum of
        windows (a grant within a producer's current window promises nothing new; growing past it
        does). O(producers); called on register, disconnect, reconfigure, and when a window drains
        while someone is short."""
        changed: dict[K, int] = {}
        if self._config.policy is CreditPolicy.NONE or not self._producers:
            self._short = False
            return changed
        target = self.target()
        need = self.need()
        marks_waiting = need > WAIT_GRANT
        grant_room = self._shareable
        promise_room = self._shareable - (self._producer_windows - len(self._producers))
        short = False
        for record in self._owners.values():
            record.room, record.promise_room, record.short = record.cap, record.cap - record.promised, False
        # _fit inlined: this pass runs on every producer's departure while some are short, so with 1,000
        # producers (970 waiting under the default policy) it is what a disconnect costs. Once grant_room
        # cannot hold `need`, everyone after waits: those already waiting are left as they are (a user's
        # cap can only lower a grant, so it changes nothing for them).
        for conn_id, grant in self._producers.items():
            window = grant.window
            if grant_room + 1 < need:
                if grant.size == WAIT_GRANT and grant.waiting == marks_waiting:
                    short = short or WAIT_GRANT < target
                    continue
                size = WAIT_GRANT
                short = short or size < target
            else:
                if target <= window:
                    size = target
                else:
                    more = target - window
                    size = window + (more if more <= promise_room else max(0, promise_room))
                if size > grant_room + 1:
                    size = grant_room + 1
                if size < need:
                    size = WAIT_GRANT
                owner = grant.owner
                if owner is not None and owner.share is not None:
                    capped = self._fit(grant, target, need, min(grant_room, owner.room),
                                       min(promise_room, owner.promise_room))
                    if capped < size:  # the owner's cap, not the pool, holds it back
                        size = capped
                        owner.short = True
                    else:
                        short = short or size < target
                    owner.room -= size - 1
                    if size > window:
                        owner.promise_room -= size - window
                else:
                    short = short or size < target
                if size > window:
                    promise_room -= size - window
            grant_room -= size - 1
            grant.waiting = size == WAIT_GRANT and marks_waiting
            if size != grant.size:
                self._resize(grant, size)
                changed[conn_id] = size
        self._short = short
        return changed
