"""Producer flow state as part of the API: which destinations are stopped, since when, and why.

Why this module exists: clients that ignore or lose "blocked/unblocked" notifications are the second
most common flow-control complaint (AMQP-CPP #443, SimpleAmqpClient #164). Here the state is kept by
the SDK from FLOW_STOPPED / FLOW_RESUMED frames and is always readable as a snapshot
(`FlowState`); events are a convenience on top. A watcher that falls behind loses its *oldest* events,
never the newest, and every event carries the full set of stopped destinations, so a slow watcher still
ends up with the true state.

Flow stops are informational: what paces a producer is credit (the byte buffer and the window of
uncompleted transfers); a saturated queue withholds completions, which withholds credit. The stopped
destinations are what `FlowControlTimeout` names.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

import trio

from flowbroker.protocol import FlowStopped
from flowbroker.protocol.names import ALL_DESTINATIONS

__all__ = ["FlowStop", "FlowEvent", "FlowState", "FlowEvents", "FlowTracker", "ALL_DESTINATIONS"]

"""The destination of an administrative stop-all."""


@dataclass(frozen=True, slots=True)
class FlowStop:
    """One stopped destination: the threshold that tripped, its limit, the queue's figure, and since when
    (`since` on trio's clock, `since_wall` as a UNIX time for logs)."""

    destination: str
    threshold: str
    limit: int
    value: int
    reason: str
    since: float
    since_wall: float


@dataclass(frozen=True, slots=True)
class FlowEvent:
    """A transition. For "resumed", `stop` is the stop that ended and `at - stop.since` its duration.
    `stopped` is the set of destinations stopped *after* this event."""

    kind: Literal["stopped", "resumed"]
    destination: str
    stop: FlowStop | None
    at: float
    stopped: frozenset[str]


@dataclass(frozen=True, slots=True)
class FlowState:
    """A snapshot of the connection's flow state and its counters (transitions, time spent stopped)."""

    stopped: Mapping[str, FlowStop]
    stop_count: int = 0
    resume_count: int = 0
    stopped_seconds: float = 0.0
    """Total time during which at least one destination was stopped, up to the snapshot."""

    @property
    def is_stopped(self) -> bool:
        return bool(self.stopped)

    @property
    def destinations(self) -> tuple[str, ...]:
        return tuple(sorted(self.stopped))


class FlowEvents:
    """An async iterator of `FlowEvent`s; also an async context manager that unregisters it.

    Bounded: holds at most `max_buffered` events, discarding the oldest (counted in `dropped`).
    Iteration ends when the connection closes.
    """

    def __init__(self, tracker: FlowTracker, max_buffered: int):
        if max_buffered < 1:
            raise ValueError("max_buffered must be >= 1")
        self._tracker = tracker
        self._events: collections.deque[FlowEvent] = collections.deque(maxlen=max_buffered)
        self._lot = trio.lowlevel.ParkingLot()
        self._closed = False
        self.dropped = 0

    def _push(self, event: FlowEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)
        self._lot.unpark_all()

    def _close(self) -> None:
        self._closed = True
        self._lot.unpark_all()

    def get_nowait(self) -> FlowEvent | None:
        return self._events.popleft() if self._events else None

    async def get(self) -> FlowEvent | None:
        """The next event, or None once the connection (or this watcher) is closed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._events:
            if self._closed:
                return None
            await self._lot.park()
        return self._events.popleft()

    def aclose_nowait(self) -> None:
        self._tracker._watchers.discard(self)
        self._close()

    def __aiter__(self) -> FlowEvents:
        return self

    async def __anext__(self) -> FlowEvent:
        event = await self.get()
        if event is None:
            raise StopAsyncIteration
        return event

    async def __aenter__(self) -> FlowEvents:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.aclose_nowait()


@dataclass
class FlowTracker:
    """The connection's flow state, fed by the reader task. Internal."""

    stopped: dict[str, FlowStop] = field(default_factory=dict)
    stop_count: int = 0
    resume_count: int = 0
    _stopped_accum: float = 0.0
    _any_stopped_since: float | None = None
    _watchers: set[FlowEvents] = field(default_factory=set)

    def on_stopped(self, frame: FlowStopped, now: float) -> None:
        known = self.stopped.get(frame.destination)
        stop = FlowStop(
            frame.destination,
            frame.threshold,
            frame.limit,
            frame.value,
            frame.reason,
            known.since if known else now,
            known.since_wall if known else time.time(),
        )
        self.stopped[frame.destination] = stop
        if known is not None:
            return  # a repeated stop refreshes the facts but is not a transition
        self.stop_count += 1
        if self._any_stopped_since is None:
            self._any_stopped_since = now
        self._emit(FlowEvent("stopped", frame.destination, stop, now, frozenset(self.stopped)))

    def on_resumed(self, destination: str, now: float) -> None:
        stop = self.stopped.pop(destination, None)
        if stop is None:
            return  # idempotent: a duplicated or stale resume changes nothing
        self.resume_count += 1
        if not self.stopped and self._any_stopped_since is not None:
            self._stopped_accum += now - self._any_stopped_since
            self._any_stopped_since = None
        self._emit(FlowEvent("resumed", destination, stop, now, frozenset(self.stopped)))

    def snapshot(self, now: float) -> FlowState:
        extra = now - self._any_stopped_since if self._any_stopped_since is not None else 0.0
        return FlowState(dict(self.stopped), self.stop_count, self.resume_count, self._stopped_accum + extra)

    def watch(self, max_buffered: int) -> FlowEvents:
        watcher = FlowEvents(self, max_buffered)
        self._watchers.add(watcher)
        return watcher

    def close(self) -> None:
        for watcher in list(self._watchers):
            watcher._close()
        self._watchers.clear()

    def _emit(self, event: FlowEvent) -> None:
        for watcher in self._watchers:
            watcher._push(event)
