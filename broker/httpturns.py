"""The turn that heavy HTTP answers (admin API pages, GET /metrics) take on the broker's thread.

Such an answer is built in slices of about a millisecond (`build`), each taken under one fair lock that
every heavy answer of a broker shares, with a checkpoint between a slice and the next. So its
connections run after every slice, and however many heavy requests there are at once (up to the admin
port's max_connections), at most one slice of theirs runs per pass of trio's scheduler: they take turns
rather than each taking one every pass. Built in one go, a page of 1,000 queues of 250-character names
(917 KB of JSON, 20-40 ms of CPU) held the broker for all of that, and 20 clients looping on it raised a
bystander's median message latency from 0.7 ms to 110-650 ms (a tester).

trio's Lock is fair: a release hands it to the longest waiter, so the task that just took a slice waits
behind every other heavy request for its next one.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import TypeVar

import trio

__all__ = ["HttpTurns", "SLICE_SECONDS"]

SLICE_SECONDS = 0.001
"""The work a heavy answer does on the broker's thread between two checkpoints (a step of it takes well
under that, so a slice ends within about a millisecond past it)."""

T = TypeVar("T")


class HttpTurns:
    """One broker's turn for heavy HTTP work: the admin API and /metrics (on the admin port or its own)
    share one, made by the server; a bare app (tests, benchmarks) makes its own."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self.slices = 0
        """Slices taken so far (for tests)."""

    async def build(self, steps: Iterator[T], out: list[T], seconds: float | None = None) -> None:
        """Take `steps`' items into `out`, `seconds` (SLICE_SECONDS) of work at a time, each slice in this
        broker's turn and a checkpoint after each. An exception of a step is raised here, the turn released."""
        seconds = SLICE_SECONDS if seconds is None else seconds
        while True:
            async with self._lock:  # (its acquire yields too, even untaken: trio's Lock checkpoints)
                self.slices += 1
                more = take_slice(steps, out, seconds)
            if not more:
                return
            await trio.lowlevel.checkpoint()


def take_slice(steps: Iterator[T], out: list[T], seconds: float) -> bool:
    """Take steps' items into `out` for `seconds`; False once there are no more. The garbage collector is
    paused for the slice (nothing else runs meanwhile): the objects a step makes are acyclic and freed by
    their counts, and a collection started among them would be a full pass over the broker's heap."""
    until = time.perf_counter() + seconds
    collecting = gc.isenabled()
    gc.disable()
    try:
        for item in steps:
            out.append(item)
            if time.perf_counter() >= until:
                return True
        return False
    finally:
        if collecting:
            gc.enable()
