"""The failed-login throttle per source address (broker/auth.py's LoginThrottle), sans-IO: after failures an
address's attempts are looked at one at a time, further and further apart up to the cap, beyond which they
are refused unlooked; other addresses never wait; the table is bounded and forgets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.broker.auth import FORGET_AFTER, LoginThrottle

S = 1_000_000_000


def test_an_address_without_failures_never_waits_and_another_address_is_not_slowed() -> None:
    throttle = LoginThrottle(1.0, 8.0)
    assert [throttle.admit("10.0.0.1", 0) for _ in range(100)] == [0] * 100  # a pool logging in at once
    throttle.failed("10.0.0.1", 0)
    assert throttle.admit("10.0.0.1", 0) == 1 * S  # the next attempt waits its turn
    assert throttle.admit("10.0.0.2", 0) == 0 and throttle.admit(None, 0) == 0
    assert throttle.delayed == 1 and throttle.refused == 0


def test_the_spacing_doubles_per_failure_up_to_the_cap_and_a_queue_beyond_it_is_refused() -> None:
    throttle = LoginThrottle(1.0, 8.0)
    assert [throttle.delay_ns(f) // S for f in range(7)] == [0, 1, 2, 4, 8, 8, 8]
    for _ in range(4):
        throttle.failed("a", 0)
    # attempts arriving at once are spaced by delay(4) = 8 s: the first waits for the slot after the
    # first failure (1 s), the next 9 s, which is over the cap: refused unlooked
    assert throttle.admit("a", 0) == 1 * S
    assert throttle.admit("a", 0) is None
    assert throttle.admit("a", 8 * S) == 1 * S  # its slot is at 9 s
    assert (throttle.delayed, throttle.refused) == (2, 1)


def test_base_zero_turns_it_off() -> None:
    throttle = LoginThrottle(0, 0)
    for _ in range(10):
        throttle.failed("a", 0)
    assert throttle.admit("a", 0) == 0 and len(throttle) == 0


def test_attempts_sent_at_once_are_spaced_further_apart_before_any_of_them_fails() -> None:
    throttle = LoginThrottle(1.0, 16.0)
    throttle.failed("a", 0)
    # one failure; five attempts at once: turns at 1, 2, 4, 8 and 16 s (the spacing doubles per attempt in flight)
    assert [throttle.admit("a", 0) for _ in range(6)] == [1 * S, 2 * S, 4 * S, 8 * S, 16 * S, None]
    for _ in range(5):
        throttle.settle("a")
    throttle.settle("a")  # one more than admitted: harmless
    assert throttle.admit("a", 100 * S) == 0 and len(throttle) == 0  # nothing in flight, 100 s quiet: forgotten


def test_failures_are_forgotten_after_a_quiet_while() -> None:
    throttle = LoginThrottle(1.0, 30.0)
    throttle.failed("a", 0)
    assert throttle.failures("a", FORGET_AFTER * S) == 1  # one failure: its 1 s spacing, ten times
    assert throttle.admit("a", FORGET_AFTER * S + 1) == 0 and len(throttle) == 0
    for _ in range(10):
        throttle.failed("b", 0)
    assert throttle.failures("b", FORGET_AFTER * 30 * S) == 10  # at the cap: ten times the cap


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fail", "admit"]), st.integers(0, 40), st.integers(0, 3 * S)),
                max_size=300))
def test_bounded_table_and_every_wait_within_the_cap(steps: list[tuple[str, int, int]]) -> None:
    """Whatever addresses fail and try, the table holds at most max_entries (the least recently failed
    go first), no wait is over max_delay, and an address that never failed never waits."""
    throttle = LoginThrottle(0.5, 4.0, max_entries=8)
    now = 0
    failed: set[str] = set()
    for action, host_no, advance in steps:
        now += advance
        host = f"10.0.0.{host_no}"
        if action == "fail":
            throttle.failed(host, now)
            failed.add(host)
        else:
            wait = throttle.admit(host, now)
            assert wait is None or 0 <= wait <= throttle.max_ns
            if host not in failed:
                assert wait == 0
            if wait is not None and host_no % 2:
                throttle.settle(host)
        assert len(throttle) <= 8


def test_an_attempt_that_left_before_its_turn_gives_the_turn_to_the_next() -> None:
    """A client whose connect timed out while its login waited kept that turn, and the next turn went one
    step further, past the cap: its retry with a longer timeout was refused unlooked (a tester)."""
    throttle = LoginThrottle(1.0, 60.0)
    for _ in range(4):
        throttle.failed("a", 0)
    assert throttle.admit("a", 0) == 1 * S  # turn at 1 s, the next delay(4) = 8 s after
    assert throttle.admit("a", 0) == 9 * S  # turn at 9 s, the next delay(5) = 16 s after: 25 s
    assert throttle.admit("a", 20 * S) == 5 * S  # turn at 25 s, the next delay(6) = 32 s after: 57 s
    throttle.give_back("a", 9 * S)  # not the last turn given: nothing moves
    throttle.settle("a")
    assert throttle.admit("a", 21 * S) == 36 * S  # turn at 57 s, the next at 89 s
    throttle.give_back("a", 57 * S)  # the last turn given went away unused
    throttle.settle("a")
    assert throttle.admit("a", 22 * S) == 35 * S  # that turn, not the one after it
    throttle.give_back("b", 0)  # an address it does not know: harmless


def test_failures_are_forgotten_on_time_whatever_attempts_from_there_are_in_flight() -> None:
    """One typo, then clients logging in again and again from that address: with some of their logins always
    in flight the failure was never forgotten, and each turn was further away (a tester: four clients
    waited up to 30 s for a minute, seven refused unlooked, against "10 s after one failure")."""
    throttle = LoginThrottle(1.0, 30.0)
    throttle.failed("a", 0)
    assert [throttle.admit("a", 0) for _ in range(4)] == [1 * S, 2 * S, 4 * S, 8 * S]  # none settled yet
    assert throttle.failures("a", FORGET_AFTER * S) == 1
    assert throttle.admit("a", FORGET_AFTER * S + 1) == 0 and len(throttle) == 0  # 10 s after the failure
    for _ in range(4):
        throttle.settle("a")  # those four ending later: harmless
    assert throttle.admit("a", FORGET_AFTER * S + 2) == 0 and throttle.delayed == 4


def test_an_attempt_waiting_its_turn_goes_when_the_failures_are_forgotten_unless_one_more_comes() -> None:
    throttle = LoginThrottle(1.0, 30.0)
    throttle.failed("a", 0)
    assert [throttle.admit("a", 0) for _ in range(5)] == [1 * S, 2 * S, 4 * S, 8 * S, 16 * S]
    assert throttle.wait_ns("a", 4 * S, 0) == 4 * S  # a turn before the forgetting: waited for
    assert throttle.wait_ns("a", 16 * S, 0) == FORGET_AFTER * S + 1  # one after it: until the failure is forgotten
    assert throttle.wait_ns("a", 16 * S, FORGET_AFTER * S + 1) == 0 and len(throttle) == 0
    throttle.failed("b", 0)
    assert throttle.admit("b", 0) == 1 * S and throttle.admit("b", 0) == 2 * S
    assert throttle.admit("b", 0) == 4 * S and throttle.admit("b", 0) == 8 * S and throttle.admit("b", 0) == 16 * S
    throttle.failed("b", 8 * S)  # one more failure before then: forgotten at 8 + 10 * 2 = 28 s
    assert throttle.wait_ns("b", 16 * S, FORGET_AFTER * S + 1) == 6 * S - 1  # so the attempt waits on for its turn
    assert throttle.wait_ns("c", 16 * S, 0) == 0 and throttle.wait_ns(None, 16 * S, 0) == 0  # no failures there
