"""The authenticator (broker/auth.py) for peers the e2e tests cannot be: other addresses, TLS, a client
certificate. Sans-IO: a Peer in, an outcome out."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowbroker.broker.auth import Accepted, Authenticator, Challenge, Outcome, PasswordCheck, Peer, Refused, is_local
from flowbroker.broker.config import AuthConfig
from flowbroker.broker.users import User, UserStore, write_users
from flowbroker.protocol.scram import ScramClient, StoredCredential

REMOTE = Peer("192.0.2.7")


def authenticator(tmp_path: Path, **config: object) -> Authenticator:
    path = tmp_path / "users.json"
    write_users(path, {"alice": User("alice", StoredCredential.from_password("pw", 4096))})
    return Authenticator(AuthConfig(users_file=str(path), **config), UserStore(path))  # type: ignore[arg-type]


@pytest.mark.parametrize("host, local", [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), (None, True),
                                         ("192.0.2.7", False), ("::ffff:10.0.0.1", False), ("fe80::1%eth0", False)])
def test_which_peers_are_local(host: str | None, local: bool) -> None:
    assert is_local(host) is local


def test_the_loopback_user_is_never_given_to_another_address(tmp_path: Path) -> None:
    auth = authenticator(tmp_path)
    assert auth.begin(None, Peer("127.0.0.1")) == Accepted("guest", "loopback", None)
    refused = auth.begin(None, REMOTE)
    assert isinstance(refused, Refused) and "from 192.0.2.7" in refused.text and "auth=(USER, PASSWORD)" in refused.text
    assert auth.failures == 1


def checked(outcome: Outcome) -> Outcome:
    """A PLAIN login's PasswordCheck run as the shell runs it (the PBKDF2, then its answer)."""
    return outcome.finish(outcome.check()) if isinstance(outcome, PasswordCheck) else outcome


def test_no_login_is_the_loopback_user_and_the_file_holding_it_is_told(tmp_path: Path) -> None:
    """A users-file user named as the loopback user was the loopback clients' identity too (a tester): no
    login by that name (SCRAM before its challenge, PLAIN before its password, a certificate's subject) is
    accepted, with one answer whether or not the file holds it; another loopback_user frees the name."""
    auth = authenticator(tmp_path)
    scram = {"mechanism": "SCRAM-SHA-256", "data": ScramClient("guest", "pw").first()}
    plain = {"mechanism": "PLAIN", "username": "guest", "password": "pw"}
    external = Peer("127.0.0.1", tls=True, certificate_identity="guest")
    absent = [auth.begin(scram, REMOTE), auth.begin(plain, Peer("127.0.0.1")), auth.begin(None, external)]
    assert auth.loopback_clash() is None
    guest = User("guest", StoredCredential.from_password("pw", 4096))
    write_users(auth.store.path, {**auth.store.users, "guest": guest})
    held = [auth.begin(scram, REMOTE), auth.begin(plain, Peer("127.0.0.1")), auth.begin(None, external)]
    texts = {r.text if isinstance(r, Refused) else "" for r in absent + held}
    (text,) = texts  # one answer, held or not
    assert "user 'guest' is this broker's loopback user" in text
    assert auth.failures == 6 and auth.successes == 0
    clash = auth.loopback_clash()
    assert clash is not None and "user 'guest' has the loopback user's name" in clash
    path = auth.store.path
    other = Authenticator(AuthConfig(users_file=str(path), loopback_user="local"), UserStore(path))
    assert isinstance(checked(other.begin(plain, Peer("127.0.0.1"))), Accepted) and other.loopback_clash() is None


def test_a_plain_password_is_checked_by_the_shell_off_the_event_loop(tmp_path: Path) -> None:
    """begin() does no PBKDF2 for PLAIN: it hands the shell a PasswordCheck (run inline, a guesser's wrong
    passwords for a user with 10^6 iterations froze the broker for 0.3 s each, a tester)."""
    auth = authenticator(tmp_path)
    check = auth.begin({"mechanism": "PLAIN", "username": "alice", "password": "wrong"}, Peer("127.0.0.1"))
    assert isinstance(check, PasswordCheck) and check.user.name == "alice"
    assert check.check() is False and isinstance(check.finish(False), Refused) and auth.failures == 1


