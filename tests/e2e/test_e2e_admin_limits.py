"""The admin port costs bounded memory whatever unauthenticated clients send (docs/management.md,
"Conventions"): at most [admin] max_connections connections are served at once, one more is answered 503,
and a connection whose request is refused (431, 400) ends at once. Before, hypercorn accepted without
limit and kept each refused connection, with what it had read, for its 5 s keep-alive timeout: 1 MB
heads sent as fast as a client could grew the broker some 60 KB a request (a tester, session 36)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flowbroker.client as fb

TOKEN = "test-admin-token-0123456789"

BIG_HEAD = b"GET /api/broker HTTP/1.1\r\nHost: localhost\r\n" + b"X-Pad: " + b"a" * 100_000 + b"\r\n\r\n"


async def _ask(port: int, request: bytes) -> bytes:
    """Send `request` and read the answer's first bytes (those the server sent before it closed)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(10):
        try:
            await stream.send_all(request)
        except trio.BrokenResourceError:
            pass  # refused before it read all of it: the answer is already on its way
        data = b""
        try:
            while chunk := await stream.receive_some(65536):
                data += chunk
                if b"\r\n\r\n" in data and data.startswith((b"HTTP/1.1 4", b"HTTP/1.1 5")):
                    break
        except trio.BrokenResourceError:
            pass  # a reset after the answer
    await stream.aclose()
    return data


def _get(token: str = TOKEN) -> bytes:
    return f"GET /api/broker HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n".encode()


@pytest.fixture
async def broker(start_flowbroker: Any) -> Any:
    return await start_flowbroker(admin={"token": TOKEN, "max_connections": 4})


async def test_a_socket_over_max_connections_is_answered_503_and_one_freed_serves_again(broker: Any) -> None:
    port = broker.server.admin_port
    held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(4)]
    http = broker.server.admin.http
    with trio.fail_after(5):
        while http.open < 4:
            await trio.sleep(0.01)
    answer = await _ask(port, _get())
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"max_connections" in answer and b"retry-after: 1" in answer.lower()
    assert http.refused == 1
    await held.pop().aclose()
    with trio.fail_after(5):
        while http.open > 3:
            await trio.sleep(0.01)
    answer = await _ask(port, _get())
    assert answer.startswith(b"HTTP/1.1 200"), answer
    for stream in held:
        await stream.aclose()


async def test_refused_requests_end_their_connections_at_once(broker: Any) -> None:
    """Twenty 100 KB heads in a row, each answered 431: none is held for the keep-alive timeout, so all
    twenty fit under max_connections 4, and the API answers right after."""
    port = broker.server.admin_port
    for _ in range(20):
        answer = await _ask(port, BIG_HEAD)
        assert answer.startswith(b"HTTP/1.1 431"), answer
        with trio.fail_after(1):  # hypercorn's keep-alive timeout is 5 s
            while broker.server.admin.http.open:
                await trio.sleep(0.01)
    assert broker.server.admin.http.refused == 0
    answer = await _ask(port, b"\x16\x03\x01garbage\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert (await _ask(port, _get())).startswith(b"HTTP/1.1 200")


async def test_a_head_over_16_kib_is_refused_431_when_it_comes_whole_in_one_write(broker: Any) -> None:
    """h11 bounds only a head it has not seen the end of: 17-65 KB heads sent in one write were answered
    200 (a tester). One under the bound is still served."""
    port = broker.server.admin_port

    def padded_to(size: int) -> bytes:
        head = _get()
        return head[:-2] + b"X-Pad: " + b"a" * (size - len(head) - len(b"X-Pad: \r\n")) + b"\r\n\r\n"

    assert len(padded_to(20_000)) == 20_000
    answer = await _ask(port, padded_to(20_000))
    assert answer.startswith(b"HTTP/1.1 431"), answer
    with trio.fail_after(1):  # ended at once, as a refused head's connection is
        while broker.server.admin.http.open:
            await trio.sleep(0.01)
    answer = await _ask(port, padded_to(16_384))
    assert answer.startswith(b"HTTP/1.1 200"), answer


async def test_an_attacker_filling_the_admin_port_changes_nothing_on_the_broker_port(broker: Any) -> None:
    """The admin port full and refusing (50 more sockets each answered 503 at once) while a producer and
    a consumer on the broker port carry on."""
    port = broker.server.admin_port
    held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(4)]
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("q")
        async with trio.open_nursery() as nursery:

            async def attack() -> None:
                for _ in range(50):
                    sock = trio.socket.socket()
                    await sock.connect(("127.0.0.1", port))
                    try:
                        await sock.send(BIG_HEAD[:65536])
                    except OSError:
                        pass  # refused before it took all of it
                    sock.close()

            nursery.start_soon(attack)
            producer = conn.producer(routing_key="q")
            for i in range(200):
                await producer.send(b"%d" % i)
            await producer.flush(timeout=10)
        got = []
        async with conn.consumer("q", prefetch=50) as consumer:
            for _ in range(200):
                msg = await consumer.receive(timeout=10)
                got.append(msg.body)
                await msg.ack()
    assert got == [b"%d" % i for i in range(200)]
    with trio.fail_after(5):
        while broker.server.admin.http.refused < 50:
            await trio.sleep(0.01)
    for stream in held:
        await stream.aclose()


