"""The broker's publications to UDP consumers (sans-IO): one per UDP subscription; the consumer's
status-message window is its byte credit, and its consumption position advances as its application
processes messages.

SUBSCRIBE_UDP makes a `UdpSubscription`: a `Subscription` of the consumer's TCP session like any other
(prefetch, SETTLE by tag, CANCEL and the connection's end requeue what is unsettled), whose deliveries go
into an Aeron `Publication` of the broker's (to the consumer's host and the port it named) instead of the
session's outbox, each as a DELIVER envelope (protocol/envelope.py) with its delivery tag. It takes a
message from its queue only while the consumer's window has room (the publication's position below the
sender limit its status messages set; one message may overflow it, as DCP lets one), so the broker never
has more than that window plus one message in flight to a consumer that has not processed them. A delivery
the publication cannot take at once waits in one slot and goes first when the window opens; status messages
that open the window put the subscription back in its queue's rotation.

A subscription alone in its queue's rotation takes a run (`UdpSubscription.deliver_ready`, as a TCP one
does): every message its prefetch and window allow in one call, the connection's ledger told once and the
data path woken once. When the consumer's connection asked for capability "deliver-batch" (the SDK does),
the run goes out as DELIVER_BATCH payloads, as many deliveries in each as fit one datagram (the publication's
mtu; a loopback consumer's is `[udp] loopback_mtu`, within its window), as a TCP run goes out as DELIVER
frames of many entries: the consumer then decodes and walks one Aeron message per batch, not one per
delivery. Otherwise each delivery is its own DELIVER payload, written into the term as its envelope head and
its body (the body copied once).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowbroker.broker.subscription import Subscription
from flowbroker.broker.udp.datapath import Address, Outgoing
from flowbroker.protocol.envelope import (
    BATCH_HEAD_BOUND,
    DELIVER_BATCH_KIND,
    delivery_entry_bound,
    delivery_head,
    pack_delivery_entries,
)
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from flowbroker.transport.frames import DATA_HEADER_LENGTH
from flowbroker.transport.publication import OfferResult, Publication, PublicationConfig

if TYPE_CHECKING:
    from flowbroker.broker.message import Message
    from flowbroker.broker.queue import Queue
    from flowbroker.broker.session import Session
    from flowbroker.broker.store import QueueStore
    from flowbroker.broker.udp.datapath import DataPath

__all__ = ["Egress", "UdpSubscription", "MAX_CLOSING"]

MAX_CLOSING = 16
EXACT_CHECK_SLACK = 2048
"""A message whose message_size is this far below the publication's maximum message length fits it whatever
its exchange and routing key (UdpSubscription._too_large): the exact envelope is measured only above."""
"""Closed publications kept until their end of stream went out and they lingered (0.2 s); beyond, dropped at
once. Each holds its log (3 x term_length) meanwhile: 256 of them let consumers that churned hold 1.5 GiB of
logs outside what configuration.md counted (a tester); 16 are 96 MiB at the defaults, counted there."""

_LINGER_NS = 200_000_000


@dataclass(eq=False)
class _Stream:
    """One UDP subscription's publication and where it goes."""

    session_id: int
    stream_id: int
    destination: tuple[str, int]
    publication: Publication
    subscription: UdpSubscription
    slot: bytes | None = None  # a delivery (or batch) the publication could not take yet (at most one)
    batch_room: int = 0  # the bytes of entries a DELIVER_BATCH may carry (one datagram's); 0: one DELIVER each


