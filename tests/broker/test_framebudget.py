"""The partial-frame budget: what connections hold for partial frames never exceeds the budget plus one
allowance each, and a connection within its allowance can always read."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker.framebudget import PROGRESS_BYTES, STALL_SECONDS, PartialFrameBudget

LIMIT = 1000
ALLOWANCE = 100


def test_a_connection_within_its_allowance_reads_even_when_the_budget_is_spent() -> None:
    budget = PartialFrameBudget(LIMIT, ALLOWANCE, clock=lambda: 0.0)
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
    budget = PartialFrameBudget(LIMIT, ALLOWANCE, clock=lambda: 0.0)
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


def test_a_waiter_has_the_partial_frame_stalled_longest_cut_and_never_one_that_progresses() -> None:
    """Ten connections that each sent all but the last byte of an 8 MiB frame spent the budget, and a
    producer beside them waited for their frame_timeout, 25 s (a tester). A connection that must wait has
    the frame stalled longest (not grown by PROGRESS_BYTES in STALL_SECONDS) cut; never one that grows,
    one that is itself waiting, or the waiter."""
    now = [0.0]
    budget = PartialFrameBudget(4 * PROGRESS_BYTES, ALLOWANCE, clock=lambda: now[0])
    cut: list[tuple[str, float]] = []
    stalled = budget.connection(lambda s: cut.append(("stalled", s)))
    slow = budget.connection(lambda s: cut.append(("slow", s)))
    waiting = budget.connection(lambda s: cut.append(("waiting", s)))
    victim = budget.connection(lambda s: cut.append(("victim", s)))
    held = {stalled: 0, slow: 0, waiting: 0}
    for conn in held:
        granted = conn.grant_read(0, PROGRESS_BYTES)
        held[conn] = granted
        conn.settle(granted)  # received: each holds a partial frame of PROGRESS_BYTES
    now[0] = 0.5
    slow.settle(held[slow] + 1)  # a byte more: no progress
    assert waiting.grant_read(held[waiting], PROGRESS_BYTES, held[waiting] + 3 * PROGRESS_BYTES) == 0  # it waits
    assert victim.grant_read(0, 2 * PROGRESS_BYTES) < 2 * PROGRESS_BYTES
    assert not budget.reclaim(victim)  # nothing stalled for STALL_SECONDS yet
    now[0] = 0.5 + STALL_SECONDS
    slow.settle(held[slow] + PROGRESS_BYTES)  # it grows: progress
    assert budget.reclaim(victim) and cut == [("stalled", 0.5 + STALL_SECONDS)]
    assert not budget.reclaim(victim)  # the slow one progressed, the waiting one waits, the stalled one is cut
    stalled.release()
    assert budget.cuts == 1 and stalled not in budget.holders
    now[0] = 0.5 + 2 * STALL_SECONDS + 0.1
    assert budget.reclaim(victim) and cut[-1][0] == "slow"  # stalled since its progress
    assert all(name != "waiting" for name, _ in cut)


@given(st.lists(st.integers(ALLOWANCE // 2, LIMIT + ALLOWANCE), min_size=2, max_size=8),
       st.lists(st.tuples(st.integers(0, 7), st.integers(1, 400)), max_size=300))
def test_connections_receiving_whole_frames_never_all_wait(frames: list[int], steps: list[tuple[int, int]]) -> None:
    """Each connection's peer sends its frame whole (of `frames`, each at most what the budget can hold);
    the reader reads what `grant_read` allows, in steps of the sizes given. Piecemeal grants let every
    connection hold part of its frame and wait for the rest, none able to complete (ten 8 MiB frames into
    a 16 MiB budget waited for frame_timeout). Now while any frame is incomplete, some connection may read."""
    budget = PartialFrameBudget(LIMIT, ALLOWANCE, clock=lambda: 0.0)
    conns = [budget.connection() for _ in frames]
    held = [0] * len(frames)
    done = [0] * len(frames)

    def grant(i: int, want: int) -> int:
        rest = frames[i] - held[i]
        return conns[i].grant_read(held[i], min(want, rest), frames[i]) if rest else 0

    for index, want in steps:
        i = index % len(frames)
        got = grant(i, want)
        held[i] += got
        if held[i] == frames[i]:  # complete: decoded, and the peer starts the same frame again
            held[i] = 0
            done[i] += 1
        conns[i].settle(held[i], frames[i])
        assert budget.charged == sum(c.charged for c in conns) <= LIMIT
        assert all(h <= ALLOWANCE + c.charged for h, c in zip(held, conns))
        # deadlock freedom: some connection can always read more of its frame
        assert any(grant(k, 1) for k in range(len(frames)) if held[k] < frames[k])


def test_three_frames_read_in_turns_all_complete() -> None:
    """The smallest deadlock of piecemeal grants: three 700-byte frames read 300 bytes at a time in turns
    into a budget of 1,000 left each with part of its frame and no room for the rest."""
    budget = PartialFrameBudget(LIMIT, ALLOWANCE, clock=lambda: 0.0)
    conns = [budget.connection() for _ in range(3)]
    held = [0, 0, 0]
    completed: set[int] = set()
    for turn in range(30):
        i = turn % 3
        if i in completed:
            continue
        got = conns[i].grant_read(held[i], min(300, 700 - held[i]), 700)
        held[i] += got
        if held[i] == 700:  # complete: decoded
            completed.add(i)
            held[i] = 0
        conns[i].settle(held[i], 700 if held[i] else None)
    assert completed == {0, 1, 2}, (held, [c.charged for c in conns], budget.charged)
    assert budget.charged == 0


def test_connections_waiting_for_the_budget_are_served_first_come_first_served() -> None:
    """Waiters were all woken and whichever read first took the freed bytes: attackers reconnecting took
    them ahead of an honest producer until its frame_timeout (a tester). A connection that must wait joins a
    queue; one arriving later waits behind it even when the bytes would fit; a connection that leaves
    gives its place up."""
    budget = PartialFrameBudget(LIMIT, ALLOWANCE, clock=lambda: 0.0)
    holder, honest, newcomer, leaver = (budget.connection() for _ in range(4))
    assert holder.grant_read(0, 600, 900) == 600  # its frame of 900 charged whole (800)
    assert honest.grant_read(0, 600, 700) == ALLOWANCE  # 600 more do not fit: its allowance only
    assert not budget.queue  # (reading within it: not waiting yet)
    assert honest.grant_read(ALLOWANCE, 600, 700) == 0 and list(budget.queue) == [honest]  # now it waits
    assert leaver.grant_read(ALLOWANCE, 200, 300) == 0 and list(budget.queue) == [honest, leaver]
    holder.settle(0)  # its frame is done: 1,000 free
    assert newcomer.grant_read(ALLOWANCE, 50, 150) == 0  # it would fit, but two wait before it
    assert list(budget.queue) == [honest, leaver, newcomer]
    leaver.release()
    assert list(budget.queue) == [honest, newcomer]
    assert newcomer.grant_read(ALLOWANCE, 50, 150) == 0  # still behind the honest one
    assert honest.grant_read(ALLOWANCE, 600, 700) == 600  # first in line: charged whole
    assert list(budget.queue) == [newcomer] and honest.charged == 600
    assert newcomer.grant_read(ALLOWANCE, 50, 150) == 50  # its turn, and it fits
    assert not budget.queue


def test_a_connection_that_has_completed_a_frame_before_goes_ahead_of_those_that_never_have() -> None:
    """Attackers that start frames, stall and reconnect once cut are always fresh connections: an honest
    producer that has completed a large frame before waits behind at most the one holding the budget, not
    behind every attacker queued before it (15 of them held it 30 s a message, a tester)."""
    budget = PartialFrameBudget(LIMIT, ALLOWANCE, clock=lambda: 0.0)
    honest, holder, attacker = (budget.connection() for _ in range(3))
    assert honest.grant_read(0, 500, 500) == 500  # a frame of 500: charged, read, complete
    honest.settle(0)
    assert honest.frames_done == 1
    assert holder.grant_read(0, 900, 1000) == 900  # the budget's whole (1,000 - 100 allowance) is its
    assert attacker.grant_read(ALLOWANCE, 800, 1000) == 0  # queued first
    assert honest.grant_read(ALLOWANCE, 400, 500) == 0  # queued later, but it has completed a frame
    assert budget.queue == [honest, attacker]
    holder.release()  # (cut)
    assert attacker.grant_read(ALLOWANCE, 800, 1000) == 0
    assert honest.grant_read(ALLOWANCE, 400, 500) == 400 and budget.queue == [attacker]
