"""The one clock of the trio shells: trio's clock in nanoseconds, the ``now_ns`` every sans-IO core takes.

Why trio's clock and not ``time.monotonic_ns``: under ``trio.testing.MockClock`` it is virtual, so tests of
timers (SETUP, heartbeats, status messages, buffer acks) are deterministic. The broker and the SDK use the
same function for their own cores.
"""

from __future__ import annotations

import trio

__all__ = ["now_ns"]


def now_ns() -> int:
    """trio's clock in nanoseconds (virtual under MockClock); call it only inside ``trio.run``."""
    return int(trio.current_time() * 1_000_000_000)
