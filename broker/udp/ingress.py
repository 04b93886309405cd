"""The images of the UDP publications producers registered over TCP (sans-IO): the status-message window
is the producer's credit, the consumption position its completion point.

A registration (REGISTER_PUBLICATION) gets a session id and a *publication session*: a broker `Session` of
its own, registered as a producer with the credit allocator at once, so the same credit policy, quota,
stop-all, memory alarm and queue watermarks apply to it as to a TCP producer (and it shows in the admin
views as `<client name> udp:<session id>`). Its image is read by one broker subscription:

- each polled message becomes a transfer of the publication session (`TransferReceiver.receive_unchecked`:
  no credit check, the image's window already bounds what the producer can send) routed by the core's one
  routing path (`BrokerCore.route`), and is *held* in the image (`Image.hold`, its `frame_space`) until
  that transfer completes; holds are released in transfer-id order, so the consumption position the SMs
  carry is the completion point and a saturated queue closes the producer's window; a producer paced on a
  queue (`[queues] pace_producers`, docs/policies.md "Pacing") keeps its holds until the queue releases it,
  as a TCP producer's completions wait;
- the image's `window_cap` is the publication session's grant from the pool, clamped to
  [min_receiver_window, max_receiver_window] (and under the congestion window); 0 while it waits for a
  share of the pool;
- the publication session's outbox is drained here: FLOW_STOPPED / FLOW_RESUMED go to the owner's TCP
  session as they are, ERRORs about its messages go there with the publication's session id
  (`Error.session_id`), and COMPLETE / BUFFER_ACK / BUFFER_CONTROL stay here (they are the hold and the cap).

Only datagrams of a registered (session id, stream id) from the registering client's address reach the
image; a SETUP must use the broker's term length and at most its mtu. Everything else is refused by reason
(`DataPath.refused`) and creates nothing.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from functools import partial
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from flowbroker.broker.logsafe import logsafe
from flowbroker.broker.udp.datapath import Address, Outgoing
from flowbroker.protocol.envelope import PUBLISH, PUBLISH_BATCH, EnvelopeError, decode_publish, decode_publish_batch
from flowbroker.protocol.credit import MESSAGE_OVERHEAD
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error, FlowResumed, FlowStopped, TransferEntry
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from flowbroker.transport.frames import DATA_HEADER_LENGTH, FrameType, Setup, decode_datagram
from flowbroker.transport.image import Image
from flowbroker.transport.positions import frame_space
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig, Subscription

if TYPE_CHECKING:
    from flowbroker.broker.session import Session
    from flowbroker.broker.udp.datapath import DataPath

__all__ = ["Ingress", "UdpPublication", "MAX_MESSAGES_PER_CYCLE"]

LOGGER = logging.getLogger("flowbroker.broker")

MAX_MESSAGES_PER_CYCLE = 4096
"""Messages one publication may have routed in one duty cycle; more wait for the next (the shell runs it
again at once), so one fast producer cannot hold the event loop for long."""

_POLL_FRAGMENTS = 256  # fragments one Subscription.poll call hands over
# tuple.__new__ through partial (all in C), as protocol/frames.py builds a TRANSFER's entries: several times
# cheaper than the NamedTuple's Python __new__.
_new_entry: Callable[[Any], TransferEntry] = partial(tuple.__new__, TransferEntry)
LOG_INTERVAL_NS = 10_000_000_000


@dataclass(eq=False)
class UdpPublication:
    """One registered publication: who owns it, where its datagrams must come from, and its image."""

    session_id: int
    stream_id: int
    owner: Session
    source: tuple[str, int]
    exchange: str
    routing_key: str
    session: Session  # the publication session its messages are routed from
    channel: ReceiveChannel
    subscription: Subscription
    image: Image | None = None
    mtu: int = 0  # the mtu it was told to send with ([udp] mtu, or loopback_mtu from a loopback address)
    pending: deque[tuple[int, int]] = field(default_factory=deque)
    """(transfer id, term bytes) of each message polled and not yet released, in transfer-id order (id 0:
    a message that was never routed, a bad envelope or one over term_length / 8, released with the ones
    before it). A PUBLISH_BATCH is one entry, its last message's transfer id: its bytes are released when
    all its messages complete, so the consumption position only ever moves to the end of a term frame.
    Kept across images (`_image_available`): what an image that timed out held stays held."""
    routed_position: int = 0
    """Where the first message of the stream not yet polled (routed, or dropped) starts: what the image has
    been read to, less the fragments of a message not yet whole. A new image of the same publication that
    joins below it (the producer sends again what it was told was not consumed) is read from here."""
    resent_skipped: int = 0  # term bytes a new image was sent again that were routed already, not again
    woken: bool = True  # the publication session's outbox or completions changed: drain it
    caught_up: bool = False  # completed all it received while more datagrams waited: report when they stop
    more_to_route: bool = False  # the last poll stopped at a bound (the cycle's messages, the grant)
    messages: int = 0


class Ingress:
    """Every registered UDP publication; DataPath hands it their datagrams and runs its duty cycle."""

    def __init__(self, datapath: DataPath) -> None:
        self.datapath = datapath
        self.publications: dict[int, UdpPublication] = {}
        self._rng = random.Random()
        self._last_warning_ns: int | None = None  # dropped messages are logged at most every LOG_INTERVAL_NS
        self.messages_dropped = 0
        """Messages of every publication ever registered dropped, never routed: a bad envelope
        (docs/protocol.md, "The envelope") or over the image's max_message_length (term_length / 8). Never
        goes back (`DataPathStatistics.messages_dropped`, a counter's value)."""
        # The loss figures of images gone (closed, timed out, replaced), so the totals never go back.
        self.retired_loss_gaps = 0
        self.retired_naks_sent = 0
        self.parked_slice_taken = False  # a publication routed a parked slice this cycle (`_poll`)

    # ------------------------------------------------------------------ registration

    def register(self, owner: Session, exchange: str, routing_key: str, stream_id: int,
                 source: tuple[str, int], now_ns: int) -> dict[str, Any]:
        """REGISTER_PUBLICATION from `owner`: the OK's result. Raises core.RequestError when refused."""
        from flowbroker.broker.core import RequestError

        datapath = self.datapath
        config, core = datapath.config, datapath.core
        if len(self.publications) >= config.max_publications:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"too many UDP publications ([udp] max_publications {config.max_publications}, broker-wide, "
                               "all in use): close UDP producers you no longer need, publish over TCP, or ask "
                               "the operator to raise it")
        mine = sum(1 for p in self.publications.values() if p.owner is owner)
        if mine >= config.max_publications_per_connection:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               "too many UDP publications on this connection "
                               f"([udp] max_publications_per_connection {config.max_publications_per_connection})")
        session_id = datapath.session_ids.take()
        publications = self.publications

        # The callbacks find the publication by its session id: holding it (its session holds `wake`, its
        # channel the image callbacks) made a cycle that kept a closed publication's session until the
        # collector's rare full pass.
        def wake() -> None:
            pub = publications.get(session_id)
            if pub is not None:
                pub.woken = True
            datapath.wake()

        session = core.open_session(f"{owner.client_name} udp:{session_id}", owner.identity, True, wake)
        if session.fault is not None:  # the pool cannot hold one more connection
            core.close_session(session)
            datapath.session_ids.give_back(session_id)
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, str(session.fault))
        session.peer_host = owner.peer_host
        session.access = owner.access  # the owner's permissions, the same object: changes reach both
        session.errors_sent = None  # its ERRORs reach the owner's wire, counted there (_drain_outbox)
        session.fences_itself = True  # its window is our status messages' (`_apply_window`), never BUFFER_LIMIT
        # Its messages routed to no queue are told as the owner's own are (HELLO capability "mandatory"): the
        # SDK counts them on the UDP producer and raises them for a mandatory one. Without it they were
        # completed silently, whatever the producer asked (a tester).
        session.report_unroutable = owner.report_unroutable
        core._register_producer(session)
        window = config.max_receiver_window
        mtu = config.publication_mtu(source[0])
        receiver = ReceiverConfig(
            receiver_id=self._rng.randrange(1, 2**31),
            receiver_window=window,
            congestion_control=config.congestion_control,
            session_id=session_id,
            so_rcvbuf=max(window, mtu),
            max_images=1,
            max_pending_setups=4,
        )
        channel = ReceiveChannel(stream_id, receiver)
        subscription = channel.add_subscription(
            now_ns,
            on_available_image=lambda image: self._image_available(publications.get(session_id), image),
            on_unavailable_image=lambda image: self._image_gone(publications.get(session_id), image),
        )
        pub = UdpPublication(session_id, stream_id, owner, source, exchange, routing_key, session, channel,
                             subscription, mtu=mtu)
        self.publications[session_id] = pub
        # (DEBUG: any client may register and close publications in a loop: 4,730 INFO lines in 10 s, a tester)
        LOGGER.debug("connection %d registered UDP publication %d (stream %d) from %s:%d to exchange %r",
                    owner.conn_id, session_id, stream_id, source[0], source[1], exchange)
        return {"session_id": session_id, "stream_id": stream_id, "endpoint": datapath.endpoint_text,
                "term_length": config.term_length, "mtu": mtu, "connection": session.conn_id,
                "publish_batch": True}

    def _image_available(self, pub: UdpPublication | None, image: Image) -> None:
        """A new image of the publication: its first, or one after an image that timed out (the producer's
        process was stopped past the image liveness timeout, 10 s) or drained.

        The SDK's producer (``Publication(rejoin_at_consumed=True)``) starts the new image at the position
        the old one's status messages last reported consumed: the completion point, so it sends again what
        the broker had routed and not completed (held by a saturated queue, or completed after that status
        message). Those messages are enqueued already: routed again they were enqueued twice (600 messages
        to a queue saturated while the producer was stopped gave 1,159). The new image is read from where
        the old one was (`routed_position`, a message boundary of the same stream), so every message is
        routed once. Its consumption position starts at the old completion point: the old image's holds
        (`pending`) are held in the new one and released as their transfers complete, in transfer-id
        order with the new image's messages. An image that joins at or past where the old one was read
        to (a producer that does not go back) starts afresh, as before: what was held is released with
        nothing (its bytes are not in this image)."""
        if pub is None:  # (closed: its channel's images were dropped)
            return
        pub.image = image
        sub_id = pub.subscription.subscription_id
        routed, join = pub.routed_position, image.join_position
        pending = pub.pending
        if join < routed <= join + image.term_length // 2 and image.has_subscriber(sub_id):
            held = sum(space for _, space in pending)
            while pending and held > routed - join:  # (held bytes below the join: not this image's)
                held -= pending.popleft()[1]
            image.resume_subscriber(sub_id, routed, held)
            pub.resent_skipped += routed - join
            self._release(pub)  # what completed while there was no image
        else:
            pending.clear()
            pub.routed_position = join
        self._apply_window(pub)

    def _image_gone(self, pub: UdpPublication | None, image: Image) -> None:
        """The image drained after end of stream or timed out. What was routed stays routed, and what it
        held stays in `pending` until a new image of the publication says whether it is sent again
        (`_image_available`)."""
        if pub is not None and pub.image is image:
            self._retire_image(pub)

    def _retire_image(self, pub: UdpPublication) -> None:
        """The publication's image goes: keep its loss figures in the totals (metrics count them)."""
        image = pub.image
        if image is not None:
            stats = image.statistics()
            self.retired_loss_gaps += stats.loss_gaps
            self.retired_naks_sent += stats.naks_sent
            pub.image = None

    def close_publication(self, owner: Session, session_id: int, now_ns: int) -> dict[str, Any]:
        from flowbroker.broker.core import RequestError

        pub = self.publications.get(session_id)
        if pub is None or pub.owner is not owner:
            raise RequestError(ErrorCode.NOT_FOUND, f"no UDP publication {session_id} on this connection")
        self._close(pub, now_ns)
        return {"session_id": session_id, "messages": pub.messages}

    def close_owner(self, owner_conn_id: int, now_ns: int) -> None:
        for pub in [p for p in self.publications.values() if p.owner.conn_id == owner_conn_id]:
            self._close(pub, now_ns)

    def _close(self, pub: UdpPublication, now_ns: int) -> None:
        if self.publications.pop(pub.session_id, None) is None:
            return
        self._drain_outbox(pub, now_ns)  # the last FLOW_RESUMED / ERRORs still reach the owner
        # A publication that ends while flow-stopped must not leave its owner's flow state stopped for ever.
        for destination in list(pub.session.flow_stopped_on):
            if destination not in pub.owner.flow_stopped_on:
                pub.owner.send(FlowResumed(destination))
        pub.subscription.close(now_ns)
        self._retire_image(pub)
        # The publication, its session and the callbacks refer to each other: the image (its 3 x
        # term_length log) waited in the channel for a full garbage collection, which a quiet broker runs
        # seldom: 100 UDP producers opened and closed held 650 MiB (a tester). Dropped here, it is freed.
        pub.channel.images.clear()
        pub.pending.clear()
        self.datapath.core.close_session(pub.session)
        self.datapath.session_ids.give_back(pub.session_id)

    # ------------------------------------------------------------------ datagrams in

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, session_id: int, stream_id: int,
                    now_ns: int) -> str | None:
        """Hand a DATA/PAD/SETUP/RTTM datagram to its image; the refusal reason, or None if taken."""
        pub = self.publications.get(session_id)
        if pub is None:
            return "unregistered_session"
        if stream_id != pub.stream_id:
            return "wrong_stream"
        if source != pub.source:
            return "wrong_source"
        if data[6] == FrameType.SETUP and data[7] == 0:
            problem = self._setup_problem(pub, data)
            if problem is not None:
                return problem
        channel = pub.channel
        rejected = channel.rejected
        channel.on_datagram(data, source, now_ns)
        if channel.rejected != rejected:  # the frames did not hold together (a SETUP's mtu past a datagram,
            return "malformed"  # a DATA frame's length past its datagram): counted as the unregistered are
        pub.woken = True
        return None

    def _setup_problem(self, pub: UdpPublication, data: bytes | bytearray | memoryview) -> str | None:
        frames, reason = decode_datagram(data)
        if reason is not None or not frames or not isinstance(frames[0], Setup):
            return None  # the channel counts a malformed SETUP itself
        setup = frames[0]
        config = self.datapath.config
        if setup.term_length != config.term_length:
            return "setup_term_length"
        if setup.mtu > pub.mtu:
            return "setup_mtu"
        return None

    # ------------------------------------------------------------------ duty cycle

    def do_work(self, now_ns: int) -> Outgoing:
        """Each image's duty cycle, its messages routed, holds released, windows set, SMs out."""
        out: Outgoing = []
        self.parked_slice_taken = False
        more_waiting = self.datapath.more_waiting
        for pub in list(self.publications.values()):
            if pub.caught_up and not more_waiting:
                pub.caught_up = False
                if pub.image is not None:
                    pub.image.report_now()
            out += pub.channel.do_work(now_ns)  # rebuild what arrived; timers
            if pub.image is not None and (pub.woken or pub.more_to_route or pub.image.rebuild_position
                                          > pub.image.subscriber_position(pub.subscription.subscription_id)):
                pub.woken = pub.more_to_route = False
                if self._poll(pub, now_ns) or self._drain_outbox(pub, now_ns):
                    out += pub.channel.do_work(now_ns)  # the SM the new consumption position calls for
            elif pub.woken:
                pub.woken = False
                self._drain_outbox(pub, now_ns)
        return out

    def _poll(self, pub: UdpPublication, now_ns: int) -> bool:
        """Route what the image has (at most MAX_MESSAGES_PER_CYCLE); True if anything was polled.

        Polling also stops once the publication session's messages routed and not yet complete would pass
        its grant in *charged* bytes (message_size: the body and MESSAGE_OVERHEAD), as a TCP producer's
        credit does: the image's window bounds term bytes, and a PUBLISH_BATCH of empty bodies costs two
        term bytes a message against 512 charged, so a window's worth of them held by a saturated queue
        would be 256 times its grant (measured: 16 MB held on a 64 KiB grant). What is not polled stays in
        the term, inside the window, until completions make room. The poll's handler counts each payload's
        messages (a batch's from its array header) and stops the poll once either bound is reached, so a
        cycle passes them by at most one payload: MAX_ENTRIES_PER_FRAME messages (a PUBLISH_BATCH must fit
        one frame; a fragmented one is dropped, so a fragmented message is always one message).

        The poll's payloads are gathered first (the handler appends and counts them) and then taken in
        bulk, as a TCP TRANSFER's entries are: when every one is a bare PUBLISH one list comprehension
        builds the entries, when they are bare PUBLISHes and PUBLISH_BATCHes (the SDK's) one pass over
        them does (`_bare_and_batched`), and when route completes them all at once (no saturated queue
        holds one) nothing is held or queued in ``pending``: the consumption position passes them straight
        away, as it would after a hold and its release. Anything else (an envelope with a key or headers, a bad envelope, a message held by a
        saturated queue) takes the per-message path, whose holds are released in transfer-id order."""
        image = pub.image
        assert image is not None
        if pub.session.parked:  # parked under the memory alarm (broker/parking.py): nothing new behind it
            core = self.datapath.core
            if not core.parked_due(pub.session):
                return False  # what follows waits in the term, inside the window, as for a closed grant
            if self.parked_slice_taken:  # one publication's slice a cycle, as the TCP writers take turns
                pub.more_to_route = True
                self.datapath.wake()
                return False
            self.parked_slice_taken = True
            core.route_parked(pub.session)
            self._more_to_route(pub)
            self._drain_outbox(pub, now_ns)
            return True
        if pub.session.routing_rest is not None:  # a fan-out's rest before anything new (its holds are set up)
            self.datapath.core.route_rest(pub.session)
            self._more_to_route(pub)
            self._drain_outbox(pub, now_ns)
            return True
        sub_id = pub.subscription.subscription_id
        window = pub.session.transfers.window
        room = max(image.window_cap or 0, pub.mtu) - (window.position - window.consumed_position)
        if room <= 0:
            return False  # the grant is held: completions wake the publication (and poll again)
        messages: list[memoryview | bytes | int] = []  # an int: the length of a message dropped (`oversized`)
        append = messages.append
        count = charged = batches = 0  # messages taken (a batch's count), their charged bytes, batches
        dropped = False

        def take(m: memoryview | bytes) -> bool:
            """Collect a payload; True (stop the poll after it) once a bound is reached."""
            nonlocal count, charged, batches
            append(m)
            if len(m) > 1 and m[0] == PUBLISH_BATCH:
                n = _batch_count(m)
                batches += 1
                count += n
                charged += len(m) + n * MESSAGE_OVERHEAD
            else:
                count += 1
                charged += len(m) + MESSAGE_OVERHEAD
            return count >= MAX_MESSAGES_PER_CYCLE or charged >= room

        def oversized(length: int) -> None:
            """A message over the image's max_message_length, dropped as it arrived (only a client writing
            its own frames sends one: the SDK's publication cannot): its place among the others is kept."""
            nonlocal count, dropped
            append(length)
            count += 1
            dropped = True

        while (image.poll(sub_id, take, _POLL_FRAGMENTS, oversized) and count < MAX_MESSAGES_PER_CYCLE
               and charged < room):
            pass
        pub.routed_position = image.subscriber_whole_position(sub_id)  # (what was polled is routed below)
        if not messages:
            return False
        if count >= MAX_MESSAGES_PER_CYCLE or charged >= room:
            pub.more_to_route = True  # stopped at a bound: the next cycle comes at once (`pending`)
            self.datapath.wake()
        if dropped:  # counted and released in their place by the per-message path
            return self._poll_each(pub, messages, now_ns)
        polled = cast(list[memoryview | bytes], messages)
        exchange, default_key = pub.exchange, pub.routing_key
        entries: list[TransferEntry] | None
        counts: list[int] | None = None  # messages in each polled payload, when batches are among them
        if batches:  # the SDK's: bare PUBLISHes and PUBLISH_BATCHes in one pass
            entries, counts = _bare_and_batched(polled, exchange, default_key, image.mtu - DATA_HEADER_LENGTH)
        else:
            try:
                # decode_publish's first case (a PUBLISH byte, then the body), for the whole poll at once.
                entries = [_new_entry((exchange, default_key, bytes(m[1:]), None, None, None))
                           for m in polled if m[0] == PUBLISH]
            except IndexError:  # an empty payload: a bad envelope, for the per-message path
                entries = None
            if entries is not None and len(entries) != len(messages):
                entries = None  # another envelope among them
        if entries is None:
            return self._poll_each(pub, messages, now_ns)
        session = pub.session
        transfers = session.transfers
        tid, sizes = transfers.receive_unchecked(entries)
        pub.messages += len(entries)
        self._route(pub, tid, entries, sizes)
        pending = pub.pending
        if pending or session.paced_on is not None or transfers.completed.cumulative < tid + len(entries) - 1:
            # Not all complete (or older ones still held, or the producer paced): hold every one, release
            # in order.
            mtu = image.mtu
            total = 0
            if counts is None:
                for m in polled:
                    space = frame_space(len(m), mtu)
                    pending.append((tid, space))
                    tid += 1
                    total += space
            else:  # a batch is released with its last message
                for m, count in zip(polled, counts):
                    space = frame_space(len(m), mtu)
                    tid += count
                    pending.append((tid - 1, space))
                    total += space
            image.hold(sub_id, total)
        elif image.rebuild_position == image.subscriber_position(sub_id):
            self._caught_up(pub, image)
        self._drain_outbox(pub, now_ns)
        return True

    def _poll_each(self, pub: UdpPublication, messages: list[memoryview | bytes | int], now_ns: int) -> bool:
        """``_poll``'s per-message path: each envelope decoded on its own, a bad one, or a message the image
        dropped for its length (an int, that length), counted and dropped (its bytes released with the
        messages before it, so the producer's window keeps moving)."""
        image = pub.image
        assert image is not None
        sub_id = pub.subscription.subscription_id
        mtu = image.mtu
        entries: list[TransferEntry] = []
        spaces: list[tuple[int, int]] = []  # (messages routed from the payload, its term bytes)
        exchange, default_key = pub.exchange, pub.routing_key
        for message in messages:
            if isinstance(message, int):
                self._drop(pub, now_ns, f"{message} bytes with its envelope, over term_length / 8 "
                                        f"({image.max_message_length})")
                spaces.append((0, frame_space(message, mtu)))  # never routed: released with those before
                continue
            space = frame_space(len(message), mtu)
            try:
                if len(message) and message[0] == PUBLISH_BATCH:
                    batch = _batch_entries(message, exchange, default_key, mtu - DATA_HEADER_LENGTH)
                    entries += batch
                    spaces.append((len(batch), space))
                    continue
                key, headers, body = decode_publish(message)
            except EnvelopeError as exc:
                self._drop(pub, now_ns, logsafe(exc))
                spaces.append((0, space))  # never routed: released with the messages before it
                continue
            entries.append(TransferEntry(exchange, default_key if key is None else key, body, headers))
            spaces.append((1, space))
        total = 0
        for _, space in spaces:
            total += space
        image.hold(sub_id, total)
        session = pub.session
        tid = 0
        sizes: list[int] = []
        if entries:
            tid, sizes = session.transfers.receive_unchecked(entries)
            pub.messages += len(entries)
        pending = pub.pending
        next_tid = tid
        for count, space in spaces:
            if not count:
                pending.append((0, space))
            else:  # a batch's bytes go with its last message
                next_tid += count
                pending.append((next_tid - 1, space))
        if entries:
            self._route(pub, tid, entries, sizes)
        self._drain_outbox(pub, now_ns)
        return True

    def _drop(self, pub: UdpPublication, now_ns: int, why: str) -> None:
        """A message of `pub` is dropped, never routed: counted where an operator looks (its connection
        view's `producer.messages_dropped`, the data path's `messages_dropped`) and logged at most every
        LOG_INTERVAL_NS. Nothing is said to the producer: the window moves past it."""
        pub.session.messages_dropped += 1
        self.messages_dropped += 1
        last = self._last_warning_ns
        if last is None or now_ns - last >= LOG_INTERVAL_NS:
            self._last_warning_ns = now_ns
            LOGGER.warning("UDP publication %d: message dropped (%d so far): %s", pub.session_id,
                           self.messages_dropped, why)

    def _route(self, pub: UdpPublication, tid: int, entries: list[TransferEntry], sizes: list[int]) -> None:
        """Route received messages as a TCP frame's are, in slices of fan-out (`BrokerCore.route_in_slices`):
        what is left is routed first in the next cycles (the shell yields between them). A poll of 55
        messages to a fanout of 10,000 queues was half a second in one step."""
        self.datapath.core.route_in_slices(pub.session, tid, entries, sizes)
        self._more_to_route(pub)

    def _more_to_route(self, pub: UdpPublication) -> None:
        """The publication session has a fan-out's rest, or parked messages the alarm no longer holds, to
        route: the next cycle comes at once."""
        if pub.session.routing_rest is not None or self.datapath.core.parked_due(pub.session):
            pub.more_to_route = True
            self.datapath.wake()

    def _drain_outbox(self, pub: UdpPublication, now_ns: int) -> bool:
        """Relay the publication session's frames, release completed holds, set the window; True if the
        consumption position or the window moved."""
        pub.woken = False  # what woke it is drained here; a wake from here on is a new one
        session = pub.session
        owner = pub.owner
        for frame in session.collect(now_ns):
            kind = type(frame)
            if kind is FlowStopped:
                owner.send(frame)
            elif kind is FlowResumed:
                assert isinstance(frame, FlowResumed)
                if frame.destination not in owner.flow_stopped_on:  # still stopped by its own transfers
                    owner.send(frame)
            elif kind is Error:
                assert isinstance(frame, Error)
                owner.send(Error(frame.code, frame.text, None, None, frame.destination, pub.session_id))
        moved = self._release(pub)
        return self._apply_window(pub) or moved

    def _release(self, pub: UdpPublication) -> bool:
        image = pub.image
        pending = pub.pending
        if image is None or not pending:
            return False
        if pub.session.paced_on is not None:
            return False  # paced (docs/policies.md, "Pacing"): its queue releases it and wakes it
        cumulative = pub.session.transfers.completed.cumulative
        released = 0
        while pending and pending[0][0] <= cumulative:
            released += pending.popleft()[1]
        if released:
            sub_id = pub.subscription.subscription_id
            image.release(sub_id, released)
            if not pending and image.rebuild_position == image.subscriber_position(sub_id):
                self._caught_up(pub, image)
        return bool(released)

    def _caught_up(self, pub: UdpPublication, image: Image) -> None:
        """Everything the image received is complete: the producer may be waiting for exactly this (its
        flush), so the status message goes out in this cycle, unless more DATA waits for later passes
        (`DataPath.more_waiting`): then the producer is still sending, and the cycle of the pass that
        leaves none sends it (`do_work`)."""
        if self.datapath.more_waiting:
            pub.caught_up = True
        else:
            image.report_now()

    def _apply_window(self, pub: UdpPublication) -> bool:
        image = pub.image
        if image is None:
            return False
        session = pub.session
        config = self.datapath.config
        if session.credit_waiting or not session.open:
            cap = 0
        else:
            # Never below one datagram of the publication's mtu (loopback_mtu may be above
            # min_receiver_window): a window smaller than a full frame would stall a fragmented message.
            cap = min(max(session.buffer_size, config.min_receiver_window, pub.mtu), config.max_receiver_window)
        if image.window_cap == cap:
            return False
        image.window_cap = cap
        return True

    def pending(self) -> bool:
        """Is there work a cycle left for the next: a poll that stopped at a bound (the cycle's messages,
        or the grant while what it routed completed at once), or a publication woken after its drain (a
        later publication's routing changed it)? The shell runs another cycle for it at once. Not a
        publication whose grant is held by a saturated queue: its completions wake it."""
        return any(pub.woken or pub.more_to_route for pub in self.publications.values())

    def deadline_ns(self, now_ns: int) -> int:
        deadline = now_ns + 1_000_000_000
        for pub in self.publications.values():
            deadline = min(deadline, pub.channel.next_deadline_ns(now_ns))
        return deadline