async def test_connections_that_pipeline_and_never_read_give_their_places_back_when_they_go(broker: Any) -> None:
    """Pipelined GET /metrics left unread: hypercorn's reader waited, with no deadline, for an answer that
    could no longer be written, so each such connection kept its max_connections place after its client
    had gone, and 64 of them kept the admin port at 503 until a restart (a tester)."""
    port = broker.server.admin_port
    http = broker.server.admin.http
    request = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n" * 50
    socks = []
    for _ in range(4):
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", port))
        await sock.send(request)
        socks.append(sock)
    with trio.fail_after(10):
        while http.open < 4:
            await trio.sleep(0.01)
    await trio.sleep(0.5)  # the answers fill the sockets; none is read
    for sock in socks:
        sock.close()
    with trio.fail_after(15):
        while http.open:
            await trio.sleep(0.05)
    answer = await _ask(port, _get())
    assert answer.startswith(b"HTTP/1.1 200"), answer


async def _send_and_close(broker: Any, request: bytes, connections: int) -> None:
    """Open `connections` to the admin port, send `request` on each, and once the port counts them all
    open, close them (the answers unread)."""
    socks = []
    for _ in range(connections):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", broker.server.admin_port))
        await sock.send(request)
        socks.append(sock)
    with trio.fail_after(10):
        while broker.server.admin.http.open < connections:
            await trio.sleep(0.01)
    for sock in socks:
        sock.close()


async def test_connections_closed_while_a_pipelined_request_waits_give_their_places_back_at_once(
        broker: Any) -> None:
    """Two pipelined requests, and the client gone before their answers: the answer whose write found it
    gone made hypercorn ready the connection for a next request and start its keep-alive timer, so each
    such connection kept its place for 5 s with nothing open, and one process doing this at full speed
    kept the admin port at 503 for everyone (a tester). Here the answers wait until the clients have
    closed, then each connection ends with them."""
    from starlette.routing import Route, request_response

    from flowbroker.broker import admin

    clients_gone = trio.Event()

    async def answered_once_the_clients_are_gone(request: Any) -> Any:
        await clients_gone.wait()
        return {"answered": True}

    route = next(r for r in broker.server.admin.app.app.routes if isinstance(r, Route) and r.path == "/api/broker")
    route.app = request_response(admin._json_endpoint(answered_once_the_clients_are_gone))
    port = broker.server.admin_port
    http = broker.server.admin.http
    request = f"GET /api/broker HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    await _send_and_close(broker, request * 2, 4)
    clients_gone.set()
    with trio.fail_after(2):  # hypercorn's keep-alive timeout is 5 s
        while http.open:
            await trio.sleep(0.01)
    answer = await _ask(port, _get())  # (answered at once: the clients are gone)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert http.refused == 0


