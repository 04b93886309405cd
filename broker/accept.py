"""Accepting TCP connections: the descriptor limit, backoff when out of descriptors, quiet logs.

trio.serve_listeners retries a failed accept every 100 ms and logs each failure, so a broker out of
descriptors printed EMFILE ten times a second while new clients waited. Here the broker raises its
soft descriptor limit to the hard limit at start (and says what it got), backs off exponentially
(10 ms to 1 s) while accept() fails, and logs such failures at most once per LOG_INTERVAL seconds
with the count of those it did not print. Counting and refusing connections over max_connections is
the caller's `admit` (broker/server.py, broker/httpserve.py), called for every accepted socket: the
broker port's and the HTTP listeners' (admin API, /metrics) alike.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import NoReturn

import trio

from flowbroker.broker.logsafe import LOG_INTERVAL, RateLimitedLog

__all__ = ["raise_descriptor_limit", "RateLimitedLog", "accept_forever"]

LOGGER = logging.getLogger("flowbroker.broker.accept")
ACCEPT_BATCH = 64  # sockets accepted in one turn of the accept loop, those already waiting (accept_forever)
BACKOFF_MIN = 0.01
BACKOFF_MAX = 1.0
NR_OPEN_DEFAULT = 1 << 20  # Linux's fs.nr_open default: the most a soft limit can be when the hard one is unlimited


def raise_descriptor_limit() -> tuple[int, int] | None:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; return (soft, hard) in force, None if the
    platform has no such limit. Each connection costs one descriptor."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NR_OPEN_DEFAULT if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        LOGGER.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


async def accept_forever(listener: trio.SocketListener, admit: Callable[[trio.SocketStream], None]) -> NoReturn:
    """Accept on `listener` until cancelled, handing each socket to `admit` (which must not block).

    Up to ACCEPT_BATCH sockets already waiting are taken in one turn (a non-blocking accept() after the
    awaited one): one a turn, a broker whose scheduler passes took 50-100 ms under load (busy producers,
    hundreds of connections) accepted 10-20 sockets a second, and with a client opening a hundred a
    second new connections waited in the backlog for their WELCOME 4-5 s and more (a tester: 10 s
    timeouts), while open connections were served within milliseconds."""
    backoff = BACKOFF_MIN
    log_failure = RateLimitedLog(LOGGER, logging.ERROR)
    # (a duplicate of the listening socket's descriptor: it shares its O_NONBLOCK; none for a stand-in)
    waiting = (socket.socket(fileno=os.dup(listener.socket.fileno())) if isinstance(listener, trio.SocketListener)
               else None)
    if waiting is not None:
        waiting.setblocking(False)  # (so it is already; said, so that accept() never waits)
    try:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                # Out of descriptors or memory: nothing to do but wait for connections to close. Anything
                # else is as unexpected, and retrying (slowly) beats ending the broker.
                log_failure("accept failed: %s; retrying with backoff up to %.0f s", exc, BACKOFF_MAX)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_MIN
            _admit(admit, stream)
            for _ in range(ACCEPT_BATCH - 1 if waiting is not None else 0):
                assert waiting is not None
                try:
                    sock, _address = waiting.accept()
                except OSError:  # none waiting (BlockingIOError), or a failure the awaited accept reports
                    break
                _admit(admit, trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
    finally:
        if waiting is not None:
            waiting.close()


def _admit(admit: Callable[[trio.SocketStream], None], stream: trio.SocketStream) -> None:
    try:
        admit(stream)
    except Exception as exc:  # a bug in admitting one socket must not stop the broker accepting
        LOGGER.error("admitting a connection failed; closed it", exc_info=exc)
        stream.socket.close()