def _batch_count(payload: memoryview | bytes) -> int:
    """The number of bodies a PUBLISH_BATCH says it carries (msgpack's array header after the kind byte),
    read without decoding it: what `_poll` bounds a cycle by. A header that is not an array's counts as
    the most a batch may carry (the batch is dropped as malformed when decoded)."""
    head = payload[1]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(payload) >= 4:
        return min((payload[2] << 8) | payload[3], MAX_ENTRIES_PER_FRAME)  # more: malformed, dropped
    return MAX_ENTRIES_PER_FRAME


def _batch_entries(payload: memoryview | bytes, exchange: str, routing_key: str,
                   max_payload: int) -> list[TransferEntry]:
    """The TRANSFER entries of a PUBLISH_BATCH within one frame (`max_payload` bytes): a fragmented one
    could carry more messages than `_poll` saw coming, so it is a bad envelope. Raises EnvelopeError."""
    if len(payload) > max_payload:
        raise EnvelopeError("publish batch: fragmented (a batch must fit one datagram)")
    return [_new_entry((exchange, routing_key, body, None, None, None)) for body in decode_publish_batch(payload)]


def _bare_and_batched(messages: list[memoryview | bytes], exchange: str, routing_key: str,
                      max_payload: int) -> tuple[list[TransferEntry] | None, list[int] | None]:
    """A poll's entries when every payload is a bare PUBLISH or a PUBLISH_BATCH (the SDK's) within one
    frame (`_batch_entries`), with the number of messages each payload carries; (None, None) when one is
    anything else or malformed (the per-message path decodes, counts and drops it)."""
    entries: list[TransferEntry] = []
    counts: list[int] = []
    for m in messages:
        kind = m[0] if len(m) else -1
        if kind == PUBLISH:
            entries.append(_new_entry((exchange, routing_key, bytes(m[1:]), None, None, None)))
            counts.append(1)
        elif kind == PUBLISH_BATCH:
            try:
                batch = _batch_entries(m, exchange, routing_key, max_payload)
            except EnvelopeError:
                return None, None
            entries += batch
            counts.append(len(batch))
        else:
            return None, None
    return entries, counts
