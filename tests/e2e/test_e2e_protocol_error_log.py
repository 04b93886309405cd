"""Connections closed for a protocol error are not a WARNING each: one per error code per 10 s, the
others at DEBUG (a tester: a client that sent a HELLO and then an oversized length prefix, in a loop,
wrote 6,523 WARNING lines, 1 MB, in 10 s)."""

from __future__ import annotations

import logging
import re
import struct
from typing import Any

import pytest
import trio
from tests.e2e.test_e2e_faults import RawClient, closing_frames, raw_frame

from flowbroker.protocol import ErrorCode

CONNECTIONS = 20  # of each kind
BAD_FRAMES = {
    ErrorCode.FRAME_TOO_LARGE: struct.pack(">I", 0xFFFFFFF0),  # a length prefix over max_frame_size
    ErrorCode.MALFORMED_FRAME: raw_frame(b"\xc1" * 8),  # not msgpack (0xc1 is never used)
}


async def test_connections_closed_for_a_protocol_error_are_one_warning_per_kind(
        start_flowbroker: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="flowbroker")
    broker = await start_flowbroker()
    for code, data in BAD_FRAMES.items():
        for _ in range(CONNECTIONS):
            raw = await RawClient.connect(broker.port)
            await raw.send_raw(data)
            error, _close = closing_frames(await raw.frames_until_closed())
            assert error.code is code
            await raw.aclose()
    with trio.fail_after(10):  # every close logged (the broker logs it after closing the socket)
        while len(_closed(caplog, logging.DEBUG)) + len(_closed(caplog, logging.WARNING)) < 2 * CONNECTIONS:
            await trio.sleep(0.01)
    # the first of each kind, with the connection and its reason; the others at DEBUG (seen with -v)
    assert [code for code, _text in _closed(caplog, logging.WARNING)] == ["FRAME_TOO_LARGE", "MALFORMED_FRAME"]
    assert "exceeds max_frame_size" in _closed(caplog, logging.WARNING)[0][1]
    assert len(_closed(caplog, logging.DEBUG)) == 2 * (CONNECTIONS - 1)


CLOSED = re.compile(r"connection \d+ closed: (.+) \((\w+)\)")


def _closed(caplog: pytest.LogCaptureFixture, level: int) -> list[tuple[str, str]]:
    """(code, reason) of each "connection N closed" line at `level`."""
    return [(m[2], m[1]) for r in caplog.records
            if r.levelno == level and (m := CLOSED.fullmatch(r.getMessage())) is not None]
