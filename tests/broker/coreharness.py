"""Drive `BrokerCore` in memory: simulated clients that see only the frames a real client would.

`Harness` builds a core with a fake clock. `Producer` and `Consumer` each open a session, feed frames
to `core.handle()` and read what the client would receive with `session.collect(now)`. They keep the
client's own bookkeeping, mirrored from those frames: a producer's window of uncompleted transfers and
its byte credit (`SenderWindow`, moved only by BUFFER_ACK / BUFFER_CONTROL frames), its flow-stopped
destinations and the errors it got; a consumer's deliveries, unsettled tags and buffer positions.
Nothing here reads broker internals except the session object the broker hands out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.session import Session
from flowbroker.policies.credit import WAIT_GRANT
from flowbroker.protocol.credit import SenderWindow, message_size
from flowbroker.protocol.frames import (
    Bind,
    BufferAck,
    BufferControl,
    BufferLimit,
    Complete,
    DeclareExchange,
    DeclareQueue,
    Deliver,
    DeliveryEntry,
    Error,
    FlowResumed,
    FlowStopped,
    Frame,
    Headers,
    Noop,
    Ok,
    Outcome,
    PurgeQueue,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    Unbind,
)
from flowbroker.protocol.ranges import IdSet, to_ranges

__all__ = ["Harness", "Client", "Producer", "Consumer", "MiB", "REQUEST_ID_BASE"]

MiB = 1024 * 1024
REQUEST_ID_BASE = 2**62
"""Request ids start here, as in the SDK, so an ERROR's ref_id tells a request from a transfer."""


class Harness:
    """A `BrokerCore` with a fake clock (`t` in ns). Overrides are `load_config` sections."""

    def __init__(self, **sections: dict[str, Any]):
        overrides: dict[str, dict[str, Any]] = {"server": {"memory_quota": 1 << 30}}
        for name, values in sections.items():
            overrides.setdefault(name, {}).update(values)
        self.config = load_config(None, overrides)
        self.t = [0]
        self.core = BrokerCore(self.config, lambda: self.t[0])

    @property
    def now(self) -> int:
        return self.t[0]

    def advance(self, seconds: float) -> None:
        self.t[0] += int(seconds * 1e9)

    def producer(
        self, name: str = "producer", *, flow_control: bool = True, window: int | None = None, fences: bool = False
    ) -> Producer:
        """`fences`: answer every BUFFER_CONTROL with BUFFER_LIMIT, as the SDK does; without it, a client
        from before BUFFER_LIMIT."""
        return Producer(self, name, flow_control=flow_control, window=window, fences=fences)

    def consumer(self, name: str = "consumer", *, flow_control: bool = False,
                 capabilities: Collection[str] = ()) -> Consumer:
        """`flow_control=True` is what the SDK does by default: a connection that only consumes.
        `capabilities`: what its HELLO asked for (protocol/capabilities.py)."""
        return Consumer(self, name, flow_control=flow_control, capabilities=capabilities)

    def queue(self, name: str, **arguments: Any) -> None:
        """Declare a queue through the core's API (not a frame)."""
        self.core.declare_queue(name, arguments or None)


