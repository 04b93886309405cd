"""A connection's timer sees a fault set on its session (an operator's close, DELETE /api/connections/ID)
within one tick, as docs/management.md promises ("within a second"); it slept its random phase and then a
whole tick before its first look, so a close could take up to two ticks (1.5 s measured, a tester)."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

import flowbroker.client as fb
from flowbroker.protocol import ErrorCode
from tests.serving import serving, url


async def test_an_operators_close_is_seen_within_one_tick(mock_clock: trio.testing.MockClock,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    mock_clock.autojump_threshold = 0.05  # virtual time jumps only while the real sockets are quiet
    monkeypatch.setattr(random, "random", lambda: 0.9)  # the timer's phase: 0.9 of its 1 s tick
    async with serving() as server:
        async with await fb.connect(url(server), timeout=30) as conn:
            (session,) = server.core.sessions.values()
            closed_at = trio.current_time()
            server.core.force_close(session.conn_id, "maintenance")
            with trio.fail_after(10):
                while not conn.is_closed:
                    await trio.sleep(0.01)
            took = trio.current_time() - closed_at
        assert isinstance(conn.close_error, fb.ConnectionClosed) and conn.close_error.code is ErrorCode.CONNECTION_FORCED
    assert took <= 1.0 + 0.1, took  # the tick is min(idle_timeout / 3, 1 s); before, 0.9 + 1 s
