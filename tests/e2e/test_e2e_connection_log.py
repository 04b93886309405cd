"""Connections open and close at DEBUG, and INFO gets one summary line per period (issue 10.5): a busy
broker's log is not a line per connection."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import trio

import flowbroker.client as fb
from flowbroker.broker import server as server_module


async def test_connections_are_summarised_at_info_and_each_is_logged_at_debug(
        start_flowbroker: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "CONNECTION_SUMMARY_SECONDS", 0.2)
    caplog.set_level(logging.DEBUG, logger="flowbroker")
    broker = await start_flowbroker()
    for i in range(3):
        async with await fb.connect(broker.url, client_name=f"c{i}"):
            pass
    async with await fb.connect(broker.url, client_name="kept"):
        with trio.fail_after(5):  # the periods may split them (a busy machine): add the summaries up
            while summed(caplog)[:2] != (4, 3):
                await trio.sleep(0.05)
        # read while "kept" is still open: once it closes, the broker may log that before the asserts run
        info = [r.getMessage() for r in caplog.records
                if r.levelno == logging.INFO and r.getMessage().startswith("connection")]
        debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
        last_open = summed(caplog)[2]
    assert info and all(SUMMARY.fullmatch(m) for m in info)
    assert last_open == 1  # the last summary: "kept" is open
    assert sum(m.startswith("connection ") and " from 127.0.0.1:" in m for m in debug) == 4
    assert sum(m.startswith("connection ") and " closed: " in m for m in debug) == 3


SUMMARY = re.compile(r"connections in the last 0\.2 s: (\d+) opened, (\d+) closed; (\d+) open now")


def summed(caplog: pytest.LogCaptureFixture) -> tuple[int, int, int]:
    """Opened and closed over every summary so far, and the last one's open count."""
    opened = closed = now = 0
    for record in caplog.records:
        if (match := SUMMARY.fullmatch(record.getMessage())) is not None:
            opened, closed, now = opened + int(match[1]), closed + int(match[2]), int(match[3])
    return opened, closed, now
