"""Producer credit policies: sizes, bounds, the dynamic threshold, aggressive sharing, reconfiguration."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowbroker.policies import (
    MAX_BUFFER_SIZE,
    CreditAllocator,
    CreditPolicy,
    CreditPolicyConfig,
    DuplicateConnectionError,
    MiB,
    PolicyConfigError,
    PolicyError,
    UnknownConnectionError,
    aggressive_size,
    dynamic_size,
    static_size,
)

GiB = 1024 * MiB
Q10 = 10 * GiB  # aggressive pool 512 MiB, dynamic 1 % = 102.4 MiB (clamped to 50), threshold 1 GiB


def cfg(policy: str = "aggressive", quota: int = Q10, **kw: object) -> CreditPolicyConfig:
    return CreditPolicyConfig.from_mapping({"policy": policy, "quota": quota, **kw})


def connect_n(alloc: CreditAllocator[int], n: int) -> list[dict[int, int]]:
    return [alloc.connect(i) for i in range(n)]


# --- configuration ---------------------------------------------------------------------------------


def test_defaults_match_couchbase() -> None:
    c = CreditPolicyConfig(quota=Q10)
    assert c.policy is CreditPolicy.AGGRESSIVE
    assert (c.static_size, c.min_size, c.max_size) == (10 * MiB, 10 * MiB, 50 * MiB)
    assert (c.dynamic_percent, c.dynamic_threshold_percent, c.aggressive_percent) == (1.0, 10.0, 5.0)
    assert c.override_size == 0
    assert (c.dynamic_bytes, c.dynamic_threshold_bytes, c.aggressive_pool_bytes) == (
        107374182,
        1073741824,
        536870912,
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("quota", 0),
        ("quota", -1),
        ("quota", 1.5),
        ("quota", True),
        ("policy", "fastest"),
        ("policy", 3),
        ("static_size", 0),
        ("static_size", MAX_BUFFER_SIZE + 1),
        ("min_size", 0),
        ("max_size", MAX_BUFFER_SIZE + 1),
        ("max_size", "50MiB"),
        ("dynamic_percent", 0),
        ("dynamic_percent", 100.01),
        ("dynamic_threshold_percent", -5),
        ("aggressive_percent", 0.0),
        ("aggressive_percent", "5"),
        ("override_size", -1),
        ("override_size", MAX_BUFFER_SIZE + 1),
        ("override_size", False),
    ],
)
def test_config_validation_names_key_and_value(key: str, value: object) -> None:
    settings_ = {"quota": Q10, key: value}
    with pytest.raises(PolicyConfigError) as info:
        CreditPolicyConfig.from_mapping(settings_)
    assert info.value.key == key
    assert info.value.value == value
    assert key in str(info.value) and repr(value) in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, PolicyError)


def test_min_above_max_is_rejected_naming_min() -> None:
    with pytest.raises(PolicyConfigError) as info:
        CreditPolicyConfig(quota=Q10, min_size=60 * MiB, max_size=50 * MiB)
    assert info.value.key == "min_size"


def test_percentage_upper_bound_is_inclusive() -> None:
    c = CreditPolicyConfig(quota=1000, aggressive_percent=100, min_size=1, max_size=1000)
    assert c.aggressive_pool_bytes == 1000


def test_unknown_and_missing_keys_from_mapping() -> None:
    with pytest.raises(PolicyConfigError) as info:
        CreditPolicyConfig.from_mapping({"quota": Q10, "agressive_percent": 5})
    assert info.value.key == "agressive_percent"
    with pytest.raises(PolicyConfigError) as info:
        CreditPolicyConfig.from_mapping({"policy": "static"})
    assert info.value.key == "quota"


def test_from_toml_table() -> None:
    doc = tomllib.loads(
        """
        [credit]
        policy = "dynamic"
        quota = 2147483648
        dynamic_percent = 2.5
        max_size = 104857600
        """
    )
    c = CreditPolicyConfig.from_mapping(doc["credit"])
    assert c.policy is CreditPolicy.DYNAMIC
    assert c.dynamic_bytes == 53687091  # floor(2 GiB * 2.5 / 100)


def test_percentages_are_exact_decimals() -> None:
    # float arithmetic gives 10000 * 0.57 / 100 = 56.99999... -> 56; the config means 57 bytes.
    assert CreditPolicyConfig(quota=10_000, dynamic_percent=0.57, min_size=1).dynamic_bytes == 57


# --- pure size functions -------------------------------------------------------------------------------


def test_static_and_none_sizes_for_1_to_1000_connections() -> None:
    static = CreditAllocator[int](cfg("static", static_size=3 * MiB))
    none = CreditAllocator[int](cfg("none"))
    for n in range(1, 1001):
        assert static.connect(n) == {n: 3 * MiB}
        assert none.connect(n) == {n: 0}
        assert static.total_granted() == n * 3 * MiB
        assert none.total_granted() == 0
    assert static_size(cfg("static")) == 10 * MiB


def test_dynamic_size_threshold_boundary() -> None:
    c = cfg("dynamic")
    assert dynamic_size(c, 0) == 50 * MiB  # 1 % of 10 GiB = 102.4 MiB, clamped to max
    assert dynamic_size(c, 1 * GiB) == 50 * MiB  # at the threshold: not yet exceeded
    assert dynamic_size(c, 1 * GiB + 1) == 10 * MiB  # beyond it: the minimum
    small = cfg("dynamic", quota=100 * MiB)  # 1 % = 1 MiB, below the minimum
    assert dynamic_size(small, 0) == 10 * MiB
    mid = cfg("dynamic", quota=2 * GiB)  # 1 % = 21474836 bytes, inside [10, 50] MiB
    assert dynamic_size(mid, 0) == 21474836


def test_dynamic_sizes_for_1_to_1000_connections() -> None:
    alloc = CreditAllocator[int](cfg("dynamic"))
    sizes = [alloc.connect(i)[i] for i in range(1000)]
    # The 21st sees 20 x 50 MiB = 1000 MiB <= 1 GiB and still gets 50 MiB; the 22nd sees 1050 MiB.
    assert sizes[:21] == [50 * MiB] * 21
    assert sizes[21:] == [10 * MiB] * 979
    assert alloc.total_granted() == 21 * 50 * MiB + 979 * 10 * MiB


def test_dynamic_threshold_with_unclamped_percentage() -> None:
    alloc = CreditAllocator[int](cfg("dynamic", quota=2 * GiB))
    sizes = [alloc.connect(i)[i] for i in range(13)]
    # threshold 214748364: after 10 grants the sum is 214748360 (not beyond), after 11 it is beyond.
    assert sizes == [21474836] * 11 + [10 * MiB] * 2


def test_dynamic_sizes_are_set_once_and_disconnect_frees_the_threshold() -> None:
    alloc = CreditAllocator[int](cfg("dynamic"))
    connect_n(alloc, 22)
    assert alloc.size_of(21) == 10 * MiB
    assert alloc.disconnect(0) == {}  # nobody else is resized
    assert alloc.size_of(1) == 50 * MiB and alloc.size_of(21) == 10 * MiB
    assert alloc.disconnect(21) == {}
    assert alloc.disconnect(20) == {}  # now 19 x 50 MiB granted: under the threshold again
    assert alloc.connect(99) == {99: 50 * MiB}


def test_aggressive_size_spot_values() -> None:
    c = cfg()
    assert [aggressive_size(c, n) for n in (1, 10)] == [50 * MiB, 50 * MiB]  # 51.2 MiB each: clamped
    assert aggressive_size(c, 11) == 536870912 // 11 == 48806446
    assert aggressive_size(c, 51) == 10526880  # just above the minimum
    assert aggressive_size(c, 52) == 10 * MiB  # 10324440 would be below it
    assert aggressive_size(c, 1000) == 10 * MiB
    with pytest.raises(ValueError):
        aggressive_size(c, 0)


def test_aggressive_sizes_for_1_to_1000_connections() -> None:
    c = cfg()
    alloc = CreditAllocator[int](c)
    previous = None
    for n in range(1, 1001):
        changed = alloc.connect(n)
        size = alloc.size_of(n)
        assert size == aggressive_size(c, n)
        assert 10 * MiB <= size <= 50 * MiB
        assert alloc.total_granted() == n * size <= c.aggressive_pool_bytes + n * c.min_size
        if 10 * MiB < size < 50 * MiB:
            assert size == c.aggressive_pool_bytes // n  # not clamped: an even share of the pool
            assert alloc.total_granted() <= c.aggressive_pool_bytes
        # Everyone whose size moved is pushed; when clamped nothing moves but the newcomer.
        expected = {i: size for i in range(1, n + 1)} if size != previous else {n: size}
        assert changed == expected
        previous = size


def test_aggressive_disconnect_grows_the_others() -> None:
    alloc = CreditAllocator[str](cfg())
    for i in range(12):
        alloc.connect(f"p{i}")
    assert alloc.size_of("p0") == 536870912 // 12
    changed = alloc.disconnect("p5")
    assert changed == {f"p{i}": 536870912 // 11 for i in range(12) if i != 5}
    assert alloc.disconnect("p6") == {f"p{i}": 50 * MiB for i in range(12) if i not in (5, 6)}
    assert alloc.disconnect("p7") == {}  # still clamped at the maximum: nothing to push
    for conn in alloc.connections():
        alloc.disconnect(conn)
    assert len(alloc) == 0 and alloc.total_granted() == 0


def test_max_buffer_size_caps_huge_quotas() -> None:
    # MB-72330: a 1 PiB quota must not produce a > 4 GiB buffer.
    c = cfg(quota=2**50, max_size=MAX_BUFFER_SIZE, static_size=MAX_BUFFER_SIZE)
    assert aggressive_size(c, 1) == MAX_BUFFER_SIZE
    assert dynamic_size(c, 0) == MAX_BUFFER_SIZE
    assert MAX_BUFFER_SIZE == 2**32 - 1


def test_override_is_absolute_under_every_paced_policy() -> None:
    for policy in ("static", "dynamic", "aggressive"):
        alloc = CreditAllocator[int](cfg(policy, override_size=123_456))
        results = connect_n(alloc, 100)
        assert results == [{i: 123_456} for i in range(100)]  # no resizing of others
        assert alloc.disconnect(0) == {}
    none = CreditAllocator[int](cfg("none", override_size=123_456))
    assert none.connect(1) == {1: 0}  # "none" means not paced, override or not


# --- allocator bookkeeping -----------------------------------------------------------------------------


def test_connection_ids_are_known_once() -> None:
    alloc = CreditAllocator[int](cfg())
    alloc.connect(1)
    with pytest.raises(DuplicateConnectionError):
        alloc.connect(1)
    assert alloc.connections() == (1,) and alloc.total_granted() == 50 * MiB
    with pytest.raises(UnknownConnectionError):
        alloc.disconnect(2)
    with pytest.raises(UnknownConnectionError):
        alloc.size_of(2)
    alloc.disconnect(1)
    with pytest.raises(LookupError):
        alloc.disconnect(1)
    assert 1 not in alloc


def test_reconfigure_between_policies_with_live_connections() -> None:
    alloc = CreditAllocator[int](cfg())
    connect_n(alloc, 30)  # aggressive: 536870912 // 30 = 17895697 each
    assert alloc.reconfigure(cfg("static")) == {i: 10 * MiB for i in range(30)}
    assert alloc.reconfigure(cfg("static")) == {}  # nothing changed, nothing to push
    assert alloc.reconfigure(cfg("none")) == {i: 0 for i in range(30)}
    assert alloc.total_granted() == 0
    # dynamic replays the connects in order: 21 at 50 MiB, the rest at the minimum
    changed = alloc.reconfigure(cfg("dynamic"))
    assert changed == {i: (50 * MiB if i < 21 else 10 * MiB) for i in range(30)}
    assert alloc.reconfigure(cfg("dynamic")) == {}  # same config: nothing to push
    # quota doubled: threshold 2 GiB, 30 x 50 MiB stays under it, so the nine at the minimum grow
    assert alloc.reconfigure(cfg("dynamic", quota=20 * GiB)) == {i: 50 * MiB for i in range(21, 30)}
    assert alloc.sizes() == {i: 50 * MiB for i in range(30)}


def test_reconfigure_dynamic_quota_change_recomputes_everyone() -> None:
    alloc = CreditAllocator[int](cfg("dynamic"))
    connect_n(alloc, 25)
    changed = alloc.reconfigure(cfg("dynamic", quota=100 * GiB))  # threshold 10 GiB: nobody beyond
    assert changed == {i: 50 * MiB for i in range(21, 25)}
    assert alloc.total_granted() == 25 * 50 * MiB


def test_reconfigure_aggressive_quota_and_back() -> None:
    alloc = CreditAllocator[int](cfg("static"))
    connect_n(alloc, 40)
    assert alloc.reconfigure(cfg(quota=20 * GiB)) == {i: 1073741824 // 40 for i in range(40)}
    assert alloc.reconfigure(cfg(quota=80 * GiB)) == {i: 50 * MiB for i in range(40)}
    assert alloc.connect(40) == {40: 50 * MiB}  # the new policy applies to later connects too
    empty = CreditAllocator[int](cfg("none"))
    assert empty.reconfigure(cfg()) == {}


# --- random connect/disconnect/reconfigure sequences -----------------------------------------------------

configs = st.builds(
    lambda policy, quota, lo, span, pct, override: CreditPolicyConfig(
        quota=quota,
        policy=policy,
        min_size=lo,
        max_size=lo + span,
        static_size=lo,
        aggressive_percent=pct,
        dynamic_percent=pct,
        override_size=override,
    ),
    policy=st.sampled_from(list(CreditPolicy)),
    quota=st.integers(1, 2**44),
    lo=st.integers(1, 64 * MiB),
    span=st.integers(0, 256 * MiB),
    pct=st.floats(0.01, 100, allow_nan=False),
    override=st.sampled_from([0, 0, 0, 7 * MiB]),
)


class AllocatorMachine(RuleBasedStateMachine):
    """Model: every op's result is exactly the diff of sizes; aggressive stays within the pool + floor."""

    def __init__(self) -> None:
        super().__init__()
        self.config = CreditPolicyConfig(quota=Q10)
        self.alloc = CreditAllocator[int](self.config)
        self.shadow: dict[int, int] = {}
        self.next_id = 0

    def _apply(self, changed: dict[int, int]) -> None:
        for conn, size in changed.items():
            assert self.shadow.get(conn) != size, "a size that did not change was pushed"
            self.shadow[conn] = size

    @rule()
    def connect(self) -> None:
        conn, self.next_id = self.next_id, self.next_id + 1
        changed = self.alloc.connect(conn)
        assert conn in changed
        self.shadow[conn] = -1  # the new connection must always be in the result
        self._apply(changed)

    @precondition(lambda self: bool(self.shadow))
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        conn = data.draw(st.sampled_from(sorted(self.shadow)))
        del self.shadow[conn]
        changed = self.alloc.disconnect(conn)
        assert conn not in changed
        self._apply(changed)

    @rule(config=configs)
    def reconfigure(self, config: CreditPolicyConfig) -> None:
        self.config = config
        self._apply(self.alloc.reconfigure(config))

    @invariant()
    def sizes_match_and_stay_bounded(self) -> None:
        c, n = self.config, len(self.shadow)
        assert self.alloc.sizes() == self.shadow
        assert self.alloc.total_granted() == sum(self.shadow.values())
        assert self.alloc.connections() == tuple(sorted(self.shadow))
        for size in self.shadow.values():
            assert size <= MAX_BUFFER_SIZE
            if c.policy is CreditPolicy.NONE:
                assert size == 0
            elif c.override_size:
                assert size == c.override_size
            else:
                assert c.min_size <= size <= max(c.max_size, c.static_size)
        if c.policy is CreditPolicy.AGGRESSIVE and not c.override_size and n:
            assert len(set(self.shadow.values())) == 1
            assert self.alloc.total_granted() <= c.aggressive_pool_bytes + n * c.min_size
            assert next(iter(self.shadow.values())) == aggressive_size(c, n)


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase


