"""Where a queue keeps its messages: the `QueueStore` seam, and the in-memory store behind it today.

`Queue` decides *what* happens to a message (watermarks, holds, delivery, credit); its store keeps
*which* messages the queue has and in which order. Every message that enters a queue reaches
`append` with its *offset* set: a per-queue int that the queue gives in enqueue order, from the
store's `start_offset` up, never reused (Kafka's offset). With the producer's `producer_id` and
`sequence`, carried from its TRANSFER entry on the `Message`, that is the identity a journal
records and an idempotent producer is deduplicated by.

A message's life in a store: `append` (ready) -> `take` (delivered, unsettled: the store keeps
its identity, the queue's consumer has the message) -> either `settle` (gone for good: acked,
rejected, dropped) or `requeue` (ready again, at its original place in offset order). `purge`
removes every ready message for good, `delete` everything, with the queue.

The durable journal (issue 14) plugs in here: a store chosen per queue by the broker's
`StoreFactory` (queue name, durable flag), which sees every append with the message's identity
and every settlement. `MemoryStore` is the whole of the memory-only path: it keeps the ready
messages in offset order in memory, which a journalling store needs too (it can extend it and
write a record in `append`, `settle`, `purge` and `delete`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat, starmap
from typing import Protocol

from flowbroker.broker.message import Message

__all__ = ["QueueStore", "MemoryStore", "StoreFactory", "memory_store"]


def _offset(msg: Message) -> int:
    return msg.offset


def _below(ready: deque[Message], offset: int, limit: int) -> int:
    """How many of the first `limit` messages of `ready` (in offset order) have an offset below `offset`.
    It gallops from the head, then bisects: a deque's index walks its blocks from the nearer end, so the
    probes of a place near the head stay near it (a plain bisect starts at the middle)."""
    step = 1
    while step <= limit and ready[step - 1].offset < offset:
        step *= 2
    return bisect_left(ready, offset, step // 2, min(step, limit), key=_offset)


class QueueStore(Protocol):
    """The messages of one queue, in offset order. `len()` and iteration cover the ready messages
    only (those not taken), lowest offset first. Bytes are counted once, by the queue, which does
    that accounting for its watermarks anyway."""

    start_offset: int
    """The offset a queue over this store gives its first message: 0 for a new store, one past
    the highest recovered offset for a journal's."""

    def append(self, msg: Message) -> None:
        """A new message enters the queue, ready, last; its offset is above every offset before."""

    def take(self) -> Message:
        """The ready message with the lowest offset, now delivered (the caller checked len() > 0)."""

    def __getitem__(self, index: int) -> Message:
        """The `index`-th ready message in offset order, not taken: `store[0]` is what `take` returns next
        (a UDP subscription sizes its next batch by it before taking it)."""

    def requeue(self, msgs: Iterable[Message]) -> None:
        """Taken messages are ready again, each at its place in offset order (offsets are kept)."""

    def settle(self, msg: Message) -> None:
        """A taken (or just dropped) message is gone for good: acked, rejected or dropped."""

    def purge(self) -> list[Message]:
        """Every ready message is gone for good; returns them in offset order."""

    def delete(self) -> None:
        """The queue is deleted: forget every message, ready or taken."""

    def page(self, after: int | None, limit: int) -> list[Message]:
        """Up to `limit` ready messages with an offset above `after` (None: from the first), in order."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Message]: ...


StoreFactory = Callable[[str, bool], QueueStore]
"""Makes a queue's store from its name and durable flag; the broker core holds one."""


class MemoryStore(deque[Message]):
    """The ready messages in memory, in offset order, and nothing else (a memory-only queue forgets
    a taken message: its consumer's delivery holds it until settled). It *is* the deque, so
    `append`, `take`, `len()` and truthiness, which the queue calls on every message, are the
    deque's own C methods and the hot path keeps today's speed (a Python `take` costs about 700
    instructions a message more); only the operations of `QueueStore` are its interface. A store
    that must hear of deliveries (a journal flagging redelivery after a restart) overrides `take`.

    The ready deque is always sorted by offset: appends come with a higher offset than any, takes
    are from the head, and a requeue puts what returns at its offset's place. So a requeued message is
    back exactly where it was, and `page` and `requeue` can bisect.
    """

    __slots__ = ()

    start_offset = 0  # nothing to recover
    take = deque.popleft
    merge_span = 16
    """A requeue merges what returns with the ready messages it lands among when those are at most this
    many per returning message, and places it run by run among more: a merge costs about 0.07 us a
    message, placing a run about 1 us (a test store sets 0 to check placing on small queues)."""

    def __repr__(self) -> str:
        return f"<MemoryStore ready={len(self)}>"

    def requeue(self, msgs: Iterable[Message]) -> None:
        """Requeues arrive in separate batches (one SETTLE each, or a consumer going away), so what
        returns goes back among the ready messages by offset, next to those requeued before.

        Its place is found by bisection, and the ready messages before it are rotated to the tail and
        back (the deque's C `rotate`, the shorter way round, about 2 ns a message), never popped one by
        one: popped, one delivery returning above the 290,000 another consumer had given back took
        35-117 ms (a tester); placed, it reads some 40 of them. What returns is merged with the ready
        messages it lands among when they are few (`merge_span`); among many, each run of it goes
        where it lands, the ready ones between passed over by rotation."""
        returning = sorted(msgs, key=_offset)
        count = len(returning)
        if not count:
            return
        first = _below(self, returning[0].offset, len(self))
        self.rotate(-first)  # where the first lands is the head now, the ready messages before it the tail
        span = _below(self, returning[-1].offset, len(self) - first)  # the ready messages they land among
        if span <= self.merge_span * count:
            among = list(starmap(self.popleft, repeat((), span)))  # (called from C, not a Python loop)
            merged = sorted(among + returning, key=_offset) if among else returning  # two sorted runs: a merge
            self.extendleft(reversed(merged))
            self.rotate(first)
            return
        offsets = [msg.offset for msg in returning]
        placed = passed = 0
        while placed < count:
            ahead = _below(self, offsets[placed], span - passed)  # ready messages before this one
            self.rotate(-ahead)
            passed += ahead
            # it, and the ones that return before the next ready message, join the tail there
            run_end = bisect_left(offsets, self[0].offset, placed + 1) if passed < span else count
            self.extend(returning[placed:run_end])
            placed = run_end
        self.rotate(first + passed + count)

    def settle(self, msg: Message) -> None:
        """Nothing to do in memory: the message is no longer referenced once the queue lets it go."""

    def purge(self) -> list[Message]:
        msgs = list(self)
        self.clear()
        return msgs

    def delete(self) -> None:
        self.clear()

    def page(self, after: int | None, limit: int) -> list[Message]:
        start = 0 if after is None else bisect_right(self, after, key=_offset)
        return [self[i] for i in range(start, min(start + max(limit, 0), len(self)))]


def memory_store(name: str, durable: bool) -> QueueStore:
    """The store for every queue today: in memory. `durable` is accepted and ignored until the
    journal (issue 14) gives durable queues a store of their own."""
    return MemoryStore()
