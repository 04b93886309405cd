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


@pytest.mark.parametrize("quota", [2**50 + 1, 2**1030])
def test_a_quota_past_2_to_the_50_is_refused_and_shown_short(quota: int) -> None:
    """PUT /api/policy {"quota": 2**1030} was taken and every /metrics scrape then failed converting it to a
    float (a tester); and its error message printed every digit."""
    with pytest.raises(PolicyConfigError) as info:
        CreditPolicyConfig.from_mapping({"quota": quota})
    assert info.value.key == "quota" and "2^50" in str(info.value)
    assert len(str(info.value)) < 200
    assert CreditPolicyConfig.from_mapping({"quota": 2**50}).quota == 2**50


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


# --- pure size functions and the allocator under each policy ----------------------------------------------
# (the invariants under random sequences are in test_credit_pool.py)

FLOOR = 4 * MiB + 512  # one maximum message, as the broker passes it


def producers(alloc: CreditAllocator[int], n: int, *, drained: bool = True) -> None:
    """n producers connect and register; with `drained`, each one's acknowledgements then overtake
    whatever a shrink left promised (every producer active), so only grants are charged."""
    for i in range(len(alloc), len(alloc) + n):
        alloc.connect(i)
        alloc.register_producer(i)
        if drained:
            for c in alloc.producers():
                alloc.set_window(c, alloc.size_of(c))


def test_static_and_none_sizes_for_1_to_1000_connections() -> None:
    static = CreditAllocator[int](cfg("static", static_size=3 * MiB), floor=FLOOR, slots=10_000)
    none = CreditAllocator[int](cfg("none"), floor=FLOOR, slots=10_000)
    for n in range(1000):
        assert static.connect(n) == {n: 1}  # provisional: one byte
        assert static.register_producer(n) == {n: 3 * MiB}  # 3000 MiB in all fits in the 10 GiB quota
        assert none.connect(n) == {n: 0} and none.register_producer(n) == {}
        assert static.total_granted() == (n + 1) * 3 * MiB
        assert none.total_granted() == 0
    assert static_size(cfg("static")) == 10 * MiB


def test_static_is_bounded_by_the_quota() -> None:
    alloc = CreditAllocator[int](cfg("static", quota=100 * MiB), floor=FLOOR, slots=100)
    producers(alloc, 12)  # 10 MiB each: nine fit in 100 MiB - 100 bytes, the tenth gets the rest
    sizes = [alloc.size_of(i) for i in range(12)]
    assert sizes[:9] == [10 * MiB] * 9 and sizes[9] == 10 * MiB - 90 and sizes[10:] == [1, 1]
    assert alloc.total_granted() <= 100 * MiB and alloc.waiting() == 2


def test_dynamic_size_and_its_pool_the_threshold() -> None:
    assert dynamic_size(cfg("dynamic")) == 50 * MiB  # 1 % of 10 GiB = 102.4 MiB, clamped to max
    assert dynamic_size(cfg("dynamic", quota=100 * MiB)) == 10 * MiB  # 1 MiB, below the minimum
    assert dynamic_size(cfg("dynamic", quota=2 * GiB)) == 21474836  # inside [10, 50] MiB
    alloc = CreditAllocator[int](cfg("dynamic"), floor=FLOOR, slots=10_000)  # pool: 10 % = 1 GiB
    producers(alloc, 25)
    sizes = [alloc.size_of(i) for i in range(25)]
    # 20 x 50 MiB = 1000 MiB; the 21st gets the 24 MiB left (>= one maximum message); then they wait
    assert sizes[:20] == [50 * MiB] * 20
    assert sizes[20] == GiB - 10_000 - 20 * (50 * MiB - 1) + 1
    assert sizes[21:] == [1] * 4 and alloc.waiting() == 4
    assert alloc.total_granted() <= GiB
    assert alloc.disconnect(0) == {20: 50 * MiB, 21: GiB - 10_000 - 20 * (50 * MiB - 1) + 1 - 0}


