"""The credit pool: whatever connects, registers, leaves or is reconfigured, the grants (provisional and
waiting ones included) never exceed the policy's pool, every live connection keeps a positive grant, the
promises a shrink leaves behind stay charged until they drain, and nobody waits while a share is free."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowbroker.policies import (
    WAIT_GRANT,
    CreditAllocator,
    CreditPolicy,
    CreditPolicyConfig,
    MiB,
    PolicyConfigError,
    PoolExhaustedError,
    reserve_for,
)

MAX_MESSAGE = 4 * MiB + 512  # what the broker passes as the floor with the default max_message_size


def test_every_policy_has_a_pool() -> None:
    q = 10_000_000
    assert CreditPolicyConfig(quota=q, policy=CreditPolicy.NONE).pool_bytes == 0
    assert CreditPolicyConfig(quota=q, policy=CreditPolicy.STATIC).pool_bytes == q
    assert CreditPolicyConfig(quota=q, policy=CreditPolicy.AGGRESSIVE, override_size=5).pool_bytes == q
    assert CreditPolicyConfig(quota=q, policy=CreditPolicy.DYNAMIC).pool_bytes == q // 10
    assert CreditPolicyConfig(quota=q, policy=CreditPolicy.AGGRESSIVE).pool_bytes == q // 20
    assert reserve_for(1000, 10_000) == 500 and reserve_for(10**9, 10_000) == 10_000


def test_1000_aggressive_producers_stay_within_the_pool() -> None:
    """The issue's figure: 1,000 producers under the defaults were granted 10.5 GB of a 6.3 GB quota."""
    config = CreditPolicyConfig(quota=6_442_450_944)  # pool 5 % = 322122547 bytes
    alloc = CreditAllocator[int](config, floor=MAX_MESSAGE, slots=10_000)
    for i in range(1000):
        alloc.connect(i)
        alloc.register_producer(i)
        assert alloc.total_granted() <= alloc.total_committed() <= config.pool_bytes
    for i in range(1000):  # every producer sends: acknowledgements overtake what shrinks left promised
        alloc.set_window(i, alloc.size_of(i))
    sizes = alloc.sizes()
    shares = [s for s in sizes.values() if s > WAIT_GRANT]
    assert alloc.total_granted() == sum(sizes.values()) <= config.pool_bytes
    # An even split below min_size: 1,000 shares of 322 KB, nobody waits (969 did while min_size lifted
    # the first 30 to 10 MiB, for as long as they stayed connected).
    assert alloc.waiting() == 0 and len(shares) == 1000
    (share,) = set(shares)  # 322 KB, in steps of 2^(1/4) (policies/credit.py `_stepped`)
    assert 0.84 * alloc.shareable // 1000 <= share <= alloc.shareable // 1000
    for i in range(500):
        alloc.disconnect(i)
    for i in range(500, 1000):
        alloc.set_window(i, alloc.size_of(i))
    (share,) = set(alloc.sizes().values())
    assert alloc.waiting() == 0 and 0.84 * alloc.shareable // 500 <= share <= alloc.shareable // 500
    assert alloc.total_granted() <= config.pool_bytes


def test_half_idle_provisional_connections_hold_one_byte_each() -> None:
    """200 connections, half of them idle: provisional grants are WAIT_GRANT, counted in the total."""
    config = CreditPolicyConfig(quota=134_217_728, min_size=32 * 1024, max_size=4 * MiB)  # pool 6.71 MB
    alloc = CreditAllocator[int](config, floor=64 * 1024 + 512, slots=10_000)
    for i in range(200):
        alloc.connect(i)
        if i % 2:
            alloc.register_producer(i)
            alloc.set_window(i, alloc.size_of(i))
    idle = [alloc.size_of(i) for i in range(0, 200, 2)]
    assert idle == [WAIT_GRANT] * 100
    assert alloc.total_granted() == sum(alloc.sizes().values()) <= config.pool_bytes


