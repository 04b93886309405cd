"""Authentication on HELLO, without I/O: what HELLO's `auth` asks for, and who the connection is.

The shell (broker/server.py) calls `begin(hello.auth, peer)` and gets one of four answers: `Accepted`
(WELCOME with that identity), `Challenge` (send AUTH_CHALLENGE, then give the AUTH_RESPONSE to
`Challenge.finish`), `PasswordCheck` (run its `check` off the event loop, give the answer to its
`finish`), or `Refused` (wait `failed_login_delay`, then ERROR UNAUTHORIZED + CLOSE). The
text of a refusal sent to the client never says whether the user exists; the reason for the log does.

HELLO's `auth` map (docs/protocol.md):
- absent or nil: no credentials. Accepted as `[auth] loopback_user` from a loopback address (or from an
  in-process stream, which has no network peer), else refused naming what to do;
- `{"mechanism": "SCRAM-SHA-256", "data": client-first}`: RFC 7677, one AUTH_CHALLENGE round;
- `{"mechanism": "PLAIN", "username": u, "password": p}`: only where `[auth] plain` allows it (by default
  over TLS or from loopback, where the password is not on an untrusted wire).

The only file it touches besides the users file is the salt secret beside it (`salt_secret`).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from flowbroker.broker.config import AuthConfig
from flowbroker.broker.privatefile import read_private, write_private
from flowbroker.broker.users import User, UserStore
from flowbroker.protocol.saslprep import SaslprepError, saslprep
from flowbroker.protocol.scram import DEFAULT_ITERATIONS, MECHANISM as SCRAM, ScramError, ScramServer

__all__ = ["Peer", "Accepted", "Challenge", "PasswordCheck", "Refused", "Authenticator",
           "LoginThrottle", "PLAIN", "SCRAM", "is_local", "salt_secret", "salt_secret_path", "THROTTLE_SOURCES"]

LOGGER = logging.getLogger("flowbroker.broker.auth")

PLAIN = "PLAIN"

HOW_TO = ("connect with a user and password: connect(url, auth=(USER, PASSWORD)) in the Python SDK, "
          "FLOWBROKER_USER and FLOWBROKER_PASSWORD for the CLI (users: `flowbroker user add`; docs/security.md)")


@dataclass(frozen=True, slots=True)
class Peer:
    """What the shell knows of the other end: its IP address (None: an in-process stream), whether the
    stream is TLS, and the subject of a verified client certificate, if any."""

    host: str | None
    tls: bool = False
    certificate_identity: str | None = None


def is_local(host: str | None) -> bool:
    """A loopback address, or no network peer at all (a stream made inside this process)."""
    if host is None:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Accepted:
    identity: str
    mechanism: str  # "loopback", "PLAIN", "SCRAM-SHA-256", "EXTERNAL" (a client certificate)
    user: User | None  # None for the loopback user (it may do anything)
    server_final: bytes | None = None  # SCRAM's server-final, for WELCOME's auth_data


@dataclass(frozen=True, slots=True)
class Refused:
    text: str  # for the client: no hint whether the user exists
    reason: str  # for the log
    username: str | None = None


class Challenge:
    """A SCRAM exchange half done: `data` is the server-first message for AUTH_CHALLENGE."""

    def __init__(self, auth: Authenticator, scram: ScramServer, data: bytes):
        self._auth = auth
        self._scram = scram
        self.data = data
        self.username = scram.username

    def finish(self, data: bytes) -> Accepted | Refused:
        try:
            server_final = self._scram.final(data)
        except ScramError as exc:
            return self._auth.failed(str(exc), self.username)
        user = self._auth.store.get(self.username or "")
        if user is None:  # deleted between the two messages
            return self._auth.failed("user deleted during the exchange", self.username)
        return self._auth._accepted(Accepted(user.name, SCRAM, user, server_final))


class PasswordCheck:
    """A PLAIN login's password against the user's stored credential: PBKDF2 at the user's iterations (0.3 s
    at 10^6, and `flowbroker user add` takes up to 10^7). The shell runs `check` in a worker thread
    (hashlib releases the GIL) and gives its answer to `finish`: run inline, a guesser's wrong passwords
    for a user with many iterations froze the broker for every client, up to 3 s at a time (a tester)."""

    def __init__(self, auth: Authenticator, user: User, password: str):
        self._auth = auth
        self.user = user
        self._password = password

    @property
    def password(self) -> str:
        """What the client sent, for the shell's check (broker/passwords.py `checked`)."""
        return self._password

    def check(self) -> bool:
        """The PBKDF2 (in any thread: it reads only the credential)."""
        return self.user.credential.check_password(self._password)

    def finish(self, ok: bool) -> Accepted | Refused:
        if not ok:
            return self._auth.failed("wrong password", self.user.name)
        return self._auth._accepted(Accepted(self.user.name, PLAIN, self.user))


