"""The broker's rules for the transfers one connection produces, without I/O: `TransferReceiver`.

The broker is the receiver (DCP's consumer) toward a producer. For each TRANSFER it checks that the
transfer ids continue the connection's sequence (TRANSFER_ID_GAP) and that every message starts below
the credit limit (CREDIT_VIOLATION; DCP's rule lets the one message that starts below it overflow the
window); it records completions as an `IdSet` (a cumulative point plus ranges) and turns them into
COMPLETE frames; and it schedules BUFFER_ACKs through its `ReceiverWindow`.

The limit a transfer is checked against is the highest ever granted (monotonic), and it moves only
with what the broker actually sends: a BUFFER_ACK returned by `ack_due()`/`poll()` or a resize that the
caller announces with BUFFER_CONTROL. A shrink never lowers it, since the producer may not have seen the
smaller window yet; only the producer's answer to the shrink, BUFFER_LIMIT (`fence()`), lowers it, to
what the producer promises not to reach. While the producer waits for a share of the credit pool (`credit_waiting`), its
acknowledgements are withheld: that is what makes it wait.

What the caller does with the messages (routing, holding a completion while a queue is saturated) is
the broker core's business; this class only asks it to `complete()` each transfer id once, and refuses
(LocalProtocolError) a completion of an id never received or completed twice, so a core bug cannot
reach the wire as a COMPLETE the client would misread. No clock: time arrives as `now_ns`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowbroker.protocol.credit import MESSAGE_OVERHEAD, ReceiverWindow, message_size
from flowbroker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from flowbroker.protocol.frames import BufferAck, Complete, TransferEntry
from flowbroker.protocol.limits import MAX_RANGES_PER_FRAME
from flowbroker.protocol.ranges import IdSet, to_ranges

__all__ = ["TransferReceiver", "TransferReceiverStatistics"]


@dataclass(frozen=True, slots=True)
class TransferReceiverStatistics:
    """A snapshot of one producer connection's receiving side, in the credit vocabulary (bytes)."""

    position: int  # bytes received
    consumed_position: int  # bytes of completed transfers
    acked_position: int  # consumed bytes acknowledged in a BUFFER_ACK
    window: int  # the window granted now (0: flow control off)
    limit: int  # the highest limit granted (lowered only by the producer's BUFFER_LIMIT)
    transfers_received: int
    transfers_completed: int
    credit_waiting: bool


UNFENCED_IN_FLIGHT = 64 * 1024 * 1024
"""Bytes that may be on their way from a producer when its buffer goes from 0 (no flow control) to a
size: in the sockets' buffers between the two (a few MiB on Linux) and in one write of the client's (the
SDK writes up to 8 frames at once, 64 MiB at the default frame size). Until the producer answers the
new buffer (BUFFER_LIMIT), it may send twice this beyond what had arrived when the buffer was announced:
measured from the credit limit instead, which under size 0 is never acknowledged forward, it closed a
well-behaved SDK producer streaming 1 MiB messages at the switch (a tester, 3 of 5 runs)."""
UNFENCED_CLAIM = 1 << 30
"""The least a first BUFFER_LIMIT after size 0 -> n may claim beyond what had arrived (see UNFENCED_MESSAGES)."""
UNFENCED_MESSAGES = 1024
"""What a producer's first BUFFER_LIMIT after size 0 -> n may claim beyond what had arrived and the new
buffer: this many maximum messages (`TransferReceiver.max_message`), at least UNFENCED_CLAIM (a
connection's producers each admit their own window: three of 1,000 messages of 60 KB under a 64 KiB
max_message_size claimed 180 MB, and were closed, a later tester). Under
size 0 a client admits messages by its window of transfers alone (the SDK's: 1,000), and its answer
names what it admitted, sent or not: capped at 64 MiB, a well-behaved SDK producer with 1,000 messages of
1 MiB admitted was closed (a tester, 2 of 5 runs); uncapped, a raw client's 2**50 was charged to the pool
whole, and every other producer waited while it stayed (an earlier tester)."""


