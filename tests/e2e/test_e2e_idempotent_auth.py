"""Idempotent producers on authenticated connections (issues 13 and 15 together): a SCRAM user's producer
whose connection is cut reconnects, logs in again with a SCRAM exchange of its own (a new client nonce,
never the first HELLO's replayed), and the queue holds every message once, in order; the same through the
TLS port, where the reconnect opens TLS again with the connection's `ssl_context`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

import flowbroker.client as fc
import flowbroker.client.credentials as credentials
from flowbroker.broker.users import User, write_users
from flowbroker.protocol import ErrorCode
from flowbroker.protocol.scram import ScramClient, StoredCredential

from tests.e2e.test_e2e_idempotent import CuttableProxy, read_queue, send_with_cuts
from tests.e2e.test_e2e_tls import client_context, tls_section

COUNT = 2000
CUTS = {150: ("", 0.0), 900: ("answers", 0.05), 1500: ("both", 0.02)}


class RecordingScram(ScramClient):
    """The SDK's SCRAM client, recording each exchange's client-first message (its nonce)."""

    firsts: list[bytes] = []

    def first(self) -> bytes:
        data = super().first()
        RecordingScram.firsts.append(data)
        return data


@pytest.fixture
def scram_exchanges(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    RecordingScram.firsts = []
    monkeypatch.setattr(credentials, "ScramClient", RecordingScram)
    return RecordingScram.firsts


def users_file(tmp_path: Path) -> str:
    path = tmp_path / "users.json"
    write_users(path, {"alice": User("alice", StoredCredential.from_password("wonderland", 4096))})
    return str(path)


def check_fresh_logins(broker: Any, conn: fc.Connection, firsts: list[bytes]) -> None:
    """One SCRAM exchange per stream (the first and each reconnect), every client nonce new, every one a
    login the broker accepted as alice."""
    assert conn.reconnects >= 2
    assert len(firsts) >= conn.reconnects + 1
    nonces = [first.rpartition(b",r=")[2] for first in firsts]
    assert len(set(nonces)) == len(nonces)
    assert broker.server.authenticator.successes >= conn.reconnects + 1
    assert broker.server.authenticator.failures == 0


async def test_a_scram_users_idempotent_producer_reconnects_with_a_fresh_exchange_and_lands_each_message_once(
        start_flowbroker: Any, nursery: trio.Nursery, tmp_path: Path, scram_exchanges: list[bytes]) -> None:
    broker = await start_flowbroker(auth={"users_file": users_file(tmp_path), "failed_login_delay": 0.1},
                                    udp={"enabled": False})
    proxy = CuttableProxy(broker.port)
    port = await nursery.start(proxy.serve)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")
    conn = await send_with_cuts(f"flowbroker://127.0.0.1:{port}", proxy, COUNT, CUTS,
                                auth=("alice", "wonderland"))
    assert conn.welcome.identity == "alice"
    check_fresh_logins(broker, conn, scram_exchanges)
    assert await read_queue(broker.url, "q", COUNT) == [b"%d" % i for i in range(COUNT)]


async def test_over_tls_the_reconnect_keeps_the_ssl_context_and_logs_in_again(
        start_flowbroker: Any, nursery: trio.Nursery, tmp_path: Path, scram_exchanges: list[bytes]) -> None:
    ca = trustme.CA()
    broker = await start_flowbroker(tls=tls_section(ca, tmp_path), udp={"enabled": False},
                                    auth={"users_file": users_file(tmp_path), "failed_login_delay": 0.1})
    proxy = CuttableProxy(broker.tls_port)  # TLS passes through the proxy: the cut ends the TLS session
    port = await nursery.start(proxy.serve)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")
    conn = await send_with_cuts(f"flowbroker+tls://localhost:{port}", proxy, COUNT, CUTS,
                                auth=("alice", "wonderland"), ssl_context=client_context(ca))
    assert conn.welcome.identity == "alice"
    check_fresh_logins(broker, conn, scram_exchanges)
    assert await read_queue(broker.url, "q", COUNT) == [b"%d" % i for i in range(COUNT)]


async def test_a_reconnect_the_broker_refuses_stops_at_once_with_the_authentication_error(
        start_flowbroker: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    """The password changes while an idempotent producer's connection is up; the connection is cut. Its
    reconnect is refused (UNAUTHORIZED): it does not retry for reconnect_timeout (a silent hang with a
    wrong password), it closes with fc.AuthenticationError, which the application's next call raises."""
    users = users_file(tmp_path)
    broker = await start_flowbroker(auth={"users_file": users, "failed_login_delay": 0.05}, udp={"enabled": False})
    proxy = CuttableProxy(broker.port)
    port = await nursery.start(proxy.serve)
    async with await fc.connect(broker.url) as admin:
        await admin.declare_queue("q")
    conn = await fc.connect(f"flowbroker://127.0.0.1:{port}", auth=("alice", "wonderland"), timeout=5,
                            reconnect_timeout=600)
    with pytest.raises(fc.AuthenticationError) as info:
        async with conn:
            producer = conn.producer(routing_key="q", producer_id="p-auth", idempotent=True)
            await producer.send(b"0")
            await producer.flush(timeout=10)
            write_users(Path(users), {"alice": User("alice", StoredCredential.from_password("changed!", 4096))})
            proxy.cut()
            with trio.fail_after(60):  # far below reconnect_timeout: only a reconnect that gave up ends here
                while not conn.is_closed:
                    await trio.sleep(0.01)
            assert isinstance(conn.close_error, fc.AuthenticationError)
            assert conn.close_error.code is ErrorCode.UNAUTHORIZED
            await producer.send(b"1")
    assert info.value is conn.close_error
    assert proxy.accepted == 2 and broker.server.authenticator.failures == 1  # one attempt, no retries
