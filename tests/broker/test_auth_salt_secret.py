"""The made-up SCRAM salt of an unknown user stays the same across a broker restart, as a real user's
does: its key is kept in a file beside the users file (broker/auth.py salt_secret)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowbroker.broker.auth import Authenticator, Challenge, Peer
from flowbroker.broker.config import AuthConfig
from flowbroker.broker.users import User, UserStore, write_users
from flowbroker.protocol.scram import ScramClient, StoredCredential


def _secret_file(users: Path) -> Path:
    return users.with_name(users.name + ".salt-secret")


def _salt(users: Path, name: str) -> str:
    """The salt a new broker (a new Authenticator: a restart) offers `name` in SCRAM's server-first."""
    auth = Authenticator(AuthConfig(users_file=str(users)), UserStore(users))
    challenge = auth.begin({"mechanism": "SCRAM-SHA-256", "data": ScramClient(name, "pw").first()}, Peer("192.0.2.7"))
    assert isinstance(challenge, Challenge)
    return dict(part.split("=", 1) for part in challenge.data.decode().split(","))["s"]


@pytest.fixture
def users(tmp_path: Path) -> Path:
    path = tmp_path / "users.json"
    write_users(path, {"alice": User("alice", StoredCredential.from_password("pw", 4096))})
    return path


def test_an_unknown_users_salt_survives_a_restart_as_a_real_users_does(users: Path) -> None:
    before = {name: _salt(users, name) for name in ("alice", "ghost")}
    assert {name: _salt(users, name) for name in ("alice", "ghost")} == before
    assert _salt(users, "ghost2") != before["ghost"]  # still one per name
    assert _secret_file(users).stat().st_mode & 0o777 == 0o600


def test_a_secret_file_others_may_read_is_replaced(users: Path) -> None:
    ghost = _salt(users, "ghost")
    os.chmod(_secret_file(users), 0o644)  # perhaps read by someone else: no longer secret
    assert _salt(users, "ghost") != ghost
    assert _secret_file(users).stat().st_mode & 0o777 == 0o600


def test_a_secret_that_cannot_be_written_still_gives_made_up_salts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    users = tmp_path / "file" / "users.json"  # its folder is a file: nothing can be written there
    assert len(_salt(users, "ghost")) > 0
    assert "cannot write the SCRAM salt secret" in caplog.text and "will change when the broker restarts" in caplog.text


def test_a_corrupt_secret_is_replaced_and_said_at_warning(users: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A non-hex secret (mode 0600) was rewritten silently, so the made-up salts changed without trace (a tester)."""
    before = _salt(users, "nobody")
    secret = _secret_file(users)
    secret.write_text("not hex at all\n")
    os.chmod(secret, 0o600)
    assert _salt(users, "nobody") != before
    assert any("salt secret" in r.getMessage() and "replaced" in r.getMessage() for r in caplog.records)
