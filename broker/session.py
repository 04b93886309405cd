"""The broker's state for one client connection, and the outbox its writer task drains.

A session may produce and consume at once. As a producer it has contiguous transfer ids, a set of
completed ids (cumulative point plus ranges), a byte buffer whose acknowledgements it schedules
(the broker is the DCP *consumer* toward producers) and the destinations it is flow-stopped on.
As a consumer it has subscriptions, unsettled deliveries by tag, and an optional connection-level
byte buffer. Nothing here does I/O: queues and the router append to the outbox and call `wake`,
and the connection's writer task turns the outbox into frames with `collect()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from flowbroker.protocol.credit import MESSAGE_OVERHEAD, ReceiverWindow, SenderWindow
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import (
    BufferAck,
    Complete,
    DeliveryEntry,
    Deliver,
    FlowResumed,
    FlowStopped,
    Frame,
)
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME, MAX_RANGES_PER_FRAME
from flowbroker.protocol.names import ALL_DESTINATIONS
from flowbroker.protocol.ranges import IdSet, to_ranges

if TYPE_CHECKING:
    from flowbroker.broker.message import Message
    from flowbroker.broker.queue import Queue
    from flowbroker.broker.subscription import Subscription

__all__ = ["Session", "SessionFault", "ADMIN_DESTINATION"]

_make_entry = DeliveryEntry._make  # tuple.__new__: cheaper than the NamedTuple's Python __new__ (hot path)

ADMIN_DESTINATION = ALL_DESTINATIONS
"""protocol.names.ALL_DESTINATIONS under its old name here (kept while the session is rewritten)."""


class SessionFault(Exception):
    """The client broke a rule that ends its connection (credit violation, transfer id gap, ...)."""

    def __init__(self, code: ErrorCode, text: str):
        super().__init__(text)
        self.code = code


class Session:
    def __init__(
        self,
        conn_id: int,
        client_name: str,
        identity: str,
        flow_control: bool,
        buffer_size: int,
        wake: Callable[[], None],
        max_outbox_frames: int = 10_000,
        max_delivery_frame_bytes: int = MAX_ENTRIES_PER_FRAME * MESSAGE_OVERHEAD,
    ):
        self.conn_id = conn_id
        self.client_name = client_name
        self.identity = identity
        self.flow_control = flow_control
        self.open = True
        self._wake = wake
        self._woken = False
        self.max_outbox_frames = max_outbox_frames
        self.max_delivery_frame_bytes = max_delivery_frame_bytes
        # producer side
        self.next_transfer_id = 1
        self.completed = IdSet()
        self._newly_completed: list[int] = []
        self._sent_cumulative = 0
        # position: bytes received; limit: the highest limit ever granted (monotonic)
        self.receiver_window = ReceiverWindow(buffer_size if flow_control else 0)
        self.credit_waiting = False  # a producer waiting for a share of the pool: BUFFER_ACKs withheld
        self.window_listener: Callable[[Session], None] | None = None  # told of each grant while a
        # shrunk window leaves the limit above acknowledged + buffer (the core returns it to the pool)
        self.flow_stopped_on: dict[str, tuple[Queue | None, int]] = {}  # destination -> (queue, since_ns)
        self.transfers_held_total = 0  # running count of transfers ever held (metrics)
        self.report_unroutable = False  # HELLO asked for CAPABILITY_MANDATORY: ERROR UNROUTABLE per transfer
        # that reached no queue (protocol/capabilities.py)
        self.broker_stops: tuple[str, ...] = ()  # broker-wide stops holding this producer: "admin", "memory"
        self.broker_stop: FlowStopped | None = None  # the FLOW_STOPPED "*" that announced them
        self.transfers_held_now = 0  # kept by HeldTransfer, so the admin view need not walk every queue
        # consumer side
        self.subscriptions: dict[int, Subscription] = {}
        self.unsettled: dict[int, tuple[Subscription, Message]] = {}
        # The same tags in ascending order (tags only grow, so delivering appends): a SETTLE range finds
        # what it settles by bisection, costing its own size, never the number of tags outstanding.
        self.unsettled_tags: list[int] = []
        self.dispatch_turn = 0  # which subscription gets the connection buffer's freed space first
        self.next_delivery_tag = 1
        self.sender_window = SenderWindow(0)
        # outbox
        self._control: list[Frame] = []
        self._deliveries: dict[int, list[DeliveryEntry]] = {}  # open DELIVER frame per subscription
        self._delivery_bytes: dict[int, int] = {}
        self._sealed: list[Frame] = []  # DELIVER frames that reached the frame size budget
        self.now_ns = 0  # set by the shell before it hands frames to the core
        self.fault: SessionFault | None = None  # set when the outbox overflowed; see send()

    def __repr__(self) -> str:
        return f"<Session {self.conn_id} {self.client_name!r}>"

    @property
    def buffer_size(self) -> int:
        return self.receiver_window.window

    # -- outbox ------------------------------------------------------------------------------

    def wake(self) -> None:
        if not self._woken and self.open:
            self._woken = True
            self._wake()

    def send(self, frame: Frame) -> None:
        """Queue a control frame. A client that lets them pile up without reading is cut off.

        Never raises: frames for this session are often sent while *another* session's frame is
        handled (a consumer's ack resumes producers), and that session must not pay for this one.
        The fault is kept and raised by the core when this session next sends a frame."""
        if not self.open:
            return
        if len(self._control) >= self.max_outbox_frames:
            if self.fault is None:
                self.fault = SessionFault(ErrorCode.INTERNAL_ERROR, "client is not reading: too many frames pending")
            return
        self._control.append(frame)
        self.wake()

    def collect(self, now_ns: int) -> list[Frame]:
        """Everything due to the client now, in order: control, completions, credit, deliveries."""
        self._woken = False
        frames, self._control = self._control, []
        cumulative = self.completed.cumulative
        if self._newly_completed or cumulative != self._sent_cumulative:
            above = to_ranges(i for i in self._newly_completed if i > cumulative)
            for start in range(0, max(len(above), 1), MAX_RANGES_PER_FRAME):
                frames.append(Complete(cumulative, above[start : start + MAX_RANGES_PER_FRAME]))
            self._newly_completed = []
            self._sent_cumulative = cumulative
        credit = self.receiver_window
        if credit.pending >= credit.threshold() and not self.credit_waiting:
            ack = credit.flush(now_ns)  # None when byte flow control is off
            if ack is not None:
                frames.append(self._granted(ack))
        if self._sealed:
            frames.extend(self._sealed)
            self._sealed = []
        if self._deliveries:
            for sub_id, entries in self._deliveries.items():
                frames.append(Deliver(sub_id, entries))
            self._deliveries = {}
            self._delivery_bytes = {}
        return frames

    def poll_credit(self, now_ns: int) -> None:
        """Timer: after the interval, acknowledge what is pending and re-advertise the absolute position
        (even unchanged), so a lost grant costs a producer at most one interval."""
        ack = None if self.credit_waiting else self.receiver_window.poll(now_ns)
        if ack is not None:
            self.send(self._granted(ack))

    def _granted(self, ack: BufferAck) -> BufferAck:
        """Every grant raises the limit the credit check allows (monotonic: a shrink never lowers it)."""
        window = self.receiver_window
        window.limit = max(window.limit, ack.acked_position + window.window)
        if self.window_listener is not None:
            self.window_listener(self)
        return ack

    # -- producer side -----------------------------------------------------------------------

    def complete_transfer(self, transfer_id: int, size: int) -> None:
        if not self.open:
            return
        completed = self.completed
        if transfer_id == completed.cumulative + 1 and not completed.holes:
            completed.cumulative = transfer_id  # the common case, without IdSet's bookkeeping
        else:
            completed.add(transfer_id)
            self._newly_completed.append(transfer_id)
        self.receiver_window.consumed_position += size
        self.wake()

    def resize_buffer(self, size: int, now_ns: int) -> None:
        """A credit policy changed this producer's buffer. Shrinking below what is in flight loses
        nothing: the client just waits until acknowledgements bring it under the new size."""
        window = self.receiver_window
        window.window = size
        window.limit = max(window.limit, window.acked_position + size)

    def flow_stopped(self, queue: Queue) -> None:
        threshold, limit, value = queue.stop_reason
        self.flow_stopped_on[queue.name] = (queue, self.now_ns)
        self.send(
            FlowStopped(
                queue.name,
                threshold,
                limit,
                value,
                f"queue {queue.name!r} is over {threshold} ({value} > {limit}); transfers are held",
            )
        )

    def flow_resumed(self, queue: Queue) -> None:
        if self.flow_stopped_on.pop(queue.name, None) is not None:
            self.send(FlowResumed(queue.name))

    def broker_stopped(self, stop: FlowStopped | None, reasons: tuple[str, ...] = ()) -> None:
        """Broker-wide stops (destination `*`: "admin" for stop-all, "memory" for the memory alarm)
        changed: `reasons` are those in force and `stop` announces them, or None when none is."""
        self.broker_stops = reasons
        self.broker_stop = stop
        if stop is not None:
            since = self.flow_stopped_on.get(ADMIN_DESTINATION, (None, self.now_ns))[1]
            self.flow_stopped_on[ADMIN_DESTINATION] = (None, since)
            self.send(stop)
        elif self.flow_stopped_on.pop(ADMIN_DESTINATION, None) is not None:
            self.send(FlowResumed(ADMIN_DESTINATION))

    # -- consumer side -----------------------------------------------------------------------

    def deliver(self, sub: Subscription, msg: Message) -> None:
        tag = self.next_delivery_tag
        self.next_delivery_tag = tag + 1
        self.unsettled[tag] = (sub, msg)
        self.unsettled_tags.append(tag)
        self.sender_window.on_sent(msg.size)
        sub_id = sub.sub_id
        entries = self._deliveries.get(sub_id)
        if entries is None:
            entries = self._deliveries[sub_id] = []
            self._delivery_bytes[sub_id] = 0
        entries.append(_make_entry((tag, msg.exchange, msg.routing_key, msg.body, msg.headers, msg.redelivered)))
        size = self._delivery_bytes[sub_id] + msg.size
        if size >= self.max_delivery_frame_bytes:
            # Seal the frame so none exceeds the frame size or the entries the client accepts (the
            # core keeps max_delivery_frame_bytes <= MAX_ENTRIES_PER_FRAME x MESSAGE_OVERHEAD).
            self._sealed.append(Deliver(sub_id, entries))
            del self._deliveries[sub_id], self._delivery_bytes[sub_id]
        else:
            self._delivery_bytes[sub_id] = size
        self.wake()

    def detach(self) -> None:
        """The connection ended: give back unsettled deliveries in order, leave every queue."""
        self.open = False
        by_queue: dict[Queue, list[Message]] = {}
        for sub, msg in self.unsettled.values():
            by_queue.setdefault(sub.queue, []).append(msg)
        self.unsettled.clear()
        self.unsettled_tags.clear()
        for sub in self.subscriptions.values():
            sub.queue.remove_subscription(sub)
        self.subscriptions.clear()
        for queue, msgs in by_queue.items():
            queue.requeue_many(msgs)
        for stopped_queue, _ in self.flow_stopped_on.values():
            if stopped_queue is not None:
                stopped_queue.stopped_producers.pop(self, None)
        self.flow_stopped_on.clear()
