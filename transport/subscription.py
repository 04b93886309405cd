"""The receiving endpoint of a channel and the subscriptions reading from it (sans-IO).

``ReceiveChannel`` is Aeron's receive channel endpoint plus its data-packet dispatcher for one stream id:
every datagram from the socket goes to ``on_datagram``; it validates it, routes DATA to the session's image,
elicits a SETUP (an SM with the 0x80 flag) for a session it has no image for, creates images from SETUPs
after checking them, and counts every datagram under exactly one disposition, so nothing malformed can
raise out of it or go unaccounted. ``do_work(now_ns)`` runs each image's duty cycle and returns the control
datagrams (SMs, NAKs, RTTMs) with their destinations.

``Subscription`` is the application's handle: ``poll(handler, fragment_limit)`` delivers whole messages
from every image it reads. Several subscriptions share the channel's images, each with its own position;
tethered ones (the default) hold the sender back, untethered ones may be left behind.
"""

from __future__ import annotations

import random
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Hashable

from flowbroker.transport.channel import ChannelUri
from flowbroker.transport.congestion import (
    DEFAULT_INITIAL_WINDOW,
    CongestionParams,
    congestion_control_from_param,
)
from flowbroker.transport.frames import (
    DATA_HEADER,
    EOS_FLAG,
    ERROR_CODE_IMAGE_REJECTED,
    MAX_MTU,
    SETUP_LENGTH,
    ErrorFrame,
    FrameType,
    RejectReason,
    RttMeasurement,
    Setup,
    SM_SETUP_FLAG,
    StatusMessage,
    check_data_datagram,
    decode_datagram,
    encode_error,
    encode_status_message,
)
from flowbroker.transport.image import Image, ImageState, ImageTimers, MessageHandler
from flowbroker.transport.loss import DEFAULT_NAK_UNICAST_DELAY_NS, LossDetector
from flowbroker.transport.positions import TERM_MAX_LENGTH

__all__ = [
    "HANDLED_DISPOSITIONS",
    "ReceiveChannel",
    "ReceiveChannelStatistics",
    "ReceiverConfig",
    "Subscription",
    "SubscriptionStatistics",
]

Address = Hashable
ImageCallback = Callable[[Image], None]

#: ``AERON_DRIVER_RECEIVER_PENDING_SETUP_TIMEOUT_NS``: don't elicit SETUP for a session more often. Also
#: the period of the SETUP-eliciting SM a receiver with an explicit control address (MDC) sends to it.
PENDING_SETUP_TIMEOUT_NS = 1_000_000_000

#: (session, stream) field offsets in a SETUP, read from one that failed validation to address the ERR.
_SETUP_IDS = struct.Struct("<ii")
_SETUP_IDS_OFFSET = 12


#: Dispositions of datagrams the receiver used (or answered as the protocol says); every other key of
#: ``ReceiveChannel.dispositions`` is a datagram refused, and its key says why.
HANDLED_DISPOSITIONS = frozenset(
    {"data", "heartbeat", "setup", "rttm", "setup_for_existing_image", "elicit_setup", "draining"}
)


@dataclass(frozen=True, slots=True)
class ReceiveChannelStatistics:
    """A snapshot of a receive channel (``ReceiveChannel.statistics()``).

    ``dispositions``: every datagram received, counted under exactly one key, as ``(key, count)`` pairs
    sorted by key (so ``sum`` of the counts is ``datagrams_received``); ``refused``: the pairs whose key is
    not in ``HANDLED_DISPOSITIONS``, i.e. the datagrams refused by reason (``rejected:<reason>``,
    ``out_of_window``, ``unknown_session``, ``other_stream``, ``setup_rejected:<why>``, ...).
    """

    stream_id: int
    images: int
    subscriptions: int
    datagrams_received: int
    announcements_sent: int
    errors_sent: int
    dispositions: tuple[tuple[str, int], ...]
    refused: tuple[tuple[str, int], ...]

    @property
    def datagrams_refused(self) -> int:
        return sum(count for _, count in self.refused)


