"""The broker-wide budget of bytes held for partial frames ([server] max_partial_frame_bytes).

A frame costs memory from its first byte to its last; a peer that starts 8 MiB frames and never
finishes them (slowloris) would otherwise hold 8 MiB per connection for as long as it likes. Every
connection may hold `allowance` bytes of undecoded input for free: one read's worth, which is what a
connection sending small frames ever holds, so such connections never wait here. Beyond that, what a
connection holds is charged to the shared budget *before* it reads: the reader asks `grant_read()`
how much it may read, reads no more, and after decoding `settle()`s its charge down to what is still
partial. So the bytes held for partial frames never exceed `limit + allowance x connections`, and
when the budget is spent a connection in the middle of a large frame stops being read (it could not
process anything behind that frame anyway) until another connection's frame completes or ends, or its
own frame deadline ([server] frame_timeout) closes it.
"""

from __future__ import annotations

import trio

__all__ = ["PartialFrameBudget", "FrameBytes"]


class PartialFrameBudget:
    """Shared by all connections of a broker. `charged` never exceeds `limit`."""

    def __init__(self, limit: int, allowance: int):
        self.limit = limit
        self.allowance = allowance
        self.charged = 0
        self.peak = 0  # the most ever charged at once (for tests and diagnosis)
        self._freed: trio.Event | None = None  # exists while some connection waits

    def _charge(self, delta: int) -> None:
        self.charged += delta
        if delta < 0:
            if self._freed is not None:
                self._freed.set()
                self._freed = None
        elif self.charged > self.peak:
            self.peak = self.charged

    async def wait_freed(self) -> None:
        """Until some connection gives bytes back."""
        if self._freed is None:
            self._freed = trio.Event()
        await self._freed.wait()

    def connection(self) -> FrameBytes:
        return FrameBytes(self)


class FrameBytes:
    """One connection's share: what it has charged to the budget for the frame it is receiving."""

    def __init__(self, budget: PartialFrameBudget):
        self.budget = budget
        self.charged = 0

    def grant_read(self, held: int, want: int) -> int:
        """How many bytes (at most `want`) the connection holding `held` undecoded bytes may read now;
        0 when it must wait for the budget. What it may hold after that read is charged at once."""
        budget = self.budget
        if held + want <= budget.allowance and not self.charged:  # the common case: small frames
            return want
        may_hold = budget.allowance + self.charged + (budget.limit - budget.charged)
        size = min(want, may_hold - held)
        if size <= 0:
            return 0
        self.settle(held + size)
        return size

    def settle(self, held: int) -> None:
        """Charge exactly what `held` undecoded bytes take beyond the allowance (after a read was decoded)."""
        charge = max(0, held - self.budget.allowance)
        if charge != self.charged:
            self.budget._charge(charge - self.charged)
            self.charged = charge

    def release(self) -> None:
        """The connection is gone: give everything back."""
        self.settle(0)