def test_plain_from_another_address_needs_tls_unless_always(tmp_path: Path) -> None:
    creds = {"mechanism": "PLAIN", "username": "alice", "password": "pw"}
    auth = authenticator(tmp_path)
    assert isinstance(auth.begin(creds, REMOTE), Refused)
    accepted = checked(auth.begin(creds, Peer("192.0.2.7", tls=True)))
    assert isinstance(accepted, Accepted) and accepted.identity == "alice"
    assert isinstance(checked(authenticator(tmp_path, plain="always").begin(creds, REMOTE)), Accepted)


def test_scram_from_another_address_without_tls(tmp_path: Path) -> None:
    auth = authenticator(tmp_path)
    client = ScramClient("alice", "pw")
    challenge = auth.begin({"mechanism": "SCRAM-SHA-256", "data": client.first()}, REMOTE)
    assert isinstance(challenge, Challenge)
    accepted = challenge.finish(client.final(challenge.data))
    assert isinstance(accepted, Accepted) and accepted.server_final is not None
    client.verify(accepted.server_final)


def test_a_verified_client_certificate_is_the_identity(tmp_path: Path) -> None:
    auth = authenticator(tmp_path, loopback_user="")
    accepted = auth.begin(None, Peer("192.0.2.7", tls=True, certificate_identity="alice"))
    assert isinstance(accepted, Accepted) and accepted.identity == "alice" and accepted.mechanism == "EXTERNAL"


@pytest.mark.parametrize("auth_map", [{"mechanism": "GSSAPI"}, {"mechanism": "SCRAM-SHA-256", "data": "text"},
                                      {"mechanism": "PLAIN", "username": 1, "password": "pw"}, {"x": 1},
                                      {"mechanism": "SCRAM-SHA-256", "data": b"garbage"}])
def test_malformed_auth_maps_are_refused(tmp_path: Path, auth_map: dict[str, object]) -> None:
    auth = authenticator(tmp_path)
    assert isinstance(auth.begin(auth_map, Peer("127.0.0.1")), Refused)
    assert auth.failures == 1


def test_a_user_added_to_the_file_logs_in_without_a_restart(tmp_path: Path) -> None:
    auth = authenticator(tmp_path)
    creds = {"mechanism": "PLAIN", "username": "bob", "password": "b"}
    assert isinstance(auth.begin(creds, Peer("127.0.0.1")), Refused)  # (no such user: refused at once)
    users = dict(auth.store.users)
    users["bob"] = User("bob", StoredCredential.from_password("b", 4096))
    write_users(auth.store.path, users)
    assert isinstance(checked(auth.begin(creds, Peer("127.0.0.1"))), Accepted)


def test_an_unknown_users_made_up_answer_carries_the_users_most_common_iteration_count(tmp_path: Path) -> None:
    """Made-up answers always said i=4096: in a file whose users were made with more, any name answered
    4096 did not exist (a tester). They carry the file's most common count now."""
    path = tmp_path / "users.json"
    write_users(path, {name: User(name, StoredCredential.from_password("pw", 5000)) for name in ("a", "b")}
                | {"c": User("c", StoredCredential.from_password("pw", 4096))})
    auth = Authenticator(AuthConfig(users_file=str(path)), UserStore(path))

    def iterations(name: str) -> str:
        challenge = auth.begin({"mechanism": "SCRAM-SHA-256", "data": ScramClient(name, "x").first()}, REMOTE)
        assert isinstance(challenge, Challenge)
        return dict(part.split("=", 1) for part in challenge.data.decode().split(","))["i"]

    assert iterations("a") == "5000" and iterations("c") == "4096"
    assert iterations("ghost") == "5000"


def test_a_users_file_replaced_with_the_same_size_and_mtime_is_read_again(tmp_path: Path) -> None:
    """Deploy tools that keep timestamps (cp -p, rsync -t, install -p) replaced the file with one of the same
    size and modification time, and a revoked permission stayed in force (a tester): the change time and
    the inode are compared too."""
    import os

    path = tmp_path / "users.json"
    credential = StoredCredential.from_password("pw", 4096)
    write_users(path, {"gina": User("gina", credential, read="^g[.]aaa")})
    store = UserStore(path)
    before = path.stat()
    write_users(path, {"gina": User("gina", credential, read="^g[.]bbb")})  # same length, a new inode
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert store.refresh() is None
    user = store.get("gina")
    assert user is not None and user.read == "^g[.]bbb"