@dataclass(frozen=True, slots=True)
class SubscriptionStatistics:
    """A snapshot of a subscription (``Subscription.statistics()``).

    ``consumption_positions``: ``(session_id, position)`` for each image this subscription reads, the bytes
    its handler has processed (what the image's status messages report when it is the slowest);
    ``messages``: whole messages handed to the handler from the images still there.
    """

    subscription_id: int
    tether: bool
    closed: bool
    consumption_positions: tuple[tuple[int, int], ...]
    messages: int


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    """Receiver settings from the subscription channel (``rcv-wnd``, ``cc``, ``gtag``, ...)."""

    receiver_id: int
    receiver_window: int = DEFAULT_INITIAL_WINDOW
    congestion_control: str | None = None  # cc=static|cubic
    group_tag: int | None = None
    session_id: int | None = None  # only this session (session-id= on a subscription)
    so_rcvbuf: int = 128 * 1024
    nak_delay_ns: int = DEFAULT_NAK_UNICAST_DELAY_NS
    multicast: bool = False
    reliable: bool = True
    tether: bool = True
    timers: ImageTimers = ImageTimers()
    max_images: int = 256
    max_pending_setups: int = 1024
    #: Where SMs/NAKs/ERRs go instead of the data's source: multicast, the control group; a subscription
    #: with an explicit ``control`` (multi-destination-cast), the publication's control address, which
    #: this receiver also announces itself to every second with a SETUP-eliciting SM (session 0, stream 0,
    #: as Aeron's receiver does), so a ``control-mode=dynamic`` publication learns it as a destination.
    control_address: Address | None = None
    seed: int = 0  # NAK backoff randomness (multicast)

    @classmethod
    def from_channel(
        cls, channel: ChannelUri, receiver_id: int, *, control_address: Address | None = None, seed: int = 0
    ) -> ReceiverConfig:
        """Receiver settings from a parsed subscription URI (``rcv-wnd``, ``cc``, ``gtag``, ...).

        ``control_address``: the resolved control address the I/O shell sends SMs/NAKs to: for multicast
        the control group (``channel.control_endpoint``), with an explicit ``control=`` (MDC) that one.
        """
        return cls(
            receiver_id=receiver_id,
            receiver_window=channel.rcv_wnd or DEFAULT_INITIAL_WINDOW,
            congestion_control=channel.cc.value,
            group_tag=channel.gtag,
            session_id=channel.session_id,
            so_rcvbuf=channel.so_rcvbuf,
            nak_delay_ns=channel.nak_delay_ns,
            multicast=channel.is_multicast,
            reliable=channel.reliable,
            tether=channel.tether,
            control_address=control_address,
            seed=seed,
        )