Outcome = Union[Accepted, Challenge, PasswordCheck, Refused]

THROTTLE_SOURCES = 10_000
"""Source addresses the login throttle remembers at once; the least recently failed is forgotten first."""

FORGET_AFTER = 10
"""A source's failures are forgotten this many times its current spacing after its last one (10 s after one
failure with the default 1 s delay, 5 minutes once the spacing is at the 30 s cap)."""


class _Source:
    __slots__ = ("failures", "last_failure_ns", "next_slot_ns", "inflight", "last_slot_ns")

    def __init__(self) -> None:
        self.failures = 0
        self.last_failure_ns = 0
        self.next_slot_ns = 0  # the earliest an attempt from there may be looked at
        self.inflight = 0  # attempts admitted and not settled yet
        self.last_slot_ns = -1  # the slot `admit` gave last, which `give_back` may return (-1: none)


class LoginThrottle:
    """Failed logins per source address, so that one address cannot guess passwords in parallel over
    many connections (the per-connection `failed_login_delay` slows only one at a time).

    Once an address has f recent failures, the login attempts from there are looked at one at a time:
    `admit` gives each a slot, `delay(f + n)` = base * 2**(f+n-1) (capped at `max_delay`) after the one
    before, n being the attempts from there admitted and not settled yet (so that many attempts sent at
    once are spaced further and further apart before any of them fails), and returns how long until that
    slot, when the broker reads its credentials; or None when its slot would be over `max_delay` away (the
    shell refuses it without looking). An address with no recent failure waits for nothing, so a pool of
    connections logging in at once is not slowed; nor is any other address, nor a connection already
    logged in. A success does not forget the failures (an attacker may own one good account); time does.

    Bounded: at most `max_entries` addresses (LRU by last failure); an address's failures are forgotten
    FORGET_AFTER times its current spacing after its last one, whatever attempts from there are in flight,
    and the attempts still waiting their turn then go (`wait_ns`): remembered while any was in flight, one
    typo kept a busy address throttled for good, its succeeding logins' turns ever further away (a tester's
    four clients logging in every 0.5 s waited up to 30 s for a minute). Sans-IO: takes `now_ns`."""

    def __init__(self, base: float, max_delay: float, max_entries: int = THROTTLE_SOURCES):
        self.base_ns = int(base * 1e9)
        self.max_ns = max(int(max_delay * 1e9), self.base_ns)
        self.max_entries = max_entries
        self._sources: OrderedDict[str, _Source] = OrderedDict()
        self.delayed = 0  # attempts made to wait (metrics)
        self.refused = 0  # attempts refused without a look because their address's queue was full

    def __len__(self) -> int:
        return len(self._sources)

    def delay_ns(self, failures: int) -> int:
        if failures <= 0 or not self.base_ns:
            return 0
        return min(self.max_ns, self.base_ns << min(failures - 1, 62))

    def _forgotten_ns(self, source: _Source) -> int:
        """When the source's failures are forgotten if no more come (just after FORGET_AFTER spacings)."""
        return source.last_failure_ns + FORGET_AFTER * self.delay_ns(source.failures) + 1

    def _live(self, host: str, now_ns: int) -> _Source | None:
        source = self._sources.get(host)
        if source is not None and now_ns >= self._forgotten_ns(source):
            del self._sources[host]
            return None
        return source

    def admit(self, host: str | None, now_ns: int) -> int | None:
        """Nanoseconds until this attempt's turn (0: now), when its credentials are looked at unless its
        address's failures are forgotten first (the shell waits with `wait_ns`), or None: refuse it
        unlooked (its turn would be over `max_delay` away). An admitted attempt from an address with
        failures must be `settle`d when it ends, however it ends."""
        if host is None or not self.base_ns:
            return 0
        source = self._live(host, now_ns)
        if source is None or not source.failures:
            return 0
        slot = max(now_ns, source.next_slot_ns)
        wait = slot - now_ns
        if wait > self.max_ns:
            self.refused += 1
            return None
        source.next_slot_ns = slot + self.delay_ns(source.failures + source.inflight)
        source.last_slot_ns = slot
        source.inflight += 1
        if wait:
            self.delayed += 1
        return wait

    def wait_ns(self, host: str | None, turn_ns: int, now_ns: int) -> int:
        """Nanoseconds the attempt `admit` gave `turn_ns` still waits (0: look at it now): until that turn,
        or until its address's failures are forgotten if that comes first. Ask again when that wait is
        over: a failure meanwhile puts the forgetting off, and the attempt then waits on for its turn."""
        source = self._live(host, now_ns) if host is not None else None
        if source is None:
            return 0
        return max(0, min(turn_ns, self._forgotten_ns(source)) - now_ns)

    def settle(self, host: str | None) -> None:
        """An attempt `admit` counted ended (logged in, refused, or gone)."""
        source = self._sources.get(host) if host is not None else None
        if source is not None and source.inflight:
            source.inflight -= 1

    def give_back(self, host: str | None, slot_ns: int) -> None:
        """The attempt given `slot_ns` went away before its turn (its client timed out waiting): when no
        attempt was given a slot after it, the next one takes that slot. Kept, it pushed the address's
        next turn one more step away, past `max_delay`: a client whose connect timed out while it waited
        was refused unlooked when it tried again with a longer timeout (a tester). `settle` it too."""
        source = self._sources.get(host) if host is not None else None
        if source is not None and source.last_slot_ns == slot_ns:
            source.next_slot_ns = slot_ns
            source.last_slot_ns = -1

    def failed(self, host: str | None, now_ns: int) -> None:
        """A login from `host` failed: the next attempts from there are spaced further apart."""
        if host is None or not self.base_ns:
            return
        source = self._live(host, now_ns)
        if source is None:
            source = self._sources[host] = _Source()
            source.next_slot_ns = now_ns + self.delay_ns(1)  # even the second attempt waits its turn
            while len(self._sources) > self.max_entries:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(host)
        source.failures += 1
        source.last_failure_ns = now_ns

    def failures(self, host: str, now_ns: int) -> int:
        source = self._live(host, now_ns)
        return source.failures if source is not None else 0