class UdpSubscription(Subscription):
    """A subscription whose deliveries travel over UDP (see the module docstring)."""

    __slots__ = ("stream", "egress", "oversized", "sure_fit")

    stream: _Stream
    egress: Egress
    oversized: int  # the size of a message too large for this subscription's publication (0: none yet)
    sure_fit: int  # a message of at most this message_size fits the publication, whatever its envelope

    def has_credit(self) -> bool:
        stream = self.stream
        pub = stream.publication
        # Asked before every delivery: the cheap comparisons first, the flow-control strategy's last.
        return (self.unsettled < self.prefetch and stream.slot is None and pub.position < pub.sender_limit
                and pub.is_connected
                and not ((store := self.queue.store) and store[0].size > self.sure_fit and self._too_large(store[0])))

    def _too_large(self, msg: Message) -> bool:
        """`msg`'s DELIVER envelope is over what the publication carries (Aeron's maximum message length,
        term_length / 8): offered, it raised and took the broker down (a tester). Then the subscription takes
        nothing more; the egress ends it at its next cycle, telling the client, and the message stays in the
        queue. Called only for a message whose message_size is above `sure_fit` (within EXACT_CHECK_SLACK of
        the limit: message_size counts body and headers generously; the exchange and routing key are at
        most 1,276 bytes more), so the common message costs one comparison, no call."""
        limit = self.stream.publication.max_message_length
        size = len(delivery_head(0xFFFFFFFF, msg.exchange, msg.routing_key, msg.headers, msg.redelivered)) + len(msg.body)
        if size <= limit:
            return False
        if not self.oversized:
            self.oversized = size
            self.egress.datapath.wake()
        return True

    def deliver(self, msg: Message) -> None:
        """The next tag of the connection, then the publication's term (not the outbox). Charged 0 bytes to
        the connection's TCP byte buffer: the consumer's window for these is its status messages'."""
        self.unsettled += 1
        self.delivered_total += 1
        tag = self.session.deliveries.deliver(self, msg, 0)
        _append(self.stream, delivery_head(tag, msg.exchange, msg.routing_key, msg.headers, msg.redelivered),
                msg.body)
        self.egress.datapath.wake()

    def deliver_ready(self, store: QueueStore) -> None:
        """Deliver ready messages from `store` while this subscription has credit (its queue's rotation holds
        only this one): `has_credit` and `deliver` once per message, with the checks read into locals, the
        connection's ledger told once for the run and the data path woken once. Each delivery goes into the
        term as its envelope head and its body (`Publication.offer_parts`: the body copied once). The run
        stops where `has_credit` would: prefetch used, the consumer's window (the sender limit) reached, or a
        delivery the publication could not take (it waits in the slot, as `deliver` leaves it)."""
        stream = self.stream
        pub = stream.publication
        room = self.prefetch - self.unsettled
        if room <= 0 or stream.slot is not None or not store or not pub.is_connected:
            return
        sender_limit = pub.sender_limit
        if pub.position >= sender_limit:
            return
        if stream.batch_room:
            self._deliver_batches(store, room, sender_limit)
            return
        ledger = self.session.deliveries
        take = store.take
        offer = pub.offer_parts
        sure_fit = self.sure_fit
        tag = ledger.next_tag
        msgs: list[Message] = []
        while True:
            if store[0].size > sure_fit and self._too_large(store[0]):
                break  # it stays ready; the egress ends this subscription (_too_large)
            msg = take()
            msgs.append(msg)
            head = delivery_head(tag, msg.exchange, msg.routing_key, msg.headers, msg.redelivered)
            position = offer(head, msg.body)
            if position < 0:
                position = _append_slow(stream, position, head, msg.body)
                if position < 0:
                    break  # in the slot now
            tag += 1
            room -= 1
            if not room or position >= sender_limit or not store:
                break
        n = len(msgs)
        self.unsettled += n
        self.delivered_total += n
        ledger.deliver_many(self, msgs, 0)  # the tags counted above, in order
        self.egress.datapath.wake()

    def _deliver_batches(self, store: QueueStore, room: int, sender_limit: int) -> None:
        """`deliver_ready` in DELIVER_BATCH payloads: entries are collected while their bounds
        (`delivery_entry_bound`) fit the batch's room, and the batch goes into the term when the next
        message would not fit (it opens the next batch), at MAX_ENTRIES_PER_FRAME, or at the run's end.
        A batch's room is one datagram's, and never more than what is left of the window (the first
        message of a batch always goes, so at most one message overflows the window, as with one DELIVER
        each). The run stops as `deliver_ready`'s: prefetch used, the window reached, the store empty, or a
        batch the publication could not take (it waits in the slot). A message too big for any batch goes
        alone as a DELIVER payload (fragmented by the publication)."""
        stream = self.stream
        pub = stream.publication
        batch_room = stream.batch_room
        ledger = self.session.deliveries
        take = store.take
        sure_fit = self.sure_fit
        tag = ledger.next_tag
        msgs: list[Message] = []
        batch: list[Any] = []
        space = min(batch_room, sender_limit - pub.position - DATA_HEADER_LENGTH)
        while True:
            msg = store[0]
            if msg.size > sure_fit and self._too_large(msg):
                break  # it stays ready; the egress ends this subscription (_too_large)
            body, exchange, routing_key, headers = msg.body, msg.exchange, msg.routing_key, msg.headers
            need = delivery_entry_bound(body, exchange, routing_key, headers)
            if batch and (need > space or len(batch) == MAX_ENTRIES_PER_FRAME):  # full: out it goes
                position = _offer_batch(stream, batch)
                batch = []
                if position < 0 or position >= sender_limit:
                    break  # in the slot, or the window is used: the message stays ready
                space = min(batch_room, sender_limit - position - DATA_HEADER_LENGTH)
            take()
            msgs.append(msg)
            room -= 1
            if need > batch_room:  # no batch can carry it: alone, as a DELIVER
                position = _append(stream, delivery_head(tag, exchange, routing_key, headers, msg.redelivered),
                                   body)
                tag += 1
                if position < 0 or position >= sender_limit or not room or not store:
                    break
                space = min(batch_room, sender_limit - position - DATA_HEADER_LENGTH)
                continue
            batch.append((tag, exchange, routing_key, body, headers, msg.redelivered))
            tag += 1
            space -= need
            if not room or not store:
                break
        if batch:
            _offer_batch(stream, batch)
        n = len(msgs)
        self.unsettled += n
        self.delivered_total += n
        ledger.deliver_many(self, msgs, 0)  # the tags counted above, in order
        self.egress.datapath.wake()


