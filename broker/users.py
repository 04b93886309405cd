"""The users file: who may log in, with what credential, tags and permissions (docs/security.md).

One JSON document, `{"users": {NAME: {"password": "SCRAM-SHA-256$...", "tags": [...], "configure": RE,
"write": RE, "read": RE, "max_connections": N, "max_queues": N, "credit_share_percent": P}}}` (the
last three optional, 0 = no limit of the user's own). The CLI's `flowbroker user add/set/passwd/delete` change it (atomically, mode
0600); the broker looks at its modification time on every login and re-reads it when it changed:
a user added or a password changed takes effect at the next login without a restart. JSON, because the
standard library writes it; only SCRAM credentials are stored, never a password.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowbroker.broker.privatefile import write_private
from flowbroker.protocol.saslprep import SaslprepError, saslprep
from flowbroker.protocol.scram import StoredCredential

__all__ = ["User", "UsersError", "UserStore", "compile_pattern", "read_users", "write_users", "LIMITS", "TAGS"]

TAGS = ("administrator", "monitoring")
"""Admin API tags (RabbitMQ's): administrator may do anything, monitoring may read views and metrics."""


LIMITS = ("max_connections", "max_queues", "credit_share_percent")
"""Per-user resource limits, beside the permissions; each 0 (the default) is no limit of the user's own."""


class UsersError(ValueError):
    """The users file is unreadable or wrong; the message names the file and the user."""


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A permission pattern compiled with each `$` anchor as `\\Z`, the end of the name: Python's `$` also
    matches before a newline that ends the name, so `^orders$` allowed `orders\\n` (a tester declared it
    and read another user's messages from it). A `$` escaped or in a character class is a character, left as
    it is. re.error, with its position in `pattern`, when it is not a regular expression."""
    re.compile(pattern)
    out: list[str] = []
    i, end = 0, len(pattern)
    while i < end:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":  # a class runs to the first `]` not escaped and not its first character
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < end and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i:j + 1])
            i = j + 1
            continue
        out.append(r"\Z" if c == "$" else c)
        i += 1
    return re.compile("".join(out))


@dataclass(frozen=True)
class User:
    name: str
    credential: StoredCredential
    tags: tuple[str, ...] = ()
    configure: str = ".*"  # RabbitMQ's permissions: regular expressions over queue and exchange names
    write: str = ".*"
    read: str = ".*"
    max_connections: int = 0  # connections open at once as this user; 0 = no limit of its own
    max_queues: int = 0  # queues it declared that exist at once; 0 = no limit of its own
    credit_share_percent: float = 0  # the most its producers hold together of the credit pool, in percent; 0 = no cap
    patterns: tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = []
        for kind in ("configure", "write", "read"):
            try:
                compiled.append(compile_pattern(getattr(self, kind)))
            except re.error as exc:
                raise UsersError(f"user {self.name!r}: {kind} pattern {getattr(self, kind)!r}: {exc}") from None
        object.__setattr__(self, "patterns", tuple(compiled))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"password": self.credential.encode(), "tags": list(self.tags),
                               "configure": self.configure, "write": self.write, "read": self.read}
        for key in LIMITS:
            if getattr(self, key):
                doc[key] = getattr(self, key)
        return doc


def check_name(name: object, where: str) -> str:
    """`name` if a users file may hold it: printable, 1..255 characters, in its SASLprep form. The loader
    and `flowbroker user add` share it, so the CLI never writes a file the broker would refuse whole."""
    if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 255:
        raise UsersError(f"{where}: user name {name!r} must be printable, 1..255 characters")
    try:
        prepared = saslprep(name, stored=True, what="user name")
    except SaslprepError as exc:
        raise UsersError(f"{where}: {exc}") from None
    if prepared != name:  # logins are looked up by their SASLprepped name: this one could never log in
        raise UsersError(f"{where}: user name {name!r} is not in its SASLprep form {prepared!r} (RFC 4013)")
    return name


def _user(name: object, entry: object, where: str) -> User:
    name = check_name(name, where)
    if not isinstance(entry, dict):
        raise UsersError(f"{where}: user {name!r} must be an object")
    unknown = set(entry) - {"password", "tags", "configure", "write", "read", *LIMITS}
    if unknown:
        raise UsersError(f"{where}: user {name!r}: unknown keys {sorted(unknown)}")
    try:
        credential = StoredCredential.decode(entry.get("password"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsersError(f"{where}: user {name!r}: password {exc}") from None
    tags = entry.get("tags", [])
    if not isinstance(tags, list) or any(t not in TAGS for t in tags):
        raise UsersError(f"{where}: user {name!r}: tags must be a list of {', '.join(TAGS)}")
    perms = {k: entry.get(k, ".*") for k in ("configure", "write", "read")}
    for kind, value in perms.items():
        if not isinstance(value, str):
            raise UsersError(f"{where}: user {name!r}: {kind} must be a regular expression string")
    limits: dict[str, Any] = {}
    for key in ("max_connections", "max_queues"):
        limit = limits[key] = entry.get(key, 0)
        if type(limit) is not int or not 0 <= limit <= 1_000_000:
            raise UsersError(f"{where}: user {name!r}: {key} must be an integer in [0, 1000000]")
    share = limits["credit_share_percent"] = entry.get("credit_share_percent", 0)
    if type(share) not in (int, float) or not 0 <= share <= 100:
        raise UsersError(f"{where}: user {name!r}: credit_share_percent must be a number in [0, 100] (0: no cap)")
    return User(name, credential, tuple(tags), perms["configure"], perms["write"], perms["read"], **limits)


def read_users(path: Path) -> dict[str, User]:
    """The users in `path`; {} when it does not exist. UsersError naming what is wrong."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UsersError(f"{path}: cannot be read: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise UsersError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("users"), dict):
        raise UsersError(f'{path}: expected {{"users": {{NAME: {{...}}}}}}')
    return {name: _user(name, entry, str(path)) for name, entry in doc["users"].items()}


def write_users(path: Path, users: dict[str, User]) -> None:
    """Replace `path` atomically (a reader sees the old file or the new one), mode 0600, folder 0700."""
    doc = {"users": {name: user.to_json() for name, user in sorted(users.items())}}
    write_private(path, json.dumps(doc, indent=2) + "\n")


class UserStore:
    """The broker's view of the users file, re-read when its modification or change time, size, inode or
    device changes (the change time and inode too: deploy tools that keep timestamps, `cp -p`, `rsync -t`,
    `install -p`, replaced a file of the same size and mtime, and a revocation was never read, a tester). A file
    that became invalid keeps the users last read (and the error is reported by `refresh`), so a typo in
    a hand edit does not lock everyone out."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: tuple[int, ...] | None = None
        self.users: dict[str, User] = {}
        self.generation = 0  # bumped whenever the users change: permission caches compare it
        self.error: str | None = None  # why the file last read was refused, if it was
        self.refresh()

    def refresh(self) -> str | None:
        """Re-read the file if it changed; returns the error text if it is now invalid, else None."""
        try:
            st = self.path.stat()
            stamp: tuple[int, ...] | None = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return None
        try:
            users = read_users(self.path) if stamp is not None else {}
        except UsersError as exc:
            self.error = str(exc)
            return self.error
        self._stamp = stamp
        self.error = None
        if users != self.users:
            self.users = users
            self.generation += 1
        return None

    def get(self, name: str) -> User | None:
        return self.users.get(name)