class ReceiveChannel:
    """All images of one stream on one receive endpoint."""

    def __init__(self, stream_id: int, config: ReceiverConfig) -> None:
        self.stream_id = stream_id
        self.config = config
        self.images: dict[int, Image] = {}
        self._pending_setup: dict[tuple[int, Address], int] = {}
        self._subscriptions: dict[int, Subscription] = {}
        self._next_subscription_id = 1
        self._outbox: list[tuple[bytes, Address]] = []
        self._rng = random.Random(config.seed)
        # MDC receivers announce themselves to the publication's control address (never multicast ones).
        self._announces = config.control_address is not None and not config.multicast
        self._next_announce_ns: int | None = None
        # Last ERR sent per (session, source) for a refused image: at most one per SM timeout.
        self._rejections: dict[tuple[int, Address], int] = {}
        self.announcements_sent = 0
        self.errors_sent = 0
        self.datagrams_received = 0
        #: One entry per datagram: how it was handled ("data", "heartbeat", "setup", "rttm", "duplicate",
        #: "rejected:<reason>", "unknown_session", "other_stream", "out_of_window", "no_image", ...).
        self.dispositions: Counter[str] = Counter()
        self.rejected = 0  #: datagrams refused as malformed ("rejected:<reason>"), for a caller's own count

    def statistics(self) -> ReceiveChannelStatistics:
        """A frozen snapshot of the counters (reads them; nothing is counted for it)."""
        dispositions = tuple(sorted(self.dispositions.items()))
        return ReceiveChannelStatistics(
            self.stream_id, len(self.images), len(self._subscriptions), self.datagrams_received,
            self.announcements_sent, self.errors_sent, dispositions,
            tuple(kv for kv in dispositions if kv[0] not in HANDLED_DISPOSITIONS),
        )

    # ------------------------------------------------------------------------------------ subscriptions

    def add_subscription(
        self,
        now_ns: int,
        *,
        tether: bool | None = None,
        on_available_image: ImageCallback | None = None,
        on_unavailable_image: ImageCallback | None = None,
    ) -> Subscription:
        sub_id = self._next_subscription_id
        self._next_subscription_id += 1
        sub = Subscription(
            self, sub_id, self.config.tether if tether is None else tether, on_available_image, on_unavailable_image
        )
        self._subscriptions[sub_id] = sub
        if self._announces and self._next_announce_ns is None:
            self._next_announce_ns = now_ns  # announce at the next duty cycle
        for image in self.images.values():
            image.add_subscriber(sub_id, sub.tether, now_ns)
            sub._notify_available(image)
        return sub

    def _remove_subscription(self, sub: Subscription, now_ns: int) -> None:
        self._subscriptions.pop(sub.subscription_id, None)
        for image in self.images.values():
            image.remove_subscriber(sub.subscription_id, now_ns)

    # ------------------------------------------------------------------------------------ datagrams in

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, now_ns: int) -> None:
        """Handle one received datagram. Never raises for any content of ``data``."""
        self.datagrams_received += 1
        n = len(data)
        if n >= 32:
            frame_length, version, flags, ftype, term_offset, session_id, stream_id, term_id, _r = (
                DATA_HEADER.unpack_from(data, 0)
            )
            if version == 0 and (ftype == FrameType.DATA or ftype == FrameType.PAD):
                self._on_data(data, source, now_ns, frame_length, flags, term_offset, session_id, stream_id, term_id)
                return
        frames, reason = decode_datagram(data)
        if reason is not None:
            self.dispositions[f"rejected:{reason.value}"] += 1
            self.rejected += 1
            if n >= SETUP_LENGTH and DATA_HEADER.unpack_from(data, 0)[3] == FrameType.SETUP:
                self._on_invalid_setup(data, reason, source, now_ns)
            return
        frame = frames[0]
        if isinstance(frame, Setup):
            self._on_setup(frame, source, now_ns)
        elif isinstance(frame, RttMeasurement):
            image = self.images.get(frame.session_id)
            if image is None or frame.stream_id != self.stream_id:
                self.dispositions["no_image"] += 1
            else:
                image.on_rttm(frame, now_ns)
                self.dispositions["rttm"] += 1
        else:
            self.dispositions["not_for_receiver"] += 1  # SM/NAK/ERR belong to a publication

    def _on_data(
        self, data: bytes | bytearray | memoryview, source: Address, now_ns: int,
        frame_length: int, flags: int, term_offset: int, session_id: int, stream_id: int, term_id: int,
    ) -> None:
        if stream_id != self.stream_id:
            self.dispositions["other_stream"] += 1
            return
        image = self.images.get(session_id)
        term_length = image.term_length if image is not None else TERM_MAX_LENGTH
        reason = check_data_datagram(data, term_length)
        if reason is not None:
            self.dispositions[f"rejected:{reason.value}"] += 1
            self.rejected += 1
            return
        if image is None:
            self._elicit_setup(session_id, flags, source, now_ns)
            return
        is_heartbeat = frame_length == 0
        if image.state is not ImageState.ACTIVE:
            # Draining after end of stream (or a timeout): the publication's heartbeats and a last
            # retransmit still arrive. Not a refusal (it was counted as out_of_window).
            self.dispositions["draining"] += 1
            return
        if image.insert_packet(
            term_id, term_offset, data, now_ns, is_heartbeat=is_heartbeat, is_eos=bool(flags & EOS_FLAG)
        ):
            self.dispositions["heartbeat" if is_heartbeat else "data"] += 1
        else:
            self.dispositions["out_of_window"] += 1

    def _elicit_setup(self, session_id: int, flags: int, source: Address, now_ns: int) -> None:
        if flags & EOS_FLAG or (self.config.session_id is not None and session_id != self.config.session_id):
            self.dispositions["unknown_session"] += 1
            return
        key = (session_id, source)
        last = self._pending_setup.get(key)
        if last is not None and now_ns - last < PENDING_SETUP_TIMEOUT_NS:
            self.dispositions["pending_setup"] += 1
            return
        if last is None and len(self._pending_setup) >= self.config.max_pending_setups:
            self._expire_pending_setups(now_ns)
            if len(self._pending_setup) >= self.config.max_pending_setups:
                self.dispositions["pending_setup_full"] += 1
                return
        self._pending_setup[key] = now_ns
        sm = StatusMessage(session_id, self.stream_id, 0, 0, 0, self.config.receiver_id, None, SM_SETUP_FLAG)
        destination = self.config.control_address if self.config.control_address is not None else source
        self._outbox.append((encode_status_message(sm), destination))
        self.dispositions["elicit_setup"] += 1

    def _expire_pending_setups(self, now_ns: int) -> None:
        for key in [k for k, t in self._pending_setup.items() if now_ns - t >= PENDING_SETUP_TIMEOUT_NS]:
            del self._pending_setup[key]

    def _setup_problem(self, setup: Setup, window: int) -> str | None:
        """Why the image cannot be created (the driver's checks), or None."""
        if setup.mtu < 32 or setup.mtu > MAX_MTU or setup.mtu % 32:
            return "bad_mtu"
        # Against the configured receiver window, not the one clamped to term_length / 2, as the C driver
        # does: mtu=65504 with term-length=65536 works between C drivers and must work from one to us.
        if setup.mtu > max(window, self.config.receiver_window):
            return "mtu_exceeds_window"
        if self.config.so_rcvbuf < window or self.config.so_rcvbuf < setup.mtu:
            return "so_rcvbuf_too_small"
        return None

    def _on_invalid_setup(
        self, data: bytes | bytearray | memoryview, reason: RejectReason, source: Address, now_ns: int
    ) -> None:
        """A SETUP that failed validation (bad term length, MTU, offset): tell its publication with an ERR."""
        session_id, stream_id = _SETUP_IDS.unpack_from(data, _SETUP_IDS_OFFSET)
        if stream_id != self.stream_id or not self._subscriptions:
            return
        if self.config.session_id is not None and session_id != self.config.session_id:
            return
        self._send_rejection(session_id, source, f"image rejected: invalid SETUP ({reason.value})", now_ns)

    def _send_rejection(self, session_id: int, source: Address, text: str, now_ns: int) -> None:
        """ERR (code IMAGE_REJECTED) to the publication, at most once per SM timeout per (session, source).

        The 1.47 driver sends an ERR instead of SMs once it refuses an image; the publication then treats
        this receiver as gone. Our SETUP retries (every 100 ms until an SM) are answered at the SM pace.
        """
        key = (session_id, source)
        last = self._rejections.get(key)
        if last is not None and now_ns - last < self.config.timers.sm_timeout_ns:
            return
        if last is None and len(self._rejections) >= self.config.max_pending_setups:
            timeout = self.config.timers.sm_timeout_ns
            for k in [k for k, t in self._rejections.items() if now_ns - t >= timeout]:
                del self._rejections[k]
            if len(self._rejections) >= self.config.max_pending_setups:
                return
        self._rejections[key] = now_ns
        err = ErrorFrame(session_id, self.stream_id, self.config.receiver_id, ERROR_CODE_IMAGE_REJECTED, text,
                         self.config.group_tag)
        destination = self.config.control_address if self.config.control_address is not None else source
        self._outbox.append((encode_error(err), destination))
        self.errors_sent += 1

    def _on_setup(self, setup: Setup, source: Address, now_ns: int) -> None:
        if setup.stream_id != self.stream_id:
            self.dispositions["other_stream"] += 1
            return
        if self.config.session_id is not None and setup.session_id != self.config.session_id:
            self.dispositions["unknown_session"] += 1
            return
        existing = self.images.get(setup.session_id)
        if existing is not None:
            if existing.state is ImageState.ACTIVE:
                existing._sm_pending = True  # our SM may have been lost: answer again
            self.dispositions["setup_for_existing_image"] += 1
            return
        if not self._subscriptions:
            self.dispositions["no_subscribers"] += 1  # nobody would read it; don't hold buffers for it
            return
        if len(self.images) >= self.config.max_images:
            self.dispositions["too_many_images"] += 1
            return
        params = CongestionParams(setup.term_length, setup.mtu, self.config.receiver_window)
        congestion = congestion_control_from_param(self.config.congestion_control, params, now_ns)
        problem = self._setup_problem(setup, congestion.max_window_length())
        if problem is not None:
            self.dispositions[f"setup_rejected:{problem}"] += 1
            self._send_rejection(
                setup.session_id, source,
                f"image rejected: {problem} (mtu={setup.mtu}, term-length={setup.term_length}, "
                f"window={congestion.max_window_length()}, so-rcvbuf={self.config.so_rcvbuf})",
                now_ns,
            )
            return
        loss = LossDetector(
            nak_delay_ns=self.config.nak_delay_ns,
            multicast=self.config.multicast,
            rng=random.Random(self._rng.getrandbits(64)),
        )
        image = Image(
            setup,
            source,
            now_ns,
            receiver_id=self.config.receiver_id,
            congestion=congestion,
            loss=loss,
            timers=self.config.timers,
            group_tag=self.config.group_tag,
            control_address=self.config.control_address,
            reliable=self.config.reliable,
        )
        self.images[setup.session_id] = image
        self._pending_setup.pop((setup.session_id, source), None)
        for sub in self._subscriptions.values():
            image.add_subscriber(sub.subscription_id, sub.tether, now_ns)
            sub._notify_available(image)
        self.dispositions["setup"] += 1

    # ------------------------------------------------------------------------------------ duty cycle

    def do_work(self, now_ns: int) -> list[tuple[bytes, Address]]:
        """Run every image's duty cycle; return control datagrams and where to send them."""
        out = self._outbox
        self._outbox = []
        announce = self._next_announce_ns
        if announce is not None and self._subscriptions and now_ns - announce >= 0:
            sm = StatusMessage(0, 0, 0, 0, 0, self.config.receiver_id, None, SM_SETUP_FLAG)
            assert self.config.control_address is not None
            out.append((encode_status_message(sm), self.config.control_address))
            self.announcements_sent += 1
            self._next_announce_ns = now_ns + PENDING_SETUP_TIMEOUT_NS
        done: list[int] = []
        for session_id, image in self.images.items():
            for frame in image.do_work(now_ns):
                out.append((frame, image.control_address))
            if image.state is ImageState.DONE:
                done.append(session_id)
        for session_id in done:
            image = self.images.pop(session_id)
            for sub in self._subscriptions.values():
                sub._notify_unavailable(image)
        if len(self._pending_setup) > self.config.max_pending_setups // 2:
            self._expire_pending_setups(now_ns)
        return out

    def next_deadline_ns(self, now_ns: int) -> int:
        """When ``do_work`` must run again if nothing arrives."""
        deadline = now_ns + self.config.timers.sm_timeout_ns
        if self._next_announce_ns is not None and self._subscriptions:
            deadline = min(deadline, self._next_announce_ns)
        for image in self.images.values():
            deadline = min(deadline, image.next_deadline_ns())
        return deadline


