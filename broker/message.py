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

__all__ = ["Message", "HeldTransfer", "SessionRef", "SequenceKey", "release_all"]


SequenceKey = tuple[str, int]
"""An idempotent producer's message: (its producer id as the broker keys it, its sequence)."""


class SessionRef:
    """What a held transfer keeps of its producer's session: the session while its connection is open,
    None after (`BrokerCore.close_session`), when a completion has nowhere to go. A held message can
    outlive its connection by as long as its queue keeps it; holding the Session itself kept the whole
    connection with it (its handler, socket objects, buffers: about 6 KB a message charged 512, a
    tester's 36,000 one-message connections grew the broker 220 MiB)."""

    __slots__ = ("session", "ids_taken")

    def __init__(self, session: Session):
        self.session: Session | None = session
        self.ids_taken = 0  # idempotent producer ids it took up (broker/idempotence.py, `Holder`)


class HeldTransfer:
    """A transfer whose completion waits for `pending` holders (saturated queues, an admin stop).

    An idempotent producer's held transfer is also found by its `sequence_key` in `registry` while it is
    pending: its session's `held_sequences`, or, once that connection has closed, the core's orphans, from
    which the resend of the same message on the producer's next connection adopts it (BrokerCore.
    _sequence_taken): the new connection's transfer completes when the original leaves the queue."""

    __slots__ = ("owner", "transfer_id", "size", "pending", "sequence_key", "registry")

    def __init__(self, session: Session, transfer_id: int, size: int, pending: int):
        self.owner = session.ref
        self.transfer_id = transfer_id
        self.size = size
        self.pending = pending
        self.sequence_key: SequenceKey | None = None
        self.registry: dict[SequenceKey, HeldTransfer] | None = None
        session.transfers_held_now += 1

    def release(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            if self.registry is not None:
                self.registry.pop(self.sequence_key, None)  # type: ignore[arg-type]
            session = self.owner.session
            if session is not None:
                session.transfers_held_now -= 1
                session.complete_transfer(self.transfer_id, self.size)


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
        if transfer.registry is not None:
            transfer.registry.pop(transfer.sequence_key, None)  # type: ignore[arg-type]
        owner = transfer.owner.session
        if owner is None:  # its connection has closed: nothing to complete
            continue
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
