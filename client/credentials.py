"""Credentials for HELLO: a user and password, sent as SCRAM-SHA-256 (the default) or PLAIN.

SCRAM never puts the password on the wire and makes the broker prove it knows the user's credential
(WELCOME's `auth_data`), so it is safe without TLS; PLAIN sends the password itself, which a broker
allows only over TLS or from loopback by default (docs/security.md). Credentials are an argument of
`connect`, never part of the URL, which ends up in logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from flowbroker.client.errors import InvalidCredentials
from flowbroker.protocol.saslprep import SaslprepError
from flowbroker.protocol.scram import MECHANISM as SCRAM, ScramClient

__all__ = ["Credentials", "AuthArg", "hello_auth"]


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    mechanism: str = SCRAM  # or "PLAIN"

    def __post_init__(self) -> None:
        if self.mechanism not in (SCRAM, "PLAIN"):
            raise ValueError(f"mechanism {self.mechanism!r}: use {SCRAM!r} or 'PLAIN'")


AuthArg = Union[Credentials, tuple[str, str], dict[str, Any], None]
"""What `connect(auth=...)` takes: Credentials, a (user, password) pair (SCRAM-SHA-256), a raw HELLO
auth map (for tests of the broker), or None (the broker's loopback user, from the broker's own host)."""


def hello_auth(auth: AuthArg) -> tuple[dict[str, Any] | None, ScramClient | None]:
    """HELLO's auth map for `auth`, and the SCRAM exchange to continue when the broker challenges."""
    if auth is None or isinstance(auth, dict):
        return auth, None
    if isinstance(auth, tuple):
        auth = Credentials(*auth)
    if auth.mechanism == "PLAIN":
        return {"mechanism": "PLAIN", "username": auth.username, "password": auth.password}, None
    try:
        scram = ScramClient(auth.username, auth.password)
    except SaslprepError as exc:
        raise InvalidCredentials(str(exc)) from None
    return {"mechanism": SCRAM, "data": scram.first()}, scram