class Client:
    """One connection: frames in, frames out, and what a client learns from them."""

    def __init__(self, harness: Harness, name: str, *, flow_control: bool, capabilities: Collection[str] = ()):
        self.h = harness
        self.core = harness.core
        self.wakes = 0
        self.session: Session = self.core.open_session(name, "anonymous", flow_control, self._wake,
                                                       capabilities=capabilities)
        self.frames: list[Frame] = []  # everything ever received, in order
        self.errors: list[Error] = []
        self.oks: dict[int, Ok] = {}
        self.request_errors: dict[int, Error] = {}
        self._next_request_id = REQUEST_ID_BASE

    def _wake(self) -> None:
        self.wakes += 1

    # -- frames --------------------------------------------------------------------------------

    def handle(self, frame: Frame) -> None:
        """As the shell does: a TRANSFER whose fan-out the core routes in slices is routed to its end."""
        self.core.handle(self.session, frame)
        while self.session.routing_rest is not None:
            self.core.route_rest(self.session)

    def pump(self) -> list[Frame]:
        """Collect what the broker has for this client now and act on it, as the client would; first, as
        the shell's writer does, route what the session parked under the memory alarm once it is off."""
        while self.core.parked_due(self.session):
            self.core.route_parked(self.session)
        frames = self.session.collect(self.h.now)
        for frame in frames:
            self.frames.append(frame)
            self.on_frame(frame)
        return frames

    def on_frame(self, frame: Frame) -> None:
        if isinstance(frame, Ok):
            self.oks[frame.request_id] = frame
        elif isinstance(frame, Error):
            if frame.ref_id is not None and frame.ref_id >= REQUEST_ID_BASE:
                self.request_errors[frame.ref_id] = frame
            else:
                self.errors.append(frame)
        elif isinstance(frame, Noop):
            pass

    def received(self, kind: type[Any]) -> list[Any]:
        return [f for f in self.frames if isinstance(f, kind)]

    def request(self, make: Any) -> Ok | Error:
        """Send a request frame built by `make(request_id)`; returns its answer (Ok or Error)."""
        rid = self._next_request_id
        self._next_request_id += 1
        self.handle(make(rid))
        self.pump()
        answer: Ok | Error | None = self.oks.get(rid) or self.request_errors.get(rid)
        assert answer is not None, f"no answer to request {rid}"
        return answer

    def ok(self, make: Any) -> dict[str, Any]:
        answer = self.request(make)
        assert isinstance(answer, Ok), answer
        return answer.result

    def declare_queue(self, name: str, **arguments: Any) -> Ok | Error:
        return self.request(lambda rid: DeclareQueue(rid, name, False, arguments or None))

    def declare_exchange(self, name: str, kind: str) -> Ok | Error:
        return self.request(lambda rid: DeclareExchange(rid, name, kind))

    def bind(self, queue: str, exchange: str, key: str = "") -> Ok | Error:
        return self.request(lambda rid: Bind(rid, queue, exchange, key))

    def unbind(self, queue: str, exchange: str, key: str = "") -> Ok | Error:
        return self.request(lambda rid: Unbind(rid, queue, exchange, key))

    def purge(self, queue: str) -> Ok | Error:
        return self.request(lambda rid: PurgeQueue(rid, queue))

    def close(self) -> None:
        self.core.close_session(self.session)