class Subscription:
    """An application's reader of a stream: polls every image of the channel from its own position."""

    def __init__(
        self,
        channel: ReceiveChannel,
        subscription_id: int,
        tether: bool,
        on_available_image: ImageCallback | None,
        on_unavailable_image: ImageCallback | None,
    ) -> None:
        self.channel = channel
        self.subscription_id = subscription_id
        self.tether = tether
        self._on_available = on_available_image
        self._on_unavailable = on_unavailable_image
        self._closed = False
        self._start = 0

    def _notify_available(self, image: Image) -> None:
        if self._on_available is not None:
            self._on_available(image)

    def _notify_unavailable(self, image: Image) -> None:
        if self._on_unavailable is not None:
            self._on_unavailable(image)

    @property
    def images(self) -> list[Image]:
        return [i for i in self.channel.images.values() if i.is_available_to(self.subscription_id)]

    @property
    def is_connected(self) -> bool:
        return bool(self.images)

    def position(self, session_id: int) -> int:
        """This subscription's consumption position on the session's image."""
        return self.channel.images[session_id].subscriber_position(self.subscription_id)

    def statistics(self) -> SubscriptionStatistics:
        """A frozen snapshot of this subscription's positions (reads them; nothing is counted for it)."""
        sid = self.subscription_id
        joined = [(session_id, image) for session_id, image in sorted(self.channel.images.items())
                  if image.has_subscriber(sid)]
        return SubscriptionStatistics(
            sid, self.tether, self._closed,
            tuple((session_id, image.subscriber_position(sid)) for session_id, image in joined),
            sum(image.subscriber_messages(sid) for _, image in joined),
        )

    def poll(self, handler: MessageHandler, fragment_limit: int = 10) -> int:
        """Deliver up to ``fragment_limit`` fragments as whole messages to ``handler``; return fragments read.

        Images are polled round-robin from a rotating start so no publisher starves the others. Positions
        advance only after the handler returned, so SMs (and the sender) follow what was processed.
        """
        if self._closed:
            return 0
        images = list(self.channel.images.values())
        if not images:
            return 0
        count = len(images)
        start = self._start % count
        self._start += 1
        total = 0
        for i in range(count):
            if total >= fragment_limit:
                break
            total += images[(start + i) % count].poll(self.subscription_id, handler, fragment_limit - total)
        return total

    def close(self, now_ns: int) -> None:
        if not self._closed:
            self._closed = True
            self.channel._remove_subscription(self, now_ns)
