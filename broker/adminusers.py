"""Admin API users: the users file's users with an admin tag, by HTTP Basic auth or the console's login.

`administrator` may do anything the admin token may; `monitoring` may read (GET: views, metrics) and is
refused every change (403). The admin token still works, for scripts and the CLI. A password check
costs a PBKDF2 (a few ms at 4096 iterations), so a verified (user, password) pair is remembered, by a
hash of the password, until the users file changes: a dashboard polling every second with Basic auth
does not cost a PBKDF2 a request. The memory is bounded (MAX_REMEMBERED pairs).
"""

from __future__ import annotations

import base64
import hmac
import secrets

from flowbroker.broker.users import User, UserStore

__all__ = ["AdminUsers", "ADMINISTRATOR", "MONITORING", "MAX_REMEMBERED", "basic_credentials"]

ADMINISTRATOR = "administrator"
MONITORING = "monitoring"
MAX_REMEMBERED = 256


def basic_credentials(value: bytes) -> tuple[str, str] | None:
    """`user:password` of an HTTP Basic credential (the part after "Basic "), or None if malformed."""
    try:
        user, sep, password = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return (user, password) if sep and user else None


class AdminUsers:
    def __init__(self, store: UserStore, failed_delay: float = 1.0):
        self.store = store
        self.failed_delay = failed_delay  # [auth] failed_login_delay: a refused password waits this long
        self._pepper = secrets.token_bytes(16)
        self._verified: dict[tuple[str, bytes], int] = {}  # (user, keyed password hash) -> store generation

    def check(self, name: str, password: str) -> tuple[User, bool] | None:
        """(user, read_only) for a user with an admin tag and this password; None otherwise."""
        self.store.refresh()
        user = self.store.get(name)
        if user is None or not ({ADMINISTRATOR, MONITORING} & set(user.tags)):
            return None
        key = (name, hmac.digest(self._pepper, password.encode("utf-8"), "sha256"))
        if self._verified.get(key) != self.store.generation:
            if not user.credential.check_password(password):
                return None
            if len(self._verified) >= MAX_REMEMBERED:
                self._verified.clear()
            self._verified[key] = self.store.generation
        return user, ADMINISTRATOR not in user.tags