def test_aggressive_size_spot_values() -> None:
    c = cfg()
    assert [aggressive_size(c, n) for n in (1, 10)] == [50 * MiB, 50 * MiB]  # 51.2 MiB each: clamped
    assert aggressive_size(c, 11) == 536870912 // 11 == 48806446
    assert aggressive_size(c, 51) == 10526880  # just above the minimum
    # below min_size the split stays even: every producer gets a share, none waits (the pool is 512 MiB)
    # (in steps of 2^(1/4), so that a registration does not change every share: policies/credit.py)
    assert aggressive_size(c, 52) == int(2 ** (93 / 4)) == 9_975_792  # 536870912 // 52 = 10324440
    assert 0.84 * 536870 <= aggressive_size(c, 1000) <= 536870
    assert aggressive_size(c, 20, pool=100 * MiB) == int(2 ** (89 / 4)) == 4_987_896  # 5 MiB of another pool, stepped
    assert aggressive_size(c, 10**9, pool=100) == 1  # never 0 (0 means "not paced")
    with pytest.raises(ValueError):
        aggressive_size(c, 0)


def test_aggressive_equal_shares_while_the_pool_holds_them() -> None:
    c = cfg()
    alloc = CreditAllocator[int](c, floor=FLOOR, slots=10_000)
    shareable = c.aggressive_pool_bytes - 10_000
    for n in range(1, 52):
        producers(alloc, 1)
        share = aggressive_size(c, n, shareable)
        assert alloc.sizes() == {i: share for i in range(n)}
        assert alloc.total_granted() == n * share <= c.aggressive_pool_bytes
    producers(alloc, 20)  # beyond min_size for all: the split stays even, and nobody waits
    assert alloc.total_granted() <= c.aggressive_pool_bytes
    (share,) = set(alloc.sizes().values())
    assert alloc.waiting() == 0 and 0.84 * shareable // 71 <= share <= shareable // 71


