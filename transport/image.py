"""The receiving half of one publication's stream: Aeron's publication image as a sans-IO state machine.

An image rebuilds the publication's term log from datagrams (``insert_packet``), finds gaps and NAKs them
(``loss.LossDetector``), and tells the publication how far it may send with status messages. The SM carries
the *consumption* position: the minimum over this image's subscribers of how far their application has
*processed* (``poll`` moves a subscriber's position only after its handler returned). So a slow consumer
closes the window and the publication's ``offer`` is back-pressured: flow control is tied to processing,
not to arrival.

SM scheduling follows Aeron: an SM is sent when the consumption position moved more than a quarter of
the window since the last one, when it entered a new term, when the congestion strategy changed the
window or asked for one, and at least every ``sm_timeout_ns`` (200 ms) regardless.

Several subscribers may read one image. Tethered subscribers hold the window back; an untethered one that
lags in the bottom eighth of the window for ``untethered_window_limit_timeout_ns`` is told the image went
away, keeps holding the window for the same timeout (so it can notice), then rests for
``untethered_resting_timeout_ns`` without holding it, and rejoins at the current position.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Hashable

from flowbroker.transport.congestion import CongestionControl
from flowbroker.transport.frames import (
    DATA_HEADER_LENGTH,
    RTTM_REPLY_FLAG,
    SM_EOS_FLAG,
    RttMeasurement,
    Setup,
    StatusMessage,
    encode_nak,
    encode_rttm,
    encode_status_message,
    Nak,
)
from flowbroker.transport.loss import LossDetector
from flowbroker.transport.positions import compute_max_message_length, compute_position, compute_term_id_from_position
from flowbroker.transport.terms import FragmentAssembler, TermRebuilder

__all__ = ["Image", "ImageState", "ImageStatistics", "ImageTimers", "MessageHandler", "SubscriberState"]

Address = Hashable
MessageHandler = Callable[[memoryview | bytes], object]
"""Called with each whole message. A true result from an unfragmented message stops the poll after it
(Aeron's controlled poll, BREAK); a fragmented message's result is not looked at."""


class ImageState(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"  # EOS consumed, liveness lost or no subscribers: SMs with the EOS flag for a while
    DONE = "done"


class SubscriberState(enum.Enum):
    """An untethered subscriber's life (tethered ones are always ACTIVE)."""

    ACTIVE = "active"
    LINGER = "linger"  # told the image is unavailable; still holds the window
    RESTING = "resting"  # no longer holds the window; rejoins later


@dataclass(frozen=True, slots=True)
class ImageTimers:
    """Receiver timers (C driver defaults)."""

    sm_timeout_ns: int = 200_000_000
    image_liveness_timeout_ns: int = 10_000_000_000
    untethered_window_limit_timeout_ns: int = 5_000_000_000
    untethered_resting_timeout_ns: int = 10_000_000_000

    @property
    def draining_ns(self) -> int:
        """How long a draining image keeps sending EOS SMs: 5 x SM timeout (1 s by default)."""
        return 5 * self.sm_timeout_ns


@dataclass(frozen=True, slots=True)
class ImageStatistics:
    """A snapshot of an image (``Image.statistics()``), in Aeron's words.

    Positions are bytes since the stream's start: ``join_position`` where this image joined,
    ``rebuild_position`` contiguous data received, ``hwm_position`` the highest byte seen (a gap lies
    between the two), ``consumption_position`` the slowest holding subscriber's processed position,
    ``status_message_position`` the position the last status message reported and ``receiver_window`` the
    window it advertised (so the sender may send up to their sum). ``loss_gaps`` counts gaps found, NAKs
    sent for them ``naks_sent``; ``underruns``/``overruns`` are datagrams refused as outside the window,
    ``duplicates`` datagrams whose bytes were already in.
    """

    session_id: int
    stream_id: int
    state: ImageState
    join_position: int
    rebuild_position: int
    hwm_position: int
    consumption_position: int
    status_message_position: int
    receiver_window: int
    end_of_stream_position: int | None
    subscribers: int
    datagrams_inserted: int
    duplicates: int
    heartbeats_received: int
    underruns: int
    overruns: int
    loss_gaps: int
    naks_sent: int
    status_messages_sent: int
    rttms_sent: int


class _Subscriber:
    """One subscription's cursor on the image, with its own fragment reassembly."""

    __slots__ = ("subscriber_id", "position", "tether", "state", "time_of_last_update_ns", "assembler",
                 "handler", "oversized_handler", "messages", "hold", "partial", "max_message_length")

    def __init__(self, subscriber_id: int, position: int, tether: bool, now_ns: int,
                 max_message_length: int) -> None:
        self.subscriber_id = subscriber_id
        self.position = position
        self.tether = tether
        self.state = SubscriberState.ACTIVE
        self.time_of_last_update_ns = now_ns
        self.handler: MessageHandler | None = None
        self.oversized_handler: Callable[[int], object] | None = None
        self.messages = 0
        self.hold = 0  # bytes polled but not yet released by the application (see Image.hold)
        self.partial = 0  # term bytes of the message being reassembled, read past and not handed up yet
        self.max_message_length = max_message_length
        self.assembler = self.new_assembler()

    def new_assembler(self) -> FragmentAssembler:
        return FragmentAssembler(self._deliver, self.max_message_length, self._oversized)

    def _deliver(self, message: memoryview | bytes) -> None:
        self.messages += 1
        if self.handler is not None:
            self.handler(message)

    def _oversized(self, length: int) -> None:
        if self.oversized_handler is not None:
            self.oversized_handler(length)


class Image:
    """One (session, stream) being received from ``source``.

    Args:
        setup: the SETUP that created it (term geometry and the join position).
        source: where data came from; SMs, NAKs and RTTMs go to ``control_address`` or, if ``None``, here.
        receiver_id: this receiver's id in SMs (random per process in Aeron).
        congestion: the window strategy (``cc=``).
        loss: NAK timing.
        group_tag: sent in every SM (the 44-byte form) when set.
    """

    def __init__(
        self,
        setup: Setup,
        source: Address,
        now_ns: int,
        *,
        receiver_id: int,
        congestion: CongestionControl,
        loss: LossDetector,
        timers: ImageTimers = ImageTimers(),
        group_tag: int | None = None,
        control_address: Address | None = None,
        reliable: bool = True,
    ) -> None:
        self.session_id = setup.session_id
        self.stream_id = setup.stream_id
        self.initial_term_id = setup.initial_term_id
        self.term_length = setup.term_length
        self.mtu = setup.mtu
        self.source = source
        self.control_address = control_address if control_address is not None else source
        self.receiver_id = receiver_id
        self.group_tag = group_tag
        self.congestion = congestion
        self.loss = loss
        self.timers = timers
        self.reliable = reliable
        self.position_bits_to_shift = self.term_length.bit_length() - 1
        self.max_message_length = compute_max_message_length(self.term_length)
        """The most payload bytes a message may reassemble to: what a publication of this term length may
        send (`Publication.offer`). A longer one is dropped while it arrives (`FragmentAssembler`)."""
        self.join_position = compute_position(
            setup.active_term_id, setup.term_offset, self.position_bits_to_shift, setup.initial_term_id
        )
        self.rebuilder = TermRebuilder(self.term_length, self.initial_term_id, self.join_position)
        self.rebuild_position = self.join_position
        self.hwm_position = self.join_position
        self.state = ImageState.ACTIVE
        self.end_of_stream_position: int | None = None
        self.time_of_last_packet_ns = now_ns
        self._time_of_last_work_ns = now_ns  # the last duty cycle (see do_work: a receiver that did not run)
        self._state_change_ns = now_ns
        # SM bookkeeping: what we scheduled, what we last sent, and when.
        self.window_length = congestion.initial_window_length()
        self.next_sm_position = self.join_position
        self.last_sm_position = self.join_position
        self.last_sm_window = self.window_length
        self._sm_pending = True  # the first SM goes out at once: it is what starts the publication
        self._time_of_last_sm_ns = now_ns
        self._overrun_threshold = self.join_position + self.term_length // 2
        self._subscribers: dict[int, _Subscriber] = {}
        #: The most the SMs may advertise, whatever the congestion window says (None: no cap). The broker
        #: sets it to the producer's credit grant, the SDK's UDP consumer to its byte buffer: over UDP
        #: the receiver window *is* the credit. 0 closes the window.
        self.window_cap: int | None = None
        self.hold_partial = False
        """Report no fragment of a message not yet whole as consumed (`poll`). For a receiver whose sender
        sends each message whole whatever the window (the broker's publications to UDP consumers): else
        the first fragments of a message counted, and the broker took the next message into a window the
        consumer had not freed, two whole messages unprocessed at a 16 KiB window (a tester)."""
        self._control: list[bytes] = []
        # counters
        self.packets_inserted = 0
        self.duplicates = 0
        self.heartbeats = 0
        self.underruns = 0
        self.overruns = 0
        self.status_messages_sent = 0
        self.naks_sent = 0
        self.rttms_sent = 0

    def statistics(self) -> ImageStatistics:
        """A frozen snapshot of positions and counters (reads them; nothing is counted for it)."""
        return ImageStatistics(
            self.session_id, self.stream_id, self.state, self.join_position, self.rebuild_position,
            self.hwm_position, self._consumption_positions()[0], self.last_sm_position, self.window_length,
            self.end_of_stream_position, len(self._subscribers), self.packets_inserted, self.duplicates,
            self.heartbeats, self.underruns, self.overruns, self.loss.gaps_found, self.naks_sent,
            self.status_messages_sent, self.rttms_sent,
        )

    # ------------------------------------------------------------------------------------ subscribers

    def add_subscriber(self, subscriber_id: int, tether: bool, now_ns: int) -> None:
        """Attach a subscription; it joins where the slowest existing one is (data still held)."""
        active = [s.position for s in self._subscribers.values() if s.state is not SubscriberState.RESTING]
        position = min(active) if active else self.rebuild_position
        self._subscribers[subscriber_id] = _Subscriber(subscriber_id, position, tether, now_ns,
                                                       self.max_message_length)

    def remove_subscriber(self, subscriber_id: int, now_ns: int) -> None:
        self._subscribers.pop(subscriber_id, None)
        if not self._subscribers and self.state is ImageState.ACTIVE:
            self._enter_draining(now_ns)

    def subscriber_position(self, subscriber_id: int) -> int:
        return self._subscribers[subscriber_id].position

    def has_subscriber(self, subscriber_id: int) -> bool:
        return subscriber_id in self._subscribers

    def subscriber_messages(self, subscriber_id: int) -> int:
        """Whole messages this subscriber's handler was given from this image."""
        return self._subscribers[subscriber_id].messages

    def hold(self, subscriber_id: int, nbytes: int) -> None:
        """The application still holds ``nbytes`` of what this subscriber polled (a message routed but
        not completed, one handed up but not processed): the SM's consumption position stays that far
        behind the subscriber's position until ``release``. This is how "consumed" means *completed* or
        *processed* rather than *polled*, without keeping the data in the term: the position is the
        subscriber's, the hold is only subtracted from what the SMs report."""
        sub = self._subscribers.get(subscriber_id)
        if sub is not None:
            sub.hold += nbytes

    def release(self, subscriber_id: int, nbytes: int) -> None:
        """``nbytes`` of a ``hold`` are done: the consumption position may move past them."""
        sub = self._subscribers.get(subscriber_id)
        if sub is not None:
            sub.hold = max(0, sub.hold - nbytes)

    def subscriber_whole_position(self, subscriber_id: int) -> int:
        """The subscriber's position less the fragments it read of a message not yet whole (or of one
        being dropped for its length): where the first message it has not handed up starts, a frame
        boundary. Such fragments are full frames (only a message's last may be shorter)."""
        sub = self._subscribers[subscriber_id]
        _, buffered, skipped = sub.assembler.checkpoint()
        payload = buffered or max(skipped, 0)
        return sub.position - (payload // (self.mtu - DATA_HEADER_LENGTH) * self.mtu if payload else 0)

    def resume_subscriber(self, subscriber_id: int, position: int, hold: int) -> None:
        """Start a subscriber of this image at ``position`` instead of the join position, ``hold`` bytes
        before it still held: the image is a new one of a publication whose previous image timed out, the
        publication sent the stream again from below where this subscriber had read the old one to
        (``Publication(rejoin_at_consumed=True)``: from what it was told consumed), and what lies below
        ``position`` was already handed up (the broker routed it). ``position`` is a message boundary of the
        same stream (``subscriber_whole_position`` of the old image) at or after the join position and
        within the window the image accepts (half a term past it); the consumption position the status
        messages report is ``position - hold``, never below the join position."""
        sub = self._subscribers[subscriber_id]
        if not self.join_position <= position <= self.join_position + self.term_length // 2:
            raise ValueError(f"cannot resume at {position}: the image joined at {self.join_position}")
        sub.position = position
        sub.hold = min(hold, position - self.join_position)
        sub.assembler = sub.new_assembler()

    def subscriber_hold(self, subscriber_id: int) -> int:
        return self._subscribers[subscriber_id].hold

    def subscriber_state(self, subscriber_id: int) -> SubscriberState:
        return self._subscribers[subscriber_id].state

    def is_available_to(self, subscriber_id: int) -> bool:
        sub = self._subscribers.get(subscriber_id)
        return sub is not None and sub.state is SubscriberState.ACTIVE and self.state is ImageState.ACTIVE

    @property
    def is_end_of_stream(self) -> bool:
        """The publication closed and every subscriber has consumed up to its end."""
        eos = self.end_of_stream_position
        if eos is None or self.rebuild_position < eos:
            return False
        return all(s.position >= eos for s in self._subscribers.values() if s.state is SubscriberState.ACTIVE)

    def poll(self, subscriber_id: int, handler: MessageHandler, fragment_limit: int,
             on_oversized: Callable[[int], object] | None = None) -> int:
        """Hand up to ``fragment_limit`` fragments to ``handler`` (whole messages); return fragments read.

        A message longer than ``max_message_length`` is not handed up: it is dropped as it arrives, and
        ``on_oversized`` (if given) is called with its length, in its place among the messages, once its
        last fragment is read.

        The subscriber's position (and so the SM's consumption position) moves only after the handler
        has returned for every fragment of this call. If the handler raises, the position stays and the
        fragments of this call are delivered again on the next poll (at-least-once on handler failure):
        the reassembly goes back to where it was at the start of the call, so a message whose first
        fragments were read by an earlier call is still delivered whole.
        """
        sub = self._subscribers.get(subscriber_id)
        if sub is None or sub.state is not SubscriberState.ACTIVE:
            return 0
        sub.handler = handler
        sub.oversized_handler = on_oversized
        total = 0
        position = sub.position
        limit = self.rebuild_position
        assembler = sub.assembler
        checkpoint = assembler.checkpoint()
        read = self.rebuilder.read_messages
        try:
            while total < fragment_limit and position < limit:
                position_before = position
                position, count, wholes, stopped = read(position, limit, handler, assembler, fragment_limit - total)
                total += count
                sub.messages += wholes  # (the assembler's whole messages count themselves)
                if stopped or position == position_before:
                    break
        except BaseException:
            # Re-read this call's fragments next time, with the reassembly as it was when the call began
            # (the message in progress then keeps its earlier fragments: nothing is dropped).
            sub.assembler.rollback(checkpoint)
            raise
        finally:
            sub.handler = sub.oversized_handler = None
        sub.position = position
        if self.hold_partial:
            # The first fragments of a message whose last has not arrived are read past, and nothing of it
            # is consumed: with `hold_partial` status messages do not report them (Aeron's do, as its
            # subscriber position passes them, and a receiver whose window is smaller than a message needs
            # that: the broker's ingress). Such fragments are all full frames (only the last may be
            # shorter), so their term bytes are the buffered payload's frames.
            buffered = assembler.buffered
            sub.partial = buffered // (self.mtu - DATA_HEADER_LENGTH) * self.mtu if buffered else 0
        return total

    # ------------------------------------------------------------------------------------ packets in

    def insert_packet(
        self, term_id: int, term_offset: int, datagram: bytes | bytearray | memoryview, now_ns: int,
        *, is_heartbeat: bool = False, is_eos: bool = False,
    ) -> bool:
        """Put a validated DATA/PAD datagram (or a heartbeat) into the log; False when outside the window."""
        if self.state is not ImageState.ACTIVE:
            return False
        if ((term_id - self.initial_term_id) & 0xFFFF_FFFF) >= 0x8000_0000:
            self.underruns += 1  # before the initial term id
            return False
        packet_position = compute_position(term_id, term_offset, self.position_bits_to_shift, self.initial_term_id)
        length = 0 if is_heartbeat else len(datagram)
        if packet_position < self.last_sm_position:
            self.underruns += 1
            return False
        if packet_position + length > self._overrun_threshold:
            self.overruns += 1
            return False
        self.time_of_last_packet_ns = now_ns
        if is_heartbeat:
            self.heartbeats += 1
            if is_eos:
                self.end_of_stream_position = packet_position
            if packet_position > self.hwm_position:
                self.hwm_position = packet_position
            return True
        if self.rebuilder.insert(term_id, term_offset, datagram):
            self.packets_inserted += 1
        else:
            self.duplicates += 1
        end = packet_position + length
        if end > self.hwm_position:
            self.hwm_position = end
        return True

    def on_rttm(self, rttm: RttMeasurement, now_ns: int) -> None:
        """An RTTM from the publication: a reply to ours gives an RTT; a request gets a reply."""
        if rttm.receiver_id not in (0, self.receiver_id):
            return
        if rttm.is_reply_requested:
            reply = RttMeasurement(self.session_id, self.stream_id, rttm.echo_timestamp, 0, self.receiver_id, 0)
            self._control.append(encode_rttm(reply))
        else:
            rtt = now_ns - rttm.echo_timestamp - rttm.reception_delta
            self.congestion.on_rtt_measurement(now_ns, max(rtt, 0))

    # ------------------------------------------------------------------------------------ duty cycle

    def do_work(self, now_ns: int) -> list[bytes]:
        """Track the rebuild, NAK gaps, maintain subscribers, send SMs/RTTMs; return control frames."""
        out = self._control
        self._control = []
        if self.state is ImageState.DONE:
            return out
        stopped = now_ns - self._time_of_last_work_ns - self.timers.sm_timeout_ns
        self._time_of_last_work_ns = now_ns
        if stopped > 0 and self.state is ImageState.ACTIVE:
            # The receiver itself did not run for this long past its SM timer (next_deadline_ns): its
            # process was stopped (SIGSTOP, a debugger, a long pause). The publication's datagrams of that
            # time wait unread in its socket, and its owner may run this cycle before reading them: silence
            # while nobody listened is not the publication's. Liveness counts only the time the receiver
            # ran; else a consumer stopped 12-16 s (past the 10 s timeout) drained its image on resume
            # with 369 messages waiting in the socket and was given a new one at the sender's position,
            # skipping them (a tester). A publication that is really gone still times out, 10 s on.
            self.time_of_last_packet_ns = min(now_ns, self.time_of_last_packet_ns + stopped)
        if self.state is ImageState.ACTIVE:
            self._check_untethered(now_ns)
            self._track_rebuild(now_ns, out)
            if self.congestion.should_measure_rtt(now_ns):
                rttm = RttMeasurement(self.session_id, self.stream_id, now_ns, 0, self.receiver_id, RTTM_REPLY_FLAG)
                out.append(encode_rttm(rttm))
                self.congestion.on_rtt_measurement_sent(now_ns)
                self.rttms_sent += 1
            if self.is_end_of_stream or now_ns - self.time_of_last_packet_ns > self.timers.image_liveness_timeout_ns:
                self._enter_draining(now_ns)
                self._emit_sm(out, now_ns, SM_EOS_FLAG)
            else:
                self._send_status_message(out, now_ns)
        elif self.state is ImageState.DRAINING:
            if now_ns - self._state_change_ns > self.timers.draining_ns:
                self.state = ImageState.DONE
            elif now_ns - self._time_of_last_sm_ns > self.timers.sm_timeout_ns:
                self._emit_sm(out, now_ns, SM_EOS_FLAG)
        return out

    def _enter_draining(self, now_ns: int) -> None:
        self.state = ImageState.DRAINING
        self._state_change_ns = now_ns

    def _consumption_positions(self) -> tuple[int, int]:
        low = high = None
        for sub in self._subscribers.values():
            if sub.state is SubscriberState.RESTING:
                continue
            position = sub.position - sub.hold - sub.partial
            low = position if low is None or position < low else low
            high = position if high is None or position > high else high
        if low is None or high is None:
            return self.next_sm_position, self.next_sm_position
        return low, high

    def _track_rebuild(self, now_ns: int, out: list[bytes]) -> None:
        start = self.rebuild_position
        hwm = self.hwm_position
        position = start
        while position < hwm:  # walk contiguous frames, across term ends
            advanced = self.rebuilder.rebuild_position(position, hwm)
            if advanced == position:
                break
            position = advanced
        gap = self.rebuilder.scan_for_gap(position, hwm)[1] if position < hwm else None
        self.rebuild_position = position
        if gap is not None and not self.reliable:
            # reliable=false: accept the loss; skip the hole as if it were padding.
            self.rebuild_position = position + gap.length
            gap = None
        scan = self.loss.on_scan(gap, now_ns)
        if scan.nak is not None:
            nak = Nak(self.session_id, self.stream_id, scan.nak.term_id, scan.nak.term_offset, scan.nak.length)
            out.append(encode_nak(nak))
            self.naks_sent += 1
        min_position, _ = self._consumption_positions()
        outcome = self.congestion.on_track_rebuild(
            now_ns, min_position, self.next_sm_position, self.hwm_position, start, position, scan.loss_found
        )
        window = outcome.window_length
        cap = self.window_cap
        if cap is not None and cap < window:
            window = cap
        threshold = window // 4
        new_term = (min_position >> self.position_bits_to_shift) != (self.next_sm_position >> self.position_bits_to_shift)
        if (
            outcome.force_status_message
            or min_position > self.next_sm_position + threshold
            or new_term
            or window != self.window_length
        ):
            self.rebuilder.clean_to(min_position - self.term_length)
            self.next_sm_position = max(self.next_sm_position, min_position)
            self.window_length = window
            self._sm_pending = True

    def _send_status_message(self, out: list[bytes], now_ns: int) -> None:
        if self._sm_pending:
            self._emit_sm(out, now_ns, 0)
        elif now_ns - self._time_of_last_sm_ns > self.timers.sm_timeout_ns:
            # The periodic SM reports the consumption position as it is now, not as it was when the
            # position last moved a quarter window: otherwise the last quarter of a stream that then
            # goes quiet would never be reported (the sender could not learn it was consumed).
            self.next_sm_position = max(self.next_sm_position, self._consumption_positions()[0])
            self._emit_sm(out, now_ns, 0)

    def report_now(self) -> None:
        """Send an SM with the consumption position as it is now at the next duty cycle, below the quarter
        window that normally triggers one: for an owner that knows its sender waits for exactly that
        (the broker once it has completed everything it received, so a producer's flush ends at once)."""
        position = self._consumption_positions()[0]
        if position > self.next_sm_position:
            self.next_sm_position = position
            self._sm_pending = True

    def status_message_due(self) -> bool:
        """Would the next ``do_work`` send a status message for what the subscribers consumed (an SM
        pending, the consumption position a quarter window past the last reported one, or in another
        term)? Cheap enough for an application to ask after every message it processes, so that it runs
        the whole duty cycle only when there is something to report."""
        position = self._consumption_positions()[0]
        reported = self.next_sm_position
        return (self._sm_pending or position > reported + (self.window_length >> 2)
                or position >> self.position_bits_to_shift != reported >> self.position_bits_to_shift)

    def _emit_sm(self, out: list[bytes], now_ns: int, flags: int) -> None:
        position = self.next_sm_position
        # The sender may now write up to a window past this position, into the partition that held the
        # term before the previous one: clean it first, or a later rebuild would read its stale frames
        # as new ones (whoever moved next_sm_position, the quarter-window rule, the periodic SM or
        # report_now).
        self.rebuilder.clean_to(position - self.term_length)
        term_id = compute_term_id_from_position(position, self.position_bits_to_shift, self.initial_term_id)
        sm = StatusMessage(
            self.session_id,
            self.stream_id,
            term_id,
            position & (self.term_length - 1),
            self.window_length,
            self.receiver_id,
            self.group_tag,
            flags,
        )
        out.append(encode_status_message(sm))
        self.status_messages_sent += 1
        self._sm_pending = False
        self._time_of_last_sm_ns = now_ns
        self.last_sm_position = position
        self.last_sm_window = self.window_length
        self._overrun_threshold = position + self.term_length // 2

    def _check_untethered(self, now_ns: int) -> None:
        subs = self._subscribers
        if not subs or all(s.tether for s in subs.values()):
            return
        _, max_position = self._consumption_positions()
        window = self.window_length
        window_limit = max_position - window + (window >> 3)
        linger_ns = self.timers.untethered_window_limit_timeout_ns
        for sub in subs.values():
            if sub.tether:
                continue
            if sub.state is SubscriberState.ACTIVE:
                if sub.position > window_limit:
                    sub.time_of_last_update_ns = now_ns
                elif now_ns - sub.time_of_last_update_ns >= linger_ns:
                    sub.state = SubscriberState.LINGER
                    sub.time_of_last_update_ns = now_ns
            elif sub.state is SubscriberState.LINGER:
                if now_ns - sub.time_of_last_update_ns >= linger_ns:
                    sub.state = SubscriberState.RESTING
                    sub.time_of_last_update_ns = now_ns
            elif now_ns - sub.time_of_last_update_ns >= self.timers.untethered_resting_timeout_ns:
                sub.state = SubscriberState.ACTIVE
                sub.position = self.rebuild_position
                sub.assembler = sub.new_assembler()
                sub.time_of_last_update_ns = now_ns

    def next_deadline_ns(self) -> int:
        """When ``do_work`` must run again if nothing arrives (SM timer, NAK timer)."""
        deadline = self._time_of_last_sm_ns + self.timers.sm_timeout_ns
        nak = self.loss.deadline_ns()
        return deadline if nak is None else min(deadline, nak)
