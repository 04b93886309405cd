"""Wrong port, clear words (issue 10.4): an HTTP client on the broker port is answered in HTTP with
where the admin API is; the SDK on the admin (HTTP) port says so instead of "frame of 1213486160
bytes exceeds max_frame_size"; the admin CLI's client on the broker port, on a port nobody listens on,
or on a peer that is not HTTP at all says what happened in one line. A well-behaved client beside
the wrong one loses nothing."""

from __future__ import annotations

import socket
from functools import partial
from typing import Any

import click
import pytest
import trio

import flowbroker.client as fb
from flowbroker.broker.adminclient import BROKER_PORT_ANSWER, AdminClient

LIMIT = 5.0
TOKEN = "test-admin-token-0123456789"


async def _http_get(port: int, request: bytes) -> bytes:
    """Send `request` to 127.0.0.1:port and read until the peer closes (within LIMIT)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    answer = b""
    with trio.fail_after(LIMIT):
        await stream.send_all(request)
        while data := await stream.receive_some(65536):
            answer += data
    await stream.aclose()
    return answer


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS"])
async def test_an_http_request_on_the_broker_port_is_answered_400_naming_the_admin_api(
        start_flowbroker: Any, method: str) -> None:
    broker = await start_flowbroker(admin={"token": TOKEN})
    async with await fb.connect(broker.url, timeout=LIMIT) as good:  # a client beside the wrong one
        await good.declare_queue("q")
        producer = good.producer(routing_key="q")
        await producer.send(b"before", timeout=LIMIT)
        answer = await _http_get(broker.port, f"{method} /api/queues HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"Connection: close" in head
        text = body.decode()
        assert text.startswith(BROKER_PORT_ANSWER)
        assert f"http://127.0.0.1:{broker.server.admin_port}/api/" in text and "flowbroker://" in text
        await producer.send(b"after", timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
        async with good.consumer("q") as consumer:
            got = [(await consumer.receive(timeout=LIMIT)).body for _ in range(2)]
    assert got == [b"before", b"after"]


async def test_without_the_admin_api_the_answer_says_it_is_off(start_flowbroker: Any) -> None:
    broker = await start_flowbroker()
    answer = await _http_get(broker.port, b"GET / HTTP/1.0\r\n\r\n")
    assert b"400 Bad Request" in answer and b"The admin (HTTP) API is off on this broker." in answer


async def test_the_sdk_on_the_admin_port_says_it_is_an_http_port(start_flowbroker: Any) -> None:
    broker = await start_flowbroker(admin={"token": TOKEN})
    with pytest.raises(fb.HandshakeError) as caught:
        await fb.connect(f"flowbroker://127.0.0.1:{broker.server.admin_port}", timeout=LIMIT)
    text = str(caught.value)
    assert "answered in HTTP" in text and "not the broker port" in text and "5680" in text
    assert "max_frame_size" not in text


def _admin_client(url: str, tmp_path: Any) -> AdminClient:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    return AdminClient(url, str(token_file), timeout=LIMIT)


async def test_the_admin_client_on_the_broker_port_says_so(start_flowbroker: Any, tmp_path: Any) -> None:
    broker = await start_flowbroker(admin={"token": TOKEN})
    client = _admin_client(f"http://127.0.0.1:{broker.port}", tmp_path)
    with pytest.raises(click.ClickException) as caught:
        await trio.to_thread.run_sync(client.request, "GET", "/api/queues")
    text = caught.value.message
    assert text.startswith(f"http://127.0.0.1:{broker.port} is the flowbroker broker port, not its admin API")
    assert f"http://127.0.0.1:{broker.server.admin_port}/api/" in text and "\n" not in text


async def test_the_admin_client_names_a_refused_connection_and_a_peer_that_is_not_http(tmp_path: Any) -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        client = _admin_client(f"http://127.0.0.1:{port}", tmp_path)
        with pytest.raises(click.ClickException) as caught:
            await trio.to_thread.run_sync(client.request, "GET", "/api/queues")
    assert caught.value.message.startswith(f"cannot reach the admin API at http://127.0.0.1:{port}: Connection refused")

    async def not_http(stream: trio.SocketStream) -> None:  # answers binary bytes, as an old broker did
        with trio.move_on_after(LIMIT):
            await stream.receive_some(65536)
            await stream.send_all(b"\x00\x00\x00\x10binary frame....")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(partial(trio.serve_tcp, not_http, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        client = _admin_client(f"http://127.0.0.1:{port}", tmp_path)
        with pytest.raises(click.ClickException) as caught:
            await trio.to_thread.run_sync(client.request, "GET", "/api/queues")
        nursery.cancel_scope.cancel()
    text = caught.value.message
    assert text.startswith(f"http://127.0.0.1:{port} did not answer in HTTP (BadStatusLine): it is not the admin API")
    assert "broker port" in text and "5681" in text