SECRET_BYTES = 32


def salt_secret_path(users_file: Path) -> Path:
    """`<users file>.salt-secret`: the secret lives and goes with the users whose absence it hides."""
    return users_file.with_name(users_file.name + ".salt-secret")


def _reusable_secret(path: Path) -> bytes | None:
    """The secret in `path` if it may be used: a private file of ours (broker/privatefile.py) holding
    SECRET_BYTES in hex; else None."""
    text = read_private(path)
    try:
        secret = bytes.fromhex(text) if text is not None else b""
    except ValueError:
        return None
    return secret if len(secret) == SECRET_BYTES else None


def salt_secret(path: Path) -> bytes:
    """The key of the made-up SCRAM salts of unknown users (protocol/scram.py), kept in `path` across
    restarts. A real user's salt is in the users file and never changes with a restart; a made-up one
    drawn anew per process did, so comparing the salts a name got before and after a restart told which
    names exist (a tester). Created on first use, 0600 (its folder 0700 when created), written atomically
    as the admin token file is; one that is not ours or that others may read is replaced. When it cannot
    be written the secret is this process's alone, said once at WARNING."""
    existing = _reusable_secret(path)
    if existing is not None:
        return existing
    if path.exists():  # one there, unusable: its replacement changes the made-up salts, so say so (a tester)
        LOGGER.warning("the SCRAM salt secret %s is not a private file of %d hex-encoded bytes: replaced; "
                       "unknown users' made-up salts change with it", path, SECRET_BYTES)
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        write_private(path, secret.hex() + "\n")
    except OSError as exc:
        LOGGER.warning("cannot write the SCRAM salt secret %s: %s; unknown users' made-up salts will change "
                       "when the broker restarts, which tells which user names exist", path, exc.strerror or exc)
    return secret


