"""Sender flow control: how a publication turns status messages into a sender limit.

A publication may have several receivers (multicast, multi-destination-cast). Each status message (SM)
says "I have consumed up to position P and will take W more bytes". A flow-control strategy folds those
reports into one *sender limit*: the position the sender may transmit up to. Like Aeron's ``FlowControl``
interface, strategies are pure state machines: time arrives as ``now_ns`` and the strategy never sends
anything itself, so they are tested without a network.

Strategies, selected by the channel's ``fc=`` parameter (``flow_control_from_param``):

* ``max`` (the default, also unicast): the fastest receiver sets the pace. A slow receiver may fall behind
  and lose its image; nobody waits for it.
* ``min[,t:<timeout>][,g:<gtag>/<min group size>]``: the slowest live receiver sets the pace. Receivers that
  send no SM for the timeout (default 5 s) are dropped so a dead receiver cannot stall the stream forever.
* ``tagged,g:<gtag>[/<min group size>][,t:<timeout>]``: like ``min``, but only receivers whose SMs carry the
  group tag count; untagged receivers are carried along at the tagged receivers' pace.

Until ``min group size`` receivers are known, ``has_required_receivers()`` is false and the publication
reports itself not connected: a producer can wait for a quorum before its first message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

from flowbroker.transport.positions import compute_position

__all__ = [
    "DEFAULT_RECEIVER_TIMEOUT_NS",
    "FlowControl",
    "FlowControlParams",
    "MaxFlowControl",
    "MinFlowControl",
    "StatusMessageLike",
    "TaggedFlowControl",
    "flow_control_from_param",
    "parse_duration_ns",
    "parse_flow_control_param",
    "register_flow_control",
]

#: Aeron's ``AERON_MIN_MULTICAST_FLOW_CONTROL_RECEIVER_TIMEOUT`` default.
DEFAULT_RECEIVER_TIMEOUT_NS = 5_000_000_000

#: SM flag: the receiver is going away; stop counting it (``END_OF_STREAM_FLAG``).
SM_FLAG_END_OF_STREAM = 0x40

#: A bound on receivers a strategy tracks, so a flood of forged receiver ids cannot grow memory.
MAX_TRACKED_RECEIVERS = 1024


class StatusMessageLike(Protocol):
    """The fields of a decoded SM that flow control reads (``frames.StatusMessage`` has them)."""

    @property
    def flags(self) -> int: ...

    @property
    def consumption_term_id(self) -> int: ...

    @property
    def consumption_term_offset(self) -> int: ...

    @property
    def receiver_window(self) -> int: ...

    @property
    def receiver_id(self) -> int: ...

    @property
    def group_tag(self) -> int | None: ...


class FlowControl(Protocol):
    """The strategy interface a publication calls (Aeron's ``FlowControl`` in snake_case)."""

    def on_status_message(
        self,
        sm: StatusMessageLike,
        receiver_addr: Hashable,
        sender_limit: int,
        initial_term_id: int,
        position_bits_to_shift: int,
        now_ns: int,
    ) -> int:
        """Fold one SM into the sender limit and return the new limit."""
        ...

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int, is_eos: bool) -> int:
        """Called every duty cycle: expire silent receivers; return the (possibly lower) limit."""
        ...

    def on_setup(self, sender_limit: int, sender_position: int, now_ns: int) -> int:
        """Called when the publication sends a SETUP; returns the sender limit to use."""
        ...

    def on_error(self, receiver_id: int, now_ns: int) -> None:
        """An ERR frame from a receiver: treat it as gone."""
        ...

    def has_required_receivers(self) -> bool:
        """True once enough receivers are known for the publication to count as connected."""
        ...

    def max_retransmission_length(self, resend_length: int, receiver_window: int) -> int:
        """Cap a NAK-driven resend so one NAK cannot make the sender flood the network."""
        ...


def _sm_position(sm: StatusMessageLike, initial_term_id: int, position_bits_to_shift: int) -> int:
    return compute_position(
        sm.consumption_term_id, sm.consumption_term_offset, position_bits_to_shift, initial_term_id
    )


class MaxFlowControl:
    """The fastest receiver sets the pace (Aeron's unicast and ``max`` multicast strategy).

    Stateless: the limit only ever moves forward, ``max(sender_limit, position + window)``.
    """

    #: Unicast retransmits are capped at receiver window x 16 (``aeron_retransmit_handler``).
    retransmit_window_multiple = 16

    def on_status_message(
        self,
        sm: StatusMessageLike,
        receiver_addr: Hashable,
        sender_limit: int,
        initial_term_id: int,
        position_bits_to_shift: int,
        now_ns: int,
    ) -> int:
        position = _sm_position(sm, initial_term_id, position_bits_to_shift)
        return max(sender_limit, position + sm.receiver_window)

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int, is_eos: bool) -> int:
        return sender_limit

    def on_setup(self, sender_limit: int, sender_position: int, now_ns: int) -> int:
        return sender_limit

    def on_error(self, receiver_id: int, now_ns: int) -> None:
        return None

    def has_required_receivers(self) -> bool:
        return True

    def max_retransmission_length(self, resend_length: int, receiver_window: int) -> int:
        return min(resend_length, receiver_window * self.retransmit_window_multiple)