def _offer_batch(stream: _Stream, batch: list[Any]) -> int:
    """One DELIVER_BATCH into the stream's term (its kind byte and its packed entries, as two parts), or
    into the slot; the position, or the negative result that put it in the slot."""
    return _append(stream, DELIVER_BATCH_KIND, pack_delivery_entries(batch))


def _append(stream: _Stream, head: bytes, body: bytes) -> int:
    """One payload (`head` then `body`) into the stream's term, or into its slot when the publication
    cannot take it now; the position, or the negative result that put it in the slot."""
    position = stream.publication.offer_parts(head, body)
    if position < 0:
        position = _append_slow(stream, position, head, body)
    return position


def _append_slow(stream: _Stream, result: int, head: bytes, body: bytes) -> int:
    """An offer refused with `result`: after a term rotation (ADMIN_ACTION) offered again at once, as Aeron
    asks (it waited in the slot for the next status message); otherwise, or refused again, the delivery
    waits in the slot. Returns the position, or the (negative) result that put it in the slot."""
    if result == OfferResult.ADMIN_ACTION:
        result = stream.publication.offer_parts(head, body)
    if result < 0:
        stream.slot = head + body
    return result


class Egress:
    """Every UDP subscription's publication; DataPath hands it their control datagrams and runs its cycle."""

    def __init__(self, datapath: DataPath) -> None:
        self.datapath = datapath
        self.subscriptions: dict[int, _Stream] = {}
        self._closing: dict[int, _Stream] = {}
        self._rng = random.Random()
        # The figures of publications gone for good (after their linger), so the totals never go back.
        self.retired_naks_received = 0
        self.retired_retransmits_sent = 0

    def subscribe(self, owner: Session, subscription_id: int, queue: str, prefetch: int, buffer_size: int,
                  destination: tuple[str, int], stream_id: int, now_ns: int) -> dict[str, Any]:
        """SUBSCRIBE_UDP from `owner`: the OK's result. Raises core.RequestError when refused."""
        from flowbroker.broker.core import RequestError

        datapath = self.datapath
        config, core = datapath.config, datapath.core
        if len(self.subscriptions) >= config.max_subscriptions:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"too many UDP subscriptions ([udp] max_subscriptions {config.max_subscriptions}, broker-wide, "
                               "all in use): close UDP consumers you no longer need, consume over TCP, or ask the "
                               "operator to raise it")
        if 0 < buffer_size < config.mtu:
            # The consumer's image refuses a SETUP whose mtu is over its window (Aeron's rule): it then
            # received nothing, and nothing said why (a tester's buffer_size 4096 against mtu 8192).
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"buffer_size {buffer_size} is below the UDP mtu ([udp] mtu {config.mtu}): a UDP "
                               f"consumer's window must hold one datagram; give buffer_size {config.mtu} or more")
        the_queue, in_force = core.check_subscribe(owner, subscription_id, queue, prefetch)
        session_id = datapath.session_ids.take()
        # A loopback consumer gets loopback_mtu's datagrams, at most an eighth of the window it asked for
        # (several datagrams in flight, not stop-and-wait); elsewhere, and under a smaller window, [udp] mtu.
        mtu = max(config.mtu, min(config.publication_mtu(destination[0]), (buffer_size // 8) & ~31))
        publication = Publication(
            PublicationConfig(session_id, stream_id, term_length=config.term_length, mtu=mtu,
                              initial_term_id=self._rng.randrange(-(2**31), 2**31), max_messages_per_send=64,
                              linger_ns=_LINGER_NS),
            # A consumer whose image timed out (this process stopped past its 10 s liveness) is sent again
            # what it had not reported processed: else what went into the dead image was lost, counted
            # delivered and unsettled (a tester: 1,000 of 20,000). The SDK's consumer reads its new image
            # on from where it had read the old one (client/udpconsumer.py), so nothing comes twice.
            now_ns, destination=destination, rejoin_at_consumed=True,
        )
        sub = UdpSubscription(owner, subscription_id, the_queue, in_force, 0)
        stream = _Stream(session_id, stream_id, destination, publication, sub,
                         batch_room=mtu - DATA_HEADER_LENGTH - BATCH_HEAD_BOUND if owner.deliver_batches else 0)
        sub.stream = stream
        sub.egress = self
        sub.oversized = 0
        sub.sure_fit = publication.max_message_length - EXACT_CHECK_SLACK
        self.subscriptions[session_id] = stream
        owner.subscriptions[subscription_id] = sub
        the_queue.add_subscription(sub)
        datapath.wake()  # SETUP goes out now
        return {"queue": the_queue.name, "prefetch": in_force, "session_id": session_id, "stream_id": stream_id,
                "endpoint": datapath.endpoint_text}

    def close_owner(self, owner_conn_id: int, now_ns: int) -> None:
        for stream in [s for s in self.subscriptions.values() if s.subscription.session.conn_id == owner_conn_id]:
            self._close(stream, now_ns)

    def _close(self, stream: _Stream, now_ns: int) -> None:
        """End of stream for a cancelled or closed subscription (its deliveries were requeued by the core)."""
        if self.subscriptions.pop(stream.session_id, None) is None:
            return
        stream.slot = None
        stream.publication.close(now_ns)
        if len(self._closing) >= MAX_CLOSING:
            self._forget(self._closing.pop(next(iter(self._closing))))
        self._closing[stream.session_id] = stream

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, session_id: int, stream_id: int,
                    now_ns: int) -> str | None:
        """Hand an SM/NAK/ERR/RTTM to its publication; the refusal reason, or None if taken. Only from the
        consumer's own address, host and port: the SDK sends them from the socket it registered and is
        delivered to, and an SM from anywhere else on its host would open the window (`wrong_source`)."""
        stream = self.subscriptions.get(session_id) or self._closing.get(session_id)
        if stream is None:
            return "unregistered_session"
        if stream_id != stream.stream_id:
            return "wrong_stream"
        if source != stream.destination:
            return "wrong_source"
        pub = stream.publication
        limit, connected = pub.sender_limit, pub.is_connected
        pub.on_datagram(data, source, now_ns)
        # Also when the consumer is heard from again after the receiver timeout (5 s without a status
        # message: a stopped process) at the position it had reported: the limit does not move, and the
        # subscription, out of its queue's rotation while nobody was connected, stayed out for good (a tester:
        # 1,167 messages, then nothing with 18,833 ready).
        if (pub.sender_limit != limit or pub.is_connected != connected) and session_id in self.subscriptions:
            self._window_opened(stream)
        return None

    def _window_opened(self, stream: _Stream) -> None:
        """The consumer's status message moved the limit: the waiting delivery first, then the queue."""
        slot = stream.slot
        if slot is not None:
            result = stream.publication.offer(slot)
            if result == OfferResult.ADMIN_ACTION:  # the term rotated: offered again at once (see _append_slow)
                result = stream.publication.offer(slot)
            if result < 0:
                return
            stream.slot = None
        sub = stream.subscription
        queue: Queue = sub.queue
        if not sub.closed:
            queue.resume_subscription(sub)
            queue.dispatch()

    def do_work(self, now_ns: int) -> Outgoing:
        out: Outgoing = []
        closed: list[_Stream] = []
        oversized: list[UdpSubscription] = []
        for stream in self.subscriptions.values():
            if stream.subscription.closed:  # cancelled, or its queue deleted
                closed.append(stream)
                continue
            if stream.subscription.oversized:
                oversized.append(stream.subscription)
            pub = stream.publication
            # (Not while nobody is connected: a rejoin's limit waits at the consumed position for the new
            # image's first status message.)
            if pub.position > pub.sender_limit and pub.is_connected:
                # The message that overflowed the window (one may) is sent whole: cut at the window's end,
                # its tail waited for a status message that processing could not cause (nothing of a message
                # is processed before all of it is in), one such message per ~100 ms (a tester: 20 KB
                # messages through a 16 KiB window, 55 ms each). Nothing more is taken from the queue until
                # the consumer's status messages move the limit past it (the limit only moves forward). Not
                # past what the consumer's image takes: half a term beyond the position its last status
                # message reported (limit - window); past it, frames are dropped and come again by NAK (a
                # 1 MiB window, half a 2 MiB term, lost 15 % of its throughput so). A window that small is
                # never below the largest message (term_length / 8), so it needs no overflow sent early.
                room = pub.sender_limit - pub.receiver_window + pub.term_length // 2
                if room > pub.sender_limit:
                    pub.sender_limit = min(pub.position, room)
            out += pub.do_work(now_ns)
        for sub in oversized:  # (outside any dispatch: ending a subscription changes its queue's rotation)
            self.datapath.core.end_subscription(sub.session, sub, Error(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"a message of {sub.oversized} bytes with its envelope in queue {sub.queue.name!r} is over what "
                f"the UDP data path carries (term_length / 8: {sub.stream.publication.max_message_length} bytes): "
                f"UDP subscription {sub.sub_id} is cancelled and the message stays in the queue; consume it over "
                "TCP, or raise [udp] term_length", None, None, sub.queue.name))
        for stream in closed:
            self._close(stream, now_ns)
        done: list[int] = []
        for session_id, stream in self._closing.items():
            out += stream.publication.do_work(now_ns)
            if stream.publication.is_done:
                done.append(session_id)
        for session_id in done:
            self._forget(self._closing.pop(session_id))
        return out

    def _forget(self, stream: _Stream) -> None:
        """A closed publication is gone: its session id is free again, its figures go to the totals."""
        stats = stream.publication.statistics()
        self.retired_naks_received += stats.naks_received
        self.retired_retransmits_sent += stats.retransmits_sent
        self.datapath.session_ids.give_back(stream.session_id)
        # The subscription and its stream refer to each other: a cycle only the garbage collector frees,
        # and a quiet broker runs it seldom (cli.GC_GENERATION0_THRESHOLD: 50,000 allocations), so every
        # closed UDP subscription's log (3 x term_length) stayed in memory: +6 MiB per consumer opened and
        # closed, 240 MiB after 40 (a tester). Broken here, the log is freed with the stream.
        del stream.subscription.stream

    def closing(self) -> list[_Stream]:
        """Publications closed and still lingering (their figures still move)."""
        return list(self._closing.values())

    def deadline_ns(self, now_ns: int) -> int:
        deadline = now_ns + 1_000_000_000
        for stream in self.subscriptions.values():
            deadline = min(deadline, stream.publication.next_deadline_ns())
        for stream in self._closing.values():
            deadline = min(deadline, stream.publication.next_deadline_ns())
        return deadline
