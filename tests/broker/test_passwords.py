"""Password checks in worker threads, shared fairly between users (broker/passwords.py).

A tester's guesser, spread over 64 source addresses (the login throttle is per address), kept every
other user's PLAIN login waiting over 10 s and an admin's HTTP Basic login 17 s: all checks waited in one
unbounded line for the two threads. Now one user's checks run one at a time, at most
MAX_WAITING_PER_USER of them wait, and the same password for the same credential shares one check."""

from __future__ import annotations

import threading

import pytest
import trio

from flowbroker.broker.passwords import MAX_WAITING_PER_USER, PasswordChecksBusy, checked


class SlowCredential:
    """A credential whose check blocks its thread until released (PBKDF2 at 10^6 iterations, and more)."""

    def __init__(self, password: str) -> None:
        self.password = password
        self.release = threading.Event()
        self.calls = 0

    def check_password(self, password: str) -> bool:
        self.calls += 1
        self.release.wait(10)
        return password == self.password


class FastCredential(SlowCredential):
    def __init__(self, password: str) -> None:
        super().__init__(password)
        self.release.set()


async def test_a_guessed_user_holds_one_thread_and_others_log_in_meanwhile() -> None:
    heavy = SlowCredential("secret")
    refusals: list[str] = []
    async with trio.open_nursery() as nursery:
        async def guess(n: int) -> None:
            try:
                assert not await checked(heavy, f"guess{n}", "heavy")
            except PasswordChecksBusy as busy:
                refusals.append(str(busy))

        for n in range(MAX_WAITING_PER_USER + 5):
            nursery.start_soon(guess, n)
        await trio.sleep(0.2)
        assert heavy.calls == 1  # one at a time for one user
        with trio.fail_after(2):  # the other thread is free for another user
            assert await checked(FastCredential("pw"), "pw", "alice")
            assert not await checked(FastCredential("pw"), "nope", "bob")
        assert len(refusals) == 5 and "user 'heavy'" in refusals[0] and "retry" in refusals[0]
        heavy.release.set()
    assert heavy.calls == MAX_WAITING_PER_USER


async def test_the_same_password_for_the_same_credential_shares_one_check() -> None:
    """A job's tasks logging in together as one user: one PBKDF2, every task told its answer."""
    cred = SlowCredential("pw")
    answers: list[bool] = []
    async with trio.open_nursery() as nursery:
        async def login() -> None:
            answers.append(await checked(cred, "pw", "job"))

        for _ in range(3 * MAX_WAITING_PER_USER):
            nursery.start_soon(login)
        await trio.sleep(0.2)
        cred.release.set()
    assert answers == [True] * (3 * MAX_WAITING_PER_USER) and cred.calls == 1


async def test_a_cancelled_check_leaves_those_that_waited_on_it_to_check_for_themselves() -> None:
    """B waits for the user's thread behind A; C, with B's password, waits for B's answer; B's connection
    goes (cancelled): C must check for itself, not take a missing answer for a wrong password."""
    cred = SlowCredential("pw")
    result: list[bool] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(checked, cred, "other", "u")  # A: holds the user's turn
        await trio.sleep(0.1)
        b = trio.CancelScope()

        async def cancelled() -> None:
            with b:
                await checked(cred, "pw", "u")

        async def waiter() -> None:
            result.append(await checked(cred, "pw", "u"))

        nursery.start_soon(cancelled)
        await trio.sleep(0.1)
        nursery.start_soon(waiter)
        await trio.sleep(0.1)
        b.cancel()
        await trio.sleep(0.1)
        cred.release.set()
    assert result == [True] and cred.calls == 2  # A's check and C's own


@pytest.mark.parametrize("user", ["", "\u00e9"])
async def test_nothing_is_kept_once_the_checks_are_done(user: str) -> None:
    from flowbroker.broker import passwords

    assert await checked(FastCredential("pw"), "pw", user)
    assert passwords._checks().users == {}