def test_a_shrink_keeps_the_old_window_charged_until_it_drains() -> None:
    config = CreditPolicyConfig(quota=100 * MiB, min_size=1024, max_size=4 * MiB)  # pool 5 MiB
    alloc = CreditAllocator[str](config, floor=1024, slots=100)
    alloc.connect("early")
    assert alloc.register_producer("early") == {"early": 4 * MiB}
    alloc.connect("late")
    changed = alloc.register_producer("late")
    share = (config.pool_bytes - 100) // 2
    assert changed["early"] == share  # shrunk, but it may still send up to its old limit
    assert alloc.window_of("early") == 4 * MiB
    # the late one gets what the early one's promise leaves: less than its share
    assert changed["late"] == config.pool_bytes - 100 - (4 * MiB - 1) + 1 < share
    assert alloc.total_committed() <= config.pool_bytes
    assert alloc.set_window("early", 3 * MiB) == {"late": config.pool_bytes - 100 - (3 * MiB - 1) + 1}
    assert alloc.set_window("early", share) == {"late": share}  # drained: the late one has its share
    assert alloc.total_committed() == alloc.total_granted() == 2 * share + 0 <= config.pool_bytes


def test_an_owners_windows_stay_within_its_cap_while_a_shrink_drains() -> None:
    """A capped owner's first producer takes its whole cap; newcomers of other users shrink it, but its
    window cannot drain (a stopped queue holds its transfers). The owner's second producer gets only what
    that old window leaves of the cap, and the rest when it drains: with the cap counted on grants alone
    the owner held 1.34x its cap in windows, 2.08x with churn (a tester)."""
    config = CreditPolicyConfig(quota=100 * MiB, min_size=1024, max_size=4 * MiB)  # pool 5 MiB
    alloc = CreditAllocator[str](config, floor=1024, slots=100)
    cap = int(alloc.shareable * 20 // 100)

    def others_answer() -> None:  # the other users' producers answer their shrinks at once (idle)
        for conn in ("b", "c", "d", "e", "f"):
            if conn in alloc and alloc.window_of(conn) != alloc.size_of(conn):
                alloc.set_window(conn, alloc.size_of(conn))

    alloc.connect("a0", "alice", 20)
    assert alloc.register_producer("a0") == {"a0": cap + 1}
    for conn in ("b", "c", "d", "e", "f"):
        alloc.connect(conn)
        alloc.register_producer(conn)
        others_answer()
    assert alloc.size_of("a0") < cap + 1 == alloc.window_of("a0")  # shrunk; the old promise stays charged
    alloc.connect("a1", "alice", 20)
    alloc.register_producer("a1")
    others_answer()
    assert alloc.is_waiting("a1")  # the cap's grants have room, its promises none
    assert sum(alloc.window_of(c) - 1 for c in ("a0", "a1")) <= cap
    drained = alloc.set_window("a0", alloc.size_of("a0"))  # a0's queue drains: its window falls to its grant
    assert not alloc.is_waiting("a1") and drained["a1"] == alloc.size_of("a1") >= alloc.need()
    assert sum(alloc.window_of(c) - 1 for c in ("a0", "a1")) <= cap
    assert alloc.waiting() == 0


def test_waiting_producers_get_the_share_freed_by_a_leaver_in_order() -> None:
    config = CreditPolicyConfig(quota=1000, policy=CreditPolicy.STATIC, static_size=300)
    alloc = CreditAllocator[int](config, floor=250, slots=10)  # reserve 10, S 990: three shares of 300
    for i in range(5):
        alloc.connect(i)
        alloc.register_producer(i)
    assert alloc.sizes() == {0: 300, 1: 300, 2: 300, 3: WAIT_GRANT, 4: WAIT_GRANT}  # 94 left < 250
    assert alloc.waiting() == 2
    assert alloc.disconnect(1) == {3: 300}  # first come, first served
    assert alloc.is_waiting(4) and not alloc.is_waiting(3)
    assert alloc.disconnect(0) == {4: 300}
    assert alloc.waiting() == 0


def test_less_than_the_target_down_to_the_floor() -> None:
    config = CreditPolicyConfig(quota=1000, policy=CreditPolicy.STATIC, static_size=300)
    alloc = CreditAllocator[int](config, floor=50, slots=10)  # S = 990: 300, 300, 300, then 94 >= 50
    for i in range(5):
        alloc.connect(i)
        alloc.register_producer(i)
    assert alloc.sizes() == {0: 300, 1: 300, 2: 300, 3: 94, 4: WAIT_GRANT}
    assert alloc.total_granted() == 995 <= 1000


def test_connect_beyond_the_reserve_is_refused_and_a_small_pool_cannot_be_configured() -> None:
    config = CreditPolicyConfig(quota=20, policy=CreditPolicy.STATIC, static_size=5)
    alloc = CreditAllocator[int](config, floor=5, slots=100)  # reserve: half of 20
    for i in range(10):
        alloc.connect(i)
    with pytest.raises(PoolExhaustedError):
        alloc.connect(10)
    assert len(alloc) == 10 and alloc.total_granted() == 10
    with pytest.raises(PolicyConfigError) as info:
        alloc.reconfigure(CreditPolicyConfig(quota=10, policy=CreditPolicy.STATIC))
    assert info.value.key == "quota" and alloc.config is config


def test_none_grants_nothing_and_back() -> None:
    alloc = CreditAllocator[int](CreditPolicyConfig(quota=10**6, policy=CreditPolicy.NONE), floor=10, slots=10)
    assert alloc.connect(1) == {1: 0}
    assert alloc.register_producer(1) == {}
    assert alloc.total_granted() == 0
    assert alloc.reconfigure(CreditPolicyConfig(quota=10**6, policy=CreditPolicy.STATIC, static_size=100)) == {1: 100}
    assert alloc.reconfigure(CreditPolicyConfig(quota=10**6, policy=CreditPolicy.NONE)) == {1: 0}


# --- the state machine ------------------------------------------------------------------------------

configs = st.builds(
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
    quota=st.integers(1, 200_000),
    lo=st.integers(1, 20_000),
    span=st.integers(0, 50_000),
    static=st.integers(1, 30_000),
    pct=st.floats(1, 100, allow_nan=False),
    threshold=st.floats(1, 100, allow_nan=False),
    override=st.sampled_from([0, 0, 0, 7_000]),
)


class PoolMachine(RuleBasedStateMachine):
    """Random connects, producer registrations, window drains, disconnects and reconfigures. After
    every step: the result is exactly the diff of grants, the grants stay within the pool, every live
    connection has a positive grant (0 under none), promises never grow while over the pool, and a
    waiting producer could not have been given a share."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: CreditAllocator[int] | None = None
        self.shadow: dict[int, int] = {}
        self.producers: set[int] = set()
        self.next_id = 0
        self.committed = 0
        self.owner_of: dict[int, str | None] = {}
        self.shares: dict[str, float] = {}
        self.owner_promised: dict[str, int] = {}

    def _caps(self) -> dict[str, int]:
        """Each capped owner with a live connection: floor(S * share / 100)."""
        assert self.alloc is not None
        live = {o for o in self.owner_of.values() if o is not None}
        return {o: int(self.alloc.shareable * Fraction(str(self.shares[o])) // 100)
                for o in live if self.shares.get(o)}

    def _owner_free(self, conn: int, windows: bool = False) -> int | None:
        """What the connection's owner's cap leaves of S beyond its producers' grants (or, `windows`, their
        windows), None when uncapped."""
        assert self.alloc is not None
        owner = self.owner_of[conn]
        cap = self._caps().get(owner) if owner is not None else None
        if cap is None:
            return None
        held = self.alloc.window_of if windows else self.alloc.size_of
        return cap - sum(held(c) - 1 for c in self.producers if self.owner_of[c] == owner)

    @rule(config=configs, floor=st.integers(1, 20_000), slots=st.integers(1, 40))
    @precondition(lambda self: self.alloc is None)
    def start(self, config: CreditPolicyConfig, floor: int, slots: int) -> None:
        self.alloc = CreditAllocator[int](config, floor=floor, slots=slots)

    def _apply(self, changed: dict[int, int]) -> None:
        for conn, size in changed.items():
            assert self.shadow[conn] != size, "a grant that did not change was pushed"
            self.shadow[conn] = size

    @precondition(lambda self: self.alloc is not None)
    @rule(owner=st.sampled_from([None, "a", "b", "c"]), share=st.sampled_from([0, 1, 10, 33.3, 50, 100]))
    def connect(self, owner: str | None, share: float) -> None:
        assert self.alloc is not None
        conn, self.next_id = self.next_id, self.next_id + 1
        paced = self.alloc.config.policy is not CreditPolicy.NONE
        if paced and len(self.shadow) >= self.alloc.reserve:
            with pytest.raises(PoolExhaustedError):
                self.alloc.connect(conn, owner, share)
            return
        before = self.alloc.sizes()
        changed = self.alloc.connect(conn, owner, share)
        assert changed == {conn: WAIT_GRANT if paced else 0}
        assert {c: s for c, s in self.alloc.sizes().items() if c != conn} == before
        self.shadow[conn] = changed[conn]
        self.owner_of[conn] = owner
        if owner is not None:
            self.shares[owner] = share
            if any(c != conn and self.owner_of[c] == owner for c in self.shadow):
                # a new share for a live owner takes effect at once, as the broker applies it
                self._apply(self.alloc.set_owner_share(owner, share))

    @precondition(lambda self: any(o is not None for o in self.owner_of.values()))
    @rule(data=st.data(), share=st.sampled_from([0, 1, 10, 50]))
    def change_share(self, data: st.DataObject, share: float) -> None:
        """The users file gave an owner another share."""
        assert self.alloc is not None
        owner = data.draw(st.sampled_from(sorted({o for o in self.owner_of.values() if o is not None})))
        self.shares[owner] = share
        self._apply(self.alloc.set_owner_share(owner, share))

    @precondition(lambda self: bool(set(self.shadow) - self.producers))
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        conn = data.draw(st.sampled_from(sorted(set(self.shadow) - self.producers)))
        self.producers.add(conn)
        self._apply(self.alloc.register_producer(conn))

    @precondition(lambda self: bool(self.shadow))
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        conn = data.draw(st.sampled_from(sorted(self.shadow)))
        del self.shadow[conn]
        del self.owner_of[conn]
        self.producers.discard(conn)
        changed = self.alloc.disconnect(conn)
        assert conn not in changed
        self._apply(changed)

    @precondition(lambda self: bool(self.producers))
    @rule(data=st.data(), part=st.floats(0, 1))
    def acknowledge(self, data: st.DataObject, part: float) -> None:
        """The broker's acknowledgements overtake part of what a shrink left promised."""
        assert self.alloc is not None
        conn = data.draw(st.sampled_from(sorted(self.producers)))
        size, window = self.alloc.size_of(conn), self.alloc.window_of(conn)
        self._apply(self.alloc.set_window(conn, window - int((window - size) * part)))

    @precondition(lambda self: bool(self.producers))
    @rule()
    def every_producer_answers(self) -> None:
        """Every producer answers its last BUFFER_CONTROL with BUFFER_LIMIT while idle (nothing in
        flight): the broker lowers each window to the grant at once. Shares handed out meanwhile are
        answered too, until nothing moves; then nothing is promised beyond the grants, and nobody waits
        while the grants leave a share for it, even after shrinks and reconfigures."""
        alloc = self.alloc
        assert alloc is not None
        for _ in range(len(self.producers) + 2):
            moved = False
            for conn in sorted(self.producers):
                if alloc.window_of(conn) != alloc.size_of(conn):
                    moved = True
                    self._apply(alloc.set_window(conn, alloc.size_of(conn)))
            if not moved:
                break
        assert all(alloc.window_of(c) == alloc.size_of(c) for c in self.producers)
        assert alloc.total_committed() == alloc.total_granted()
        if alloc.config.policy is not CreditPolicy.NONE:
            free = alloc.shareable - sum(alloc.size_of(c) - 1 for c in self.producers)
            for conn in self.producers:
                if alloc.is_waiting(conn):
                    owner_free = self._owner_free(conn)
                    could = free + 1 if owner_free is None else min(free, owner_free) + 1
                    assert could < alloc.need(), (conn, free, owner_free, alloc.need())

    @precondition(lambda self: self.alloc is not None)
    @rule(config=configs)
    def reconfigure(self, config: CreditPolicyConfig) -> None:
        assert self.alloc is not None
        before = self.alloc.sizes()
        try:
            changed = self.alloc.reconfigure(config)
        except PolicyConfigError:
            assert self.alloc.sizes() == before and self.alloc.config is not config
            return
        self._apply(changed)

    @invariant()
    def within_the_pool(self) -> None:
        alloc = self.alloc
        if alloc is None:
            return
        pool = alloc.pool
        assert alloc.sizes() == self.shadow
        assert alloc.total_granted() == sum(self.shadow.values()) <= max(pool, 0)
        assert alloc.total_granted() <= alloc.total_committed()
        if alloc.config.policy is CreditPolicy.NONE:
            assert set(self.shadow.values()) <= {0}
            self.committed = 0
            return
        # Promises never grow beyond the pool: each connection's first byte is in the reserve, the
        # rest of every window in S; when a reconfigure shrank S below what was promised, they only drain.
        assert len(self.shadow) <= alloc.reserve
        promised = sum(alloc.window_of(c) - 1 for c in self.producers)
        assert promised <= max(alloc.shareable, self.committed)
        self.committed = promised
        if promised <= alloc.shareable:
            assert alloc.total_committed() <= pool
        assert all(size >= WAIT_GRANT for size in self.shadow.values())
        target, need, shareable = alloc.target(), alloc.need(), alloc.shareable
        for conn, size in self.shadow.items():
            if conn not in self.producers:
                assert size == WAIT_GRANT  # provisional: one byte, one message
            else:
                assert size <= target
                assert alloc.is_waiting(conn) == (size == WAIT_GRANT < need)
        # nobody waits while a share is free
        free_grants = shareable - sum(self.shadow[c] - 1 for c in self.producers)
        free_promises = shareable - sum(alloc.window_of(c) - 1 for c in self.producers)
        for conn in self.producers:
            if alloc.is_waiting(conn):
                could = min(free_grants + 1, alloc.window_of(conn) + max(0, free_promises))
                owner_free = self._owner_free(conn)
                if owner_free is not None:
                    could = min(could, owner_free + 1)
                owner_promise_free = self._owner_free(conn, windows=True)
                if owner_promise_free is not None:
                    could = min(could, alloc.window_of(conn) + max(0, owner_promise_free))
                assert could < need, (conn, could, need)
        # no owner's producers hold more of S together than the owner's share of it
        for owner, cap in self._caps().items():
            used = sum(self.shadow[c] - 1 for c in self.producers if self.owner_of[c] == owner)
            assert used <= cap, (owner, used, cap)
            assert alloc.owner_cap(owner) == cap and alloc.owner_share_used(owner) == used
        # nor their windows, except while what was promised under a larger cap (a share changed, the pool
        # reconfigured, the owner's first connection after a gap) drains: then they only fall
        owners = {o for o in self.owner_of.values() if o is not None}
        promised_now = {o: sum(alloc.window_of(c) - 1 for c in self.producers if self.owner_of[c] == o)
                        for o in owners}
        for owner, cap in self._caps().items():
            assert promised_now[owner] <= max(cap, self.owner_promised.get(owner, 0)), (owner, promised_now[owner], cap)
        self.owner_promised = promised_now


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPoolMachine = PoolMachine.TestCase
