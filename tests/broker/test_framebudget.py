"""The partial-frame budget: what connections hold for partial frames never exceeds the budget plus one
allowance each, and a connection within its allowance can always read."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker.framebudget import PartialFrameBudget

LIMIT = 1000
ALLOWANCE = 100


def test_a_connection_within_its_allowance_reads_even_when_the_budget_is_spent() -> None:
    budget = PartialFrameBudget(LIMIT, ALLOWANCE)
    hog, small = budget.connection(), budget.connection()
    assert hog.grant_read(0, 10_000) == LIMIT + ALLOWANCE  # it may hold the budget and its allowance
    assert budget.charged == LIMIT
    assert hog.grant_read(LIMIT + ALLOWANCE, 10_000) == 0  # and no more: it waits
    assert small.grant_read(0, 10_000) == ALLOWANCE
    assert small.grant_read(60, 10_000) == ALLOWANCE - 60
    small.settle(0)
    hog.settle(ALLOWANCE + 10)  # a frame of its completed: the rest is free again
    assert budget.charged == 10
    assert small.grant_read(0, 10_000) == LIMIT - 10 + ALLOWANCE
    small.release()
    hog.release()
    assert budget.charged == 0 and budget.peak == LIMIT


@given(st.lists(st.tuples(st.integers(0, 4), st.booleans(), st.integers(0, 3000), st.integers(0, 100)), max_size=200))
def test_charges_add_up_and_never_exceed_the_budget(steps: list[tuple[int, bool, int, int]]) -> None:
    budget = PartialFrameBudget(LIMIT, ALLOWANCE)
    conns = [budget.connection() for _ in range(5)]
    held = [0] * 5
    for index, read, want, percent in steps:
        conn = conns[index]
        if read:  # a read of what was granted, all of it left undecoded
            held[index] += conn.grant_read(held[index], want)
        else:  # decoding finished some frames: what is left is a part of what was held
            held[index] = held[index] * percent // 100
            conn.settle(held[index])
        assert held[index] <= ALLOWANCE + conn.charged
        assert budget.charged == sum(c.charged for c in conns) <= LIMIT
    for conn in conns:
        conn.release()
    assert budget.charged == 0
