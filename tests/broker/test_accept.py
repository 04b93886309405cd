"""The accept loop: backoff while accept() fails (out of descriptors), a quiet log, the descriptor limit."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys

import pytest
import trio
import trio.testing

from flowbroker.broker.accept import BACKOFF_MAX, BACKOFF_MIN, RateLimitedLog, accept_forever


class OutOfDescriptors:
    """A listener whose accept() fails with EMFILE `failures` times, then accepts one socket."""

    def __init__(self, failures: int):
        self.failures = failures
        self.attempts: list[float] = []

    async def accept(self) -> str:
        self.attempts.append(trio.current_time())
        if len(self.attempts) <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        if len(self.attempts) == self.failures + 1:
            return "socket"
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_accept_backs_off_while_out_of_descriptors_and_logs_rarely(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    listener = OutOfDescriptors(failures=40)
    admitted: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_forever, listener, admitted.append)  # type: ignore[arg-type]
        while not admitted:
            await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    assert admitted == ["socket"]
    tried = listener.attempts[: listener.failures + 1]  # the failures and the accept that worked
    gaps = [b - a for a, b in zip(tried, tried[1:])]
    assert gaps[0] == pytest.approx(BACKOFF_MIN)
    assert all(b >= a - 1e-6 for a, b in zip(gaps, gaps[1:])), gaps
    assert max(gaps) == pytest.approx(BACKOFF_MAX)
    failed = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    elapsed = tried[-1] - tried[0]  # about 34 s of failures
    assert 2 <= len(failed) <= elapsed // 10 + 1  # not one per failure: one per 10 s
    assert "Too many open files" in failed[0] and "more like it" in failed[-1]


def test_rate_limited_log_counts_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("test.ratelimit"), logging.WARNING, interval=10.0, clock=lambda: now[0])
    for second in range(25):
        now[0] = float(second)
        log("refused %s", second)
    assert [r.getMessage() for r in caplog.records] == [
        "refused 0",
        "refused 10 (and 9 more like it in the last 10 s)",
        "refused 20 (and 9 more like it in the last 10 s)",
    ]


def test_the_descriptor_soft_limit_is_raised_to_the_hard_limit() -> None:
    """In a child process, whose soft limit is first lowered to 64."""
    code = (
        "import resource\n"
        "from flowbroker.broker.accept import NR_OPEN_DEFAULT, raise_descriptor_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "expected = NR_OPEN_DEFAULT if hard == resource.RLIM_INFINITY else hard\n"
        "assert raise_descriptor_limit() == (expected, hard), (raise_descriptor_limit(), hard)\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == expected\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


async def test_sockets_already_waiting_are_accepted_in_one_turn() -> None:
    """One accept a turn: a loaded broker (scheduler passes of 50-100 ms) took 10-20 sockets a second, and
    new connections waited seconds in the backlog for WELCOME (a tester: 4-5 s, some past 10 s). A task
    that counts scheduler turns beside the accept loop sees all ten admitted in one turn."""
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    listener = trio.SocketListener(sock)
    port = sock.getsockname()[1]
    clients = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(10)]
    turns = [0]
    admitted_at: list[int] = []
    admitted: list[trio.SocketStream] = []

    def admit(stream: trio.SocketStream) -> None:
        admitted.append(stream)
        admitted_at.append(turns[0])

    async def count_turns() -> None:
        while True:
            turns[0] += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(count_turns)
        nursery.start_soon(accept_forever, listener, admit)
        with trio.fail_after(5):
            while len(admitted) < 10:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert len(set(admitted_at)) == 1, admitted_at  # one accept a turn before: ten turns
    for stream in admitted + clients:
        await stream.aclose()
    await listener.aclose()
