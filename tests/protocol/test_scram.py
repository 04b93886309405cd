"""SCRAM-SHA-256 (protocol/scram.py) against RFC 7677's test vector, and the exchange's refusals."""

from __future__ import annotations

import base64

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flowbroker.protocol.saslprep import SaslprepError, saslprep
from flowbroker.protocol.scram import ScramClient, ScramError, ScramServer, StoredCredential

# RFC 7677, section 3: user "user", password "pencil".
CLIENT_NONCE = "rOprNGfwEbeRWgbNEkqO"
SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
SERVER_FIRST = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
CLIENT_FINAL = (b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
SECRET = b"s" * 32


def rfc_credential() -> StoredCredential:
    return StoredCredential.from_password("pencil", 4096, SALT)


def server(credential: StoredCredential | None = None, nonce: str = SERVER_NONCE) -> ScramServer:
    cred = credential or rfc_credential()
    return ScramServer(lambda name: cred if name == "user" else None, SECRET, nonce)


def test_the_client_produces_the_rfc_messages() -> None:
    client = ScramClient("user", "pencil", CLIENT_NONCE)
    assert client.first() == CLIENT_FIRST
    assert client.final(SERVER_FIRST) == CLIENT_FINAL
    client.verify(SERVER_FINAL)


def test_the_server_produces_the_rfc_messages() -> None:
    srv = server()
    assert srv.first(CLIENT_FIRST) == SERVER_FIRST
    assert srv.final(CLIENT_FINAL) == SERVER_FINAL
    assert srv.username == "user"


def test_the_stored_credential_round_trips_and_checks_a_plain_password() -> None:
    cred = rfc_credential()
    assert StoredCredential.decode(cred.encode()) == cred
    assert cred.encode().startswith("SCRAM-SHA-256$4096:W22ZaJ0SNY7soEsUEjb6gQ==$")
    assert cred.check_password("pencil")
    assert not cred.check_password("pencil ")


@pytest.mark.parametrize("text", ["", "SCRAM-SHA-1$4096:YQ==$YQ==:YQ==", "SCRAM-SHA-256$x:YQ==$a:b",
                                  "SCRAM-SHA-256$4096:YQ==$YQ==:YQ=="])
def test_a_malformed_stored_credential_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        StoredCredential.decode(text)


def test_a_wrong_password_fails_at_the_final_message() -> None:
    srv = server()
    client = ScramClient("user", "pencil2")
    with pytest.raises(ScramError, match="wrong password"):
        srv.final(client.final(srv.first(client.first())))


def test_an_unknown_user_gets_a_stable_salt_and_fails_like_a_wrong_password() -> None:
    first = server(nonce="n1").first(b"n,,n=nobody,r=abc")
    again = server(nonce="n1").first(b"n,,n=nobody,r=abc")
    assert first == again and b"i=4096" in first  # no hint that the name does not exist
    srv = server()
    client = ScramClient("nobody", "pencil")
    with pytest.raises(ScramError, match="unknown user"):
        srv.final(client.final(srv.first(client.first())))


def test_a_replayed_client_final_fails_against_a_new_server_nonce() -> None:
    """An eavesdropper's copy of the RFC's conversation does not log in again: the broker's nonce differs."""
    srv = server(nonce="another-nonce")
    srv.first(CLIENT_FIRST)
    with pytest.raises(ScramError, match="nonce"):
        srv.final(CLIENT_FINAL)


def test_a_client_final_is_accepted_once() -> None:
    srv = server()
    srv.first(CLIENT_FIRST)
    srv.final(CLIENT_FINAL)
    with pytest.raises(ScramError, match="out of order"):
        srv.final(CLIENT_FINAL)


def test_the_client_refuses_a_server_that_does_not_know_the_credential() -> None:
    client = ScramClient("user", "pencil", CLIENT_NONCE)
    client.final(SERVER_FIRST)
    with pytest.raises(ScramError, match="signature"):
        client.verify(b"v=" + base64.b64encode(b"x" * 32))


@pytest.mark.parametrize("message", [b"p=tls-unique,,n=user,r=x", b"n,a=admin,n=user,r=x", b"n,,r=x,n=user",
                                     b"n,,n=user", b"n,,n=,r=x", b"n,,n=us=er,r=x", b"\xff", b"n,,n=u\x00,r=x",
                                     b"x" * 2000, b"n,,n=user,r=x,e=1",
                                     "n,,n=user,r=é".encode()])  # found by tests/e2e/test_e2e_auth_fuzz.py
def test_malformed_client_first_messages_are_refused(message: bytes) -> None:
    with pytest.raises(ScramError):
        server().first(message)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_random_messages_raise_only_scram_error(first: bytes, final: bytes) -> None:
    srv = server()
    try:
        srv.first(first)
        srv.final(final)
    except ScramError:
        return
    raise AssertionError("a random exchange succeeded")


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=20).filter(lambda s: s.isprintable()), st.text(max_size=20))
def test_any_name_and_password_log_in(name: str, password: str) -> None:
    """Any name and password SASLprep accepts (docs/security.md) log in, as the names they prepare to;
    a password it refuses cannot be stored."""
    try:
        saslprep(password, stored=True)
    except SaslprepError:
        with pytest.raises(SaslprepError):
            StoredCredential.from_password(password, 64)
        return
    try:
        prepared = saslprep(name, stored=True)
    except SaslprepError:
        assume(False)
        return
    cred = StoredCredential.from_password(password, 64)
    srv = ScramServer(lambda n: cred if n == prepared else None, SECRET)
    client = ScramClient(name, password)
    client.verify(srv.final(client.final(srv.first(client.first()))))
    assert srv.username == prepared
