"""The sending half of a stream: Aeron's network publication as a sans-IO state machine.

The application ``offer``s messages; they are appended to a three-partition term log (``terms``) at the
publication's tail position. The *sender* side of the same object copies runs of frames out of the log into
datagrams when ``do_work(now_ns)`` is called and hands them back as ``(datagram, address)`` pairs; the I/O
shell (``transport.udp``) sends them and feeds received control frames to ``on_datagram``. Nothing here reads a
clock or touches a socket.

Positions (Aeron's counters, snake_case):

* ``position``: the tail; where the next message will be appended.
* ``sender_position``: everything before it has been sent at least once.
* ``sender_limit``: from status messages through the flow-control strategy; the sender never sends past it.
* ``publication_limit``: ``sender_position + publication_window`` while connected. ``offer`` succeeds only
  below it, so the application can run at most one window ahead of the network; beyond it ``offer`` returns
  ``BACK_PRESSURED`` (a return value, never an exception). The window is at most half a term, which is what
  keeps unsent and retransmittable data from ever being overwritten in the three partitions.

Protocol behaviour follows the C driver (reference/aeron-wire.md section 2): SETUP every 100 ms until the
first SM and again when an SM asks for it; no data before an SM; a heartbeat after 100 ms without data; on
``close`` the remaining data drains, then end-of-stream heartbeats go out while the publication lingers;
NAKs are served at once and then ignored for the same range for the retransmit linger, with at most
``max_resend`` retransmits in flight.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Hashable

from flowbroker.transport.channel import ChannelUri, ControlMode
from flowbroker.transport.flow_control import FlowControl, MaxFlowControl, MinFlowControl, flow_control_from_param
from flowbroker.transport.frames import (
    DATA_HEADER_LENGTH,
    ErrorFrame,
    Nak,
    RttMeasurement,
    Setup,
    StatusMessage,
    decode_datagram,
    encode_heartbeat,
    encode_rttm,
    encode_setup,
)
from flowbroker.transport.positions import (
    compute_max_message_length,
    compute_position,
    compute_term_id_from_position,
    max_possible_position,
    position_bits_to_shift,
)
from flowbroker.transport.terms import TermAppender, scan_for_availability

__all__ = ["OfferResult", "Publication", "PublicationConfig", "PublicationStatistics", "PublicationCounters"]

Address = Hashable

#: Bound on control replies (RTTM) queued between duty cycles; a flood of probes cannot grow memory.
_MAX_PENDING_CONTROL = 64


class OfferResult(enum.IntEnum):
    """Aeron's ``Publication.offer`` failure codes; a successful offer returns a position (> 0)."""

    NOT_CONNECTED = -1
    BACK_PRESSURED = -2
    ADMIN_ACTION = -3
    CLOSED = -4
    MAX_POSITION_EXCEEDED = -5


