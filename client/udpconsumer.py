"""A consumer whose deliveries arrive over UDP, the Aeron data path (docs/client.md, "Consuming over UDP").

`conn.consumer(queue, transport="udp")` returns one. It is a `Consumer` (same iteration, `receive`,
`ack`/`reject`/`requeue`, statistics and closing) whose messages come through an Aeron image instead of
DELIVER frames:

- subscribing binds a UDP socket on the TCP connection's local address and sends SUBSCRIBE_UDP with its
  port; the broker answers with the session id of the publication it delivers through;
- the image's window (its status messages' window, the broker's limit) is the consumer's byte buffer:
  `buffer_size`, or DEFAULT_WINDOW when 0, never more than half a term;
- each message stays *held* in the image until the application has processed it (taken the next one, or
  settled it), so the consumption position the broker sees advances on processing, not on arrival: a
  slow handler paces the broker, which never has more than the window unprocessed in flight;
- settlement goes over the TCP connection by delivery tag, as for a TCP consumer.

The connection's HELLO asks for capability "deliver-batch", so the broker sends a run of deliveries as
DELIVER_BATCH payloads, many to an Aeron message (protocol/envelope.py).

What is held is counted in payloads, not messages: each payload polled (a batch, or one DELIVER) is
recorded with the charged bytes (`message_size`) its messages end at, counting every message handed out,
and its term bytes. The subscription's processed position (`consumed_position`, charged bytes) is kept
per message by `Message` anyway; once it reaches a payload's end, that payload's term bytes are released
in the image. Processing may go out of order (settling before taking the next), so what is released is
a count of bytes, as in the image itself: it never exceeds what was processed. Single DELIVERs (a broker
without batches) are recorded in groups of up to a sixteenth of the window, so the image is told in
steps, not per message. The check per processed message is one comparison in `Message`
(`Consumer._release_at`), not a call.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from flowbroker.client.errors import PublishError, check_timeout
from flowbroker.client.consumer import RELEASE_NEVER, Consumer, ConsumerStatistics
from flowbroker.protocol import ErrorCode, Frame
from flowbroker.protocol.credit import MESSAGE_OVERHEAD, message_size
from flowbroker.protocol.envelope import DELIVER_BATCH, EnvelopeError, decode_delivery, decode_delivery_batch
from flowbroker.protocol.frames import SubscribeUdp
from flowbroker.transport.frames import DATA_HEADER_LENGTH
from flowbroker.transport.image import Image
from flowbroker.transport.positions import frame_space
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig, Subscription
from flowbroker.transport.udp import DEFAULT_BATCH, UdpEndpoint, now_ns, open_udp

if TYPE_CHECKING:
    from flowbroker.client.connection import Connection

__all__ = ["UdpConsumer", "DEFAULT_SUBSCRIPTION_STREAM", "DEFAULT_WINDOW"]

log = logging.getLogger("flowbroker.client")

DEFAULT_SUBSCRIPTION_STREAM = 1002
"""The Aeron stream id a UDP consumer asks the broker to deliver on unless given one."""

DEFAULT_WINDOW = 1024 * 1024
"""The consumer's window (its byte credit) when `buffer_size` is 0."""

_POLL_FRAGMENTS = 256