@given(
    n=st.integers(1, 1000),
    quota=st.integers(1, 2**50),
    lo=st.integers(1, 2**31),
    span=st.integers(0, 2**31),
    pct=st.floats(0.001, 100, allow_nan=False),
)
def test_aggressive_size_properties(n: int, quota: int, lo: int, span: int, pct: float) -> None:
    c = CreditPolicyConfig(quota=quota, min_size=lo, max_size=min(lo + span, MAX_BUFFER_SIZE), aggressive_percent=pct)
    size = aggressive_size(c, n)
    assert c.min_size <= size <= c.max_size
    assert n * size <= c.aggressive_pool_bytes + n * c.min_size
    if n > 1:
        assert aggressive_size(c, n - 1) >= size  # more producers never means bigger buffers


# --- provisional size: what a flow-controlled connection has before it registers -------------------------


@pytest.mark.parametrize(
    ("policy", "override", "expected"),
    [
        ("none", 0, 0),
        ("none", 7 * MiB, 0),  # none still means not paced
        ("static", 0, 3 * MiB),  # static_size
        ("dynamic", 0, 2 * MiB),  # the floor, min_size
        ("aggressive", 0, 2 * MiB),
        ("static", 7 * MiB, 7 * MiB),  # the override, under every paced policy
        ("dynamic", 7 * MiB, 7 * MiB),
        ("aggressive", 7 * MiB, 7 * MiB),
    ],
)
def test_provisional_size_for_each_policy_and_override(policy: str, override: int, expected: int) -> None:
    config = cfg(policy, static_size=3 * MiB, min_size=2 * MiB, max_size=40 * MiB, override_size=override)
    alloc = CreditAllocator[int](config)
    assert alloc.provisional_size() == expected
    connect_n(alloc, 5)  # independent of who is registered
    assert alloc.provisional_size() == expected
    alloc.disconnect(0)
    assert alloc.provisional_size() == expected
    assert len(alloc) == 4  # asking registers nothing


