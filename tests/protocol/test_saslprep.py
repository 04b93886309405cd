"""SASLprep (RFC 4013) with RFC 4013 section 3's examples, and where SCRAM applies it: the client, the
broker's look-up, the stored credential; ASCII passwords hash as before, so existing users stay valid."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowbroker.protocol.saslprep import SaslprepError, saslprep
from flowbroker.protocol.scram import ScramClient, ScramError, ScramServer, StoredCredential, salted_password


@pytest.mark.parametrize("given_, expected", [
    ("I\u00adX", "IX"),  # 1: SOFT HYPHEN mapped to nothing
    ("user", "user"),  # 2: no transformation
    ("USER", "USER"),  # 3: case preserved, will not match #2
    ("\u00aa", "a"),  # 4: output is NFKC, input in ISO 8859-1
    ("\u2168", "IX"),  # 5: output is NFKC, will match #1
])
def test_rfc_4013_section_3_examples(given_: str, expected: str) -> None:
    assert saslprep(given_) == expected
    assert saslprep(given_, stored=True) == expected


def test_rfc_4013_section_3_errors() -> None:
    with pytest.raises(SaslprepError, match=r"control character \(U\+0007\)"):  # 6: prohibited character
        saslprep("\u0007")
    with pytest.raises(SaslprepError, match="right-to-left"):  # 7: bidirectional check
        saslprep("\u0627\u0031")


def test_spaces_mapping_prohibitions_and_unassigned_code_points() -> None:
    assert saslprep("a\u00a0b\u3000c") == "a b c"  # non-ASCII spaces become SPACE
    assert saslprep("\u0627\u0628") == "\u0627\u0628"  # right-to-left only, begins and ends with one
    with pytest.raises(SaslprepError, match="mixes"):
        saslprep("\u0627a\u0628")
    for bad in ("\ue000", "\ufffe", "\u200e", "\U000e0001", "a\x7f"):
        with pytest.raises(SaslprepError):
            saslprep(bad)
    assert saslprep("\u0221") == "\u0221"  # unassigned in Unicode 3.2: a query may carry it...
    with pytest.raises(SaslprepError, match="unassigned code point U\\+0221"):
        saslprep("\u0221", stored=True)  # ...a stored string may not
    with pytest.raises(SaslprepError) as info:
        saslprep("secret\u0007", what="password")
    assert "secret" not in str(info.value) and str(info.value).startswith("password: ")


@given(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e)))
def test_printable_ascii_is_unchanged_so_existing_hashes_stay_valid(text: str) -> None:
    assert saslprep(text) == text


def test_the_stored_credential_and_both_ends_agree_through_saslprep() -> None:
    salt = b"0123456789abcdef"
    old = StoredCredential(salt, 4096, *_keys(salted_password("pencil", salt, 4096)))  # hashed before SASLprep
    assert StoredCredential.from_password("pencil", 4096, salt) == old
    stored = StoredCredential.from_password("I\u00adX\u00a0pass", 4096)  # set with a soft hyphen and a nbsp
    assert stored.check_password("\u2168 pass") and stored.check_password("IX pass")
    assert not stored.check_password("IXpass") and not stored.check_password("I\u0007X pass")
    # a SCRAM exchange: the client types its name and password in another form; the broker looks the
    # prepared name up
    looked_up: list[str] = []

    def lookup(name: str) -> StoredCredential | None:
        looked_up.append(name)
        return stored if name == "IX" else None

    server = ScramServer(lookup, b"s" * 32)
    client = ScramClient("\u2168", "IX\u2000pass")
    server_first = server.first(client.first())
    client.verify(server.final(client.final(server_first)))
    assert looked_up == ["IX"]
    with pytest.raises(ScramError, match="control character"):
        ScramServer(lookup, b"s" * 32).first(b"n,,n=a\x07b,r=abc")
    with pytest.raises(ValueError, match="password: a control character"):
        ScramClient("user", "pass\u0007word")
    with pytest.raises(ValueError):
        StoredCredential.from_password("\u0221")  # unassigned: not stored


def _keys(salted: bytes) -> tuple[bytes, bytes]:
    import hashlib
    import hmac
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    return hashlib.sha256(client_key).digest(), hmac.digest(salted, b"Server Key", "sha256")
