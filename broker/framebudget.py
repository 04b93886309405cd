"""The broker-wide budget of bytes held for partial frames ([server] max_partial_frame_bytes).

A frame costs memory from its first byte to its last; a peer that starts 8 MiB frames and never
finishes them (slowloris) would otherwise hold 8 MiB per connection for as long as it likes. Every
connection may hold `allowance` bytes of undecoded input for free: one read's worth, which is what a
connection sending small frames ever holds, so such connections never wait here. Beyond that, what a
connection holds is charged to the shared budget *before* it reads: the reader asks `grant_read()`
how much it may read, reads no more, and after decoding `settle()`s its charge down to what is still
partial. So the bytes held for partial frames never exceed `limit + allowance x connections`, and
when the budget is spent a connection starting a large frame is not read past its allowance (it could
not process anything behind that frame anyway) until another connection's frame completes or ends. A
large frame is charged whole before its bytes past the allowance are read, never piecemeal: partial
grants let connections that each held part of a frame all wait for the rest (`grant_read`).

And a frame that stalls does not keep the others waiting: ten connections that each sent all but the last
byte of an 8 MiB frame spent the 64 MiB budget, and a producer beside them whose TRANSFER frames are over
one read waited for their frame_timeout, 25 s (a tester). A connection that must wait first has the budget
`reclaim()` the stalled partial frame: one that has not grown by PROGRESS_BYTES for STALL_SECONDS (the
one stalled longest first; never a connection that is itself waiting for the budget) is cut, its
connection closed, and its bytes go back.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import trio

__all__ = ["PartialFrameBudget", "FrameBytes", "STALL_SECONDS", "PROGRESS_BYTES"]

STALL_SECONDS = 1.0
"""A partial frame that has not grown by PROGRESS_BYTES for this long, while another connection waits for
the budget, is cut: 256 KiB a second is a 2 Mbit/s link, far below what a client sending 8 MiB frames has."""
PROGRESS_BYTES = 256 * 1024


class PartialFrameBudget:
    """Shared by all connections of a broker. `charged` never exceeds `limit`."""

    def __init__(self, limit: int, allowance: int, clock: Callable[[], float] = trio.current_time):
        self.limit = limit
        self.allowance = allowance
        self.clock = clock
        self.charged = 0
        self.peak = 0  # the most ever charged at once (for tests and diagnosis)
        self.cuts = 0  # stalled partial frames cut (reclaim)
        self.holders: set[FrameBytes] = set()  # the connections charged now
        # Connections waiting to charge a frame, first come first served: woken together, whichever read
        # first took the freed bytes, and attackers reconnecting took them again and again ahead of an
        # honest producer until its frame_timeout (a tester, 150-200 of them). Those that have completed a
        # large frame before go first: an attacker that starts frames and never ends them, reconnecting
        # after each cut, never has, so an honest producer waits behind at most one of them, not each.
        self._proven: collections.OrderedDict[FrameBytes, None] = collections.OrderedDict()
        self._fresh: collections.OrderedDict[FrameBytes, None] = collections.OrderedDict()
        self._freed: trio.Event | None = None  # exists while some connection waits

    def _charge(self, delta: int) -> None:
        self.charged += delta
        if delta < 0:
            self._wake()
        elif self.charged > self.peak:
            self.peak = self.charged

    @property
    def queue(self) -> list[FrameBytes]:
        """The connections waiting to charge a frame, in the order they are served."""
        return [*self._proven, *self._fresh]

    def _first(self) -> FrameBytes | None:
        if self._proven:
            return next(iter(self._proven))
        return next(iter(self._fresh)) if self._fresh else None

    def _enqueue(self, frame_bytes: FrameBytes) -> None:
        if frame_bytes not in self._proven and frame_bytes not in self._fresh:
            (self._proven if frame_bytes.frames_done else self._fresh)[frame_bytes] = None

    def _dequeue(self, frame_bytes: FrameBytes) -> None:
        """Out of the queue, if it is in it (then the next may go now: it is woken)."""
        if self._proven.pop(frame_bytes, False) is not False or self._fresh.pop(frame_bytes, False) is not False:
            self._wake()

    def _wake(self) -> None:
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    async def wait_freed(self) -> None:
        """Until some connection gives bytes back."""
        if self._freed is None:
            self._freed = trio.Event()
        await self._freed.wait()

    def reclaim(self, waiter: FrameBytes) -> bool:
        """`waiter` must wait for the budget: cut the partial frame stalled longest, if one has stalled for
        STALL_SECONDS (see the module's docstring). True if one was cut (its bytes come back when its
        connection has closed). O(connections charged), once per STALL_SECONDS a waiter."""
        now = self.clock()
        stalled = [held for held in self.holders
                   if held is not waiter and held.cut is not None and now - held.progressed >= STALL_SECONDS
                   and held not in self._proven and held not in self._fresh]  # (a queued one waits: not at fault)
        if not stalled:
            return False
        frame = min(stalled, key=lambda held: held.progressed)
        cut, frame.cut = frame.cut, None
        assert cut is not None
        self.cuts += 1
        cut(now - frame.progressed)
        return True

    def connection(self, cut: Callable[[float], None] | None = None) -> FrameBytes:
        """A connection's share; `cut(seconds stalled)` closes that connection (None: never cut)."""
        return FrameBytes(self, cut)