class TransferReceiver:
    """Receives one connection's TRANSFER frames: contiguity, credit, completions, BUFFER_ACKs.

    `window` is the `ReceiverWindow` (position received, consumed, acknowledged, and the monotonic
    limit). A connection without flow control still counts positions but is never checked or acked.
    """

    __slots__ = ("flow_control", "window", "next_transfer_id", "completed", "credit_waiting",
                 "newly_completed", "reported_cumulative", "controls", "answered", "unfenced", "unfenced_from",
                 "max_message")

    def __init__(self, window: int, flow_control: bool = True):
        self.flow_control = flow_control
        self.window = ReceiverWindow(window if flow_control else 0)
        self.next_transfer_id = 1
        self.completed = IdSet()
        self.credit_waiting = False  # waiting for a share of the pool: BUFFER_ACKs withheld
        # Read by a shell that wants to skip calling completions() when none is due (once a frame).
        self.newly_completed: list[int] = []  # ids completed out of order since the last COMPLETE
        self.reported_cumulative = 0  # the cumulative id the last COMPLETE carried
        self.controls = 0  # connection-level BUFFER_CONTROLs announced (`announced()`): what BUFFER_LIMIT names
        self.answered = 0  # the latest of them a BUFFER_LIMIT answered (`fence`): below `controls`, one is open
        # Turned on mid-stream (size 0 -> n): until the producer's BUFFER_LIMIT answers, what arrives may
        # have been sent under size 0, unlimited, before it saw the grant: the check allows 2 x
        # UNFENCED_IN_FLIGHT beyond what had arrived then (`unfenced_from`) until the answer (a client that
        # never answered sent 160 MiB unchecked: a tester).
        self.unfenced = False
        self.unfenced_from = 0
        self.max_message = 0  # the broker's max_message_size (the core sets it): what an answer may claim

    # -- receiving -----------------------------------------------------------------------------

    def receive(self, first_id: int, entries: Sequence[TransferEntry]) -> tuple[list[int], RemoteProtocolError | None]:
        """Check and count a TRANSFER; returns the charged size of each message the caller may take.

        Raises RemoteProtocolError(TRANSFER_ID_GAP) when `first_id` does not continue the sequence.
        A message that starts at or beyond the credit limit is a CREDIT_VIOLATION: the messages before
        it are still received (their sizes are returned, so the caller routes them as it always did)
        and the error comes back beside them, for the caller to raise once it has. The ids returned
        are taken: `next_transfer_id` moves past them.
        """
        if first_id != self.next_transfer_id:
            raise RemoteProtocolError(
                f"transfer id {first_id} received, expected {self.next_transfer_id}", ErrorCode.TRANSFER_ID_GAP
            )
        # message_size() inlined for the common message without headers (one call less per message)
        # (entries by index: the broker's reader keeps them as decoded lists, `Connection.build_transfers`)
        sizes = [len(e[2]) + MESSAGE_OVERHEAD if not e[3] else message_size(e[2], e[3]) for e in entries]
        window = self.window
        position = window.position
        total = sum(sizes)
        if self.flow_control and window.window and sizes:
            limit = window.limit
            if self.unfenced:  # sent under size 0 before it saw the grant: at most what was on its way
                # (the grant, or what had arrived plus the allowance; the grant plus the allowance, which
                # grew with every acknowledgement, let a raw client send 248 MiB past what had arrived)
                limit = max(limit, self.unfenced_from + 2 * UNFENCED_IN_FLIGHT)
            # Positions only grow, so the last message starts furthest: one sum for the whole frame.
            if position + total - sizes[-1] >= limit:
                violation = None
                for k, size in enumerate(sizes):
                    if position >= limit:
                        violation = RemoteProtocolError(
                            f"transfer {first_id + k} starts at byte {position}, beyond the credit limit "
                            f"{limit} (buffer {window.window} bytes): only one message may overflow the buffer"
                            if not self.unfenced else
                            f"transfer {first_id + k} starts at byte {position}, beyond {limit}: the credit limit, "
                            f"or {2 * UNFENCED_IN_FLIGHT} bytes beyond the {self.unfenced_from} bytes received when "
                            f"a buffer ({window.window} bytes) was turned on mid-stream, not yet answered with "
                            "BUFFER_LIMIT: no client can have had that much on its way when the grant reached it",
                            ErrorCode.CREDIT_VIOLATION,
                        )
                        del sizes[k:]
                        break
                    position += size
                window.position = position
                self.next_transfer_id = first_id + len(sizes)
                return sizes, violation
        window.position = position + total
        self.next_transfer_id = first_id + len(sizes)
        return sizes, None

    def receive_unchecked(self, entries: Sequence[TransferEntry]) -> tuple[int, list[int]]:
        """Take messages that arrived outside a TRANSFER frame (a UDP publication's image): the next
        transfer ids and their charged sizes, without the credit check, because there the image's window
        is the credit (the producer cannot send past it). Returns (first id, sizes)."""
        first_id = self.next_transfer_id
        # (entries by index: the broker's reader keeps them as decoded lists, `Connection.build_transfers`)
        sizes = [len(e[2]) + MESSAGE_OVERHEAD if not e[3] else message_size(e[2], e[3]) for e in entries]
        self.window.position += sum(sizes)
        self.next_transfer_id = first_id + len(sizes)
        return first_id, sizes

    def complete(self, transfer_id: int, size: int) -> None:
        """Transfer `transfer_id` (charged `size` bytes) is done: its bytes are consumed.

        The common case, the id just above the cumulative point with no ranges above it, costs three
        comparisons and no IdSet bookkeeping (this runs once per message)."""
        completed = self.completed
        if transfer_id == completed.cumulative + 1 and not completed.holes and transfer_id < self.next_transfer_id:
            completed.cumulative = transfer_id
        else:
            if transfer_id >= self.next_transfer_id or transfer_id < 1 or transfer_id in completed:
                raise LocalProtocolError(
                    f"cannot complete transfer {transfer_id}: received up to {self.next_transfer_id - 1}, "
                    f"completed {completed.cumulative} and {completed.ranges_above()[:4]}",
                    ErrorCode.INTERNAL_ERROR,
                )
            completed.add(transfer_id)
            self.newly_completed.append(transfer_id)
        self.window.consumed_position += size

    def complete_run(self, first_id: int, count: int, size: int) -> None:
        """`complete` for the `count` transfers from `first_id` on, `size` bytes in all: one call for
        a frame's messages that completed as they were routed. The common case, the run continuing the
        cumulative point with no ranges above it, moves the point once; otherwise each id is
        completed in turn."""
        completed = self.completed
        end = first_id + count
        if first_id == completed.cumulative + 1 and not completed.holes and end <= self.next_transfer_id:
            completed.cumulative = end - 1
            self.window.consumed_position += size
            return
        for transfer_id in range(first_id, end):
            self.complete(transfer_id, 0)
        self.window.consumed_position += size

    def completions(self) -> list[Complete]:
        """The COMPLETE frames due (none if nothing completed since the last call): the cumulative
        point, and the ids completed above it since, at most MAX_RANGES_PER_FRAME ranges a frame."""
        cumulative = self.completed.cumulative
        if not self.newly_completed and cumulative == self.reported_cumulative:
            return []
        above = to_ranges(i for i in self.newly_completed if i > cumulative)
        self.newly_completed = []
        self.reported_cumulative = cumulative
        return [
            Complete(cumulative, above[start : start + MAX_RANGES_PER_FRAME])
            for start in range(0, max(len(above), 1), MAX_RANGES_PER_FRAME)
        ]

    # -- credit --------------------------------------------------------------------------------

    def ack_due(self, now_ns: int) -> BufferAck | None:
        """The BUFFER_ACK to send now: once the consumed bytes pending reach the window's threshold,
        unless the producer waits for a pool share. Sending it raises the limit (see `_granted`)."""
        window = self.window
        if window.consumed_position - window.acked_position < window.threshold() or self.credit_waiting:
            return None
        ack = window.flush(now_ns)  # None when flow control is off
        return None if ack is None else self._granted(ack)

    def release_withheld(self, now_ns: int) -> BufferAck | None:
        """The producer stopped waiting for a pool share: what was consumed while its acknowledgements
        were withheld is acknowledged now, not at the next timer tick (or never, for one whose bytes stay
        under the threshold and whose timer ticked while it still waited: a state machine found it)."""
        if self.credit_waiting:
            return None
        ack = self.window.flush(now_ns)
        return None if ack is None else self._granted(ack)

    def poll(self, now_ns: int) -> BufferAck | None:
        """Timer: after the interval, acknowledge what is pending and re-advertise the absolute position
        (even unchanged), so a lost grant costs a producer at most one interval."""
        if self.credit_waiting:
            return None
        ack = self.window.poll(now_ns)
        return None if ack is None else self._granted(ack)

    def resize(self, window: int) -> None:
        """The broker grants another window (announced with BUFFER_CONTROL). Shrinking below what is in
        flight loses nothing: the producer waits until acknowledgements bring it under the new size."""
        if window < 0:
            raise LocalProtocolError(f"window must be >= 0, got {window}", ErrorCode.INTERNAL_ERROR)
        state = self.window
        state.window = window
        state.limit = max(state.limit, state.acked_position + window)

    def announced(self, window: int) -> None:
        """`resize(window)` that the caller sends to the producer as a BUFFER_CONTROL (the grant at
        connect, which WELCOME carries, is not one): BUFFER_LIMIT counts these to name the one it answers."""
        if self.window.window == 0 and window and self.flow_control:
            self.unfenced = True  # size 0 -> n mid-stream: see __init__
            self.unfenced_from = self.window.position
        self.resize(window)
        self.controls += 1

    def fence(self, control: int, size: int, limit: int) -> bool:
        """The producer's BUFFER_LIMIT: after applying the `control`-th BUFFER_CONTROL (of `size` bytes) it
        starts no message at or beyond `limit`. If that is the latest BUFFER_CONTROL, the credit limit
        comes down to max(`limit`, acked_position + window) (never up: `limit` may be above it by the one
        message that may overflow), so what a shrink left promised drains at once instead of when the
        producer, perhaps idle for good, sends it. Returns True if the limit moved.

        A stale one (a BUFFER_CONTROL has gone out since) is ignored: transfers admitted under the newer
        grant may follow it. Raises RemoteProtocolError(CREDIT_VIOLATION) for one that cannot be right:
        naming a BUFFER_CONTROL never sent, a size other than that one's, or a limit below the bytes
        already received (the producer cannot take back bytes it sent)."""
        window = self.window
        if control != self.controls:
            if control > self.controls:
                raise RemoteProtocolError(
                    f"BUFFER_LIMIT answers BUFFER_CONTROL {control} but only {self.controls} were sent",
                    ErrorCode.CREDIT_VIOLATION,
                )
            return False
        if size != window.window:
            raise RemoteProtocolError(
                f"BUFFER_LIMIT names buffer size {size} but BUFFER_CONTROL {control} granted {window.window}",
                ErrorCode.CREDIT_VIOLATION,
            )
        if limit < window.position:
            raise RemoteProtocolError(
                f"BUFFER_LIMIT {limit} is below the {window.position} bytes already received",
                ErrorCode.CREDIT_VIOLATION,
            )
        self.answered = control
        fenced = max(limit, window.acked_position + window.window)
        if self.unfenced:  # the first answer after size 0 -> n: its limit is the first that holds
            self.unfenced = False
            # What it admitted under no limit and the broker has not read yet (in the sockets, and queued
            # in the client): at most UNFENCED_MESSAGES maximum messages beyond what arrived (see there).
            claimable = max(UNFENCED_CLAIM, UNFENCED_MESSAGES * self.max_message)
            if limit > window.position + window.window + claimable:
                raise RemoteProtocolError(
                    f"BUFFER_LIMIT {limit} is more than {claimable} bytes ({UNFENCED_MESSAGES} maximum messages) "
                    f"beyond the {window.position} bytes received plus the {window.window}-byte buffer: no "
                    "client can have admitted that much",
                    ErrorCode.CREDIT_VIOLATION,
                )
        else:
            fenced = min(window.limit, fenced)
        if fenced == window.limit:
            return False
        window.limit = fenced
        return True

    @property
    def promised(self) -> int:
        """Bytes the producer may still have in flight unacknowledged: limit - acked_position. Above the
        window after a shrink the producer has not caught up with (the pool keeps it charged)."""
        return self.window.limit - self.window.acked_position

    def _granted(self, ack: BufferAck) -> BufferAck:
        """Every grant raises the limit the credit check allows (monotonic: a shrink never lowers it)."""
        window = self.window
        window.limit = max(window.limit, ack.acked_position + window.window)
        return ack

    def statistics(self) -> TransferReceiverStatistics:
        window, completed = self.window, self.completed
        return TransferReceiverStatistics(
            position=window.position,
            consumed_position=window.consumed_position,
            acked_position=window.acked_position,
            window=window.window,
            limit=window.limit,
            transfers_received=self.next_transfer_id - 1,
            transfers_completed=completed.cumulative + sum(hi - lo + 1 for lo, hi in completed.ranges_above()),
            credit_waiting=self.credit_waiting,
        )
