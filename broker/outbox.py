"""The frames due to one client connection, waiting for its writer task: `Outbox`.

Two kinds: control frames (answers, ERROR, FLOW_STOPPED/RESUMED, BUFFER_CONTROL, ...), kept in order
and bounded, and deliveries, gathered into one open DELIVER frame per subscription and sealed once
it reaches the frame size budget. Queues and the router add to it and call `wake`; the writer task
takes everything with `Session.collect()`. Nothing here does I/O.

A client that lets control frames pile up without reading is cut off: past `max_frames` the outbox
keeps a `SessionFault` instead of growing, and the core raises it when that connection next sends a
frame (or the timer closes it). It never raises from `send()` itself, because frames for one
connection are often sent while *another* connection's frame is handled (a consumer's settle resumes
producers), and that connection must not pay for this one.

Deliveries are limited by credit (prefetch and byte buffers), but credit comes back without the client
reading: a CANCEL or a SETTLE(REQUEUE) of tags the client may never have received returns the messages to
their queue, which delivers them again while the first entries still wait here. A connection that never
read churned SUBSCRIBE/CANCEL pairs and took the broker from 60 to 1,240 MiB (a tester); requeues did the
same. And a SETTLE(ACK or REJECT) of tags never read dequeues messages whose entries still wait here:
the queue and the memory alarm let go of them while the entries keep their bodies (a tester: 3 GiB with
256 KiB bodies, the alarm never on). So at most MAX_DELIVERIES_WAITING entries and
MAX_DELIVERY_BYTES_WAITING of their bytes wait here: past either, `full` is set and the connection's
subscriptions have no credit (`Subscription.has_credit`), until the writer's next collect, which takes
them, dispatches them again (`Session.collect`).

The control frames' bytes are counted too (`control_bytes`, an estimate: ERROR texts are most of it, counted
at 4 bytes a character unless ASCII, as CPython keeps them and UTF-8 sends them), and
past MAX_CONTROL_BYTES the connection is cut off as past `max_frames`: a client that sent requests and
never read their answers piled up 10,000 ERRORs of 1 KiB each under the count (a tester: 40 such
connections held 485 MiB of a 382 MiB bound). Not by pausing its reading instead: a client whose reader
waits for its writer (the SDK resending after a reconnect) then waited for the broker, and the broker for
it (a Spark job's 1,000 refused resends took 265 s instead of 6). Its reader is slowed meanwhile, not paused:
past 64 KiB of control frames waiting while its socket takes no more, it hands a few frames a turn to the core
(broker/server.py, UNREAD_TURN_FRAMES), so what the client does not read costs the others little.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flowbroker.protocol.credit import message_size
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Deliver, DeliveryEntry, Error, Frame
from flowbroker.protocol.limits import text_bytes_bound

__all__ = ["MAX_DELIVERIES_WAITING", "MAX_DELIVERY_BYTES_WAITING", "Outbox", "SessionFault"]

MAX_DELIVERIES_WAITING = 2_048
"""DELIVER entries one connection's outbox holds for its writer at most: about 256 KiB of entries, and what
one step delivers when the writer's collect refills it (`Session._resume_deliveries`), about 2-4 ms. At
16,384, a consumer reading fast with 20 subscriptions at the largest prefetch had each collect deliver
16,384 messages in one step, and every other connection waited 124-573 ms (a tester, 3 of 3); a
subscription's prefetch above it is still taken, over several writes."""

MAX_DELIVERY_BYTES_WAITING = 8 * 1024 * 1024
"""Their messages' bytes (message_size) at most, past one message: what one connection can pin once its
client settles what it never read, twice with what its writer took (docs/architecture.md's bound)."""


class SessionFault(Exception):
    """The client broke a rule that ends its connection (credit violation, transfer id gap, ...)."""

    def __init__(self, code: ErrorCode, text: str):
        super().__init__(text)
        self.code = code


CONTROL_FRAME_COST = 64
"""A control frame's bytes beside its texts: header, ids, codes (an estimate for `control_bytes`)."""

MAX_CONTROL_BYTES = 2 * 1024 * 1024
"""Past this many bytes of control frames waiting, the connection is cut off ("client is not reading"), as past
`max_frames` (10,000): for ERRORs of under 200 bytes the count comes first. The refusals of one TRANSFER
frame are at most 1,024 ERRORs, and the writer takes what is due after every read chunk (2 ms of frames at
most), and each refusal is bounded (`refusal`, REFUSAL_TEXT_BYTES): a client that reads stays under it."""


