"""`to_ranges` and `IdSet` (protocol/ranges.py) against a plain Python set.

`IdSet` keeps the broker's record of completed transfer ids: a cumulative point plus sorted disjoint
ranges above it. The state machine adds ids in any order (mostly ascending with holes, as completions
arrive, and at random) and after every step compares membership, the cumulative point and the ranges
with a set of ints; the examples pin down the edges: the first id, ids at the top of the wire's u64
range, ids at or below the cumulative point, ranges that join on both sides.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flowbroker.protocol.frames import Range
from flowbroker.protocol.ranges import IdSet, to_ranges

U64 = 2**64 - 1


def expand(ranges: list[Range]) -> set[int]:
    return {i for lo, hi in ranges for i in range(lo, hi + 1)}


def assert_canonical(ranges: list[Range]) -> None:
    """Sorted, each lo <= hi, and no two ranges overlap or touch (touching ones would be one range)."""
    for lo, hi in ranges:
        assert lo <= hi, ranges
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert lo > hi + 1, ranges


# -- to_ranges --------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 200)))
def test_to_ranges_round_trips_any_ids(ids: list[int]) -> None:
    ranges = to_ranges(ids)
    assert expand(ranges) == set(ids)
    assert_canonical(ranges)
    assert len(ranges) <= len(set(ids))


@given(st.lists(st.integers(U64 - 40, U64), min_size=1))
def test_to_ranges_at_the_top_of_the_u64_range(ids: list[int]) -> None:
    ranges = to_ranges(ids)
    assert expand(ranges) == set(ids)
    assert_canonical(ranges)
    assert ranges[-1][1] == max(ids)


def test_to_ranges_examples() -> None:
    assert to_ranges([]) == []
    assert to_ranges([1, 2, 3, 7, 5]) == [(1, 3), (5, 5), (7, 7)]
    assert to_ranges([3, 3, 2, 2]) == [(2, 3)]  # duplicates coalesce
    assert to_ranges([0]) == [(0, 0)]  # 0 is an id like any other here (delivery tags start at 1)
    assert to_ranges(iter([9, 8])) == [(8, 9)]  # any iterable, consumed once
    assert to_ranges([U64, U64 - 1, 1]) == [(1, 1), (U64 - 1, U64)]


# -- IdSet ------------------------------------------------------------------------------------------


class IdSetMachine(RuleBasedStateMachine):
    """An IdSet and the set of ints it stands for, changed together."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = IdSet()
        self.model: set[int] = set()
        self.base = 1  # the model holds every id in [1, base) implicitly: the initial cumulative point
        self.next = 1  # where "mostly in order" continues

    @initialize(cumulative=st.sampled_from([0, 0, 1, 1000, U64 - 64]))
    def start(self, cumulative: int) -> None:
        self.ids = IdSet(cumulative)
        self.base = self.next = cumulative + 1

    def _contains(self, i: int) -> bool:
        return i < self.base or i in self.model

    def _add(self, i: int) -> None:
        self.ids.add(i)
        if i >= self.base:
            self.model.add(i)

    @rule(skip=st.integers(0, 3))
    def add_next(self, skip: int) -> None:
        """Completions in order, now and then leaving a hole (a transfer held by a saturated queue)."""
        self.next += skip
        self._add(self.next)
        self.next += 1

    @rule(back=st.integers(1, 12))
    def fill_a_hole(self, back: int) -> None:
        """A held transfer completes late: an id below the newest, possibly already present."""
        self._add(max(self.base - 3, self.next - back, 0))

    @rule(offset=st.integers(0, 40))
    def add_anywhere(self, offset: int) -> None:
        self._add(self.base - 2 + offset)  # at or below the cumulative point too: a no-op

    @rule(lo=st.integers(0, 30), width=st.integers(-1, 6))
    def add_ranges(self, lo: int, width: int) -> None:
        start = self.base - 1 + lo
        rng: Range = (start, start + width)  # width -1: an empty range adds nothing
        self.ids.add_ranges([rng])
        self.model |= {i for i in range(rng[0], rng[1] + 1) if i >= self.base}

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def probe_a_present_id(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.model)))
        assert i in self.ids

    @invariant()
    def cumulative_is_the_longest_prefix(self) -> None:
        c = self.ids.cumulative
        assert c >= self.base - 1
        assert all(i in self.model for i in range(self.base, c + 1))
        assert c + 1 not in self.model, "the next id is present, so it should have been absorbed"

    @invariant()
    def ranges_above_are_the_rest(self) -> None:
        c = self.ids.cumulative
        above = self.ids.ranges_above()
        assert_canonical(above)
        assert expand(above) == {i for i in self.model if i > c}
        assert not above or above[0][0] > c + 1
        assert self.ids.holes == len(above) == len(to_ranges(i for i in self.model if i > c))

    @invariant()
    def membership_matches_the_model(self) -> None:
        c = self.ids.cumulative
        hi = max(self.model, default=c) + 2
        for i in range(max(self.base - 3, 0), min(hi, self.base + 80) + 1):
            assert (i in self.ids) == self._contains(i), i


TestIdSet = IdSetMachine.TestCase
TestIdSet.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_idset_joins_a_range_on_both_sides() -> None:
    ids = IdSet()
    for i in (3, 5):
        ids.add(i)
    assert ids.ranges_above() == [(3, 3), (5, 5)] and ids.holes == 2
    ids.add(4)  # joins (3, 3) and (5, 5) into one range
    assert ids.ranges_above() == [(3, 5)] and ids.holes == 1
    ids.add(1)
    assert ids.cumulative == 1 and ids.holes == 1
    ids.add(2)  # the cumulative point reaches the range and absorbs it
    assert ids.cumulative == 5 and ids.ranges_above() == [] and ids.holes == 0


def test_idset_extends_ranges_left_and_right_and_ignores_repeats() -> None:
    ids = IdSet()
    ids.add(10)
    ids.add(9)  # joins on the right of nothing, on the left of (10, 10)
    ids.add(11)
    ids.add(10)
    ids.add(20)
    assert ids.ranges_above() == [(9, 11), (20, 20)]
    assert 9 in ids and 11 in ids and 12 not in ids and 8 not in ids and 20 in ids and 21 not in ids


def test_idset_bounds() -> None:
    """Ids at or below the cumulative point are members without being stored; the top of the u64
    range works like any other id; a reversed range adds nothing."""
    ids = IdSet(U64 - 2)
    assert 0 in ids and U64 - 2 in ids and U64 - 1 not in ids
    ids.add(U64)
    assert ids.ranges_above() == [(U64, U64)] and U64 - 1 not in ids
    ids.add(U64 - 1)
    assert ids.cumulative == U64 and ids.holes == 0
    ids.add(5)  # far below: already a member, nothing stored
    ids.add_ranges([(7, 6)])
    assert ids.holes == 0 and ids.cumulative == U64
    assert IdSet().cumulative == 0 and 1 not in IdSet() and IdSet().holes == 0


@settings(max_examples=50)
@given(st.permutations(list(range(1, 41))))
def test_idset_any_order_of_a_prefix_ends_cumulative(order: list[int]) -> None:
    """However completions arrive, once all of 1..n are in the set it is one cumulative point and no
    ranges, and on the way it never keeps more ranges than ids above the cumulative point."""
    ids = IdSet()
    for k, i in enumerate(order, start=1):
        ids.add(i)
        assert ids.holes <= k - ids.cumulative
    assert ids.cumulative == 40 and ids.holes == 0 and ids.ranges_above() == []