@dataclass(slots=True)
class _Receiver:
    """What a min/tagged strategy remembers of one receiver (keyed by its receiver id)."""

    receiver_id: int
    address: Hashable
    last_position: int
    last_position_plus_window: int
    time_of_last_sm_ns: int


class MinFlowControl:
    """The slowest live receiver sets the pace (Aeron's ``AbstractMinMulticastFlowControl``).

    Args:
        receiver_timeout_ns: a receiver silent this long is forgotten (so it cannot stall everyone).
        group_min_size: receivers needed before the publication is connected and may send.
        group_tag: with ``tagged`` only SMs carrying this tag count; ``None`` counts every receiver.
    """

    retransmit_window_multiple = 4

    def __init__(
        self,
        *,
        receiver_timeout_ns: int = DEFAULT_RECEIVER_TIMEOUT_NS,
        group_min_size: int = 0,
        group_tag: int | None = None,
        tagged: bool = False,
    ) -> None:
        if receiver_timeout_ns <= 0:
            raise ValueError("receiver_timeout_ns must be > 0")
        if group_min_size < 0:
            raise ValueError("group_min_size must be >= 0")
        if tagged and group_tag is None:
            raise ValueError("tagged flow control needs a group tag (g:<gtag>)")
        self.receiver_timeout_ns = receiver_timeout_ns
        self.group_min_size = group_min_size
        self.group_tag = group_tag
        self.tagged = tagged
        self._receivers: dict[int, _Receiver] = {}
        self.overflow_to = 0
        """A position the sender may go to past the slowest receiver's window (0: none, Aeron's behaviour):
        the end of a message that overflowed it, which a receiver that reports only whole messages (its
        image holds a partial one) cannot move the window past. Bounded by `overflow_room` beyond each
        receiver's position (what its image takes: half a term). A user of this package sets both."""
        self.overflow_room = 0

    @property
    def receiver_count(self) -> int:
        return len(self._receivers)

    def _matches(self, sm: StatusMessageLike) -> bool:
        if not self.tagged:
            return True
        return sm.group_tag is not None and sm.group_tag == self.group_tag

    def _limit(self, sender_limit: int) -> int:
        if not self._receivers or len(self._receivers) < self.group_min_size:
            return sender_limit
        limit = min(r.last_position_plus_window for r in self._receivers.values())
        if self.overflow_to > limit:  # the message over the window goes whole, within what the images take
            room = min(r.last_position for r in self._receivers.values()) + self.overflow_room
            limit = max(limit, min(self.overflow_to, room))
        return limit

    def on_status_message(
        self,
        sm: StatusMessageLike,
        receiver_addr: Hashable,
        sender_limit: int,
        initial_term_id: int,
        position_bits_to_shift: int,
        now_ns: int,
    ) -> int:
        position = _sm_position(sm, initial_term_id, position_bits_to_shift)
        limit = position + sm.receiver_window
        is_eos = bool(sm.flags & SM_FLAG_END_OF_STREAM)
        # An SM without the tag neither joins the group nor moves the limit: until a tagged receiver
        # reports, the sender keeps its limit (Aeron's ``processStatusMessage(..., matchesTag=false)``).
        if self._matches(sm):
            receiver = self._receivers.get(sm.receiver_id)
            if is_eos:
                self._receivers.pop(sm.receiver_id, None)
            elif receiver is not None:
                receiver.last_position = max(receiver.last_position, position)
                receiver.last_position_plus_window = limit
                receiver.time_of_last_sm_ns = now_ns
                receiver.address = receiver_addr
            elif len(self._receivers) < MAX_TRACKED_RECEIVERS:
                self._receivers[sm.receiver_id] = _Receiver(
                    sm.receiver_id, receiver_addr, position, limit, now_ns
                )
        return self._limit(sender_limit)

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int, is_eos: bool) -> int:
        expired = [
            rid
            for rid, r in self._receivers.items()
            if now_ns - r.time_of_last_sm_ns > self.receiver_timeout_ns
        ]
        for rid in expired:
            del self._receivers[rid]
        return self._limit(sender_limit)

    def on_setup(self, sender_limit: int, sender_position: int, now_ns: int) -> int:
        return sender_limit

    def on_stopped(self, stopped_ns: int, now_ns: int) -> None:
        """The publication did not run for `stopped_ns` (its process was stopped): that silence is not the
        receivers', so their receiver timeout starts that much later (``Publication._excuse_stop``)."""
        for receiver in self._receivers.values():
            receiver.time_of_last_sm_ns = min(now_ns, receiver.time_of_last_sm_ns + stopped_ns)

    def on_error(self, receiver_id: int, now_ns: int) -> None:
        self._receivers.pop(receiver_id, None)

    def counts(self, receiver_id: int) -> bool:
        """True while ``receiver_id`` is one of the receivers that pace the stream."""
        return receiver_id in self._receivers

    def min_position(self) -> int | None:
        """The lowest consumption position of the receivers that count (None when none is live): every
        one of them has consumed the stream up to here (the broker's multicast groups settle below it)."""
        if not self._receivers:
            return None
        return min(r.last_position for r in self._receivers.values())

    def has_required_receivers(self) -> bool:
        return len(self._receivers) >= self.group_min_size

    def max_retransmission_length(self, resend_length: int, receiver_window: int) -> int:
        return min(resend_length, receiver_window * self.retransmit_window_multiple)