class UdpConsumer(Consumer):
    """A `Consumer` fed over the UDP data path. Create it with `conn.consumer(queue, transport="udp")`."""

    transport = "udp"

    def __init__(self, conn: Connection, queue: str, subscription_id: int, *, prefetch: int = 1000,
                 buffer_size: int = 0, stream_id: int = DEFAULT_SUBSCRIPTION_STREAM) -> None:
        super().__init__(conn, queue, subscription_id, prefetch=prefetch, buffer_size=0)
        self.stream_id = stream_id
        self.window = buffer_size or DEFAULT_WINDOW
        """The byte credit this consumer's status messages grant the broker."""
        self._endpoint: UdpEndpoint = self._open_endpoint()
        self.session_id: int | None = None
        self._channel: ReceiveChannel | None = None
        self._subscription: Subscription | None = None
        self._image: Image | None = None
        self._term_length: int | None = None  # the image's, for statistics() (kept after the image goes)
        self._held: deque[list[int]] = deque()
        """[charged end, term bytes] of each payload (or group of single DELIVERs) held in the image, in the
        order handed out: released once the processed position reaches its end."""
        self._charged_end = 0  # the charged bytes of every message handed out (the end of the last held)
        self._polled: list[Any] = []  # entries decoded by the poll in progress, not yet buffered
        self._polled_space = 0  # their term bytes: held in the image in one call after the poll
        self._release_step = max(self.window // 16, 1)
        self._max_payload = 0  # the image's largest unfragmented payload (mtu - header)
        self._image_subscriber = 0  # the id the image knows our subscription by
        self._read_to = -1  # where the image was read to (a message boundary); -1: no image yet
        self._unheld = False  # a poll took messages it did not hold (dropped, or after the end)
        self._dirty = trio.Event()
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._started = False
        self.malformed = 0
        """Payloads that were not delivery envelopes (dropped; their bytes released)."""
        self.foreign = 0
        """Datagrams dropped because they came from elsewhere than the image's source (the broker's
        publication, from the SETUP that made the image): forged, or stray."""
        self._on_processed = self._release
        self._release_at = RELEASE_NEVER

    def _open_endpoint(self) -> UdpEndpoint:
        """The socket the image is read from: an ephemeral port on the TCP connection's local address."""
        return open_udp((self._conn._local_host(), 0), so_rcvbuf=max(self.window, 1 << 20))

    def _subscribe_frame(self, request_id: int) -> Frame:
        port = int(self._endpoint.local_address[1])
        return SubscribeUdp(request_id, self.subscription_id, self.queue, self.prefetch, self.window, port,
                            self.stream_id)

    def _on_subscribed(self, result: dict[str, Any]) -> None:
        """The broker's OK (from the reader): the publication's session id; start reading the image."""
        self.session_id = int(result["session_id"])
        channel = ReceiveChannel(self.stream_id, self._receiver_config(self.session_id, result))
        self._channel = channel
        self._subscription = channel.add_subscription(now_ns(), on_available_image=self._image_available)
        super()._on_subscribed(result)
        nursery = self._conn._nursery
        if nursery is not None and not self._started:
            self._started = True
            nursery.start_soon(self._conn._contained, self._run, f"UDP subscription {self.subscription_id}")

    def _receiver_config(self, session_id: int, result: dict[str, Any]) -> ReceiverConfig:
        window = min(self.window, 1 << 30)
        return ReceiverConfig(receiver_id=random.randrange(1, 2**31), receiver_window=window,
                              session_id=session_id, so_rcvbuf=max(window, 1 << 20), max_images=1)

    def _image_available(self, image: Image) -> None:
        """The broker's publication's image: the first, or a new one after the last timed out (the broker's
        process stopped past the image liveness timeout, 10 s). The broker (``rejoin_at_consumed``) starts
        a new one at what this consumer last reported consumed, its *processed* position, so it sends
        again what was handed out and not processed, or processed since that status message: the image is
        read on from where the old one was (`_read_to`, a message boundary of the same stream), what the
        old one held stays held (`Image.resume_subscriber`), and nothing is handed out twice. Else the
        deliveries sent into the dead image were lost: 1,000 of 20,000 for a broker stopped 12-16 s,
        counted delivered and unsettled by the broker until the consumer closed (a tester)."""
        image.window_cap = self.window
        image.hold_partial = True  # (the broker sends a message over the window whole: Egress.do_work)
        self._image = image
        self._term_length = image.term_length
        self._max_payload = image.mtu - DATA_HEADER_LENGTH
        self._image_subscriber = self._subscription_id_in_image()
        read_to, join = self._read_to, image.join_position
        held = self._held
        if join < read_to <= join + image.term_length // 2:
            space = sum(entry[1] for entry in held)
            while held and space > read_to - join:  # (held bytes below the join: not this image's)
                space -= held.popleft()[1]
            image.resume_subscriber(self._image_subscriber, read_to, space)
            self._release_at = held[0][0] if held else RELEASE_NEVER
            self._release()  # what was processed while there was no image
            return
        if 0 <= read_to < join:
            self._stream_lost(join - read_to)
        self._read_to = join
        held.clear()  # (_charged_end goes on: what the old image handed out still counts as processed)
        self._release_at = RELEASE_NEVER

    def _stream_lost(self, gap: int) -> None:
        """A new image starts past where the old one was read to: the broker could not send again what went
        into the dead one (it went on for another receiver, or its log no longer held it), so those
        deliveries never arrive, and the broker counts them delivered and unsettled. Not carried on past
        them in silence: the subscription is cancelled (the broker requeues every unsettled delivery,
        flagged redelivered), what is buffered is not handed out, and the next receive raises."""
        log.warning("UDP subscription %s of %r: the broker's stream went on %d bytes past what arrived: "
                    "cancelled, its unsettled deliveries requeued", self.subscription_id, self.queue, gap)
        self._on_revoked(PublishError(
            ErrorCode.IDLE_TIMEOUT, f"the broker's UDP stream to this consumer went on {gap} bytes past what "
            "arrived (an image lost for 10 s): the subscription was cancelled and the broker requeues every "
            "unsettled delivery, redelivered; make a new consumer", self.queue),
            "lost part of the broker's UDP stream")
        self._conn._cancel_nowait(self)

    # -------------------------------------------------------------- the image

    def _on_message(self, payload: memoryview | bytes) -> None:
        """One message polled from the image: decoded, its term bytes counted to be held until it is
        processed, and collected in `_polled`; `_receive` holds a poll's bytes in the image in one call
        and hands its messages to the consumer's buffer in one call."""
        single = not len(payload) or payload[0] != DELIVER_BATCH
        try:
            entries: list[Any] = [decode_delivery(payload)] if single else decode_delivery_batch(payload)
        except EnvelopeError as exc:
            self._unheld = True
            self.malformed += 1
            log.warning("UDP subscription %s: payload dropped: %s", self.subscription_id, exc)
            return
        if not self._ended:
            length = len(payload)
            if length <= self._max_payload:  # one frame: frame_space inlined
                space = (length + DATA_HEADER_LENGTH + 31) & ~31
            else:
                space = frame_space(length, self._max_payload + DATA_HEADER_LENGTH)
            if any(e[4] for e in entries):
                charged = sum(message_size(e[3], e[4]) for e in entries)
            else:
                charged = sum(map(len, [e[3] for e in entries])) + MESSAGE_OVERHEAD * len(entries)
            self._hold(charged, space, single)
        else:
            self._unheld = True
        self._polled += entries

    def _hold(self, charged: int, space: int, single: bool) -> None:
        """A payload's messages (`charged` bytes of them) hold `space` term bytes until all are processed. A
        single DELIVER joins the group before it while that group is under a sixteenth of the window."""
        self._polled_space += space
        end = self._charged_end = self._charged_end + charged
        held = self._held
        if single and held:
            last = held[-1]
            if last[1] < self._release_step:
                last[0] = end
                last[1] += space
                if len(held) == 1:
                    self._release_at = end
                return
        held.append([end, space])
        if len(held) == 1:
            self._release_at = end

    def statistics(self) -> ConsumerStatistics:
        """`Consumer.statistics()`, its `window` this consumer's: the byte credit its status messages grant
        (the base class's byte buffer is the TCP one, off for a UDP subscription), at most half a term once
        the image has said how long its terms are, as the image caps it."""
        term_length = self._term_length
        window = self.window if term_length is None else min(self.window, term_length // 2)
        return replace(super().statistics(), window=window)

    def _subscription_id_in_image(self) -> int:
        assert self._subscription is not None
        return self._subscription.subscription_id

    def _release(self) -> None:
        """The processed position reached the end of the oldest held payload (`Consumer._release_at`): the
        image may report the term bytes of every payload it has passed as consumed. At once when
        everything handed out is processed; a status message goes out when `_report_due` says so (the
        status task sends it: waking it per payload, not per message)."""
        consumed = self._receiver_window.consumed_position
        held = self._held
        released = 0
        while held and held[0][0] <= consumed:
            released += held.popleft()[1]
        self._release_at = held[0][0] if held else RELEASE_NEVER
        image = self._image
        if released and image is not None:
            image.release(self._image_subscriber, released)
            if self._report_due(image):
                self._dirty.set()

    def _report_due(self, image: Image) -> bool:
        """Has processing moved the consumption position enough to tell the broker now: everything handed
        out processed and the broker half-way through the window it was last given (reported at once), or
        what the image's quarter-window rule calls for?"""
        if not self._held and image.rebuild_position - image.last_sm_position >= image.last_sm_window // 2:
            image.report_now()
        return image.status_message_due()

    def _send(self, out: list[tuple[bytes, Any]]) -> None:
        endpoint = self._endpoint
        if endpoint.closed:
            return
        for datagram, address in out:
            endpoint.send(datagram, address)

    async def _run(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._status)
                    await self._receive()
        finally:
            self._endpoint.close()
            # The consumer, its channel and the callbacks refer to each other: its image (3 x term_length
            # of term buffers) waited for the collector's full pass after every close. Let go, it is freed
            # with the consumer.
            self._on_processed = None
            self._image = None
            channel, subscription = self._channel, self._subscription
            self._channel = self._subscription = None
            if subscription is not None:
                subscription.close(now_ns())  # (it and its channel refer to each other, and it to our callback)
            if channel is not None:
                channel.images.clear()
            self._done.set()

    async def _receive(self) -> None:
        """Datagrams into the image, messages out of it into the consumer's buffer, SMs and NAKs back.

        One duty cycle of the channel per batch of datagrams, before the poll (the rebuild moves there,
        and SMs and NAKs go out). Not a second one after it: a poll holds what it hands out, so it moves
        no consumption position, unless it dropped a message or the consumer has ended (`_unheld`)."""
        channel, subscription, endpoint = self._channel, self._subscription, self._endpoint
        assert channel is not None and subscription is not None
        while True:
            batch: list[tuple[bytes, tuple[str, int]]] = []
            with trio.move_on_at(channel.next_deadline_ns(now_ns()) / 1_000_000_000):
                batch = await endpoint.receive_batch(DEFAULT_BATCH)
            now = now_ns()
            for datagram, source in batch:
                image = self._image
                if image is not None and source != image.source:
                    # Only the broker's publication feeds the image: one forged DATA datagram at the
                    # next position was handed out as a delivery, and the real one then lost (a tester).
                    self.foreign += 1
                    continue
                channel.on_datagram(datagram, source, now)
            self._send(channel.do_work(now))  # the rebuild moves here
            polled = self._polled
            while subscription.poll(self._on_message, _POLL_FRAGMENTS):
                space = self._polled_space
                if space:  # the poll's term bytes stay held until their messages are processed
                    self._polled_space = 0
                    image = self._image
                    if image is not None:
                        image.hold(self._image_subscriber, space)
                if polled:  # one DELIVER's worth: one call, one wake-up of the reader
                    self._polled = []
                    self._on_deliver(polled)
                    polled = self._polled
            image = self._image
            if image is not None and image.has_subscriber(self._image_subscriber):
                self._read_to = image.subscriber_whole_position(self._image_subscriber)
            if self._unheld:  # messages polled and not held moved the consumption position: report it
                self._unheld = False
                self._send(channel.do_work(now))

    @trio.lowlevel.enable_ki_protection
    async def _status(self) -> None:
        """Processing released bytes: the status message that reports it goes out without waiting for a datagram.

        Only when there is something to report (`_report_due`): an SM for every processed datagram's worth
        of messages was the broker's busiest input (each one a dispatch round of a few deliveries), where the
        image's quarter-window rule asks for one per quarter window; the exception is a broker that has used
        half its window and a consumer that has processed everything, told at once."""
        channel = self._channel
        assert channel is not None
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            image = self._image
            if image is not None and not self._report_due(image):
                continue  # reported since by the receiving task's cycle
            self._send(channel.do_work(now_ns()))

    async def aclose(self, timeout: float | None = None) -> None:
        """Cancel the subscription (as `Consumer.aclose`), then stop reading the image."""
        check_timeout("consumer close", timeout, "close_timeout")  # before anything is closed
        try:
            await super().aclose(timeout)
        finally:
            self._scope.cancel()
            if not self._started:
                self._endpoint.close()
