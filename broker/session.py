"""The broker's state for one client connection: who it is, whether it is open, and its two halves.

A session may produce and consume at once. Its producer half is a `TransferReceiver`
(protocol/session.py: transfer ids, credit check, completions, BUFFER_ACK scheduling) plus what the
broker adds around it: the destinations it is flow-stopped on and the transfers held for it. Its
consumer half is a `DeliveryLedger` (protocol/delivery.py: delivery tags, unsettled deliveries,
the connection-level byte buffer) plus its subscriptions. What is due to the client waits in its
`Outbox` (broker/outbox.py) until the connection's writer task calls `collect()`. Nothing here does
I/O, and the session rules themselves live in protocol/, where their tests need no broker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowbroker.broker.message import SessionRef
from flowbroker.broker.outbox import Outbox, SessionFault
from flowbroker.broker.parking import ParkedTransfers
from flowbroker.protocol.credit import MESSAGE_OVERHEAD, ReceiverWindow, SenderWindow
from flowbroker.protocol.delivery import DeliveryLedger
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import BufferAck, BufferControl, Error, FlowResumed, FlowStopped, Frame
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from flowbroker.protocol.names import ALL_DESTINATIONS, THRESHOLD_FLOW_STOP_AGE, THRESHOLD_FLOW_STOP_DRAIN_TIME
from flowbroker.protocol.ranges import IdSet
from flowbroker.protocol.session import TransferReceiver

if TYPE_CHECKING:
    from flowbroker.broker.core import Fanning, RoutingRest
    from flowbroker.broker.message import HeldTransfer, Message, SequenceKey
    from flowbroker.broker.permissions import Access
    from flowbroker.broker.queue import Queue
    from flowbroker.broker.subscription import Subscription

__all__ = ["Session", "SessionFault", "SessionStatistics"]


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    """A snapshot of one connection, in the credit vocabulary (bytes); cheap, read from live counters."""

    conn_id: int
    client_name: str
    open: bool
    # producer half (the broker receives transfers)
    position: int
    consumed_position: int
    acked_position: int
    window: int
    limit: int
    transfers_received: int
    transfers_completed: int
    transfers_held_now: int
    transfers_held_total: int
    flow_stopped_destinations: int
    # consumer half (the broker delivers)
    subscriptions: int
    unsettled: int
    delivered: int
    sender_position: int
    sender_acked_position: int
    sender_window: int
    transfers_duplicate: int = 0
    """Transfers of an idempotent producer completed at once as duplicates (broker/idempotence.py)."""


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
        self.outbox = Outbox(wake, max_outbox_frames, max_delivery_frame_bytes)
        self.now_ns = 0  # set by the shell before it hands frames to the core
        self.peer_host: str | None = None  # the client's IP address (TCP): where its UDP datagrams come from
        self.access: Access | None = None  # its user's permissions (broker/permissions.py); None: may do anything
        # The broker-wide count of ERROR frames sent, by code, that send() adds to (metrics); None for a
        # session whose frames reach no wire of their own (a UDP publication's: its owner relays them).
        self.errors_sent: Counter[ErrorCode] | None = None
        # producer half
        self.transfers = TransferReceiver(buffer_size, flow_control)  # (the core sets its max_message)
        # A UDP publication's session: its producer's window is the broker's own status messages, so a
        # shrink is in force at once (the core answers it for it: `BrokerCore._apply_buffer_sizes`).
        self.fences_itself = False
        self.heard_ns = 0  # when the shell last handed the core frames from it (BrokerCore._close_unanswered_shrinks)
        self.window_listener: Callable[[Session], None] | None = None  # told of each grant while a
        # shrunk window leaves the limit above acknowledged + buffer (the core returns it to the pool)
        self.flow_stopped_on: dict[str, tuple[Queue | None, int]] = {}  # destination -> (queue, since_ns)
        self.transfers_held_total = 0  # running count of transfers ever held (metrics)
        self.transfers_held_now = 0  # kept by HeldTransfer, so the admin view need not walk every queue
        self.ref = SessionRef(self)  # what its held transfers keep of it (cut when its connection closes)
        self.flow_stops = 0  # times a destination it was not stopped on stopped it (metrics)
        # Pacing ([queues] pace_producers, docs/policies.md): a queue it routed to that is behind its
        # consumers; until it catches up (Queue.paced) or the flow timer gives up waiting, its completions
        # and credit are not sent (`collect`), so its window fills and it waits, as for credit.
        self.paced_on: Queue | None = None
        self.paced_total = 0  # times it was paced (views, metrics)
        self.duplicates = 0  # an idempotent producer's transfers completed as duplicates, not enqueued
        self.messages_dropped = 0  # a UDP publication's messages dropped: a bad envelope, over term_length / 8 (broker/udp/ingress.py)
        # what is left to route of a TRANSFER with a large fan-out (BrokerCore.route_rest): routed before its next frame
        self.routing_rest: RoutingRest | None = None
        self.fanning: Fanning | None = None  # a message of that rest whose own fan-out is being copied in slices
        # what it sent that fans out, and everything after it, while the memory alarm is on: routed by its
        # writer once the alarm clears (broker/parking.py)
        self.parked = ParkedTransfers()
        self.answers_waiting = 0  # its requests' answers waiting for the journal's commit (AnswerAfterCommit)
        # its idempotent messages held now, by (producer key, sequence): the core's orphans when it closes,
        # for the producer's resend on its next connection to adopt (broker/message.py HeldTransfer)
        self.held_sequences: dict[SequenceKey, HeldTransfer] = {}
        self.report_unroutable = False  # HELLO asked for CAPABILITY_MANDATORY: ERROR UNROUTABLE per transfer
        # that reached no queue (protocol/capabilities.py)
        self.deliver_batches = False  # HELLO asked for CAPABILITY_DELIVER_BATCH: its UDP consumers take batches
        self.broker_stops: tuple[str, ...] = ()  # broker-wide stops holding this producer: "admin", "memory"
        self.broker_stop: FlowStopped | None = None  # the FLOW_STOPPED "*" that announced them
        self.disk_stop: FlowStopped | None = None  # the disk alarm's FLOW_STOPPED to it (broker/journal.py)
        # consumer half
        self.deliveries: DeliveryLedger[Subscription, Message] = DeliveryLedger()
        self.subscriptions: dict[int, Subscription] = {}
        self.group_memberships = 0  # multicast groups joined (broker/udp/multicast.py): they consume too
        self.dispatch_turn = 0  # which subscription gets the connection buffer's freed space first
        self.stalled_since_ns: int | None = None  # consumer buffer full with no acknowledgement since then
        self.frame_seq: int | None = None  # the client frame being handled (set by the shell): what an ERROR about it names
        self._stall_acked = -1  # the buffer's acknowledged position when the timer last looked
        self._stall_oldest = 0  # the oldest unsettled delivery tag then (0: none)

    def __repr__(self) -> str:
        return f"<Session {self.conn_id} {self.client_name!r}>"

    # -- the halves' state, under the names the core, the views and the tests read -------------

    @property
    def buffer_size(self) -> int:
        return self.transfers.window.window

    @property
    def receiver_window(self) -> ReceiverWindow:
        return self.transfers.window

    @property
    def next_transfer_id(self) -> int:
        return self.transfers.next_transfer_id

    @property
    def completed(self) -> IdSet:
        return self.transfers.completed

    @property
    def credit_waiting(self) -> bool:
        """A producer waiting for a share of the pool: its BUFFER_ACKs are withheld."""
        return self.transfers.credit_waiting

    @credit_waiting.setter
    def credit_waiting(self, waiting: bool) -> None:
        self.transfers.credit_waiting = waiting

    @property
    def sender_window(self) -> SenderWindow:
        return self.deliveries.window

    @property
    def unsettled(self) -> dict[int, tuple[Subscription, Message]]:
        return self.deliveries.unsettled

    @property
    def fault(self) -> SessionFault | None:
        """Set when the outbox overflowed or the connection was refused; raised at its next frame."""
        return self.outbox.fault

    @fault.setter
    def fault(self, fault: SessionFault | None) -> None:
        self.outbox.fault = fault

    # -- outbox ------------------------------------------------------------------------------

    def wake(self) -> None:
        self.outbox.wake()

    def send(self, frame: Frame) -> None:
        """Queue a control frame (never raises: see broker/outbox.py). An ERROR is counted by its code
        here, where every ERROR the core sends passes: control frames are not per message."""
        if type(frame) is Error and self.errors_sent is not None:
            self.errors_sent[frame.code] += 1
        self.outbox.send(frame)

    def collect(self, now_ns: int) -> list[Frame]:
        """Everything due to the client now, in order: control, completions, credit, deliveries."""
        outbox, transfers = self.outbox, self.transfers
        frames = outbox.take_control()
        # Each part is asked only when it may have something: this runs once per frame written, and
        # a connection that only produces or only consumes would otherwise pay for the other half.
        # A paced producer's completions and credit wait (its queue wakes the outbox when it catches up).
        if self.paced_on is None:
            if transfers.newly_completed or transfers.completed.cumulative != transfers.reported_cumulative:
                frames += transfers.completions()
            window = transfers.window
            if window.consumed_position != window.acked_position:
                ack = transfers.ack_due(now_ns)
                if ack is not None:
                    frames.append(self._granted(ack))
        if outbox.sealed or outbox.open_frames:
            outbox.take_deliveries(frames)
        if outbox.full:  # subscriptions went without credit while it was full: they may deliver again
            # (checked whether or not deliveries were taken: a CANCEL may have emptied it, and its OK
            # brings the writer here with nothing else to take)
            outbox.full = False
            self._resume_deliveries()
        return frames

    def _resume_deliveries(self) -> None:
        """The writer took the deliveries of a full outbox (Outbox's MAX_DELIVERIES_WAITING): every
        subscription rejoins its queue's rotation, and each queue dispatches. Into the outbox just
        emptied: the writer is woken for them and collects them next."""
        queues: dict[Queue, None] = {}
        for sub in list(self.subscriptions.values()):
            sub.queue.resume_subscription(sub)
            queues[sub.queue] = None
        for queue in queues:
            queue.dispatch()

    def poll_credit(self, now_ns: int) -> None:
        """Timer: re-advertise the position after the interval (see TransferReceiver.poll)."""
        ack = self.transfers.poll(now_ns)
        if ack is not None:
            self.send(self._granted(ack))

    def release_withheld(self, now_ns: int) -> None:
        """It no longer waits for a pool share: acknowledge at once what its waiting held back."""
        ack = self.transfers.release_withheld(now_ns)
        if ack is not None:
            self.send(self._granted(ack))

    def _granted(self, ack: BufferAck) -> BufferAck:
        if self.window_listener is not None:
            self.window_listener(self)
        return ack

    # -- producer half -----------------------------------------------------------------------

    def complete_transfer(self, transfer_id: int, size: int) -> None:
        """A held transfer is released (the core completes the others through `transfers` directly)."""
        if not self.open:
            return
        self.transfers.complete(transfer_id, size)
        self.outbox.wake()

    def complete_transfers(self, first_id: int, count: int, size: int) -> None:
        """`complete_transfer` for the `count` held transfers from `first_id` on, `size` bytes in all."""
        if not self.open:
            return
        self.transfers.complete_run(first_id, count, size)
        self.outbox.wake()

    def resize_buffer(self, size: int, now_ns: int) -> None:
        """A credit policy changed this producer's buffer (the caller sends the BUFFER_CONTROL)."""
        self.transfers.resize(size)

    def announce_buffer(self, size: int) -> None:
        """A credit policy changed this producer's buffer: resize it and tell the client (BUFFER_CONTROL),
        counted, so the client's BUFFER_LIMIT answer can name the one it answers."""
        self.transfers.announced(size)
        self.send(BufferControl(0, size))

    def flow_stopped(self, queue: Queue) -> None:
        threshold, limit, value = queue.stop_reason
        unit = " ms" if threshold in (THRESHOLD_FLOW_STOP_DRAIN_TIME, THRESHOLD_FLOW_STOP_AGE) else ""
        self.flow_stopped_on[queue.name] = (queue, self.now_ns)
        self.flow_stops += 1  # a queue stops a producer once until it resumes it
        self.send(
            FlowStopped(
                queue.name,
                threshold,
                limit,
                value,
                f"queue {queue.name!r} is over {threshold} ({value}{unit} > {limit}{unit}); transfers are held",
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
            if ALL_DESTINATIONS not in self.flow_stopped_on:
                self.flow_stops += 1
            since = self.flow_stopped_on.get(ALL_DESTINATIONS, (None, self.now_ns))[1]
            self.flow_stopped_on[ALL_DESTINATIONS] = (None, since)
            self.send(stop)
        elif self.flow_stopped_on.pop(ALL_DESTINATIONS, None) is not None:
            self.send(FlowResumed(ALL_DESTINATIONS))

    # -- consumer half -----------------------------------------------------------------------

    def consumer_stalled(self, now_ns: int) -> int | None:
        """Since when the connection's consumer has taken all it may and moved nothing, or None: its byte
        buffer full with no acknowledgement moving it (DCP's stuck consumer), or a subscription at its
        prefetch with the oldest unsettled delivery still unsettled (RabbitMQ's consumer_timeout looks at
        the same; without a byte buffer a consumer that never settles was never reported, while its
        unsettled messages kept its queue's producers flow-stopped). The connection's timer calls this
        every tick, so the state is kept here, where the metrics read it, rather than in the timer: what
        did not move between two looks is stalled from the second look on."""
        deliveries = self.deliveries
        buf = deliveries.window
        tags = deliveries.tags
        oldest = tags[0] if tags else 0
        # A subscription's own byte buffer counts as its prefetch does: full, with the oldest delivery
        # not moving (a consumer with buffer_size=4096 that never processed was never reported, a tester).
        if (buf.window and not buf.may_send() and buf.acked_position == self._stall_acked) or (
            oldest and oldest == self._stall_oldest
            and any(sub.unsettled >= sub.prefetch or (sub.sender_window.window and not sub.sender_window.may_send())
                    for sub in self.subscriptions.values())
        ):
            if self.stalled_since_ns is None:
                self.stalled_since_ns = now_ns
        else:
            self.stalled_since_ns = None
            self._stall_acked = buf.acked_position
            self._stall_oldest = oldest
        return self.stalled_since_ns

    # -- end ---------------------------------------------------------------------------------

    def detach(self, unsent: dict[int, bool]) -> None:
        """The connection ended: give back unsettled deliveries in order, leave every queue. `unsent`: the
        tags of those never written to the client, with their flags, which they keep (the client never saw
        them); the rest go back flagged redelivered."""
        self.open = False
        self.outbox.close()
        by_queue: dict[Queue, tuple[list[Message], list[bool]]] = {}
        for tag, (sub, msg) in self.deliveries.close_tagged():
            msgs, flags = by_queue.setdefault(sub.queue, ([], []))
            msgs.append(msg)
            flags.append(unsent.get(tag, True))
        for sub in self.subscriptions.values():
            sub.queue.remove_subscription(sub)
        self.subscriptions.clear()
        for queue, (msgs, flags) in by_queue.items():
            queue.requeue_many(msgs, flags if unsent else None)
        for stopped_queue, _ in self.flow_stopped_on.values():
            if stopped_queue is not None:
                stopped_queue.stopped_producers.pop(self, None)
        self.flow_stopped_on.clear()

    def statistics(self) -> SessionStatistics:
        producer, consumer = self.transfers.statistics(), self.deliveries.statistics()
        return SessionStatistics(
            conn_id=self.conn_id,
            client_name=self.client_name,
            open=self.open,
            position=producer.position,
            consumed_position=producer.consumed_position,
            acked_position=producer.acked_position,
            window=producer.window,
            limit=producer.limit,
            transfers_received=producer.transfers_received,
            transfers_completed=producer.transfers_completed,
            transfers_held_now=self.transfers_held_now,
            transfers_held_total=self.transfers_held_total,
            flow_stopped_destinations=len(self.flow_stopped_on),
            subscriptions=len(self.subscriptions),
            unsettled=consumer.unsettled,
            delivered=consumer.delivered,
            sender_position=consumer.position,
            sender_acked_position=consumer.acked_position,
            sender_window=consumer.window,
            transfers_duplicate=self.duplicates,
        )
