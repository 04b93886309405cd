"""SCRAM-SHA-256 (RFC 5802 with RFC 7677's hash), both ends, without I/O; and the stored credential.

Why our own: the exchange is three messages and four HMACs, the libraries that do it well (scramp) bring
a dependency for what is 150 lines here, and the RFC's test vector checks these lines
(tests/protocol/test_scram.py). The broker keeps only `StoredKey` and `ServerKey` (never the password
nor the salted password), so a leaked users file does not let anyone log in, only attempt a dictionary
attack against 4096 (or more) PBKDF2 iterations per guess.

User names and passwords are prepared with SASLprep (RFC 4013, protocol/saslprep.py) on both sides, as
RFC 5802 asks: the client before it salts the password and sends the name, the broker before it looks
the name up, and `StoredCredential.from_password` before it hashes (printable ASCII is unchanged, so
credentials stored before SASLprep stay valid). Channel binding (`p=`) is refused: TLS already binds
the server by its certificate, and a client asking for binding fails loudly.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Callable

from flowbroker.protocol.saslprep import SaslprepError, saslprep

__all__ = [
    "MECHANISM",
    "DEFAULT_ITERATIONS",
    "ScramError",
    "StoredCredential",
    "ScramServer",
    "ScramClient",
    "salted_password",
]

MECHANISM = "SCRAM-SHA-256"
DEFAULT_ITERATIONS = 4096  # RFC 7677's minimum
MAX_ITERATIONS = 10_000_000  # a stored credential above this is refused (a typo, or a denial of service)
MAX_MESSAGE = 1024  # bytes of one client message: user names and nonces are short


class ScramError(ValueError):
    """The exchange failed: a malformed message, an unknown user or a wrong proof. The text is for logs;
    a client is told only that authentication failed (no hint whether the user exists)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ScramError(f"not base64: {text[:32]!r}") from None


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.digest(key, msg, "sha256")


def salted_password(password: str, salt: bytes, iterations: int) -> bytes:
    """Hi(password, salt, i): PBKDF2-HMAC-SHA-256, the slow step (a few ms at 4096 iterations)."""
    return hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)


@dataclass(frozen=True, slots=True)
class StoredCredential:
    """What the broker stores per user: RFC 5802's salt, iteration count, StoredKey and ServerKey.

    Written as PostgreSQL does: `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>` (base64)."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    @classmethod
    def from_password(cls, password: str, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> StoredCredential:
        """SaslprepError (a ValueError) when the password cannot be prepared (a control character, say)."""
        salt = secrets.token_bytes(16) if salt is None else salt
        salted = salted_password(saslprep(password, stored=True, what="password"), salt, iterations)
        client_key = _hmac(salted, b"Client Key")
        return cls(salt, iterations, hashlib.sha256(client_key).digest(), _hmac(salted, b"Server Key"))

    def encode(self) -> str:
        return (f"{MECHANISM}${self.iterations}:{_b64(self.salt)}"
                f"${_b64(self.stored_key)}:{_b64(self.server_key)}")

    @classmethod
    def decode(cls, text: str) -> StoredCredential:
        """ValueError naming what is wrong (never echoing the keys)."""
        try:
            mechanism, params, keys = text.split("$")
            iterations_text, salt_text = params.split(":")
            stored_text, server_text = keys.split(":")
            iterations = int(iterations_text)
            salt, stored, server = _unb64(salt_text), _unb64(stored_text), _unb64(server_text)
        except (ValueError, AttributeError):
            raise ValueError(f"not a {MECHANISM}$<iterations>:<salt>$<StoredKey>:<ServerKey> hash") from None
        if mechanism != MECHANISM:
            raise ValueError(f"mechanism {mechanism!r} is not {MECHANISM}")
        if not 1 <= iterations <= MAX_ITERATIONS or len(stored) != 32 or len(server) != 32 or not salt:
            raise ValueError("iterations out of range, or keys that are not 32 bytes")
        return cls(salt, iterations, stored, server)

    def check_password(self, password: str) -> bool:
        """For PLAIN: derive the client key from `password` (SASLprepped; False when it cannot be) and
        compare its hash with StoredKey."""
        try:
            password = saslprep(password, what="password")
        except SaslprepError:
            return False
        salted = salted_password(password, self.salt, self.iterations)
        return hmac.compare_digest(hashlib.sha256(_hmac(salted, b"Client Key")).digest(), self.stored_key)


def _attributes(message: str, expected: str) -> dict[str, str]:
    """`a=1,b=2` as a dict, checking that the keys are `expected` in that order (extensions refused)."""
    out: dict[str, str] = {}
    for part in message.split(","):
        key, sep, value = part.partition("=")
        if not sep or len(key) != 1:
            raise ScramError(f"malformed attribute {part[:32]!r}")
        out[key] = value
    if "".join(out) != expected or len(out) != len(message.split(",")):
        raise ScramError(f"expected attributes {','.join(expected)}, got {','.join(out)[:32]}")
    return out


def _client_first(data: bytes) -> tuple[str, str, str]:
    """A client-first message's GS2 flag, authorization identity and bare part."""
    gs2, sep1, rest = _decode_message(data).partition(",")
    authzid, sep2, bare = rest.partition(",")
    if not sep1 or not sep2:
        raise ScramError("client-first lacks its GS2 header")
    return gs2, authzid, bare


