"""Connections on the admin port that send a little and then nothing are closed by the broker within a
bounded time (docs/management.md "Conventions"): before, two kinds were held for good, and 1,500 of them
used up the broker's descriptors (a tester)."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import trio

from flowbroker.broker import admin

TOKEN = "test-admin-token-0123456789"


def _frame(ftype: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream_id) + payload


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")  # the preface, then an empty SETTINGS
LOGIN_NO_BODY = (b"POST /login HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 4000\r\n\r\n")


@pytest.fixture
async def broker(start_flowbroker: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    # short bounds for the test: the listener reads them when it starts serving
    monkeypatch.setattr(admin, "HTTP_READ_SECONDS", 1.0)
    monkeypatch.setattr(admin, "COMMIT_WAIT_SECONDS", 0.5)
    return await start_flowbroker(admin={"token": TOKEN},
                                  auth={"failed_login_delay": 0.01, "failed_login_max_delay": 0.01})


@pytest.mark.parametrize("sent", [LOGIN_NO_BODY, H2_PREFACE], ids=["login-headers-no-body", "h2c-preface"])
async def test_a_connection_that_sends_nothing_more_is_closed(broker: Any, sent: bytes) -> None:
    assert broker.server.admin.read_timeout() == 1.5  # HTTP_READ_SECONDS past the longest wait of an answer
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    await stream.send_all(sent)
    with trio.fail_after(20):  # closed after 2 s (1.5 rounded up); before, never
        while await stream.receive_some(65536):
            pass  # an HTTP/2 server's SETTINGS, GOAWAY
    await stream.aclose()


async def test_an_answer_that_waits_is_not_cut_by_the_read_timeout(broker: Any) -> None:
    """The bound is counted past the longest the broker makes an answer wait: a client waiting for its
    answer sends nothing either."""
    from starlette.routing import Route, request_response

    async def slow(request: Any) -> Any:
        await trio.sleep(1.2)  # over HTTP_READ_SECONDS, under the read timeout (1.5 s; 2 s as hypercorn takes it)
        return {"slow": True}

    route = next(r for r in broker.server.admin.app.app.routes if isinstance(r, Route) and r.path == "/api/broker")
    route.app = request_response(admin._json_endpoint(slow))
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    await stream.send_all(f"GET /api/broker HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    data = b""
    with trio.fail_after(20):
        while b'"slow"' not in data:
            chunk = await stream.receive_some(65536)
            assert chunk, f"closed before the answer: {data!r}"
            data += chunk
    assert data.startswith(b"HTTP/1.1 200")
    await stream.aclose()
