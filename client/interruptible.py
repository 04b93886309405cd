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
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import trio

__all__ = ["CANCEL_WAIT", "run_interruptible"]

T = TypeVar("T")

CANCEL_WAIT = 1.0
"""How long an interrupted call waits for its trio side to end (a cancelled call ends at its next
checkpoint; only a shielded part, such as the final write of a close, takes longer)."""


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
        self.ended = threading.Event()

    def abandon(self) -> None:
        """The caller stopped waiting: cancel the call, or, if it returned already, undo it."""
        self.abandoned = True
        if self.scope is not None:
            self.scope.cancel()
        if self.result is not None and self.undo is not None:
            self.undo(self.result[0])


def run_interruptible(
    token: trio.lowlevel.TrioToken, call: Callable[[], Awaitable[T]], undo: Callable[[T], None] | None = None
) -> T:
    """`trio.from_thread.run(call)`, cancelled when the calling thread's wait ends by an exception; `undo`
    (run in the trio thread) takes back the result of a call that returned before the cancel landed."""
    state: _Call[T] = _Call(undo)

    async def guarded() -> T:
        try:
            if state.abandoned:  # the caller gave up before the call began
                raise _Abandoned
            with trio.CancelScope() as scope:
                state.scope = scope
                result = await call()
                state.result = (result,)
                if state.abandoned and undo is not None:  # cancelled too late: it returned all the same
                    undo(result)
                return result
            raise _Abandoned  # only `abandon` cancels this scope
        finally:
            state.ended.set()

    try:
        return trio.from_thread.run(guarded, trio_token=token)
    except trio.RunFinishedError:
        raise
    except BaseException:
        if state.ended.is_set() and state.result is None:  # the call's own error: nothing to cancel or undo
            raise
        try:
            token.run_sync_soon(state.abandon)
        except trio.RunFinishedError:  # the thread has ended, and the call with it
            pass
        else:
            state.ended.wait(CANCEL_WAIT)
        raise
