"""Password checks off the event loop: PBKDF2 at a user's iterations runs in a worker thread.

A PLAIN login (broker/auth.py `PasswordCheck`) and an admin user's HTTP Basic or console login
(broker/adminusers.py) check a password against its stored credential: PBKDF2-HMAC-SHA256 at the
user's iterations, 0.8 ms at the default 4096 but 0.3 s at 10^6 (`flowbroker user add --iterations`
takes up to 10^7). Run inline, each of a guesser's wrong passwords held the whole broker: a tester's
logged-in producer saw 1.8 s pauses, 3 s with HTTP Basic. hashlib releases the GIL while it hashes, so
in a thread it costs the event loop nothing; at most PASSWORD_CHECK_THREADS run at once (each source
address's failures are throttled before they get here, broker/auth.py `LoginThrottle`).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

__all__ = ["PASSWORD_CHECK_THREADS", "checked"]

PASSWORD_CHECK_THREADS = 2
"""Password checks running at once, the others waiting their turn (a machine's cores go to messages first)."""

_limiter: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("flowbroker_password_checks")


async def checked(check: Callable[[], bool]) -> bool:
    """`check()` in a worker thread, at most PASSWORD_CHECK_THREADS at once (per trio run)."""
    try:
        limiter = _limiter.get()
    except LookupError:
        limiter = trio.CapacityLimiter(PASSWORD_CHECK_THREADS)
        _limiter.set(limiter)
    return await trio.to_thread.run_sync(check, limiter=limiter)