def test_provisional_size_follows_reconfigure() -> None:
    alloc = CreditAllocator[int](cfg("aggressive", min_size=2 * MiB))
    connect_n(alloc, 3)
    assert alloc.provisional_size() == 2 * MiB
    alloc.reconfigure(cfg("static", static_size=3 * MiB))
    assert alloc.provisional_size() == 3 * MiB
    alloc.reconfigure(cfg("none"))
    assert alloc.provisional_size() == 0
    alloc.reconfigure(cfg("dynamic", override_size=5 * MiB))
    assert alloc.provisional_size() == 5 * MiB


@given(
    config=st.builds(
        lambda policy, quota, lo, span, static, pct, threshold, override: CreditPolicyConfig(
            quota=quota,
            policy=policy,
            min_size=lo,
            max_size=lo + span,
            static_size=static,
            aggressive_percent=pct,
            dynamic_percent=pct,
            dynamic_threshold_percent=threshold,
            override_size=override,
        ),
        policy=st.sampled_from(list(CreditPolicy)),
        quota=st.integers(1, 2**44),
        lo=st.integers(1, 64 * MiB),
        span=st.integers(0, 256 * MiB),
        static=st.integers(1, 64 * MiB),
        pct=st.floats(0.01, 100, allow_nan=False),
        threshold=st.floats(0.01, 100, allow_nan=False),
        override=st.one_of(st.just(0), st.integers(1, MAX_BUFFER_SIZE)),
    ),
    registered=st.integers(0, 60),
    leaving=st.integers(0, 60),
    provisional=st.integers(0, 200),
)
def test_provisional_size_is_never_above_a_registered_share(
    config: CreditPolicyConfig, registered: int, leaving: int, provisional: int
) -> None:
    alloc = CreditAllocator[int](config)
    connect_n(alloc, registered)
    for conn in range(min(leaving, registered)):
        alloc.disconnect(conn)
    size = alloc.provisional_size()
    assert 0 <= size <= MAX_BUFFER_SIZE
    assert (size == 0) is (config.policy is CreditPolicy.NONE)
    # what connect() gives the next one, and every registered size after it, is at least the provisional size
    newcomer = alloc.connect(-1)[-1]
    assert size <= newcomer
    assert all(size <= s for s in alloc.sizes().values())
    # so provisional grants stay within the aggressive bound, counted over every flow-controlled connection
    if config.policy is CreditPolicy.AGGRESSIVE and not config.override_size:
        n = len(alloc) + provisional
        assert alloc.total_granted() + provisional * size <= config.aggressive_pool_bytes + n * config.min_size