def test_aggressive_disconnect_grows_the_others() -> None:
    alloc = CreditAllocator[str](cfg(), floor=FLOOR, slots=100)
    shareable = alloc.shareable
    for i in range(12):
        alloc.connect(f"p{i}")
        alloc.register_producer(f"p{i}")
        for c in alloc.producers():
            alloc.set_window(c, alloc.size_of(c))
    assert alloc.size_of("p0") == shareable // 12
    changed = alloc.disconnect("p5")
    assert changed == {f"p{i}": shareable // 11 for i in range(12) if i != 5}
    assert alloc.disconnect("p6") == {f"p{i}": 50 * MiB for i in range(12) if i not in (5, 6)}
    assert alloc.disconnect("p7") == {}  # still clamped at the maximum: nothing to push
    for conn in alloc.connections():
        alloc.disconnect(conn)
    assert len(alloc) == 0 and alloc.total_granted() == alloc.total_committed() == 0


def test_max_buffer_size_caps_huge_quotas() -> None:
    # MB-72330: a 1 PiB quota must not produce a > 4 GiB buffer.
    c = cfg(quota=2**50, max_size=MAX_BUFFER_SIZE, static_size=MAX_BUFFER_SIZE)
    assert aggressive_size(c, 1) == MAX_BUFFER_SIZE
    assert dynamic_size(c) == MAX_BUFFER_SIZE
    assert MAX_BUFFER_SIZE == 2**32 - 1


def test_override_gives_everyone_that_size_within_the_quota() -> None:
    for policy in ("static", "dynamic", "aggressive"):
        alloc = CreditAllocator[int](cfg(policy, override_size=123_456), floor=FLOOR, slots=1000)
        for i in range(100):
            alloc.connect(i)
            assert alloc.register_producer(i) == {i: 123_456}  # no resizing of others
        assert alloc.disconnect(0) == {}
        assert alloc.pool == Q10
    none = CreditAllocator[int](cfg("none", override_size=123_456))
    assert none.connect(1) == {1: 0}  # "none" means not paced, override or not


def test_connection_ids_are_known_once() -> None:
    alloc = CreditAllocator[int](cfg(), floor=FLOOR)
    alloc.connect(1)
    with pytest.raises(DuplicateConnectionError):
        alloc.connect(1)
    assert alloc.connections() == (1,) and alloc.total_granted() == 1 and alloc.producers() == ()
    assert alloc.register_producer(1) == {1: 50 * MiB}
    assert alloc.register_producer(1) == {}  # once a producer, always
    with pytest.raises(UnknownConnectionError):
        alloc.disconnect(2)
    with pytest.raises(UnknownConnectionError):
        alloc.size_of(2)
    with pytest.raises(UnknownConnectionError):
        alloc.register_producer(2)
    alloc.disconnect(1)
    with pytest.raises(LookupError):
        alloc.disconnect(1)
    assert 1 not in alloc


def test_reconfigure_between_policies_with_live_connections() -> None:
    alloc = CreditAllocator[int](cfg(), floor=FLOOR, slots=10_000)
    producers(alloc, 30)  # aggressive: (536870912 - 10000) // 30 each
    assert alloc.size_of(0) == (536870912 - 10_000) // 30
    assert alloc.reconfigure(cfg("static")) == {i: 10 * MiB for i in range(30)}
    assert alloc.reconfigure(cfg("static")) == {}  # nothing changed, nothing to push
    assert alloc.reconfigure(cfg("none")) == {i: 0 for i in range(30)}
    assert alloc.total_granted() == alloc.total_committed() == 0
    changed = alloc.reconfigure(cfg("dynamic"))  # the threshold (1 GiB) holds 20 x 50 MiB, then 24 MiB
    assert [changed[i] for i in range(20)] == [50 * MiB] * 20 and changed[21] == 1
    assert alloc.total_granted() <= GiB
    changed = alloc.reconfigure(cfg("dynamic", quota=20 * GiB))  # a 2 GiB pool: all of them fit
    assert alloc.sizes() == {i: 50 * MiB for i in range(30)}
    alloc.connect(30)
    assert alloc.register_producer(30) == {30: 50 * MiB}  # the new policy applies to later ones too


def test_reconfigure_to_a_smaller_pool_keeps_old_promises_charged() -> None:
    alloc = CreditAllocator[int](cfg("static", static_size=50 * MiB), floor=FLOOR, slots=100)
    producers(alloc, 4)
    changed = alloc.reconfigure(cfg("static", quota=100 * MiB, static_size=50 * MiB))
    assert changed == {1: 100 * MiB - 100 - (50 * MiB - 1) + 1, 2: 1, 3: 1}  # grants fit the new pool
    # 2 and 3 wait, and they may still send their old 50 MiB (they may not have seen the shrink),
    # so nothing new is granted until that drains
    assert alloc.total_granted() <= 100 * MiB < alloc.total_committed()
    for conn in (1, 2, 3):
        alloc.set_window(conn, alloc.size_of(conn))
    assert alloc.total_committed() <= 100 * MiB


def test_a_live_change_to_a_pool_that_cannot_hold_one_connection_is_refused() -> None:
    """PUT /api/policy {"quota": 1} with no connection live was taken, and every client after it was refused
    at its handshake: "the credit pool (0 bytes) has no byte left for connection 1" (a tester)."""
    alloc = CreditAllocator[int](cfg("aggressive", quota=100 * MiB), floor=FLOOR, slots=100)
    with pytest.raises(PolicyConfigError) as info:
        alloc.reconfigure(cfg("aggressive", quota=1))
    assert info.value.key == "quota" and "cannot hold a single connection" in str(info.value)
    alloc.reconfigure(cfg("none", quota=1))  # (not paced: no pool to hold anything)


def test_a_pool_cut_by_a_percentage_names_the_percentage() -> None:
    """PUT /api/policy {"aggressive_percent": 1e-30} was refused naming the quota, "got 1073741824": the
    key that cut the pool is the one to raise."""
    alloc = CreditAllocator[int](cfg("aggressive", quota=100 * MiB), floor=FLOOR, slots=100)
    with pytest.raises(PolicyConfigError) as info:
        alloc.reconfigure(cfg("aggressive", quota=100 * MiB, aggressive_percent=1e-30))
    assert info.value.key == "aggressive_percent" and "raise aggressive_percent" in str(info.value)
    with pytest.raises(PolicyConfigError) as info:
        alloc.reconfigure(cfg("dynamic", quota=100 * MiB, dynamic_threshold_percent=1e-30, dynamic_percent=1e-30))
    assert info.value.key == "dynamic_threshold_percent"