REFUSAL_TEXT_BYTES = 512
"""Bytes (by `text_bytes_bound`) of a refusal's text: longer texts are cut, with "...". A refused transfer's
destination is cut to MAX_NAME characters (no queue or exchange has a longer name). So one ERROR costs at
most CONTROL_FRAME_COST + 512 + 4 x 255 = 1,596 bytes, and one TRANSFER's refusals (MAX_ENTRIES_PER_FRAME,
1,024) at most 1.6 MiB, under MAX_CONTROL_BYTES: a client that reads is never cut off by one frame's
refusals. Each quoting a 1,000-emoji exchange name (a TRANSFER may name any), they were 2 MiB, and the broker
cut off a client that read them (a tester)."""

MAX_NAME = 255
"""Characters of a queue's or exchange's name (broker/core.py refuses longer ones at declare)."""


def refusal(code: ErrorCode, text: str, ref_id: int, destination: str | None) -> Error:
    """The ERROR refusing transfer `ref_id`, its text and destination bounded (REFUSAL_TEXT_BYTES)."""
    if len(text) > REFUSAL_TEXT_BYTES // 4 and text_bytes_bound(text) > REFUSAL_TEXT_BYTES:
        text = text[: (REFUSAL_TEXT_BYTES if text.isascii() else REFUSAL_TEXT_BYTES // 4) - 3] + "..."
    if destination is not None and len(destination) > MAX_NAME:
        destination = destination[:MAX_NAME]
    return Error(code, text, None, ref_id, destination)


def control_cost(frame: Frame) -> int:
    """The estimated bytes of a control frame: ERROR carries up to 1,024 characters of text and of a
    destination, counted by a bound on their bytes (`text_bytes_bound`: 4 a character unless ASCII), not
    their length: names of emoji, counted as characters, let 4 x MAX_CONTROL_BYTES wait (a tester: 8 MiB
    per connection that never read its ERRORs quoting a 255-emoji queue name)."""
    if type(frame) is Error:
        destination = frame.destination
        return (CONTROL_FRAME_COST + text_bytes_bound(frame.text)
                + (text_bytes_bound(destination) if destination else 0))
    return CONTROL_FRAME_COST


def _no_wake() -> None:
    """A closed outbox's wake-up."""


class Outbox:
    """Control frames in order, and DELIVER frames sealed by size."""

    __slots__ = ("control", "control_bytes", "open_frames", "_open_bytes", "sealed", "max_frames",
                 "max_delivery_frame_bytes",
                 "fault", "overflowed", "_wake", "woken", "closed", "deliveries_waiting", "delivery_bytes_waiting",
                 "full")

    def __init__(self, wake: Callable[[], None], max_frames: int, max_delivery_frame_bytes: int):
        self.control: list[Frame] = []
        self.control_bytes = 0  # their estimated size (control_cost)
        self.open_frames: dict[int, list[DeliveryEntry]] = {}  # the DELIVER frame open per subscription
        self._open_bytes: dict[int, int] = {}
        self.sealed: list[Frame] = []  # DELIVER frames that reached the frame size budget
        self.max_frames = max_frames
        self.max_delivery_frame_bytes = max_delivery_frame_bytes
        self.fault: SessionFault | None = None  # set when the control frames overflowed
        self.overflowed = False  # they did: the client is not reading (its closing sends none of them)
        self._wake = wake
        self.woken = False
        self.closed = False
        self.deliveries_waiting = 0  # DELIVER entries in `sealed` and `open_frames`
        self.delivery_bytes_waiting = 0  # their messages' bytes
        self.full = False  # either reached its bound since the last take: no subscription delivers

    def wake(self) -> None:
        """Tell the writer task there is something to collect (once until it collects)."""
        if not self.woken and not self.closed:
            self.woken = True
            self._wake()

    def close(self) -> None:
        """Nothing more is queued or woken for. The writer's wake-up, a method of the connection's handler,
        is let go: the handler holds the session that holds this outbox, and that cycle would keep every
        closed connection (about 5 KB with its buffers) until the collector's rare full pass (a storm of
        3,000 dropped connections grew the broker ~15 MiB each time, a tester)."""
        self.closed = True
        self._wake = _no_wake

    def send(self, frame: Frame) -> None:
        """Queue a control frame; never raises (see the module's docstring)."""
        if self.closed:
            return
        if len(self.control) >= self.max_frames or self.control_bytes > MAX_CONTROL_BYTES:
            self.overflowed = True
            if self.fault is None:
                self.fault = SessionFault(ErrorCode.INTERNAL_ERROR, "client is not reading: too many frames pending "
                                          f"({len(self.control)} frames, about {self.control_bytes} bytes)")
            return
        self.control.append(frame)
        self.control_bytes += control_cost(frame)
        self.wake()

    def deliver(self, sub_id: int, entry: DeliveryEntry, size: int) -> None:
        """Add one delivery of `size` charged bytes to its subscription's open DELIVER frame."""
        entries = self.open_frames.get(sub_id)
        if entries is None:
            entries = self.open_frames[sub_id] = []
            self._open_bytes[sub_id] = 0
        entries.append(entry)
        self.deliveries_waiting += 1
        self.delivery_bytes_waiting += size
        if (self.deliveries_waiting >= MAX_DELIVERIES_WAITING
                or self.delivery_bytes_waiting >= MAX_DELIVERY_BYTES_WAITING):
            self.full = True
        size += self._open_bytes[sub_id]
        if size >= self.max_delivery_frame_bytes:
            # Seal the frame so none exceeds the frame size or the entries the client accepts (the
            # core keeps max_delivery_frame_bytes <= MAX_ENTRIES_PER_FRAME x MESSAGE_OVERHEAD).
            self.sealed.append(Deliver(sub_id, entries))
            del self.open_frames[sub_id], self._open_bytes[sub_id]
        else:
            self._open_bytes[sub_id] = size
        self.wake()

    def deliver_many(self, sub_id: int, entries: list[DeliveryEntry], total: int, sizes: Iterable[int]) -> None:
        """`deliver` for a run of deliveries to one subscription, `total` charged bytes in all (`sizes`:
        each one's, in order, read only when a frame fills up: the caller passes a lazy iterable),
        sealing frames at the same entries as `deliver` would; wakes the writer once."""
        if not entries:
            return  # (an open frame must never be empty: DELIVER carries at least one entry)
        self.deliveries_waiting += len(entries)
        self.delivery_bytes_waiting += total
        if (self.deliveries_waiting >= MAX_DELIVERIES_WAITING
                or self.delivery_bytes_waiting >= MAX_DELIVERY_BYTES_WAITING):
            self.full = True
        open_frames, open_bytes = self.open_frames, self._open_bytes
        frame = open_frames.get(sub_id)
        used = open_bytes.get(sub_id, 0)
        budget = self.max_delivery_frame_bytes
        if used + total < budget:  # the common case: no frame fills up
            if frame is None:
                open_frames[sub_id] = entries
            else:
                frame += entries
            open_bytes[sub_id] = used + total
        else:
            if frame is None:
                frame = []
            sealed = self.sealed
            for entry, size in zip(entries, sizes):
                frame.append(entry)
                used += size
                if used >= budget:
                    sealed.append(Deliver(sub_id, frame))
                    frame = []
                    used = 0
            if frame:
                open_frames[sub_id] = frame
                open_bytes[sub_id] = used
            else:
                open_frames.pop(sub_id, None)
                open_bytes.pop(sub_id, None)
        self.wake()

    def drop_subscription(self, sub_id: int) -> tuple[dict[int, bool], int]:
        """A cancelled subscription's DELIVER frames not yet taken by the writer are dropped (their
        messages go back to the queue): none follows the CANCEL's OK, whose tags the client could no
        longer settle (a tester). Returns the dropped entries' tags and their redelivered flags, and
        their bytes (message_size, as the connection's byte buffer charged them: the caller gives them
        back to it, since the client never sees them). O(frames waiting) plus the entries dropped:
        CANCEL is a request, not a per-message frame."""
        gone: list[DeliveryEntry] = []
        if self.sealed:
            kept: list[Frame] = []
            for frame in self.sealed:
                if isinstance(frame, Deliver) and frame.subscription_id == sub_id:
                    gone += frame.entries
                else:
                    kept.append(frame)
            self.sealed = kept
        entries = self.open_frames.pop(sub_id, None)
        self._open_bytes.pop(sub_id, None)
        if entries:
            gone += entries
        if not gone:
            return {}, 0
        dropped = {entry[0]: entry[5] for entry in gone}
        # what the dropped entries were charged (they carry no size: recounted, in proportion to them,
        # never to what stays: a CANCEL's cost must not grow with another subscription's backlog)
        nbytes = sum(message_size(entry[3], entry[4]) for entry in gone)
        if self.sealed or self.open_frames:
            self.deliveries_waiting -= len(gone)
            self.delivery_bytes_waiting -= nbytes
        else:
            self.deliveries_waiting = self.delivery_bytes_waiting = 0
        return dropped, nbytes

    def take_control(self) -> list[Frame]:
        """The control frames queued, in order; the writer is no longer woken for them."""
        self.woken = False
        frames, self.control = self.control, []
        self.control_bytes = 0
        return frames

    def take_deliveries(self, frames: list[Frame]) -> None:
        """Append every DELIVER frame due, sealed ones first, to `frames`. (`full` stays set for the
        caller, which dispatches the subscriptions it held back.)"""
        self.deliveries_waiting = 0
        self.delivery_bytes_waiting = 0
        if self.sealed:
            frames.extend(self.sealed)
            self.sealed = []
        if self.open_frames:
            for sub_id, entries in self.open_frames.items():
                frames.append(Deliver(sub_id, entries))
            self.open_frames = {}
            self._open_bytes = {}

    @property
    def pending(self) -> int:
        """Frames waiting now (control frames, sealed and open DELIVER frames)."""
        return len(self.control) + len(self.sealed) + len(self.open_frames)
