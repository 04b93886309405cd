"""The admin API's and /metrics' listeners (hypercorn: trio.serve_listeners) out of descriptors log as the
broker port does, at most once per 10 s with a count (a tester: an ERROR with a traceback every 100 ms,
345 lines in 6 s, beside the broker port's one line per 10 s)."""

from __future__ import annotations

import errno
import logging
import re

import pytest
import trio
import trio.testing

from flowbroker.broker import accept


class OutOfDescriptors(trio.abc.Listener[trio.abc.Stream]):
    """A listener whose every accept() fails with EMFILE, counting them."""

    def __init__(self) -> None:
        self.attempts = 0

    async def accept(self) -> trio.abc.Stream:
        self.attempts += 1
        await trio.sleep(0)
        raise OSError(errno.EMFILE, "Too many open files")

    async def aclose(self) -> None:
        pass


async def _never(stream: trio.abc.Stream) -> None:
    raise AssertionError("nothing is accepted")


async def test_http_listener_accept_failures_are_logged_once_per_10_s_without_traceback(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = getattr(accept, "SERVE_LISTENERS_LOG", None)  # (absent before the fix: the test still runs)
    if installed is not None:  # a fresh one, on the test's virtual time
        monkeypatch.setattr(installed, "clock", trio.current_time)
        monkeypatch.setattr(installed, "_last", -float("inf"))
        monkeypatch.setattr(installed, "suppressed", 0)
    caplog.set_level(logging.INFO)
    listener = OutOfDescriptors()
    with trio.move_on_after(35):  # 350 failures, one each 100 ms
        await trio.serve_listeners(_never, [listener])
    assert listener.attempts >= 340
    lines = [r for r in caplog.records if r.name == "trio.serve_listeners"]
    assert len(lines) == 4, [r.getMessage() for r in lines]  # at 0, 10, 20 and 30 s
    assert all(r.exc_info is None and r.exc_text is None for r in lines)
    first, later = lines[0].getMessage(), lines[1].getMessage()
    assert first.startswith("HTTP listener (admin API, /metrics): accept returned EMFILE (Too many open files)")
    assert re.search(r" \(and (99|100) more like it in the last 10 s\)$", later), later
    assert "Traceback" not in caplog.text