async def test_connections_closed_in_the_middle_of_a_request_body_give_their_places_back_at_once(
        broker: Any) -> None:
    """A PUT whose body never came whole, the client gone: the answer's close (aad5f1e) cut its reading
    before the request was told of the close, and the request waited for the rest of its body until the
    admin API's own 10 s deadline: 64 such connections, each closed at once, held the port at 503 for 10 s
    (a tester, 4 of 4)."""
    port = broker.server.admin_port
    http = broker.server.admin.http
    request = (f"PUT /api/policy HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\n"
               "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
    await _send_and_close(broker, request, 4)
    with trio.fail_after(2):  # the body's deadline is 10 s
        while http.open:
            await trio.sleep(0.01)
    answer = await _ask(port, _get())
    assert answer.startswith(b"HTTP/1.1 200"), answer


async def test_the_cli_tries_again_while_the_admin_port_is_full_and_says_so_when_it_stays_full(
        broker: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The port's 503 comes before the request is read: the CLI's client sends it again after Retry-After,
    for up to BUSY_RETRY_SECONDS. `flowbroker top` ended at the first 503 (a tester); a `queues` that
    waited printed nothing for 30 s (another): it says so on stderr, once."""
    import click

    from flowbroker.broker import adminclient
    from flowbroker.broker.adminclient import AdminClient

    monkeypatch.setattr(adminclient, "BUSY_RETRY_SECONDS", 2.5)
    port = broker.server.admin_port
    http = broker.server.admin.http
    held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(4)]
    with trio.fail_after(5):
        while http.open < 4:
            await trio.sleep(0.01)
    monkeypatch.setenv("FLOWBROKER_ADMIN_TOKEN", TOKEN)
    client = AdminClient(f"http://127.0.0.1:{port}", None)
    with pytest.raises(click.ClickException) as full:  # never freed within the 2.5 s
        await trio.to_thread.run_sync(client.request, "GET", "/api/broker")
    assert "max_connections" in full.value.message and "tried for 2.5 s" in full.value.message
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "max_connections" in said[0] and said[0].endswith("trying again for up to 2.5 s")
    refused = http.refused
    assert refused >= 2

    async def free_one_later() -> None:
        await trio.sleep(1.2)
        await held.pop().aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(free_one_later)
        answer = await trio.to_thread.run_sync(client.request, "GET", "/api/broker")
    assert "connections" in answer and http.refused > refused
    for stream in held:
        await stream.aclose()


async def test_a_loopback_admin_port_refuses_requests_for_another_host_name(broker: Any) -> None:
    """DNS rebinding: a page on evil.test whose name was pointed at 127.0.0.1 read all of /metrics as its own
    origin (a tester, with Chromium). The browser sends that name in Host: a loopback port refuses it 421."""
    port = broker.server.admin_port
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: evil.test:%d\r\nConnection: close\r\n\r\n" % port)
    refused = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            refused += chunk
    await stream.aclose()
    assert refused.startswith(b"HTTP/1.1 421"), refused[:200]
    assert b"host_not_allowed" in refused and b"DNS rebinding" in refused
    async def head(request: bytes) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(request)
        data = b""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
                data += chunk
        await stream.aclose()
        return data

    for host in (b"localhost:%d" % port, b"127.0.0.1:%d" % port, b"[::1]:%d" % port, b"app.localhost"):
        answer = await head(b"GET /metrics HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), (host, answer[:200])
    old = await head(b"GET /metrics HTTP/1.0\r\n\r\n")  # no Host at all: an HTTP/1.0 tool
    assert old.startswith(b"HTTP/1.1 200"), old[:200]


def test_loopback_host_names() -> None:
    from flowbroker.broker.hostcheck import _host_name, is_loopback_host

    assert [_host_name(h) for h in (b"[::1]:5681", b"localhost:5681", b"127.0.0.1", b"::1")] == [
        "::1", "localhost", "127.0.0.1", "::1"]
    assert all(is_loopback_host(h) for h in ("localhost", "LOCALHOST.", "a.localhost", "127.0.0.1", "127.8.9.1",
                                             "::1", "[::1]"))
    assert not any(is_loopback_host(h) for h in ("evil.test", "10.0.0.1", "0.0.0.0", "localhost.evil.test", ""))
