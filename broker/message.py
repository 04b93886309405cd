"""Messages inside the broker, and the pending-completion counter that makes watermarks a brake.

A transfer routed to N queues becomes N `Message`s sharing one body: the per-queue state (the
queue's `offset`, `redelivered`, `held`) lives on each, so a message has its own offset in every
queue it was routed to and no body is copied. The producer's `producer_id` and `sequence` (from the
TRANSFER entry) are the same on each: with the offset they are the identity a journal and an
idempotent producer use (broker/store.py). When some of those queues are saturated the transfer is *held*: a
`HeldTransfer` counts the saturated destinations still holding it, and the producer's transfer
completes (returning its credit) only when the count reaches zero (Qpid's ingress completion).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from flowbroker.protocol.frames import Headers

if TYPE_CHECKING:
    from flowbroker.broker.session import Session

__all__ = ["Message", "HeldTransfer", "release_all"]


class HeldTransfer:
    """A transfer whose completion waits for `pending` holders (saturated queues, an admin stop)."""

    __slots__ = ("session", "transfer_id", "size", "pending")

    def __init__(self, session: Session, transfer_id: int, size: int, pending: int):
        self.session = session
        self.transfer_id = transfer_id
        self.size = size
        self.pending = pending
        session.transfers_held_now += 1

    def release(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.session.transfers_held_now -= 1
            self.session.complete_transfer(self.transfer_id, self.size)


class Message:
    """One message in one queue. `held` is set while this queue holds the producer's completion."""

    __slots__ = (
        "exchange",
        "routing_key",
        "body",
        "headers",
        "size",
        "producer_id",
        "sequence",
        "redelivered",
        "held",
        "offset",
    )

    def __init__(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        headers: Headers | None,
        size: int,
        producer_id: str | None = None,
        sequence: int | None = None,
    ):
        self.exchange = exchange
        self.routing_key = routing_key
        self.body = body
        self.headers = headers
        self.size = size
        self.producer_id = producer_id
        self.sequence = sequence
        self.redelivered = False
        self.held: HeldTransfer | None = None
        self.offset = -1  # given by its queue's store at append: unique, monotonic; a requeue keeps it

    def release(self) -> None:
        """This queue no longer holds the producer's completion (dequeued, queue cleared, purged, deleted)."""
        held = self.held
        if held is not None:
            self.held = None
            held.release()


def release_all(msgs: Iterable[Message]) -> None:
    """`Message.release` for each of `msgs`, in order, with the completions batched: consecutive
    transfer ids of one session that complete here complete in one call (`Session.complete_transfers`).
    A saturated queue that clears releases every transfer it held at once (ten producers' windows, 10,000
    of them), and one release at a time took three calls and a wake-up each."""
    session: Session | None = None
    first = end = size = 0
    for msg in msgs:
        transfer = msg.held
        if transfer is None:
            continue
        msg.held = None
        transfer.pending -= 1
        if transfer.pending:
            continue
        owner = transfer.session
        owner.transfers_held_now -= 1
        tid = transfer.transfer_id
        if owner is session and tid == end:
            end += 1
            size += transfer.size
            continue
        if session is not None:
            session.complete_transfers(first, end - first, size)
        session, first, end, size = owner, tid, tid + 1, transfer.size
    if session is not None:
        session.complete_transfers(first, end - first, size)