def claimed_username(data: bytes) -> str | None:
    """The user name a client-first message names (`n=`), unchecked and not SASLprepped, at most 255
    characters; None when it is not a client-first message. For a log line about an attempt whose
    credentials are not looked at (a throttled login)."""
    try:
        return _unescape_name(_attributes(_client_first(data)[2], "nr")["n"])[:255]
    except ScramError:
        return None


def _decode_message(data: bytes) -> str:
    if len(data) > MAX_MESSAGE:
        raise ScramError(f"message of {len(data)} bytes (at most {MAX_MESSAGE})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ScramError("message is not UTF-8") from None
    if not text.isprintable():
        raise ScramError("message has control characters")
    return text


def _unescape_name(name: str) -> str:
    if not name:
        raise ScramError("empty user name")
    rest = name.replace("=2C", "").replace("=3D", "")
    if "=" in rest or "," in rest:
        raise ScramError("badly escaped user name")
    return name.replace("=2C", ",").replace("=3D", "=")


def _escape_name(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


def _nonce() -> str:
    return secrets.token_urlsafe(18)  # printable, no ","


class ScramServer:
    """One exchange, broker side: `first(client-first)` gives server-first, `final(client-final)` gives
    server-final or raises ScramError. `lookup(user)` returns the user's credential or None; an unknown
    user gets a made-up salt (stable per name, from `secret`) so that the answer does not tell which
    names exist, and fails at `final` like a wrong password."""

    def __init__(self, lookup: Callable[[str], StoredCredential | None], secret: bytes, nonce: str | None = None,
                 fake_iterations: int = DEFAULT_ITERATIONS):
        self._lookup = lookup
        self._secret = secret
        # an unknown user's iteration count: the broker gives its users' most common, so that a made-up
        # answer looks like most real ones (at 4096 always, a user made with more told that it existed, a tester)
        self._fake_iterations = fake_iterations
        self._server_nonce = nonce or _nonce()
        self.username: str | None = None
        self._credential: StoredCredential | None = None
        self._expected_nonce = ""
        self._auth_prefix = ""  # client-first-bare "," server-first
        self._done = False

    def first(self, data: bytes) -> bytes:
        gs2, authzid, bare = _client_first(data)
        if gs2.startswith("p"):
            raise ScramError("channel binding is not supported (send n,, as the GS2 header)")
        if gs2 not in ("n", "y"):
            raise ScramError(f"GS2 flag {gs2[:8]!r} is not n or y")
        if authzid:
            raise ScramError("an authorization identity (a=) is not supported")
        attrs = _attributes(bare, "nr")
        try:
            self.username = saslprep(_unescape_name(attrs["n"]), what="user name")
        except SaslprepError as exc:
            raise ScramError(str(exc)) from None
        client_nonce = attrs["r"]
        if not client_nonce or not client_nonce.isascii():  # RFC 5802: printable ASCII, no ","
            raise ScramError("the client nonce must be printable ASCII")
        credential = self._lookup(self.username)
        if credential is None:
            fake_salt = _hmac(self._secret, self.username.encode("utf-8"))[:16]
            self._credential = None
            salt, iterations = fake_salt, self._fake_iterations
        else:
            self._credential = credential
            salt, iterations = credential.salt, credential.iterations
        self._expected_nonce = client_nonce + self._server_nonce
        server_first = f"r={self._expected_nonce},s={_b64(salt)},i={iterations}"
        self._auth_prefix = f"{bare},{server_first}"
        self._gs2_header = f"{gs2},{authzid},"
        return server_first.encode("ascii")

    def final(self, data: bytes) -> bytes:
        if not self._auth_prefix or self._done:
            raise ScramError("client-final out of order")
        self._done = True
        text = _decode_message(data)
        without_proof, sep, proof_part = text.rpartition(",p=")
        if not sep:
            raise ScramError("client-final lacks its proof")
        attrs = _attributes(without_proof, "cr")
        if _unb64(attrs["c"]) != self._gs2_header.encode("utf-8"):
            raise ScramError("channel binding data does not match the GS2 header")
        if not hmac.compare_digest(attrs["r"].encode(), self._expected_nonce.encode()):
            raise ScramError("nonce does not match this exchange's (a replayed or altered message)")
        proof = _unb64(proof_part)
        credential = self._credential
        if credential is None:
            raise ScramError(f"unknown user {self.username!r}")
        auth_message = f"{self._auth_prefix},{without_proof}".encode("utf-8")
        signature = _hmac(credential.stored_key, auth_message)
        if len(proof) != len(signature):
            raise ScramError("proof has the wrong length")
        client_key = bytes(a ^ b for a, b in zip(proof, signature))
        if not hmac.compare_digest(hashlib.sha256(client_key).digest(), credential.stored_key):
            raise ScramError("wrong password")
        return f"v={_b64(_hmac(credential.server_key, auth_message))}".encode("ascii")


class ScramClient:
    """One exchange, client side: `first()`, `final(server-first)`, then `verify(server-final)`, which
    raises ScramError unless the server proved it knows the credential (mutual authentication)."""

    def __init__(self, username: str, password: str, nonce: str | None = None):
        """SaslprepError (a ValueError) when the name or the password cannot be prepared."""
        username = saslprep(username, what="user name")
        self._bare = f"n={_escape_name(username)},r={nonce or _nonce()}"
        self._nonce = self._bare.rpartition(",r=")[2]
        self._password = saslprep(password, what="password")
        self._server_signature = b""

    def first(self) -> bytes:
        return f"n,,{self._bare}".encode("utf-8")

    def final(self, data: bytes) -> bytes:
        text = _decode_message(data)
        attrs = _attributes(text, "rsi")
        if not attrs["r"].startswith(self._nonce) or attrs["r"] == self._nonce:
            raise ScramError("the server's nonce does not extend ours")
        try:
            iterations = int(attrs["i"])
        except ValueError:
            raise ScramError("iteration count is not a number") from None
        if not 1 <= iterations <= MAX_ITERATIONS:
            raise ScramError(f"iteration count {iterations} out of range")
        salted = salted_password(self._password, _unb64(attrs["s"]), iterations)
        without_proof = f"c={_b64(b'n,,')},r={attrs['r']}"
        auth_message = f"{self._bare},{text},{without_proof}".encode("utf-8")
        client_key = _hmac(salted, b"Client Key")
        signature = _hmac(hashlib.sha256(client_key).digest(), auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature))
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth_message)
        return f"{without_proof},p={_b64(proof)}".encode("ascii")

    def verify(self, data: bytes) -> None:
        text = _decode_message(data)
        if text.startswith("e="):
            raise ScramError(f"the server refused: {text[2:]}")
        attrs = _attributes(text, "v")
        if not self._server_signature or not hmac.compare_digest(_unb64(attrs["v"]), self._server_signature):
            raise ScramError("the server's signature is wrong: it does not know this user's credential")