class TaggedFlowControl(MinFlowControl):
    """``min`` over the receivers whose SMs carry ``group_tag`` (Aeron's ``TaggedMulticastFlowControl``)."""

    def __init__(
        self,
        *,
        group_tag: int,
        receiver_timeout_ns: int = DEFAULT_RECEIVER_TIMEOUT_NS,
        group_min_size: int = 0,
    ) -> None:
        super().__init__(
            receiver_timeout_ns=receiver_timeout_ns,
            group_min_size=group_min_size,
            group_tag=group_tag,
            tagged=True,
        )


@dataclass(frozen=True, slots=True)
class FlowControlParams:
    """A parsed ``fc=`` value: the strategy name and its options."""

    name: str
    receiver_timeout_ns: int | None = None
    group_tag: int | None = None
    group_min_size: int | None = None


_DURATION = re.compile(r"^(\d+)(ns|us|ms|s)?$")
_UNITS = {None: 1, "ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}


def parse_duration_ns(text: str) -> int:
    """Parse an Aeron duration (``5s``, ``500ms``, ``100us``, plain nanoseconds) into ns."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"bad duration {text!r}: expected <int>[ns|us|ms|s]")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_flow_control_param(value: str) -> FlowControlParams:
    """Parse ``max`` | ``min[,t:..][,g:..]`` | ``tagged,g:<gtag>[/<n>][,t:..]``; errors name the bad part."""
    parts = [p.strip() for p in value.split(",")]
    name = parts[0]
    timeout: int | None = None
    gtag: int | None = None
    min_size: int | None = None
    for part in parts[1:]:
        if part.startswith("t:"):
            try:
                timeout = parse_duration_ns(part[2:])
            except ValueError as exc:
                raise ValueError(f"fc={value}: bad receiver timeout {part!r}: {exc}") from None
        elif part.startswith("g:"):
            tag_text, _, size_text = part[2:].partition("/")
            try:
                gtag = int(tag_text) if tag_text else None
                min_size = int(size_text) if size_text else None
            except ValueError:
                raise ValueError(f"fc={value}: bad group {part!r}, expected g:<gtag>[/<min size>]") from None
            if min_size is not None and min_size < 0:
                raise ValueError(f"fc={value}: bad group {part!r}: min group size must be >= 0")
        else:
            raise ValueError(f"fc={value}: unknown option {part!r}, expected t:<timeout> or g:<gtag>/<n>")
    return FlowControlParams(name, timeout, gtag, min_size)


FlowControlFactory = Callable[[FlowControlParams], FlowControl]


def _make_max(params: FlowControlParams) -> FlowControl:
    if params.receiver_timeout_ns is not None or params.group_tag is not None or params.group_min_size is not None:
        raise ValueError("fc=max takes no options")
    return MaxFlowControl()


def _make_min(params: FlowControlParams) -> FlowControl:
    return MinFlowControl(
        receiver_timeout_ns=params.receiver_timeout_ns or DEFAULT_RECEIVER_TIMEOUT_NS,
        group_min_size=params.group_min_size or 0,
    )


def _make_tagged(params: FlowControlParams) -> FlowControl:
    if params.group_tag is None:
        raise ValueError("fc=tagged needs a group tag: tagged,g:<gtag>[/<min size>]")
    return TaggedFlowControl(
        group_tag=params.group_tag,
        receiver_timeout_ns=params.receiver_timeout_ns or DEFAULT_RECEIVER_TIMEOUT_NS,
        group_min_size=params.group_min_size or 0,
    )


_REGISTRY: dict[str, FlowControlFactory] = {"max": _make_max, "min": _make_min, "tagged": _make_tagged}


def register_flow_control(name: str, factory: FlowControlFactory) -> None:
    """Make a custom strategy selectable as ``fc=<name>`` (Aeron's supplier table)."""
    _REGISTRY[name] = factory


def flow_control_from_param(value: str | None) -> FlowControl:
    """The strategy for a channel's ``fc=`` value; ``None`` (no ``fc``) means ``max``."""
    if value is None or value == "":
        return MaxFlowControl()
    params = parse_flow_control_param(value)
    factory = _REGISTRY.get(params.name)
    if factory is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unsupported flow control strategy: fc={params.name} (known: {known})")
    return factory(params)