class FrameBytes:
    """One connection's share: what it has charged to the budget for the frame it is receiving."""

    def __init__(self, budget: PartialFrameBudget, cut: Callable[[float], None] | None = None):
        self.budget = budget
        self.charged = 0
        self.cut = cut
        self.progressed = 0.0  # when what it holds last grew by PROGRESS_BYTES, or began to be charged
        self.frames_done = 0  # large frames charged whole that it completed (the queue serves these first)
        self._whole = False  # its charge is a large frame's, charged whole (grant_read)
        self._progress_mark = 0  # what it held then

    def grant_read(self, held: int, want: int, frame_end: int | None = None) -> int:
        """How many bytes (at most `want`) the connection holding `held` undecoded bytes may read now;
        0 when it must wait for the budget. `frame_end`: the size of the frame being received (its
        length prefix included; None before the prefix is in). A frame larger than the allowance is
        charged whole before its bytes past the allowance are read, or not at all: granted piecemeal, ten
        connections sending complete 8 MiB frames into a 16 MiB budget each got part of theirs, all
        waited for more, and none completed until frame_timeout (every such frame a deadlock). So a
        connection either holds its whole frame's charge, and waits only for its peer, or waits for the
        budget holding nothing beyond its allowance."""
        budget = self.budget
        allowance = budget.allowance
        frame_need = frame_end - allowance if frame_end is not None and frame_end > held else 0
        if held + want <= allowance and frame_need <= 0 and not self.charged:  # the common case: small frames
            return want
        if frame_need > self.charged:
            first = budget._first()
            if (first is not None and first is not self) or frame_need - self.charged > budget.limit - budget.charged:
                size = max(0, min(want, allowance + self.charged - held))  # only within what it has
                if not size:  # it must wait: in turn (queued only then, so the queue's first always waits
                    # for the budget, never for its peer, which could hold up everyone behind it)
                    budget._enqueue(self)
                return size
            if first is self:
                budget._dequeue(self)  # it was first: the next may go now, if there is room for it
            self._set_charge(frame_need, held)
            self._whole = True
        # The frame is charged (or its size is not in yet): the read, charging what passes the charge.
        size = min(want, allowance + self.charged + (budget.limit - budget.charged) - held)
        if size <= 0:
            return 0
        if held + size - allowance > self.charged:
            self._set_charge(held + size - allowance, held)
        return size

    def settle(self, held: int, frame_end: int | None = None) -> None:
        """Charge what `held` undecoded bytes take beyond the allowance, keeping the whole frame's charge
        while the frame being received (`frame_end`, as in `grant_read`) is not complete; after a read
        was decoded, or before the reader waits for the peer. Never more than is charged already but
        for `held` itself. Bytes really received, so progress counts here alone."""
        allowance = self.budget.allowance
        charge = held - allowance if held > allowance else 0
        if frame_end is not None and frame_end > held:
            charge = max(charge, min(self.charged, frame_end - allowance))
        self._set_charge(charge, held)
        if self.charged and (held >= self._progress_mark + PROGRESS_BYTES or held < self._progress_mark):
            self.progressed, self._progress_mark = self.budget.clock(), held

    def _set_charge(self, charge: int, held: int) -> None:
        if charge != self.charged:
            budget = self.budget
            if not self.charged:  # a frame begins to be charged
                budget.holders.add(self)
                self.progressed, self._progress_mark = budget.clock(), held
            elif not charge:
                budget.holders.discard(self)
                if self._whole:  # a large frame charged whole was decoded (or its connection is gone)
                    self._whole = False
                    self.frames_done += 1
            budget._charge(charge - self.charged)
            self.charged = charge

    def release(self) -> None:
        """The connection is gone: give everything back, and its place in the queue."""
        self.settle(0)
        self.cut = None
        self.budget._dequeue(self)