class Producer(Client):
    """A producer that keeps the SDK's books: window of uncompleted transfers, byte credit from the
    Welcome's buffer size moved by BUFFER_ACK/BUFFER_CONTROL, flow-stopped destinations."""

    def __init__(self, harness: Harness, name: str, *, flow_control: bool, window: int | None, fences: bool = False):
        super().__init__(harness, name, flow_control=flow_control)
        self.window = window
        self.fences = fences
        self.buffer_limits: list[BufferLimit] = []  # the BUFFER_LIMITs sent (with `fences`)
        # The WELCOME frame carries session.buffer_size; nothing else is read from the session.
        self.credit = SenderWindow(self.session.buffer_size if flow_control else 0)
        self.welcome_buffer = self.session.buffer_size
        self.next_id = 1
        self.sizes: dict[int, int] = {}
        self.completed = IdSet()
        self.outstanding: dict[int, int] = {}  # transfer id -> size, not yet completed
        self.stopped: dict[str, FlowStopped] = {}
        self.flow_events: list[FlowStopped | FlowResumed] = []
        self.completions: list[int] = []  # transfer ids in the order their completion was learnt
        self.grants: list[BufferAck] = []
        self.buffer_controls: list[BufferControl] = []
        self.reads_credit = True  # can_send() reads frames when only the provisional grant stops it

    def can_send(self) -> bool:
        if self.window is not None and len(self.outstanding) >= self.window:
            return False
        if not self.credit.may_send() and self.reads_credit and self.provisional_spent():
            self.pump()  # as the SDK waits for credit: its first message registered it, the share follows
        return self.credit.may_send()

    def provisional_spent(self) -> bool:
        """Sent the one message its provisional grant (WAIT_GRANT, from WELCOME) allows, and not yet
        read the BUFFER_CONTROL that registering as a producer brings (if any share was free)."""
        return self.welcome_buffer == WAIT_GRANT and not self.buffer_controls and self.next_id > 1

    def send(
        self, exchange: str, routing_key: str, body: bytes = b"x", headers: Headers | None = None, *, force: bool = False
    ) -> int:
        """Send one message; unless `force`, only when window and credit allow. Returns its transfer id."""
        return self.send_many([(exchange, routing_key, body, headers)], force=force)[0]

    def send_many(
        self,
        messages: Iterable[tuple[str, str, bytes, Headers | None]],
        *,
        force: bool = False,
        producer_id: str | None = None,
        sequences: Iterable[int | None] = (),
    ) -> list[int]:
        """Several messages in one TRANSFER frame (each checked against window and credit first); with
        `producer_id`, as an idempotent producer: the messages carry it and `sequences`, in order."""
        entries: list[TransferEntry] = []
        ids: list[int] = []
        numbers = iter(sequences)
        for exchange, key, body, headers in messages:
            if not force:
                assert self.can_send(), f"no credit: {len(self.outstanding)}/{self.window}, {self.credit.outstanding}/{self.credit.window}"
            size = message_size(body, headers)
            tid = self.next_id + len(entries)
            sequence = next(numbers, None) if producer_id is not None else None
            entries.append(TransferEntry(exchange, key, body, headers, producer_id, sequence))
            ids.append(tid)
            self.credit.on_sent(size)
            self.sizes[tid] = size
            self.outstanding[tid] = size
        first = self.next_id
        self.next_id += len(entries)
        self.handle(Transfer(first, entries))
        return ids

    def on_frame(self, frame: Frame) -> None:
        super().on_frame(frame)
        if isinstance(frame, Complete):
            before = set(self.outstanding)
            self.completed.cumulative = max(self.completed.cumulative, frame.cumulative_id)
            self.completed.add_ranges(frame.ranges)
            for tid in sorted(before):
                if tid in self.completed:
                    del self.outstanding[tid]
                    self.completions.append(tid)
        elif isinstance(frame, BufferAck):
            assert frame.opaque == 0, frame
            self.grants.append(frame)
            self.credit.on_ack(frame.acked_position)  # raises if the broker acknowledges bytes never sent
        elif isinstance(frame, BufferControl):
            assert frame.opaque == 0, frame
            self.buffer_controls.append(frame)
            self.credit.resize(frame.buffer_size)
            if self.fences and frame.buffer_size:
                # the SDK's answer (ProducerLedger.buffer_limit): this client sends at once, so every
                # byte it admitted is already sent, and the next message starts below acked + size
                credit = self.credit
                fence = BufferLimit(len(self.buffer_controls), frame.buffer_size,
                                    max(credit.position, credit.acked_position + credit.window))
                self.buffer_limits.append(fence)
                self.handle(fence)
        elif isinstance(frame, FlowStopped):
            self.flow_events.append(frame)
            self.stopped[frame.destination] = frame
        elif isinstance(frame, FlowResumed):
            self.flow_events.append(frame)
            self.stopped.pop(frame.destination, None)

    def register(self) -> int:
        """Send one (unroutable) message and read the answer. A flow-controlled connection gets the
        policy's provisional buffer at connect and counts as a producer for the credit policy only
        from its first TRANSFER, so this is how a test makes it one. Returns the transfer id."""
        tid = self.send("amq.fanout", "register")
        self.pump()
        return tid

    def is_complete(self, tid: int) -> bool:
        return tid in self.completed

    def errors_for(self, tid: int) -> list[Error]:
        return [e for e in self.errors if e.ref_id == tid]


