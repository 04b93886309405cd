"""Sockets that end before their handshake (no HELLO in time) are not a line each at INFO: one line per
10 s with the count left out, each at DEBUG, and the minute's summary counts them (a tester: 10,000
silent sockets were 10,000 INFO lines, and the summary did not mention them)."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import trio

from flowbroker.broker import server as server_module

SOCKETS = 20
EARLY = re.compile(r"connections in the last 0\.2 s: 0 opened, 0 closed; 0 open now; "
                   r"(\d+) socket\(s\) ended before completing the handshake")


async def _silent_sockets(port: int, caplog: pytest.LogCaptureFixture) -> list[str]:
    streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(SOCKETS)]
    try:
        with trio.fail_after(10):  # every one timed out (handshake_timeout 0.2 s) and was summarised
            while sum(int(m[1]) for r in caplog.records if (m := EARLY.fullmatch(r.getMessage()))) < SOCKETS:
                await trio.sleep(0.05)
    finally:
        for stream in streams:
            await trio.aclose_forcefully(stream)
    return [r.getMessage() for r in caplog.records if "sent no HELLO" in r.getMessage()]


async def test_sockets_without_hello_are_rate_limited_at_info_and_summarised(
        start_flowbroker: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "CONNECTION_SUMMARY_SECONDS", 0.2)
    caplog.set_level(logging.INFO, logger="flowbroker")
    broker = await start_flowbroker(server={"handshake_timeout": 0.2})
    lines = await _silent_sockets(broker.port, caplog)
    assert len(lines) == 1, lines  # the first; the other 19 within 10 s are counted in the next one


async def test_sockets_without_hello_are_each_logged_at_debug(
        start_flowbroker: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "CONNECTION_SUMMARY_SECONDS", 0.2)
    caplog.set_level(logging.DEBUG, logger="flowbroker")
    broker = await start_flowbroker(server={"handshake_timeout": 0.2})
    lines = await _silent_sockets(broker.port, caplog)
    assert len(lines) == SOCKETS
