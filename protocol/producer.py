"""The producer half of a connection, without I/O: transfer ids, byte credit and the ledger of transfers in flight.

A client connection may carry several producers, but the protocol knows only the connection: transfer ids
count messages from 1 on the connection, byte credit is one buffer per connection (DCP), and COMPLETE
names ids, not producers. `ProducerLedger` keeps what the client must know to map the broker's answers back
to the producers that sent, and refuses answers that cannot be right:

- **ids.** `on_sent(owner, size)` gives the next id (contiguous from 1) and charges `size` bytes to the
  connection's `SenderWindow` (`may_send()` says whether the next message may start);
- **the ledger.** The ids above the cumulative point are kept as *runs* of consecutive ids sent by one
  owner, `(first id, owner)`, sorted: a producer sending a burst costs one entry, not one per message, and
  a COMPLETE retires whole runs, one `(owner, count)` per run. A run whose owner is None completed out of
  order (a COMPLETE range); completed neighbours merge, so repeated ranges cannot split runs;
- **validation.** `on_complete` raises `RemoteProtocolError` for a COMPLETE that names an id never sent,
  moves the cumulative point backwards, or carries ranges that are not ascending above its own cumulative
  id (docs/protocol.md, COMPLETE), before it changes anything; a range repeating ids already completed is
  harmless (the broker may repeat itself) and completes nothing twice. `on_buffer_ack` refuses an
  acknowledgement of bytes never sent or for a buffer other than the connection's.

Every method returns at once, and its work is bounded by the frame it is given and the runs it retires
(each run is created by a send, so retiring runs is paid for by the sends). The trio shell
(client/connection.py) feeds it the broker's frames and wakes the producers the results name.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from operator import itemgetter
from typing import Generic, TypeVar

from flowbroker.protocol.credit import CreditError, SenderWindow
from flowbroker.protocol.errors import ErrorCode, RemoteProtocolError
from flowbroker.protocol.frames import BufferAck, BufferControl, BufferLimit, Complete

__all__ = ["ProducerLedger", "ProducerLedgerStatistics"]

Owner = TypeVar("Owner")
"""Whatever the shell uses for "who sent it" (the SDK's `Producer`); compared by identity, never None."""

_run_first = itemgetter(0)


@dataclass(frozen=True, slots=True)
class ProducerLedgerStatistics:
    """A snapshot of the producer half of a connection; bytes are `message_size` bytes since it opened."""

    transfers_sent: int
    transfers_completed: int
    transfers_in_flight: int
    cumulative_id: int
    """Every transfer id up to this one is complete (the broker's cumulative point)."""
    runs: int
    """Entries in the ledger: runs of consecutive transfers by one producer, or completed out of order."""
    position: int
    acked_position: int
    window: int
    limit: int


class ProducerLedger(Generic[Owner]):
    """Transfer ids, the connection's byte credit (`window`, a `SenderWindow`) and the transfers in flight."""

    __slots__ = ("window", "next_id", "cumulative", "completed", "_runs", "_tail", "controls", "_unanswered")

    def __init__(self, window: int = 0) -> None:
        self.window = SenderWindow(window)
        """The connection's producer byte credit, shared by its producers (WELCOME's buffer_size, then BUFFER_CONTROL)."""
        self.next_id = 1
        """The id the next transfer gets; every id below it was sent."""
        self.cumulative = 0
        """The highest cumulative id a COMPLETE has named: every id up to it is complete."""
        self.completed = 0
        """Transfers completed so far (each counted once, however many COMPLETEs named it)."""
        self._runs: list[tuple[int, Owner | None]] = []
        """The transfers above `cumulative`, as runs of consecutive ids sent by one owner: (first id, owner),
        sorted. A run ends where the next begins, the last at the highest id sent. Owner None: completed
        out of order."""
        self.controls = 0
        """Connection-level BUFFER_CONTROLs applied: what a BUFFER_LIMIT names (the broker ignores a stale one)."""
        self._unanswered = False
        """The last BUFFER_CONTROL set a paced buffer and `buffer_limit()` has not answered it yet."""
        self._tail: Owner | None = None
        """The owner of the last run (None when there is none or it is completed): a send by this owner
        extends that run instead of adding one."""

    # ------------------------------------------------------------------ reading

    @property
    def highest_sent(self) -> int:
        return self.next_id - 1

    @property
    def in_flight(self) -> int:
        """Transfers sent and not yet completed."""
        return self.next_id - 1 - self.completed

    def runs(self) -> list[tuple[int, int, Owner | None]]:
        """The ledger as `(first, last, owner)` triples (owner None: completed out of order), for tests and
        debugging; costs one step per run."""
        runs = self._runs
        ends = [first - 1 for first, _ in runs[1:]] + [self.next_id - 1]
        return [(first, last, owner) for (first, owner), last in zip(runs, ends)]

    def owner_of(self, transfer_id: int) -> Owner | None:
        """The owner of an uncompleted transfer (None if it is completed or was never sent): whom an
        ERROR naming that transfer concerns."""
        if not self.cumulative < transfer_id < self.next_id:
            return None
        runs = self._runs
        return runs[bisect_right(runs, transfer_id, key=_run_first) - 1][1]

    def statistics(self) -> ProducerLedgerStatistics:
        window = self.window
        return ProducerLedgerStatistics(
            self.next_id - 1,
            self.completed,
            self.next_id - 1 - self.completed,
            self.cumulative,
            len(self._runs),
            window.position,
            window.acked_position,
            window.window,
            window.limit,
        )

    # ------------------------------------------------------------------ sending

    def may_send(self) -> bool:
        """True when byte credit lets the next message start (one message may overflow the window, as in DCP)."""
        return self.window.may_send()

    def on_sent(self, owner: Owner, size: int) -> int:
        """Record one message of `size` bytes sent by `owner`; returns its transfer id. The caller has
        checked `may_send()` (sending beyond credit is the broker's CREDIT_VIOLATION to refuse)."""
        transfer_id = self.next_id
        self.next_id = transfer_id + 1
        self.window.position += size  # SenderWindow.on_sent, inlined: this is the per-message path
        if owner is not self._tail:
            self._runs.append((transfer_id, owner))
            self._tail = owner
        return transfer_id

    # ------------------------------------------------------------------ receiving

    def on_buffer_control(self, frame: BufferControl) -> bool:
        """The broker resized the connection's producer buffer; True if it applies here (opaque 0: the
        others are consumer-side subscription ids, which a broker never sends a producer). Then
        `buffer_limit()` is the answer the broker waits for."""
        if frame.opaque != 0:
            return False
        window = self.window
        self.controls += 1
        self._unanswered = frame.buffer_size > 0
        window.resize(frame.buffer_size)
        return True

    def buffer_limit(self) -> BufferLimit | None:
        """The BUFFER_LIMIT that answers the last BUFFER_CONTROL (None if it is answered, or turned flow
        control off): the position every admitted message stays below, L = max(position, acked_position
        + window). Only a shrink needs the answer, but every BUFFER_CONTROL gets one so that the latest is
        always answered: a shrink followed by a smaller grow before the answer arrives makes the first
        answer stale, and the old promise would stay if the grow went unanswered.

        `position` counts every byte admitted by `on_sent`, written or still queued, so whatever the
        shell sends after this frame was admitted below L, and from now on `may_send()` lets a message
        start only below acked_position + window <= L; the broker then lowers its credit limit to L
        and stops charging the old grant to the pool (docs/protocol.md, BUFFER_LIMIT)."""
        if not self._unanswered:
            return None
        self._unanswered = False
        window = self.window
        return BufferLimit(self.controls, window.window, max(window.position, window.acked_position + window.window))

    def on_buffer_ack(self, frame: BufferAck) -> int:
        """Apply the broker's acknowledgement; returns the bytes it newly freed (0 when stale or repeated:
        `acked_position` is absolute, so duplicates and reordering are harmless).

        Raises RemoteProtocolError: UNEXPECTED_FRAME for an opaque other than 0 (producer credit is per
        connection), CREDIT_VIOLATION for an acknowledgement beyond the bytes sent (what the broker answers a
        consumer's, docs/protocol.md)."""
        if frame.opaque != 0:
            raise RemoteProtocolError(
                f"BUFFER_ACK for opaque {frame.opaque}: producer credit is per connection", ErrorCode.UNEXPECTED_FRAME
            )
        try:
            return self.window.on_ack(frame.acked_position)
        except CreditError as exc:
            raise RemoteProtocolError(str(exc), ErrorCode.CREDIT_VIOLATION) from None

    def on_complete(self, frame: Complete) -> list[tuple[Owner, int]]:
        """Apply a COMPLETE; returns how many transfers it newly completed per run, as (owner, count)
        pairs in id order (an owner may appear more than once). Ids already completed count nothing.

        Raises RemoteProtocolError, and changes nothing, for a COMPLETE that cannot be right:
        UNEXPECTED_FRAME when it names ids never sent or its cumulative id is below one received before,
        MALFORMED_FRAME when its ranges are not ascending, disjoint and above its cumulative id."""
        cumulative = frame.cumulative_id
        highest_sent = self.next_id - 1
        previous = cumulative
        for first, last in frame.ranges:
            if first <= previous or last < first:
                raise RemoteProtocolError(
                    f"COMPLETE range ({first}, {last}) is not above the cumulative id {cumulative} and the "
                    f"ranges before it (ranges must be ascending, disjoint and above cumulative_id)",
                    ErrorCode.MALFORMED_FRAME,
                )
            previous = last
        # Refusing ids never sent also bounds the work below by what was actually sent, so a COMPLETE
        # naming id 2**63 cannot spin the caller.
        if previous > highest_sent:
            raise RemoteProtocolError(
                f"COMPLETE names transfer ids up to {previous} but only {highest_sent} were sent",
                ErrorCode.UNEXPECTED_FRAME,
            )
        if cumulative < self.cumulative:
            raise RemoteProtocolError(
                f"COMPLETE moves the cumulative id back from {self.cumulative} to {cumulative}",
                ErrorCode.UNEXPECTED_FRAME,
            )
        done: list[tuple[Owner, int]] = []
        if cumulative > self.cumulative:
            self._complete_through(cumulative, highest_sent, done)
        for first, last in frame.ranges:  # all above `cumulative`, now `self.cumulative`
            self._complete_range(first, last, highest_sent, done)
        for _, count in done:
            self.completed += count
        return done

    def _complete_through(self, cumulative: int, highest_sent: int, done: list[tuple[Owner, int]]) -> None:
        """Every transfer up to `cumulative` (above `self.cumulative`, at most `highest_sent`) is complete:
        retire the runs it covers, one count per run."""
        runs = self._runs
        self.cumulative = cumulative
        count = len(runs)
        i = 0
        while i < count:
            first, owner = runs[i]
            last = runs[i + 1][0] - 1 if i + 1 < count else highest_sent
            if last > cumulative:  # the run goes on above the cumulative point: cut its head off
                if first <= cumulative:
                    if owner is not None:
                        done.append((owner, cumulative - first + 1))
                    runs[i] = (cumulative + 1, owner)
                break
            if owner is not None:
                done.append((owner, last - first + 1))
            i += 1
        if i:
            del runs[:i]
            if not runs:
                self._tail = None

    def _complete_range(self, first: int, last: int, highest_sent: int, done: list[tuple[Owner, int]]) -> None:
        """Transfers `first`..`last` (above `self.cumulative`, at most `highest_sent`) are complete, out of
        order: count them to their owners and mark them completed (a run with owner None), merged with
        completed neighbours so that repeated ranges do not split runs."""
        runs = self._runs
        count = len(runs)
        start = bisect_right(runs, first, key=_run_first) - 1  # the run holding `first`
        stop = start
        completed = False
        while stop < count and runs[stop][0] <= last:
            run_first, owner = runs[stop]
            stop += 1
            if owner is not None:
                run_last = runs[stop][0] - 1 if stop < count else highest_sent
                done.append((owner, min(run_last, last) - max(run_first, first) + 1))
                completed = True
        if not completed:
            return
        # Replace runs[start:stop] by: the head of the first one (below `first`), a completed run from
        # `first` (unless the run before it is completed too and goes on), and the tail of the last one
        # (above `last`, unless it is a completed run: then the completed run goes on).
        head_first, head_owner = runs[start]
        tail_owner = runs[stop - 1][1]
        tail_last = runs[stop][0] - 1 if stop < count else highest_sent
        replacement: list[tuple[int, Owner | None]] = []
        if head_first < first:
            replacement.append((head_first, head_owner))
            extends_previous = head_owner is None
        else:
            extends_previous = start > 0 and runs[start - 1][1] is None
        if not extends_previous:
            replacement.append((first, None))
        if tail_last > last:
            if tail_owner is not None:
                replacement.append((last + 1, tail_owner))
        elif stop < count and runs[stop][1] is None:
            stop += 1  # the next run is completed too: it joins this one
        runs[start:stop] = replacement
        self._tail = runs[-1][1]
