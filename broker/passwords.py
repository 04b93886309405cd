"""Password checks off the event loop: PBKDF2 at a user's iterations runs in a worker thread.

A PLAIN login (broker/auth.py `PasswordCheck`) and an admin user's HTTP Basic or console login
(broker/adminusers.py) check a password against its stored credential: PBKDF2-HMAC-SHA256 at the
user's iterations, 0.8 ms at the default 4096 but 0.3 s at 10^6 (`flowbroker user add --iterations`
takes up to 10^7). Run inline, each of a guesser's wrong passwords held the whole broker: a tester's
logged-in producer saw 1.8 s pauses, 3 s with HTTP Basic. hashlib releases the GIL while it hashes, so
in a thread it costs the event loop nothing; at most PASSWORD_CHECK_THREADS run at once (each source
address's failures are throttled before they get here, broker/auth.py `LoginThrottle`).

The threads are shared fairly between users: one user's checks run one at a time, so a guesser against
one user (from as many source addresses as it likes: 127.0.0.0/8 is 16 million of them) holds one thread,
never both; at most MAX_WAITING_PER_USER of a user's checks wait or run, and one more is refused at once
(`PasswordChecksBusy`); and logins with the same password for the same credential while one is being
checked share its answer (a job's hundred tasks logging in together cost one PBKDF2, not a queue of
them). Before, every check waited in one unbounded line: a tester's 120 guesses from 64 addresses kept
other users' PLAIN logins waiting over 10 s and an admin's HTTP Basic login 17 s.
"""

from __future__ import annotations

import hmac
import os
from typing import Any, Protocol

import trio

__all__ = ["MAX_WAITING_PER_USER", "PASSWORD_CHECK_THREADS", "PasswordChecksBusy", "checked"]

PASSWORD_CHECK_THREADS = 2
"""Password checks running at once, the others waiting their turn (a machine's cores go to messages first)."""
MAX_WAITING_PER_USER = 16
"""One user's password checks waiting or running at once (different passwords: the same one waits for
the check in progress); past it, a login of that user is refused without a check until some finish."""

_PEPPER = os.urandom(32)  # the waiting checks are told apart by a keyed digest, not the passwords themselves


class Credential(Protocol):
    def check_password(self, password: str) -> bool: ...


class PasswordChecksBusy(Exception):
    """A user has MAX_WAITING_PER_USER password checks waiting or running: this login is refused unchecked."""

    def __init__(self, user: str):
        super().__init__(f"{MAX_WAITING_PER_USER} logins of user {user!r} are waiting for their password checks "
                         "(someone may be guessing its password): retry in a few seconds")
        self.user = user


class _Pending:
    """One check in progress: who asked for it, and its answer once known."""

    __slots__ = ("credential", "done", "ok")

    def __init__(self, credential: Any):
        self.credential = credential
        self.done = trio.Event()
        self.ok: bool | None = None  # the answer; None until then, and for good if the check was cancelled


class _UserChecks:
    __slots__ = ("lock", "waiting", "pending")

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.waiting = 0
        self.pending: dict[bytes, _Pending] = {}


class _Checks:
    def __init__(self) -> None:
        self.limiter = trio.CapacityLimiter(PASSWORD_CHECK_THREADS)
        self.users: dict[str, _UserChecks] = {}  # only users with checks waiting or running: bounded by them


_state: trio.lowlevel.RunVar[_Checks] = trio.lowlevel.RunVar("flowbroker_password_checks")


def _checks() -> _Checks:
    try:
        return _state.get()
    except LookupError:
        checks = _Checks()
        _state.set(checks)
        return checks


async def checked(credential: Credential, password: str, user: str) -> bool:
    """`credential.check_password(password)` in a worker thread (per trio run: at most
    PASSWORD_CHECK_THREADS at once, one per `user`); the answer of a check of the same password against
    the same credential already in progress; PasswordChecksBusy past MAX_WAITING_PER_USER of `user`'s."""
    checks = _checks()
    digest = hmac.digest(_PEPPER, password.encode("utf-8", "surrogatepass"), "sha256")
    while True:
        mine = checks.users.get(user)
        if mine is None:
            mine = checks.users[user] = _UserChecks()
        pending = mine.pending.get(digest)
        if pending is None or pending.credential is not credential:
            break
        await pending.done.wait()
        if pending.ok is not None:
            return pending.ok
        # (its check was cancelled, its connection gone: this one checks for itself)
    if mine.waiting >= MAX_WAITING_PER_USER:
        raise PasswordChecksBusy(user)
    mine.waiting += 1
    pending = _Pending(credential)
    if digest not in mine.pending:
        mine.pending[digest] = pending
    try:
        async with mine.lock:
            pending.ok = await trio.to_thread.run_sync(credential.check_password, password, limiter=checks.limiter)
        return pending.ok
    finally:
        pending.done.set()
        if mine.pending.get(digest) is pending:
            del mine.pending[digest]
        mine.waiting -= 1
        if not mine.waiting and checks.users.get(user) is mine:
            del checks.users[user]