class _State(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"  # closed by the application; unsent data still going out
    LINGER = "linger"  # all sent; EOS heartbeats and retransmits for linger_ns
    DONE = "done"


@dataclass(frozen=True, slots=True)
class PublicationConfig:
    """Stream identity, term geometry and timers (defaults are the C driver's)."""

    session_id: int
    stream_id: int
    term_length: int = 16 * 1024 * 1024
    mtu: int = 1408
    initial_term_id: int = 0
    active_term_id: int | None = None  # with term_offset: start mid-stream (init-term-id/term-id/term-offset)
    term_offset: int = 0
    publication_window: int | None = None  # pub-wnd; default and maximum term_length / 2
    ttl: int = 0
    setup_interval_ns: int = 100_000_000
    heartbeat_interval_ns: int = 100_000_000
    connection_timeout_ns: int = 5_000_000_000
    linger_ns: int = 5_000_000_000
    retransmit_delay_ns: int = 0
    retransmit_linger_ns: int = 10_000_000
    max_resend: int = 16
    max_messages_per_send: int = 2
    reserved_value: int = 0

    def __post_init__(self) -> None:
        if self.mtu < 64 or self.mtu > 65504 or self.mtu % 32:
            raise ValueError(f"mtu={self.mtu}: must be a multiple of 32 in [64, 65504]")
        position_bits_to_shift(self.term_length)  # raises on a bad term length
        if self.term_offset < 0 or self.term_offset >= self.term_length or self.term_offset % 32:
            raise ValueError(f"term-offset={self.term_offset}: must be 32-aligned and inside the term")
        if self.publication_window is not None and self.publication_window <= 0:
            raise ValueError(f"pub-wnd={self.publication_window}: must be > 0")
        if not 1 <= self.max_resend <= 256:
            raise ValueError(f"max-resend={self.max_resend}: must be in [1, 256]")
        if self.max_messages_per_send < 1:
            raise ValueError("max_messages_per_send must be >= 1")


@dataclass(slots=True)
class PublicationCounters:
    """Counters, named after the driver's where one exists."""

    setups_sent: int = 0
    data_datagrams_sent: int = 0
    bytes_sent: int = 0
    heartbeats_sent: int = 0
    status_messages_received: int = 0
    naks_received: int = 0
    naks_ignored: int = 0
    retransmits_sent: int = 0
    retransmitted_bytes: int = 0
    back_pressure_events: int = 0
    invalid_packets: int = 0
    errors_received: int = 0
    rttm_replies_sent: int = 0
    rejoins: int = 0  # a receiver that lost its image was sent the stream again from what it consumed


@dataclass(frozen=True, slots=True)
class PublicationStatistics:
    """A snapshot of a publication (``Publication.statistics()``), in Aeron's words.

    Positions are bytes since the stream's start: ``position`` the tail (next append), ``sender_position``
    sent at least once, ``sender_limit`` what the receivers' status messages allow (through the flow-control
    strategy), ``publication_limit`` how far ``offer`` may append (``sender_position + publication_window``
    while connected), ``receiver_window`` the window in the last status message. The counters are
    ``PublicationCounters``' at that moment.
    """

    session_id: int
    stream_id: int
    position: int
    sender_position: int
    sender_limit: int
    publication_limit: int
    publication_window: int
    receiver_window: int
    receiver_count: int
    connected: bool
    closed: bool
    setups_sent: int
    data_datagrams_sent: int
    bytes_sent: int
    heartbeats_sent: int
    status_messages_received: int
    naks_received: int
    naks_ignored: int
    retransmits_sent: int
    retransmitted_bytes: int
    back_pressure_events: int
    invalid_packets: int
    errors_received: int
    rttm_replies_sent: int


@dataclass(slots=True)
class _Resend:
    position: int
    length: int
    due_ns: int
    lingering: bool = False


@dataclass(slots=True)
class _Receiver:
    address: Address
    last_sm_ns: int
    window: int = 0
    position: int = 0  # the consumption position of its last SM


class Publication:
    """One Aeron stream's sender: ``offer`` on the application side, ``do_work``/``on_datagram`` on the wire.

    Args:
        config: session, stream, term geometry and timers.
        now_ns: creation time (starts the SETUP timer).
        destination: where data goes (the channel endpoint: unicast or multicast group). ``None`` with
            ``dynamic=True`` means multi-destination-cast: every receiver that sends an SM becomes a
            destination; with ``add_destination`` a manual multi-destination-cast.
        flow_control: the strategy from ``fc=`` (default ``max``).
        dynamic: learn destinations from SMs (``control-mode=dynamic``).
        rejoin_at_consumed: a unicast receiver whose image died (timed out after 10 s without data: this
            sender's process was stopped) and asks for SETUP again, with nobody else connected, is given
            the stream from the position it last reported consumed, not from the sender position: what was
            sent into the image that died and never consumed is sent again (Aeron's rule, a new image at
            the sender position, skips it: at most once across images). The broker's UDP data paths, at
            least once, set it (see ``_rejoin``).
    """

    def __init__(
        self,
        config: PublicationConfig,
        now_ns: int,
        *,
        destination: Address | None = None,
        flow_control: FlowControl | None = None,
        dynamic: bool = False,
        rejoin_at_consumed: bool = False,
    ) -> None:
        self.config = config
        self.session_id = config.session_id
        self.stream_id = config.stream_id
        self.term_length = config.term_length
        self.mtu = config.mtu
        self.initial_term_id = config.initial_term_id
        self.position_bits_to_shift = position_bits_to_shift(config.term_length)
        self.max_message_length = compute_max_message_length(config.term_length)
        self.max_possible_position = max_possible_position(config.term_length)
        window = config.publication_window or config.term_length // 2
        self.publication_window = min(window, config.term_length // 2)
        self.flow_control: FlowControl = flow_control if flow_control is not None else MaxFlowControl()
        self.dynamic = dynamic
        self.rejoin_at_consumed = rejoin_at_consumed
        active_term_id = config.initial_term_id if config.active_term_id is None else config.active_term_id
        self.appender = TermAppender(
            config.term_length,
            config.initial_term_id,
            config.session_id,
            config.stream_id,
            config.mtu,
            active_term_id=active_term_id,
            term_offset=config.term_offset,
        )
        start = compute_position(
            active_term_id, config.term_offset, self.position_bits_to_shift, config.initial_term_id
        )
        self.start_position = start
        self.sender_position = start
        self.sender_limit = start
        self.publication_limit = start
        self.counters = PublicationCounters()
        self._state = _State.ACTIVE
        self._destinations: dict[Address, int | None] = {}
        if destination is not None:
            self._destinations[destination] = None
        self._receivers: dict[int, _Receiver] = {}
        self._consumed = start  # consumption_position as the last status message left it
        self._has_initial_connection = False
        self._setup_due_ns: int | None = now_ns
        self._time_of_last_send_ns = now_ns
        self._time_of_last_work_ns = now_ns  # the last duty cycle (see do_work: a sender that did not run)
        self._linger_deadline_ns = 0
        self._resends: dict[int, _Resend] = {}
        self._receiver_window = 0
        self._pending_control: list[tuple[bytes, Address]] = []
        self._eos_sent = False
        self._more_to_send = False  # the last cycle stopped at max_messages_per_send, not at the limit
        #: The last ERR a receiver sent (the reason it refused our image), and an optional callback for
        #: each one (Aeron's publication error frame handler).
        self.last_error: ErrorFrame | None = None
        self.error_handler: Callable[[ErrorFrame, Address], None] | None = None

    # ------------------------------------------------------------------------------------ application side

    @classmethod
    def from_channel(
        cls, channel: ChannelUri, stream_id: int, session_id: int, now_ns: int, *,
        destination: Address | None = None, **overrides: int,
    ) -> Publication:
        """A publication configured from a parsed ``aeron:udp?...`` URI.

        ``destination`` is the resolved data address (the I/O shell resolves ``endpoint``); with
        ``control-mode=dynamic`` it may be ``None`` and receivers are learnt from their SMs.
        ``overrides`` set other ``PublicationConfig`` fields (timers, ``max_messages_per_send``).
        """
        initial_term_id = channel.init_term_id if channel.init_term_id is not None else 0
        config = PublicationConfig(
            session_id=channel.session_id if channel.session_id is not None else session_id,
            stream_id=stream_id,
            term_length=channel.term_length,
            mtu=channel.mtu,
            initial_term_id=initial_term_id,
            active_term_id=channel.term_id,
            term_offset=channel.term_offset or 0,
            publication_window=channel.publication_window,
            ttl=channel.ttl,
            linger_ns=channel.linger_ns,
            max_resend=channel.max_resend,
            **overrides,
        )
        return cls(
            config,
            now_ns,
            destination=destination,
            flow_control=flow_control_from_param(channel.fc),
            dynamic=channel.control_mode is ControlMode.DYNAMIC,
        )

    @property
    def position(self) -> int:
        """The tail position: where the next offered message will start."""
        return self.appender.position

    @property
    def consumption_position(self) -> int:
        """The lowest consumption position the live receivers' status messages report (the start position
        before any; once every receiver timed out or left, what they last reported: what was consumed stays
        consumed, and the broker's views showed the whole stream unacknowledged while a stopped consumer
        was silent): how far every receiver has *consumed*. Over flowbroker's UDP data path that is the
        broker's completion point, so a producer's messages below it are complete."""
        receivers = self._receivers
        if not receivers:
            return self._consumed
        return min(r.position for r in receivers.values())

    @property
    def is_closed(self) -> bool:
        return self._state is not _State.ACTIVE

    @property
    def is_done(self) -> bool:
        """Closed, drained and lingered: the I/O shell may drop this publication."""
        return self._state is _State.DONE

    @property
    def receiver_window(self) -> int:
        """The window of the last status message (0 before one)."""
        return self._receiver_window

    @property
    def is_connected(self) -> bool:
        """At least one live receiver, and as many as the flow-control strategy requires."""
        return bool(self._receivers) and self.flow_control.has_required_receivers()

    @property
    def receiver_count(self) -> int:
        """Receivers heard from (by receiver id) and not yet gone (timeout, EOS SM or ERR)."""
        return len(self._receivers)

    def statistics(self) -> PublicationStatistics:
        """A frozen snapshot of positions and counters (reads them; nothing is counted for it)."""
        st = self.counters
        return PublicationStatistics(
            self.session_id, self.stream_id, self.appender.position, self.sender_position, self.sender_limit,
            self.publication_limit, self.publication_window, self._receiver_window, len(self._receivers),
            self.is_connected, self.is_closed, st.setups_sent, st.data_datagrams_sent, st.bytes_sent,
            st.heartbeats_sent, st.status_messages_received, st.naks_received, st.naks_ignored,
            st.retransmits_sent, st.retransmitted_bytes, st.back_pressure_events, st.invalid_packets,
            st.errors_received, st.rttm_replies_sent,
        )

    def offer(self, payload: bytes | bytearray | memoryview) -> int:
        """Append one message; return the new position, or an ``OfferResult`` (negative) saying why not."""
        if self._state is not _State.ACTIVE:
            return OfferResult.CLOSED
        # The common case (one frame, room in the term and the window) in one call; else the general path.
        position = self.appender.append_unfragmented(payload, self.publication_limit, self.max_possible_position,
                                                     self.config.reserved_value)
        if position:
            return position
        length = len(payload)
        if length > self.max_message_length:
            raise ValueError(
                f"message length {length} exceeds max message length {self.max_message_length}"
            )
        position = self.appender.position
        if position < self.publication_limit:
            if position + length + DATA_HEADER_LENGTH >= self.max_possible_position:
                return OfferResult.MAX_POSITION_EXCEEDED
            if self.appender.needs_rotation(length):
                # Aeron's behaviour: pad the term out, rotate, and let the caller retry at once.
                self.appender.pad_and_rotate()
                return OfferResult.ADMIN_ACTION
            return self.appender.append(payload, self.config.reserved_value)
        self.counters.back_pressure_events += 1
        if position + length >= self.max_possible_position:
            return OfferResult.MAX_POSITION_EXCEEDED
        return OfferResult.BACK_PRESSURED if self.is_connected else OfferResult.NOT_CONNECTED

    def offer_parts(self, head: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview) -> int:
        """``offer(head + body)``, each part copied once into the term in the common case (one frame, room in
        the term and the window); the same return, the same bytes in the term."""
        if self._state is not _State.ACTIVE:
            return OfferResult.CLOSED
        position = self.appender.append_unfragmented_parts(head, body, self.publication_limit,
                                                           self.max_possible_position, self.config.reserved_value)
        if position:
            return position
        return self.offer(bytes(head) + bytes(body))

    def offer_many(self, messages: list[bytes], head: bytes = b"", claimed_limit: int = 0) -> int:
        """Append ``messages``, each behind ``head``, as unfragmented frames, all or none: the new
        position, or 0 when one would need the general path (``offer`` of ``head + message`` each:
        fragmenting, padding to the next term, back pressure, a closed publication) and nothing was
        appended. The bytes are those of offering each in turn. A producer that collects a burst
        (the SDK's UDP producer, up to a datagram's worth) appends it in one call.

        ``claimed_limit``: the publication limit the caller checked its messages' places against when it
        claimed them (as Aeron's ``tryClaim`` checks it), if higher than the limit now. A claim holds: the
        limit dropping meanwhile (every receiver timed out or said end of stream: the limit falls to the
        sender position) does not take it back, and what is appended below a limit that was in force
        overwrites nothing unsent (the window is at most half a term)."""
        if self._state is not _State.ACTIVE:
            return 0
        return self.appender.append_many(messages, head, max(self.publication_limit, claimed_limit),
                                         self.max_possible_position, self.config.reserved_value)

    def close(self, now_ns: int) -> None:
        """Stop accepting offers; drain what is appended, then linger with end-of-stream heartbeats."""
        if self._state is _State.ACTIVE:
            self._state = _State.DRAINING

    def remove_receiver(self, receiver_id: int, now_ns: int) -> None:
        """Forget a receiver the application knows is gone (a broker's multicast group member whose TCP
        connection ended): as an ERR from it does, it leaves the flow-control strategy and the connected set."""
        self.flow_control.on_error(receiver_id, now_ns)
        self._receivers.pop(receiver_id, None)
        self.sender_limit = self.flow_control.on_idle(
            now_ns, self.sender_limit, self.sender_position, self._state is not _State.ACTIVE
        )
        self._update_publication_limit()

    # ------------------------------------------------------------------------------------ destinations

    def add_destination(self, address: Address) -> None:
        """Manual multi-destination-cast: send to ``address`` too."""
        self._destinations[address] = None

    def remove_destination(self, address: Address) -> None:
        self._destinations.pop(address, None)

    @property
    def destinations(self) -> list[Address]:
        return list(self._destinations)

    # ------------------------------------------------------------------------------------ control frames in

    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address, now_ns: int) -> None:
        """A datagram arrived on the control address (SM, NAK, ERR, RTTM); anything else is counted."""
        frames, reason = decode_datagram(data, self.term_length)
        if reason is not None or not frames:
            self.counters.invalid_packets += 1
            return
        frame = frames[0]
        if isinstance(frame, StatusMessage):
            self._on_status_message(frame, source, now_ns)
        elif isinstance(frame, Nak):
            self._on_nak(frame, now_ns)
        elif isinstance(frame, RttMeasurement):
            self._on_rttm(frame, source)
        elif isinstance(frame, ErrorFrame):
            self._on_error_frame(frame, source, now_ns)
        else:
            self.counters.invalid_packets += 1

    def _on_status_message(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        if sm.is_setup_request and sm.session_id in (0, self.session_id) and sm.stream_id in (0, self.stream_id):
            # A receiver without an image (or an MDC receiver announcing itself) asks for SETUP.
            if self.rejoin_at_consumed:
                self._rejoin(sm.receiver_id)
            self._setup_due_ns = now_ns
            if self.dynamic:
                self._destinations[source] = now_ns
            return
        if sm.session_id != self.session_id or sm.stream_id != self.stream_id:
            return
        self.counters.status_messages_received += 1
        if sm.is_eos:
            if self._receivers.pop(sm.receiver_id, None) is not None and not self._receivers:
                # The last receiver's image is going (its end of stream): what it reported is consumed.
                position = compute_position(sm.consumption_term_id, sm.consumption_term_offset,
                                            self.position_bits_to_shift, self.initial_term_id)
                self._consumed = max(self._consumed, min(position, self.sender_position))
        else:
            receiver = self._receivers.get(sm.receiver_id)
            if receiver is None:
                if len(self._receivers) >= 1024:
                    return
                receiver = self._receivers[sm.receiver_id] = _Receiver(source, now_ns)
            receiver.last_sm_ns = now_ns
            receiver.window = sm.receiver_window
            position = compute_position(sm.consumption_term_id, sm.consumption_term_offset,
                                        self.position_bits_to_shift, self.initial_term_id)
            if position > receiver.position:
                receiver.position = position
            self._receiver_window = sm.receiver_window
            if not self._has_initial_connection:
                self._has_initial_connection = True
                self._setup_due_ns = None  # SETUP has done its job
            if self.dynamic:
                self._destinations[source] = now_ns
        if self._receivers:
            self._consumed = min(r.position for r in self._receivers.values())
        self.sender_limit = self.flow_control.on_status_message(
            sm, source, self.sender_limit, self.initial_term_id, self.position_bits_to_shift, now_ns
        )
        self._update_publication_limit()

    def _rejoin(self, receiver_id: int) -> None:
        """``rejoin_at_consumed``: a receiver asks for SETUP, so it has no image (any it had is gone: timed
        out or drained); it is no longer connected. With nobody else connected, the sender goes back to the
        position last reported consumed, and the SETUP (which follows) makes the new image start there, so
        it is sent everything not consumed again, from a frame boundary (a consumption position is one). No
        data goes before the new image's first status message (the sender limit falls to that position).
        Only while the log still holds it (the tail within a term of it; the window is at most half a
        term, so it always does unless the consumed position is stale)."""
        self._receivers.pop(receiver_id, None)
        consumed = self._consumed
        if (self._receivers or not self._has_initial_connection or consumed >= self.sender_position
                or self.appender.position - consumed > self.term_length):
            return
        self.sender_position = consumed
        self.sender_limit = consumed
        self._resends.clear()
        self._more_to_send = False
        self.counters.rejoins += 1
        self._update_publication_limit()

    def _on_error_frame(self, err: ErrorFrame, source: Address, now_ns: int) -> None:
        """A receiver refused our image (ERR, e.g. IMAGE_REJECTED): it is gone, as the reference treats it.

        Counted and kept in ``last_error`` (Aeron hands it to the client's publication error handler:
        ``error_handler`` here). The receiver leaves the flow-control strategy and the connected set at
        once, so ``min`` flow control stops waiting for it and, if it was the last one, the publication
        is no longer connected. A dynamically learnt (MDC) destination at that address is dropped, so no
        more data goes to a receiver that refused it; if it announces itself again it gets a new SETUP.
        """
        if err.session_id != self.session_id or err.stream_id != self.stream_id:
            return  # another publication's (several may share a control port), like SMs and NAKs
        self.counters.errors_received += 1
        self.last_error = err
        self.flow_control.on_error(err.receiver_id, now_ns)
        self._receivers.pop(err.receiver_id, None)
        if self.dynamic:
            self._destinations.pop(source, None)
        self.sender_limit = self.flow_control.on_idle(
            now_ns, self.sender_limit, self.sender_position, self._state is not _State.ACTIVE
        )
        self._update_publication_limit()
        if self.error_handler is not None:
            self.error_handler(err, source)

    def _on_nak(self, nak: Nak, now_ns: int) -> None:
        if nak.session_id != self.session_id or nak.stream_id != self.stream_id:
            return
        self.counters.naks_received += 1
        position = compute_position(nak.term_id, nak.term_offset, self.position_bits_to_shift, self.initial_term_id)
        bottom = self.sender_position - (self.term_length // 2) - self.max_message_length
        if not bottom <= position < self.sender_position or nak.length <= 0:
            self.counters.naks_ignored += 1
            return
        existing = self._resends.get(position)
        if existing is not None and existing.lingering and now_ns - existing.due_ns >= 0:
            del self._resends[position]  # its linger is over: this NAK is a new request
            existing = None
        if existing is not None or len(self._resends) >= self.config.max_resend:
            self.counters.naks_ignored += 1  # already resent and lingering, or too many resends in flight
            return
        length = self.flow_control.max_retransmission_length(nak.length, max(self._receiver_window, self.mtu))
        length = min(length, self.term_length - nak.term_offset, self.sender_position - position)
        self._resends[position] = _Resend(position, length, now_ns + self.config.retransmit_delay_ns)

    def _on_rttm(self, rttm: RttMeasurement, source: Address) -> None:
        if rttm.session_id != self.session_id or rttm.stream_id != self.stream_id:
            return
        if rttm.is_reply_requested:
            reply = RttMeasurement(self.session_id, self.stream_id, rttm.echo_timestamp, 0, rttm.receiver_id, 0)
            if len(self._pending_control) < _MAX_PENDING_CONTROL:
                self._pending_control.append((encode_rttm(reply), source))
                self.counters.rttm_replies_sent += 1

    # ------------------------------------------------------------------------------------ duty cycle

    def do_work(self, now_ns: int, *, whole_datagrams: bool = False) -> list[tuple[bytes, Address]]:
        """One sender duty cycle: control replies, SETUP, resends, new data, heartbeats.

        ``whole_datagrams``: the application is still appending (it calls again after its next messages), so
        the last datagram of new data, the one that would end at the tail with room for more, stays for a
        later cycle instead of going out part-empty. A producer appending a burst then sends mtu-full
        datagrams (fewer system calls and fewer datagrams for the receiver to take in); a cycle without
        it (the shell's, once the application yields) sends the rest."""
        out = self._pending_control
        self._pending_control = []
        if self._state is _State.DONE:
            return out
        self._excuse_stop(now_ns)
        self._expire_receivers(now_ns)
        if self._setup_due_ns is not None and now_ns >= self._setup_due_ns:
            self._send_setup(out, now_ns)
        self._send_resends(out, now_ns)
        if self._has_initial_connection:
            sent = self._send_data(out, whole_datagrams)
        else:
            sent = 0
            self._more_to_send = False
        if sent:
            self._time_of_last_send_ns = now_ns
        elif self._has_initial_connection and now_ns - self._time_of_last_send_ns >= self.config.heartbeat_interval_ns:
            self._send_heartbeat(out, now_ns)
        self._advance_close_state(now_ns)
        self._update_publication_limit()
        return out

    def next_deadline_ns(self) -> int:
        """The latest time ``do_work`` must run again if nothing arrives (timers: SETUP, heartbeat, resend)."""
        if self._has_initial_connection:
            deadline = self._time_of_last_send_ns + self.config.heartbeat_interval_ns
        elif self._setup_due_ns is not None:
            # Not connected: the next SETUP. (Not the time of the last data send, which has not moved since
            # creation: a deadline in the past made the I/O shell spin without reading the first SM.)
            deadline = self._setup_due_ns
        else:
            deadline = self._time_of_last_send_ns + self.config.setup_interval_ns
        if self._state is _State.LINGER:
            deadline = min(deadline, self._linger_deadline_ns)
        if self._setup_due_ns is not None:
            deadline = min(deadline, self._setup_due_ns)
        for resend in self._resends.values():
            deadline = min(deadline, resend.due_ns)
        if self._more_to_send:
            # The last cycle stopped at max_messages_per_send datagrams (so that one publication cannot hold
            # a shell's loop) with more the window allows: the next cycle is due now, not at the next SM or
            # heartbeat. (Waiting for those stalled fragmented messages: 1,000 x 5,000 B in 64 KiB terms
            # took 52 s.)
            deadline = min(deadline, self._time_of_last_send_ns)
        return deadline

    def _excuse_stop(self, now_ns: int) -> None:
        """Timeouts count only the time this sender ran. A duty cycle later than its timers (the SETUP and
        heartbeat intervals: ``next_deadline_ns`` is never further than that) means its process did not run
        meanwhile (SIGSTOP, a debugger, a long pause): the receivers' status messages of that time wait
        unread in its socket, and its owner may run this cycle before reading them. The lateness is added to
        the time of each receiver's last status message (and a learnt destination's, and the flow-control
        strategy's receivers'), so none is declared gone for silence while nobody listened. Else a producer
        stopped 7-14 s (past the 5 s connection timeout) found itself not connected on resume, with a
        claimed batch beyond the publication limit that then dropped to the sender position: its append
        was refused and the producer died (a tester). A receiver really gone still times out, 5 s on.
        The receiver-side twin is ``Image.do_work``'s."""
        timer = max(self.config.heartbeat_interval_ns, self.config.setup_interval_ns)
        stopped = now_ns - self._time_of_last_work_ns - timer
        self._time_of_last_work_ns = now_ns
        if stopped <= 0:
            return
        for receiver in self._receivers.values():
            receiver.last_sm_ns = min(now_ns, receiver.last_sm_ns + stopped)
        destinations = self._destinations
        for address, seen in destinations.items():
            if seen is not None:
                destinations[address] = min(now_ns, seen + stopped)
        if isinstance(self.flow_control, MinFlowControl):
            self.flow_control.on_stopped(stopped, now_ns)

    def _expire_receivers(self, now_ns: int) -> None:
        timeout = self.config.connection_timeout_ns
        for rid in [r for r, rcv in self._receivers.items() if now_ns - rcv.last_sm_ns > timeout]:
            del self._receivers[rid]
        if self.dynamic:
            for address in [a for a, t in self._destinations.items() if t is not None and now_ns - t > timeout]:
                del self._destinations[address]
        self.sender_limit = self.flow_control.on_idle(
            now_ns, self.sender_limit, self.sender_position, self._state is not _State.ACTIVE
        )

    def _update_publication_limit(self) -> None:
        if self._state is _State.ACTIVE and self.is_connected:
            self.publication_limit = self.sender_position + self.publication_window
        elif self.publication_limit > self.sender_position:
            # Nobody to send to: let the application run no further ahead (Aeron's "clean" limit).
            self.publication_limit = self.sender_position

    def _emit(self, out: list[tuple[bytes, Address]], datagram: bytes) -> None:
        for address in self._destinations:
            out.append((datagram, address))

    def _send_setup(self, out: list[tuple[bytes, Address]], now_ns: int) -> None:
        term_id = compute_term_id_from_position(self.sender_position, self.position_bits_to_shift, self.initial_term_id)
        setup = Setup(
            self.sender_position & (self.term_length - 1),
            self.session_id,
            self.stream_id,
            self.initial_term_id,
            term_id,
            self.term_length,
            self.mtu,
            self.config.ttl,
        )
        self._emit(out, encode_setup(setup))
        self.counters.setups_sent += 1
        self.sender_limit = self.flow_control.on_setup(self.sender_limit, self.sender_position, now_ns)
        self._setup_due_ns = None if self._has_initial_connection else now_ns + self.config.setup_interval_ns

    def _send_heartbeat(self, out: list[tuple[bytes, Address]], now_ns: int) -> None:
        eos = self._state is _State.LINGER
        term_id = compute_term_id_from_position(self.sender_position, self.position_bits_to_shift, self.initial_term_id)
        datagram = encode_heartbeat(
            self.sender_position & (self.term_length - 1), self.session_id, self.stream_id, term_id, eos=eos
        )
        self._emit(out, datagram)
        self.counters.heartbeats_sent += 1
        self._time_of_last_send_ns = now_ns
        if eos:
            self._eos_sent = True

    def _scan(self, position: int, limit: int) -> tuple[int, int]:
        """Bytes to copy and bytes to advance for one datagram of whole frames from ``position``.

        At most one MTU, never across the term end, never past ``limit``. A PAD goes out as its 32-byte
        header but advances the position to the end of the term.
        """
        term = self.appender.partition_for_position(position)
        available, padding = scan_for_availability(
            term, position & (self.term_length - 1), min(self.mtu, limit - position)
        )
        return available, available + padding

    def _datagram(self, position: int, length: int) -> bytes:
        term = self.appender.partition_for_position(position)
        offset = position & (self.term_length - 1)
        return bytes(term[offset : offset + length])

    def _send_data(self, out: list[tuple[bytes, Address]], whole_datagrams: bool = False) -> int:
        sent = 0
        tail = self.appender.position
        limit = min(self.sender_limit, tail)
        self._more_to_send = True
        for _ in range(self.config.max_messages_per_send):
            position = self.sender_position
            if position >= limit:
                self._more_to_send = False
                break
            copy, advance = self._scan(position, limit)
            if advance == 0:  # the next frame does not fit in what the window allows
                self._more_to_send = False
                break
            if whole_datagrams and position + advance == tail and limit == tail and copy < self.mtu:
                break  # part-empty and at the tail: the next messages may fill it (see do_work)
            datagram = self._datagram(position, copy)
            self._emit(out, datagram)
            self.sender_position = position + advance
            self.counters.data_datagrams_sent += 1
            self.counters.bytes_sent += copy
            sent += copy
        return sent

    def _send_resends(self, out: list[tuple[bytes, Address]], now_ns: int) -> None:
        for key in list(self._resends):
            resend = self._resends[key]
            if resend.lingering:
                if now_ns - resend.due_ns >= 0:
                    del self._resends[key]
                continue
            if now_ns - resend.due_ns < 0:
                continue
            position, end = resend.position, resend.position + resend.length
            while position < end:
                copy, advance = self._scan(position, end)
                if advance == 0:
                    break
                self._emit(out, self._datagram(position, copy))
                self.counters.retransmits_sent += 1
                self.counters.retransmitted_bytes += copy
                position += advance
            resend.lingering = True
            resend.due_ns = now_ns + self.config.retransmit_linger_ns

    def _advance_close_state(self, now_ns: int) -> None:
        if self._state is _State.DRAINING:
            if self.sender_position >= self.appender.position or not self.is_connected:
                self._state = _State.LINGER
                self._linger_deadline_ns = now_ns + self.config.linger_ns
                self._time_of_last_send_ns = now_ns - self.config.heartbeat_interval_ns  # EOS at once
        elif self._state is _State.LINGER and now_ns - self._linger_deadline_ns >= 0:
            self._state = _State.DONE