class Authenticator:
    """One per broker: the config, the users file, and the failures counted (for metrics and views)."""

    def __init__(self, config: AuthConfig, store: UserStore | None = None):
        self.config = config
        self.store = store if store is not None else UserStore(config.users_path())
        self._secret: bytes | None = None  # of made-up salts of unknown users: salt_secret, on first SCRAM
        self._usual = DEFAULT_ITERATIONS  # `_usual_iterations`, as of users-file generation `_iterations_for`
        self._iterations_for = -1
        self.failures = 0
        self.successes = 0
        # failed logins per source address: attempts from an address that keeps failing wait their turn
        self.throttle = LoginThrottle(config.failed_login_delay, config.failed_login_max_delay)

    def _usual_iterations(self) -> int:
        """The users file's most common PBKDF2 iteration count (the default with no users), what an unknown
        user's made-up SCRAM answer carries; counted once per version of the file."""
        store = self.store
        if self._iterations_for != store.generation:
            counts = Counter(user.credential.iterations for user in store.users.values())
            self._usual = counts.most_common(1)[0][0] if counts else DEFAULT_ITERATIONS
            self._iterations_for = store.generation
        return self._usual

    def users_changed(self) -> bool:
        """Re-read the users file if it changed; True when the users (or their permissions) did."""
        generation = self.store.generation
        self.store.refresh()
        return self.store.generation != generation

    def failed(self, reason: str, username: str | None) -> Refused:
        self.failures += 1
        return Refused(f"authentication failed for user {username!r}" if username is not None
                       else "authentication failed", reason, username)

    def begin(self, auth: dict[str, Any] | None, peer: Peer) -> Outcome:
        self.store.refresh()
        if peer.certificate_identity is not None and not auth:
            if (clash := self._loopback_name(peer.certificate_identity)) is not None:
                return clash
            user = self.store.get(peer.certificate_identity)
            if user is None:  # as RabbitMQ's EXTERNAL: the subject must be a user, for its permissions
                return self.failed("client certificate subject is not a user", peer.certificate_identity)
            return self._accepted(Accepted(user.name, "EXTERNAL", user))
        if not auth:
            if self.config.loopback_user and is_local(peer.host):
                return self._accepted(Accepted(self.config.loopback_user, "loopback", None))
            self.failures += 1
            where = "from a loopback address" if is_local(peer.host) else f"from {peer.host}"
            return Refused(f"this broker requires authentication {where}: HELLO carried no credentials; "
                           f"{HOW_TO}", "no credentials")
        mechanism = auth.get("mechanism")
        if mechanism == SCRAM:
            data = auth.get("data")
            if type(data) is not bytes:
                return self.failed("SCRAM-SHA-256 without binary data (client-first)", None)
            if self._secret is None:
                self._secret = salt_secret(salt_secret_path(self.store.path))
            scram = ScramServer(self._lookup, self._secret, fake_iterations=self._usual_iterations())
            try:
                first = scram.first(data)
            except ScramError as exc:
                return self.failed(str(exc), scram.username)
            if (clash := self._loopback_name(scram.username or "")) is not None:
                return clash
            return Challenge(self, scram, first)
        if mechanism == PLAIN:
            return self._plain(auth, peer)
        self.failures += 1
        return Refused(f"unknown mechanism {str(mechanism)[:40]!r}: use {SCRAM} or {PLAIN}",
                       f"mechanism {str(mechanism)[:40]!r}")

    def _plain(self, auth: dict[str, Any], peer: Peer) -> PasswordCheck | Refused:
        name, password = auth.get("username"), auth.get("password")
        if type(name) is not str or type(password) is not str or len(name) > 255 or len(password) > 1024:
            return self.failed("PLAIN without string username and password", None)
        mode = self.config.plain
        if mode == "never" or (mode == "tls-or-loopback" and not peer.tls and not is_local(peer.host)):
            self.failures += 1
            how = "" if mode == "never" else " or connect over TLS"
            return Refused(f"PLAIN is not allowed here ([auth] plain = {mode!r}): use {SCRAM} (the SDK does "
                           f"unless auth= says PLAIN){how}", "PLAIN not allowed", name)
        try:
            name = saslprep(name, what="user name")
        except SaslprepError as exc:
            return self.failed(str(exc), None)
        if (clash := self._loopback_name(name)) is not None:
            return clash
        user = self.store.get(name)
        if user is None:
            return self.failed("unknown user", name)
        return PasswordCheck(self, user, password)

    def _loopback_name(self, name: str) -> Refused | None:
        """Credentials (or a client certificate) naming the loopback user are refused, before any password
        is looked at: identities are names, so a users-file user of that name was the loopback clients'
        identity too (one's idempotent producer ids took the other's messages as duplicates, its refusals
        were replayed to them, its max_connections counted them, a tester). The same answer whether or not
        the users file holds the name, so it says nothing of which users exist."""
        if not name or name != self.config.loopback_user:
            return None
        self.failures += 1
        return Refused(f"user {name!r} is this broker's loopback user ([auth] loopback_user): a client is {name!r} "
                       "only without credentials, from a loopback address; a user of that name cannot log in "
                       "(docs/security.md)", "the name of the loopback user ([auth] loopback_user), which cannot "
                       "log in", name)

    def loopback_clash(self) -> str | None:
        """What to log (at ERROR, at start and when the users file changes) when the users file holds a user
        named as the loopback user, which `_loopback_name` refuses; None when it does not."""
        name = self.config.loopback_user
        if not name or self.store.get(name) is None:
            return None
        return (f"user {name!r} has the loopback user's name ([auth] loopback_user): it cannot connect as a "
                f"client, since a client without credentials from a loopback address is {name!r}; rename the "
                "user, or set [auth] loopback_user to another name or \"\"")

    def _accepted(self, accepted: Accepted) -> Accepted:
        self.successes += 1
        return accepted

    def _lookup(self, name: str) -> Any:
        user = self.store.get(name)
        return user.credential if user is not None else None
