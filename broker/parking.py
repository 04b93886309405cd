"""Messages that fan out, parked once while the memory alarm is on.

Under the memory alarm a flow-controlled producer's transfers are held: they stay enqueued, and their
completions (so its credit) wait for the alarm to clear. Credit bounds what a producer holds that way
once per message, but a message routed to K queues is held K times: a tester's 1-byte bodies to a fanout
of 600 queues took the broker to 7.6 times its bound's growth. Refusing such messages instead gave a
well-behaved producer 100,000 refusals (a producer within its credit is paced, never refused), so they are
*parked*: the first message of a TRANSFER that would fan out to more than one queue while the alarm is
on, and every later message of the same connection (so that each queue still gets a producer's messages
in the order it sent them), are kept as they arrived, one copy each, not routed, not completed. The
connection's writer routes them, in slices of fan-out as a large TRANSFER is (`core.FANOUT_BUDGET`), once
the alarm has cleared; if it comes on again meanwhile, what is left stays parked. What a connection has
parked is bounded by its credit, like any transfer not yet completed; a connection that closes with
messages parked never had them completed, so they are dropped with it, as the unrouted rest of a
TRANSFER is (its producer resends what it was not told was taken).

A UDP publication's session parks the same way; its data path's cycles route what it parked once the
alarm is off, and poll nothing new meanwhile: what follows waits in the term, inside the window, as it
does behind a closed grant (broker/udp/ingress.py `_poll`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowbroker.broker.core import RoutingRest

__all__ = ["ParkedTransfers"]


class ParkedTransfers:
    """One connection's parked transfers: received, not yet routed, in transfer-id order."""

    __slots__ = ("rests", "bytes", "messages", "total")

    def __init__(self) -> None:
        self.rests: deque[RoutingRest] = deque()
        self.bytes = 0  # charged sizes of the messages parked now
        self.messages = 0  # messages parked now
        self.total = 0  # messages ever parked (views)

    def __bool__(self) -> bool:
        return bool(self.rests)

    def add(self, rest: RoutingRest) -> None:
        """Park `rest` behind what is parked already (its ids follow theirs)."""
        if rest.sizes:
            self.rests.append(rest)
            self.bytes += sum(rest.sizes)
            self.messages += len(rest.sizes)
            self.total += len(rest.sizes)

    def first(self) -> RoutingRest:
        return self.rests[0]

    def routed(self, done: int) -> None:
        """The first `done` messages of the first rest were routed: drop them."""
        rest = self.rests[0]
        self.bytes -= sum(rest.sizes[:done])
        self.messages -= done
        if done >= len(rest.sizes):
            self.rests.popleft()
        else:
            self.rests[0] = rest._replace(tid=rest.tid + done, entries=rest.entries[done:], sizes=rest.sizes[done:])

    def clear(self) -> None:
        self.rests.clear()
        self.bytes = self.messages = 0
