"""TLS on the client port (issue 15.2), with a CA made in the test (trustme): `flowbroker+tls://` in the SDK,
a certificate the client does not trust, mutual TLS whose certificate subject is the identity, PLAIN
allowed over TLS, and the plain port serving beside the TLS one."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

import flowbroker.client as fc
from flowbroker.broker.users import User, write_users
from flowbroker.protocol import ErrorCode
from flowbroker.protocol.scram import StoredCredential

LIMIT = 10.0


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_section(ca: trustme.CA, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    cert = ca.issue_cert("localhost")
    cert_file, key_file, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    ca.cert_pem.write_to_path(str(ca_file))
    return {"enabled": True, "port": 0, "cert_file": str(cert_file), "key_file": str(key_file),
            "ca_file": str(ca_file), **extra}


def client_context(ca: trustme.CA, common_name: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if common_name is not None:
        ca.issue_cert("client.example", common_name=common_name).configure_cert(context)
    return context


async def start(start_flowbroker: Any, ca: trustme.CA, tmp_path: Path, auth: dict[str, Any] | None = None,
                **tls: Any) -> Any:
    users = tmp_path / "users.json"
    write_users(users, {"alice": User("alice", StoredCredential.from_password("pw", 4096))})
    return await start_flowbroker(tls=tls_section(ca, tmp_path, **tls), udp={"enabled": False},
                                  auth={"users_file": str(users), "failed_login_delay": 0.1, **(auth or {})})


async def roundtrip(conn: fc.Connection, body: bytes) -> None:
    await conn.declare_queue("q")
    producer = conn.producer(routing_key="q")
    await producer.send(body, timeout=LIMIT)
    await producer.flush(timeout=LIMIT)
    async with conn.consumer("q") as consumer:
        message = await consumer.receive(timeout=LIMIT)
        assert message.body == body
        await message.ack()


async def test_the_sdk_publishes_and_consumes_over_tls_beside_the_plain_port(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, ca, tmp_path)
    url = f"flowbroker+tls://localhost:{broker.tls_port}"
    async with await fc.connect(url, ssl_context=client_context(ca), auth=("alice", "pw"), timeout=LIMIT) as conn:
        assert conn.welcome.identity == "alice"
        (session,) = broker.core.sessions.values()
        handler = broker.server.connections[session.conn_id]
        assert isinstance(handler.stream, trio.SSLStream) and not handler.io.direct
        await roundtrip(conn, b"x" * 100_000)
        async with await fc.connect(broker.url, timeout=LIMIT) as plain:  # the plain port, beside it
            await roundtrip(plain, b"plain")


async def test_plain_is_allowed_over_tls(start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, ca, tmp_path, auth={"loopback_user": ""})
    url = f"flowbroker+tls://localhost:{broker.tls_port}"
    creds = fc.Credentials("alice", "pw", "PLAIN")
    async with await fc.connect(url, ssl_context=client_context(ca), auth=creds, timeout=LIMIT) as conn:
        assert conn.welcome.identity == "alice"


async def test_a_broker_certificate_the_client_does_not_trust_fails_the_handshake(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, ca, tmp_path)
    other = trustme.CA()
    with pytest.raises(fc.HandshakeError, match="TLS handshake .* failed.*certificate verify failed"):
        await fc.connect(f"flowbroker+tls://localhost:{broker.tls_port}", ssl_context=client_context(other),
                         timeout=LIMIT)
    with pytest.raises(fc.HandshakeError, match="TLS handshake"):  # the name is checked too: the certificate is for localhost
        await fc.connect(f"flowbroker+tls://127.0.0.1:{broker.tls_port}", ssl_context=client_context(ca),
                         timeout=LIMIT)
    async with await fc.connect(f"flowbroker+tls://localhost:{broker.tls_port}", ssl_context=client_context(ca),
                                timeout=LIMIT) as conn:
        await roundtrip(conn, b"still served")


async def test_mutual_tls_makes_the_certificate_subject_the_identity(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, ca, tmp_path, auth={"loopback_user": ""}, verify_client="required")
    url = f"flowbroker+tls://localhost:{broker.tls_port}"
    async with await fc.connect(url, ssl_context=client_context(ca, "alice"), timeout=LIMIT) as conn:
        assert conn.welcome.identity == "alice"
        await roundtrip(conn, b"mtls")
    with pytest.raises(fc.HandshakeError):  # no client certificate: refused by TLS (or at the first read)
        async with await fc.connect(url, ssl_context=client_context(ca), timeout=LIMIT) as conn:
            await conn.declare_queue("never")
    stranger = trustme.CA()
    context = client_context(ca)
    stranger.issue_cert("client.example", common_name="mallory").configure_cert(context)
    with pytest.raises((fc.HandshakeError, fc.BrokerConnectionError)):
        async with await fc.connect(url, ssl_context=context, timeout=LIMIT) as conn:
            await conn.declare_queue("never")


async def test_with_optional_client_certificates_a_client_without_one_logs_in_with_a_password(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, ca, tmp_path, auth={"loopback_user": ""}, verify_client="optional")
    url = f"flowbroker+tls://localhost:{broker.tls_port}"
    async with await fc.connect(url, ssl_context=client_context(ca), auth=("alice", "pw"), timeout=LIMIT) as conn:
        assert conn.welcome.identity == "alice"
    with pytest.raises(fc.HandshakeError) as info:
        await fc.connect(url, ssl_context=client_context(ca), timeout=LIMIT)
    assert info.value.code is ErrorCode.UNAUTHORIZED


def test_tls_urls_parse() -> None:
    address = fc.parse_url("flowbroker+tls://broker.example")
    assert address.tls and address.port == 5671 and str(address) == "flowbroker+tls://broker.example:5671"
    assert not fc.parse_url("flowbroker://h").tls
    with pytest.raises(ValueError, match="scheme"):
        fc.parse_url("flowbrokers://h")


async def test_a_tls_connection_over_max_connections_is_closed_at_accept(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    write_users(users, {})
    broker = await start_flowbroker(tls=tls_section(ca, tmp_path), udp={"enabled": False},
                                    auth={"users_file": str(users)},
                                    server={"port": 0, "memory_quota": 1 << 30, "max_connections": 1})
    url = f"flowbroker+tls://localhost:{broker.tls_port}"
    async with await fc.connect(broker.url, timeout=LIMIT) as first:
        with pytest.raises(fc.HandshakeError):
            await fc.connect(url, ssl_context=client_context(ca), timeout=LIMIT)
        assert broker.server.refused == 1
        await roundtrip(first, b"the first is served")
    async with await fc.connect(url, ssl_context=client_context(ca), timeout=LIMIT) as conn:  # room again
        await roundtrip(conn, b"tls")


async def test_a_client_on_the_wrong_port_is_told_which_kind_of_port_it_reached(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, ca, tmp_path, auth={"loopback_user": ""})
    with pytest.raises(fc.HandshakeError, match=r"does not speak TLS.*\[tls\] port"):
        await fc.connect(f"flowbroker+tls://localhost:{broker.port}", ssl_context=client_context(ca), timeout=LIMIT)
    with pytest.raises(fc.HandshakeError, match=r"TLS port\? It needs a flowbroker\+tls:// URL"):
        await fc.connect(f"flowbroker://127.0.0.1:{broker.tls_port}", timeout=LIMIT)


async def test_a_refused_client_certificate_is_named_in_the_error(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, ca, tmp_path, auth={"loopback_user": ""}, verify_client="required")
    url = f"flowbroker+tls://localhost:{broker.tls_port}"
    with pytest.raises(fc.HandshakeError, match="client certificate") as refused:
        async with await fc.connect(url, ssl_context=client_context(ca), timeout=LIMIT) as conn:
            await conn.declare_queue("never")
    assert "failed: (" not in str(refused.value) and not str(refused.value).endswith("failed: ")


async def test_a_client_certificate_refused_with_a_reset_is_named_in_the_error_too(
        start_flowbroker: Any, ca: trustme.CA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS 1.3 refuses a client certificate after the handshake: with an alert (an SSLError, above) or, as a
    tester's CLI saw it, a reset: 'HandshakeError: ... [Errno 104] Connection reset by peer', no hint."""
    import trio

    import flowbroker.client.handshake as handshake

    async def reset(*args: Any, **kwargs: Any) -> Any:
        raise trio.BrokenResourceError("reset") from ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(handshake, "_await_welcome", reset)
    broker = await start(start_flowbroker, ca, tmp_path, auth={"loopback_user": ""}, verify_client="required")
    with pytest.raises(fc.HandshakeError, match="may require a client certificate"):
        await fc.connect(f"flowbroker+tls://localhost:{broker.tls_port}", ssl_context=client_context(ca), timeout=LIMIT)
