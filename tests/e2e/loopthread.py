"""A client run on a trio loop of its own, in a thread, that a test can stop whole, as SIGSTOP stops a process.

The UDP pause tests (a consumer, a producer or the broker stopped past the transport's timeouts) need one
side's event loop to stop while the other's runs on: the client goes in a `LoopThread`, the broker stays
on the test's loop. `pause` runs `time.sleep` inside the client's loop, so none of its tasks run meanwhile
and its socket fills as a stopped process's would.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable
from types import ModuleType

import pytest
import trio

from flowbroker.transport.image import ImageTimers
from flowbroker.transport.publication import PublicationConfig
from flowbroker.transport.subscription import ReceiverConfig

__all__ = ["LoopThread", "scale_udp_timeouts"]


class LoopThread:
    """`main` run by `trio.run` in a daemon thread; what it raises is raised again by `join`."""

    def __init__(self, main: Callable[[], Awaitable[object]]) -> None:
        self._main = main
        self._failure: list[BaseException] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.resumed = threading.Event()  # set when a pause is over

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 (raised again by join)
            self._failure.append(exc)

    def start(self) -> None:
        self._thread.start()

    def mark(self) -> None:
        """Called by `main`, inside its loop: the point from which `pause` may stop it."""
        self._token = trio.lowlevel.current_trio_token()

    async def marked(self, timeout: float = 30) -> None:
        """Wait until `main` has called `mark`."""
        with trio.fail_after(timeout):
            while self._token is None:
                await trio.sleep(0.001)

    def _sleep_in_loop(self, seconds: float) -> None:
        assert self._token is not None, "pause before mark"
        trio.from_thread.run_sync(time.sleep, seconds, trio_token=self._token)  # the loop stops whole
        self.resumed.set()

    def pause_soon(self, seconds: float) -> None:
        """Stop the loop for `seconds` from another thread, without waiting (`resumed` is set after)."""
        threading.Thread(target=self._sleep_in_loop, args=(seconds,), daemon=True).start()

    async def pause(self, seconds: float) -> None:
        """Stop the loop for `seconds` and wait until it runs again."""
        await trio.to_thread.run_sync(self._sleep_in_loop, seconds)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def join(self, timeout: float = 60) -> None:
        """Wait for `main` to end (polling, so the test's loop, the broker's, runs); raise what it raised."""
        with trio.fail_after(timeout):
            while self._thread.is_alive():
                await trio.sleep(0.05)
        self._thread.join()
        if self._failure:
            raise self._failure[0]


def scale_udp_timeouts(monkeypatch: pytest.MonkeyPatch, sender: ModuleType, receiver: ModuleType, *,
                       receiver_timeout_ns: int, liveness_ns: int) -> None:
    """Scale down the timeouts a pause must outlast: the publications `sender` makes (its
    `PublicationConfig`: the receiver timeout) and the images `receiver` makes (its `ReceiverConfig`: the
    image liveness), so a pause of a few seconds is past both."""
    monkeypatch.setattr(sender, "PublicationConfig",
                        functools.partial(PublicationConfig, connection_timeout_ns=receiver_timeout_ns))
    monkeypatch.setattr(receiver, "ReceiverConfig",
                        functools.partial(ReceiverConfig, timers=ImageTimers(image_liveness_timeout_ns=liveness_ns)))
