"""Admin API users: the users file's users with an admin tag, by HTTP Basic auth or the console's login.

`administrator` may do anything the admin token may; `monitoring` may read (GET: views, metrics) and is
refused every change (403). The admin token still works, for scripts and the CLI. A password check
costs a PBKDF2 (a few ms at 4096 iterations), so a verified (user, password) pair is remembered, by a
hash of the password, until the users file changes: a dashboard polling every second with Basic auth
does not cost a PBKDF2 a request. The memory is bounded (MAX_REMEMBERED pairs).

Failed logins are throttled per source address with the broker's `LoginThrottle` (broker/auth.py), the
one the data port uses: an address guessing admin passwords over many parallel requests has its attempts
looked at one at a time, and its failures slow its logins on either port.
"""

from __future__ import annotations

import base64
import hmac
import secrets
from collections.abc import Callable

import trio

from flowbroker.broker.auth import LoginThrottle
from flowbroker.broker.passwords import PasswordChecksBusy, checked
from flowbroker.broker.users import User, UserStore
from flowbroker.protocol.names import LOGIN_THROTTLED
from flowbroker.protocol.saslprep import SaslprepError, saslprep

__all__ = ["AdminUsers", "ADMINISTRATOR", "MONITORING", "MAX_REMEMBERED", "LoginRefused", "LoginThrottled",
           "basic_credentials", "peer_address"]

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


def peer_address(client: tuple[str, int] | None) -> str:
    """host:port of an HTTP request's peer (the ASGI scope's `client`), as the data port's log lines say it."""
    return f"{client[0]}:{client[1]}" if client else "an unknown address"


class LoginRefused(Exception):
    """Wrong user or password, or the user has no admin tag: `reason` says which, for the log only (the
    answer never says whether the user exists)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class LoginThrottled(Exception):
    """Refused unlooked: the address has failed so often lately that its turn is over the maximum delay,
    or the user has MAX_WAITING_PER_USER password checks waiting already (broker/passwords.py).
    `retry_after` is the 429's Retry-After (seconds, [auth] failed_login_max_delay rounded up): HTTP
    Basic and the console's login both answer it, so a client of either knows when to come back."""

    def __init__(self, message: str, retry_after: int, code: str = "too_many_failed_logins"):
        super().__init__(message)
        self.retry_after = retry_after
        self.code = code  # the 429's error code: the address's failures, or the user's checks waiting


class AdminUsers:
    def __init__(self, store: UserStore, failed_delay: float = 1.0, throttle: LoginThrottle | None = None,
                 clock_ns: Callable[[], int] | None = None):
        self.store = store
        self.failed_delay = failed_delay  # [auth] failed_login_delay: a refused password waits this long
        self.throttle = throttle
        self._clock_ns = clock_ns or (lambda: int(trio.current_time() * 1e9))
        self._pepper = secrets.token_bytes(16)
        self._verified: dict[tuple[str, bytes], int] = {}  # (user, keyed password hash) -> store generation

    async def login(self, name: str, password: str, host: str | None) -> tuple[User, bool]:
        """`check`, throttled per source address: waits for `host`'s turn when it has failed lately (raises
        LoginThrottled when that turn is too far away), and after a refusal counts the failure and waits
        `failed_delay` before raising LoginRefused."""
        throttle = self.throttle
        admitted_ns = self._clock_ns()
        wait = throttle.admit(host, admitted_ns) if throttle is not None else 0
        if wait is None and throttle is not None:
            # refused without a look, after the same delay as any refused login (security.md; the data
            # port's throttled logins waited, the admin API's 429 came at once, a tester)
            await trio.sleep(self.failed_delay)
            raise LoginThrottled(f"{LOGIN_THROTTLED} {host}: wait and try again", -(-throttle.max_ns // 1_000_000_000))
        try:
            turn_ns = admitted_ns + (wait or 0)
            # its turn, or sooner when the address's failures are forgotten (as on the data port)
            while throttle is not None and (left := throttle.wait_ns(host, turn_ns, self._clock_ns())):
                await trio.sleep(left / 1e9)
            try:
                return await self.check(name, password)
            except LoginRefused:
                if throttle is not None:
                    throttle.failed(host, self._clock_ns())
                await trio.sleep(self.failed_delay)
                raise
        finally:
            if throttle is not None:
                throttle.settle(host)

    def rights(self, name: str, credential: str | None = None) -> bool | None:
        """What user `name` may do now, by the users file as it is: read_only (True: monitoring only), or
        None when it is gone, has no admin tag, or (given the `credential` it logged in with, encoded) has
        another one now: a password changed, or the user deleted and added again. A console session asks
        this on every request; it survived `user passwd` and a delete-and-add (a tester)."""
        self.store.refresh()
        user = self.store.get(name)
        if user is None or not ({ADMINISTRATOR, MONITORING} & set(user.tags)):
            return None
        if credential is not None and user.credential.encode() != credential:
            return None
        return ADMINISTRATOR not in user.tags

    async def check(self, name: str, password: str) -> tuple[User, bool]:
        """(user, read_only) for a user with an admin tag and this password; else LoginRefused. The
        PBKDF2 runs in a worker thread (broker/passwords.py), once per password and users file. `name` is
        looked up SASLprepped, as the data port does (broker/auth.py): the users file holds that form, so
        `Ⅸ` or a decomposed `josé` was refused here while it logged in there (a tester)."""
        try:
            name = saslprep(name, what="user name")
        except SaslprepError as exc:  # a control character, say: no user could have this name
            raise LoginRefused(str(exc)) from None
        self.store.refresh()
        user = self.store.get(name)
        if user is None:
            raise LoginRefused("unknown user")
        if not ({ADMINISTRATOR, MONITORING} & set(user.tags)):
            # (before the password, which costs a PBKDF2: the log says it was not checked, or a wrong
            # password read as refused for the tag alone, a tester)
            raise LoginRefused("the user has no admin tag (administrator or monitoring; its password was not checked)")
        key = (name, hmac.digest(self._pepper, password.encode("utf-8"), "sha256"))
        if self._verified.get(key) != self.store.generation:
            try:
                ok = await checked(user.credential, password, name)
            except PasswordChecksBusy as busy:  # not this address's failure: 429 with Retry-After, unchecked
                raise LoginThrottled(str(busy), 5, "password_checks_busy") from None
            if not ok:
                raise LoginRefused("wrong password")
            if len(self._verified) >= MAX_REMEMBERED:
                self._verified.clear()
            self._verified[key] = self.store.generation
        return user, ADMINISTRATOR not in user.tags
