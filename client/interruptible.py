"""A blocking call into the connection's trio thread that ends there when the caller stops waiting.

Why: `trio.from_thread.run` only waits for its call. When that wait ends by an exception of the calling
thread (Ctrl-C's KeyboardInterrupt, anything a signal handler raises), the call went on in the trio
thread: an interrupted `receive()` took the next message and handed it to nobody (with prefetch 1 the
consumer stalled for good), and a `send()` interrupted while it waited for credit sent its message
later, when the application believed it unsent and sent it again. Here the call runs in a cancel scope
that the calling thread cancels when its wait ends so, and the calling thread waits, at most
`CANCEL_WAIT` seconds, for the call to end: it has then happened in full or not at all, as far as trio's
cancellation allows. A call that completed before the cancel could land is handed to `undo` (a received
message goes back to the front of its consumer's buffer); one that cannot be undone (a message sent)
stays done.

The calling thread may be interrupted again while it cancels (Ctrl-C pressed twice, a signal every few
ms): a second interrupt that escaped before the cancel was scheduled left the call running, and a send
the caller believed unsent was sent later (a tester: 1 duplicate in 2,000 sends at a signal every 3 ms).
So the cancel is scheduled, and waited for, again until done, with the first wait's deadline, and the
first exception goes on; only the few bytecodes between one try and the next are unguarded (pure Python
has no gapless retry). The waits here never use `threading.Event` or `Thread.join`: both are Python code
over locks that an interrupt can leave wrong (`Ended`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import trio

__all__ = ["CANCEL_WAIT", "Ended", "run_interruptible"]

T = TypeVar("T")

CANCEL_WAIT = 1.0
"""How long an interrupted call waits for its trio side to end (a cancelled call ends at its next
checkpoint; only a shielded part, such as the final write of a close, takes longer)."""


class Ended:
    """A one-shot flag that one thread sets when something ends and others wait for, whose wait an exception
    in the waiting thread (Ctrl-C) may interrupt anywhere without harm. Why not `threading.Event`: its wait
    is Python code around a Condition, and an interrupt landing at the start of `Condition.__exit__` leaves
    the Event's lock held, so that `set()` in the other thread blocks for good (shown with a tracer raising
    there). Nor `Thread.join`: on CPython 3.11 one interrupted marks a running thread stopped (bpo-45274).
    Here a waiter reads a bool and acquires a plain lock (one C call); a waiter interrupted just after its
    acquire leaves the lock held, and the others then see the flag within a second."""

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """In the thread that ends, once (a second call does nothing)."""
        if not self._flag:
            self._flag = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """True once set, False after `timeout` seconds (None: no limit) if not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                break
            if self._lock.acquire(timeout=wait):
                self._lock.release()  # for the next waiter
        return self._flag


class _Abandoned(Exception):
    """Ends a call whose caller has stopped waiting: nobody reads it (the calling thread raised)."""


class _Call(Generic[T]):
    """One call's state, written in the trio thread only (the calling thread sets nothing but reads)."""

    def __init__(self, undo: Callable[[T], None] | None) -> None:
        self.undo = undo
        self.scope: trio.CancelScope | None = None
        self.abandoned = False
        self.result: tuple[T] | None = None
        """The call's return value, once it returned one."""
        self.undone = False
        self.error: BaseException | None = None
        """The call's own exception (not the cancel's), once it raised one."""
        self.ended = Ended()

    def abandon(self) -> None:
        """The caller stopped waiting: cancel the call, or, if it returned already, undo it. (Scheduled
        again if an interrupt landed while it was being scheduled: a second run changes nothing.)"""
        self.abandoned = True
        if self.scope is not None:
            self.scope.cancel()
        self.take_back()

    def take_back(self) -> None:
        """Undo the result, if the call returned one, at most once."""
        if self.result is not None and self.undo is not None and not self.undone:
            self.undone = True
            self.undo(self.result[0])


def run_interruptible(
    token: trio.lowlevel.TrioToken, call: Callable[[], Awaitable[T]], undo: Callable[[T], None] | None = None,
    restore: Callable[[BaseException], None] | None = None,
) -> T:
    """`trio.from_thread.run(call)`, cancelled when the calling thread's wait ends by an exception; `undo`
    (run in the trio thread) takes back the result of a call that returned before the cancel landed, and
    `restore` an exception the call raised that its caller, interrupted, never saw (a refusal `flush()`
    reports once: it was lost, and the retried flush returned normally, a tester)."""
    state: _Call[T] = _Call(undo)

    async def guarded() -> T:
        try:
            if state.abandoned:  # the caller gave up before the call began
                raise _Abandoned
            with trio.CancelScope() as scope:
                state.scope = scope
                try:
                    result = await call()
                except trio.Cancelled:
                    raise
                except BaseException as exc:  # the call's own: its caller may never see it
                    state.error = exc
                    raise
                state.result = (result,)
                if state.abandoned:  # cancelled too late: it returned all the same
                    state.take_back()
                return result
            raise _Abandoned  # only `abandon` cancels this scope
        finally:
            state.ended.set()

    try:
        return trio.from_thread.run(guarded, trio_token=token)
    except trio.RunFinishedError:
        raise
    except BaseException as raised:
        # Each step below may be interrupted again: it is then tried again (scheduling `abandon` twice
        # does no harm), within the first deadline, and this first exception goes on.
        deadline: float | None = None
        scheduled = False
        while True:
            try:
                if deadline is None:
                    deadline = time.monotonic() + CANCEL_WAIT
                if not scheduled:
                    if state.ended.is_set() and state.result is None:
                        break  # the call's own error: nothing to cancel or undo
                    try:
                        token.run_sync_soon(state.abandon)
                    except trio.RunFinishedError:  # the thread has ended, and the call with it
                        break
                    scheduled = True
                state.ended.wait(deadline - time.monotonic())
                break
            except BaseException:  # a further interrupt
                continue
        if restore is not None and state.error is not None and raised is not state.error:
            # run before any later call of this thread's (run_sync_soon keeps their order)
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(restore, state.error)
        raise
