"""POST /login's body, which anyone may send: a peer hanging up mid-body is not logged as a bug, and the
body is never held past its limit (docs/console.md)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from tests.console.test_console_auth import TOKEN, login

LOGIN_HEAD = b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


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
