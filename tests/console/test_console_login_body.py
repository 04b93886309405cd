"""POST /login's body, which anyone may send: a peer hanging up mid-body is not logged as a bug, and the
body is never held past its limit (docs/console.md)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from tests.console.test_console_auth import TOKEN, login

LOGIN_HEAD = b"POST /login HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


@pytest.fixture
async def broker(start_flowbroker: Any) -> Any:
    return await start_flowbroker(admin={"token": TOKEN})


async def test_a_peer_hanging_up_mid_body_logs_no_traceback(broker: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Each hang-up logged a 43-line ERROR "Error in ASGI Framework" (starlette's ClientDisconnect), with no
    rate limit: 200 of them wrote 8,600 lines (a tester)."""
    caplog.set_level(logging.DEBUG)
    for _ in range(5):
        stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
        await stream.send_all(LOGIN_HEAD + b"Content-Length: 100\r\n\r\n{")
        await trio.sleep(0.2)  # the endpoint is reading the body now
        await stream.aclose()
    await trio.sleep(0.5)
    assert "Traceback" not in caplog.text and "Error in ASGI" not in caplog.text, caplog.text[:2000]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    await login(broker)  # and the console still logs in


async def _answer(stream: trio.SocketStream) -> tuple[int, dict[str, str], bytes, bool]:
    from tests.e2e.test_e2e_admin import _http_response

    return await _http_response(stream)


async def test_a_login_body_announced_over_the_limit_is_refused_at_once(broker: Any) -> None:
    """A 300 MiB body was read whole before the 4,096-byte check (RSS 46 -> 588 MiB), and a Content-Length of
    70,000 with no body got no answer at all (a tester)."""
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    await stream.send_all(LOGIN_HEAD + b"Content-Length: %d\r\n\r\n" % (10 << 20))  # and none of it
    with trio.fail_after(5):
        status, headers, body, closed = await _answer(stream)
    assert status == 413 and b'"too_large"' in body and b"4096 bytes" in body
    assert headers["connection"] == "close" and closed
    await stream.aclose()


async def test_a_chunked_login_body_is_read_no_further_than_the_limit(broker: Any) -> None:
    got: list[int] = []  # the body bytes the console's app was handed
    auth = broker.server.admin.app  # BearerAuth around the Starlette app
    inner = auth.app

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        async def counted() -> Any:
            message = await receive()
            got.append(len(message.get("body", b"")))
            return message
        await inner(scope, counted, send)

    auth.app = counting
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    await stream.send_all(LOGIN_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    await stream.send_all((b"400\r\n" + b" " * 1024 + b"\r\n") * 8)  # 8 KiB in 1 KiB chunks, never the last
    with trio.fail_after(5):
        status, headers, body, closed = await _answer(stream)
    assert status == 413 and closed
    assert 4096 < sum(got) <= 4096 + 1024, got  # read up to the limit's first step past it, and no further
    await stream.aclose()


async def test_a_login_body_nested_thousands_deep_is_a_400_not_a_500_with_a_traceback(
    broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """json.loads of `{"token": [[[[...` 3,000 deep raises RecursionError: uncaught, each such request (from
    anyone: /login is public) was a 500 and a 48-line traceback, 22 MB of log in 10 s (a tester)."""
    caplog.set_level(logging.DEBUG)
    body = b'{"token": ' + b"[" * 3000
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    await stream.send_all(LOGIN_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    with trio.fail_after(5):
        status, _, answer, _ = await _answer(stream)
    assert status == 400 and b'"invalid_json"' in answer
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    await stream.aclose()


async def test_a_login_body_that_trickles_is_cut_at_the_body_deadline(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte every few seconds never let the read timeout pass: an unauthenticated client held POST /login
    connections for good, 1,100 of them every descriptor of a broker (a tester). The whole body must be in
    within BODY_SECONDS: 408, and the connection closes."""
    from flowbroker.broker import console

    monkeypatch.setattr(console, "BODY_SECONDS", 1.0)
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    await stream.send_all(LOGIN_HEAD + b"Content-Length: 100\r\n\r\n{")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def trickle() -> None:
                for _ in range(20):
                    await trio.sleep(0.3)
                    try:
                        await stream.send_all(b" ")
                    except trio.BrokenResourceError:
                        return

            nursery.start_soon(trickle)
            status, headers, answer, closed = await _answer(stream)
            nursery.cancel_scope.cancel()
    assert status == 408 and b'"request_timeout"' in answer and headers["connection"] == "close" and closed
    await stream.aclose()
    await login(broker)


async def test_the_login_media_type_is_compared_without_case(broker: Any) -> None:
    """Media types are case-insensitive (RFC 9110): "APPLICATION/JSON" was refused 415 (a tester). A
    cross-site form still cannot send it (its types are form-urlencoded, multipart and text/plain)."""
    body = b'{"token": "%s"}' % TOKEN.encode()
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    head = LOGIN_HEAD.replace(b"application/json", b"APPLICATION/JSON; charset=UTF-8")
    await stream.send_all(head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with trio.fail_after(5):
        status, _, answer, _ = await _answer(stream)
    assert status == 200, answer
    await stream.aclose()