class Consumer(Client):
    """A consumer: subscriptions, deliveries, settlement and buffer acknowledgements."""

    def __init__(self, harness: Harness, name: str, *, flow_control: bool = False,
                 capabilities: Collection[str] = ()):
        super().__init__(harness, name, flow_control=flow_control, capabilities=capabilities)
        self.deliveries: list[tuple[int, DeliveryEntry]] = []  # (subscription id, entry), tag order
        self.unsettled: dict[int, tuple[int, DeliveryEntry]] = {}  # tag -> (sub id, entry)
        self.delivered_bytes: dict[int, int] = {0: 0}  # opaque (0 = connection) -> bytes delivered
        self.acked_bytes: dict[int, int] = {0: 0}  # opaque -> acked_position last sent
        self._next_sub = 1
        self.last_tag: dict[int, int] = {}
        self.tags_seen: set[int] = set()

    def subscribe(self, queue: str, *, prefetch: int = 0, buffer_size: int = 0, sub_id: int | None = None) -> int:
        if sub_id is None:
            sub_id = self._next_sub
        self._next_sub = max(self._next_sub, sub_id + 1)
        answer = self.request(lambda rid: Subscribe(rid, sub_id, queue, prefetch, buffer_size))
        assert isinstance(answer, Ok), answer
        self.delivered_bytes.setdefault(sub_id, 0)
        self.acked_bytes.setdefault(sub_id, 0)
        return sub_id

    def on_frame(self, frame: Frame) -> None:
        super().on_frame(frame)
        if isinstance(frame, Deliver):
            sub = frame.subscription_id
            # The broker fills DELIVER with plain tuples in DeliveryEntry's order (the wire is the same):
            # named here, as the SDK names what it decodes.
            for entry in map(DeliveryEntry._make, frame.entries):
                # Tags are unique per connection and increase per subscription. Across subscriptions
                # the wire order may differ from tag order: the outbox batches DELIVER per subscription.
                assert entry.delivery_tag > self.last_tag.get(sub, 0), f"tags of subscription {sub} must increase"
                assert entry.delivery_tag not in self.tags_seen, f"tag {entry.delivery_tag} reused"
                self.last_tag[sub] = entry.delivery_tag
                self.tags_seen.add(entry.delivery_tag)
                size = message_size(entry.body, entry.headers)
                self.deliveries.append((frame.subscription_id, entry))
                self.unsettled[entry.delivery_tag] = (frame.subscription_id, entry)
                self.delivered_bytes[0] += size
                self.delivered_bytes[frame.subscription_id] = self.delivered_bytes.get(frame.subscription_id, 0) + size

    def bodies(self, sub_id: int | None = None) -> list[bytes]:
        return [e.body for s, e in self.deliveries if sub_id is None or s == sub_id]

    def tags(self, sub_id: int | None = None) -> list[int]:
        return [t for t, (s, _) in self.unsettled.items() if sub_id is None or s == sub_id]

    def settle(self, outcome: Outcome, tags: Iterable[int]) -> None:
        tags = list(tags)
        for tag in tags:
            self.unsettled.pop(tag, None)
        if tags:
            self.handle(Settle(outcome, to_ranges(tags)))

    def ack(self, tags: Iterable[int] | None = None) -> None:
        self.settle(Outcome.ACK, self.tags() if tags is None else tags)

    def reject(self, tags: Iterable[int]) -> None:
        self.settle(Outcome.REJECT, tags)

    def requeue(self, tags: Iterable[int]) -> None:
        self.settle(Outcome.REQUEUE, tags)

    def buffer_ack(self, opaque: int = 0, acked_position: int | None = None) -> None:
        """Acknowledge buffer bytes (absolute); default: everything delivered on that buffer so far."""
        total = self.delivered_bytes.get(opaque, 0) if acked_position is None else acked_position
        freed = max(0, total - self.acked_bytes.get(opaque, 0))
        self.acked_bytes[opaque] = max(self.acked_bytes.get(opaque, 0), total)
        self.handle(BufferAck(opaque, freed, total))

    def set_buffer(self, opaque: int, size: int) -> None:
        self.handle(BufferControl(opaque, size))
