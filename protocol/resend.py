"""An idempotent producer's side of the sequence rule, without I/O: `ResendLedger`.

An idempotent producer numbers its messages 0, 1, 2, ... under its producer id (docs/protocol.md,
"Idempotent producers") and keeps each one until the broker completes it, so that after a lost
connection it can send again, in sequence order, everything whose COMPLETE it has not seen: the broker
completes what it had already taken as duplicates and takes the rest, so each message lands once.

Transfer ids are per connection, sequences per producer id: each kept message records the transfer id
it was last sent under. A COMPLETE's cumulative id retires kept messages from the oldest (they were sent
in order, so the oldest have the lowest ids); ids completed out of order (a COMPLETE's ranges, when a
saturated queue held an earlier one) are left to a later cumulative id, so a message completed that way
just before the connection is lost is sent again and completed by the broker as a duplicate: harmless.
What is kept is bounded by the producer's window of uncompleted transfers plus those few.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["ResendLedger", "UNSENT"]

Entry = TypeVar("Entry")
"""Whatever the shell sends for one message (the SDK: the TRANSFER entry's fields, sequence included)."""

UNSENT = sys.maxsize
"""The transfer id of a kept message not (yet) sent on the current connection: no COMPLETE retires it."""


class ResendLedger(Generic[Entry]):
    """The messages of one producer id sent and not known complete, in sequence order: for each, the
    transfer id it was last sent under, its entry and its charged size."""

    __slots__ = ("producer_id", "next_sequence", "_kept")

    def __init__(self, producer_id: str, first_sequence: int = 0):
        if not producer_id:
            raise ValueError("a producer id must not be empty")
        self.producer_id = producer_id
        self.next_sequence = first_sequence
        """The sequence the next new message gets."""
        self._kept: OrderedDict[int, list[object]] = OrderedDict()
        """sequence -> [transfer id, entry, size], oldest first."""

    def __len__(self) -> int:
        return len(self._kept)

    def take_sequence(self) -> int:
        """The next sequence, for a new message about to be sent."""
        sequence = self.next_sequence
        self.next_sequence = sequence + 1
        return sequence

    def sent(self, sequence: int, transfer_id: int, entry: Entry, size: int) -> None:
        """Message `sequence` went out as `transfer_id` on the current connection: keep it until completed."""
        self._kept[sequence] = [transfer_id, entry, size]

    def retire(self, cumulative_id: int) -> int:
        """Every transfer up to `cumulative_id` on the current connection is complete: forget those
        messages; returns how many. Costs one step per message forgotten, plus one."""
        kept = self._kept
        removed = 0
        while kept:
            record = next(iter(kept.values()))
            if record[0] > cumulative_id:  # type: ignore[operator]
                break
            kept.popitem(last=False)
            removed += 1
        return removed

    def lost(self) -> list[tuple[int, Entry, int]]:
        """The connection is gone: every kept message is unsent now (no COMPLETE of the next connection
        may retire it under an old id). Returns them, (sequence, entry, size) in sequence order: what to
        send again, before anything new."""
        out: list[tuple[int, Entry, int]] = []
        for sequence, record in self._kept.items():
            record[0] = UNSENT
            out.append((sequence, record[1], record[2]))  # type: ignore[arg-type]
        return out

    def resent(self, sequence: int, transfer_id: int) -> None:
        """A message `lost()` returned went out again as `transfer_id`."""
        self._kept[sequence][0] = transfer_id

    def sequences(self) -> list[int]:
        """The kept sequences, oldest first (for tests and statistics)."""
        return list(self._kept)
