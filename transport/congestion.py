"""Receiver-side congestion control: the size of the receiver window an image advertises in its SMs.

Aeron does congestion control entirely at the receiver, by changing the window in its status messages:
a smaller window slows the sender without any sender-side state. Two strategies, chosen by ``cc=``:

* ``static`` (default): a fixed window, ``min(rcv-wnd or 128 KiB, term_length / 2)``. No congestion control.
* ``cubic``: RFC 8312 CUBIC on a window counted in MTUs, shrunk by 20 % on loss and grown along the cubic
  curve otherwise, with the RTT measured by RTTM frames (Aeron's ``CubicCongestionControl``).

Strategies take time as ``now_ns`` and return a ``WindowOutcome`` rather than a packed long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

__all__ = [
    "DEFAULT_INITIAL_WINDOW",
    "CongestionControl",
    "CongestionParams",
    "CubicCongestionControl",
    "StaticWindowCongestionControl",
    "WindowOutcome",
    "congestion_control_from_param",
    "register_congestion_control",
]

#: ``AERON_RCV_INITIAL_WINDOW_LENGTH`` default.
DEFAULT_INITIAL_WINDOW = 128 * 1024


class WindowOutcome(NamedTuple):
    """What a strategy decided after the image tracked its rebuild."""

    window_length: int
    force_status_message: bool


class CongestionControl(Protocol):
    """Aeron's ``CongestionControl`` interface in snake_case."""

    def should_measure_rtt(self, now_ns: int) -> bool:
        """True when the image should send an RTTM (with the reply flag) now."""
        ...

    def on_rtt_measurement_sent(self, now_ns: int) -> None: ...

    def on_rtt_measurement(self, now_ns: int, rtt_ns: int) -> None: ...

    def on_track_rebuild(
        self,
        now_ns: int,
        new_consumption_position: int,
        last_sm_position: int,
        hwm_position: int,
        starting_rebuild_position: int,
        ending_rebuild_position: int,
        loss_occurred: bool,
    ) -> WindowOutcome:
        """Called each image duty cycle; returns the window to advertise next."""
        ...

    def initial_window_length(self) -> int: ...

    def max_window_length(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CongestionParams:
    """What a strategy needs to size its window."""

    term_length: int
    mtu: int
    receiver_window: int = DEFAULT_INITIAL_WINDOW
    measure_rtt: bool = True
    tcp_mode: bool = False
    initial_rtt_ns: int = 100_000


def static_window_length(term_length: int, receiver_window: int) -> int:
    """``min(rcv-wnd, term_length / 2)``: more than half a term could overwrite unconsumed data."""
    return min(receiver_window, term_length // 2)


class StaticWindowCongestionControl:
    """A constant window: congestion control switched off (Aeron's default)."""

    def __init__(self, params: CongestionParams) -> None:
        self._window = static_window_length(params.term_length, params.receiver_window)

    def should_measure_rtt(self, now_ns: int) -> bool:
        return False

    def on_rtt_measurement_sent(self, now_ns: int) -> None:
        return None

    def on_rtt_measurement(self, now_ns: int, rtt_ns: int) -> None:
        return None

    def on_track_rebuild(
        self,
        now_ns: int,
        new_consumption_position: int,
        last_sm_position: int,
        hwm_position: int,
        starting_rebuild_position: int,
        ending_rebuild_position: int,
        loss_occurred: bool,
    ) -> WindowOutcome:
        return WindowOutcome(self._window, False)

    def initial_window_length(self) -> int:
        return self._window

    def max_window_length(self) -> int:
        return self._window


class CubicCongestionControl:
    """CUBIC on the receiver window (RFC 8312, as Aeron's ``CubicCongestionControl``).

    The congestion window ``cwnd`` counts MTU-sized segments. On loss: ``w_max = cwnd``,
    ``cwnd *= (1 - B)``. Otherwise, at most once per RTT: ``cwnd = C (t - K)^3 + w_max`` with
    ``K = cbrt(w_max B / C)`` and ``t`` the seconds since the last loss; in TCP mode never below the
    Reno-friendly ``w_max (1 - B) + 3B/(2-B) t / RTT``. The RTT comes from RTTM round trips.
    """

    C = 0.4
    B = 0.2
    INITIAL_CWND = 10
    RTT_MEASUREMENT_TIMEOUT_NS = 10_000_000
    RTT_MAX_TIMEOUT_NS = 1_000_000_000
    MAX_OUTSTANDING_RTT_MEASUREMENTS = 1
    SECOND_NS = 1_000_000_000

    def __init__(self, params: CongestionParams, now_ns: int) -> None:
        if params.mtu <= 0:
            raise ValueError("mtu must be > 0")
        self.mtu = params.mtu
        self.measure_rtt = params.measure_rtt
        self.tcp_mode = params.tcp_mode
        max_window = static_window_length(params.term_length, params.receiver_window)
        self.max_cwnd = max(1, max_window // self.mtu)
        self.cwnd = min(self.max_cwnd, self.INITIAL_CWND)
        self.w_max = self.max_cwnd
        self.k = math.cbrt(self.w_max * self.B / self.C)
        self.rtt_ns = params.initial_rtt_ns
        self.window_update_timeout_ns = self.rtt_ns
        self.outstanding_rtt_measurements = 0
        self.last_rtt_timestamp_ns = now_ns
        self.last_loss_timestamp_ns = now_ns
        self.last_update_timestamp_ns = now_ns

    def should_measure_rtt(self, now_ns: int) -> bool:
        if not self.measure_rtt:
            return False
        since = now_ns - self.last_rtt_timestamp_ns
        if since > self.RTT_MAX_TIMEOUT_NS:
            return True
        return (
            since > self.RTT_MEASUREMENT_TIMEOUT_NS
            and self.outstanding_rtt_measurements < self.MAX_OUTSTANDING_RTT_MEASUREMENTS
        )

    def on_rtt_measurement_sent(self, now_ns: int) -> None:
        self.last_rtt_timestamp_ns = now_ns
        self.outstanding_rtt_measurements += 1

    def on_rtt_measurement(self, now_ns: int, rtt_ns: int) -> None:
        self.outstanding_rtt_measurements = 0
        self.last_rtt_timestamp_ns = now_ns
        if rtt_ns > 0:
            self.rtt_ns = rtt_ns
            self.window_update_timeout_ns = rtt_ns

    def on_track_rebuild(
        self,
        now_ns: int,
        new_consumption_position: int,
        last_sm_position: int,
        hwm_position: int,
        starting_rebuild_position: int,
        ending_rebuild_position: int,
        loss_occurred: bool,
    ) -> WindowOutcome:
        force = False
        if loss_occurred:
            self.w_max = self.cwnd
            self.k = math.cbrt(self.w_max * self.B / self.C)
            self.cwnd = max(1, int(self.cwnd * (1.0 - self.B)))
            self.last_loss_timestamp_ns = now_ns
            force = True
        elif (
            self.cwnd < self.max_cwnd
            and now_ns - self.last_update_timestamp_ns > self.window_update_timeout_ns
        ):
            since_loss_s = (now_ns - self.last_loss_timestamp_ns) / self.SECOND_NS
            diff_to_k = since_loss_s - self.k
            increment = self.C * diff_to_k * diff_to_k * diff_to_k
            self.cwnd = max(1, min(self.max_cwnd, self.w_max + int(increment)))
            if self.tcp_mode and self.cwnd < self.w_max:
                rtt_s = self.rtt_ns / self.SECOND_NS
                w_tcp = self.w_max * (1.0 - self.B) + (3.0 * self.B / (2.0 - self.B)) * (since_loss_s / rtt_s)
                self.cwnd = min(self.max_cwnd, max(self.cwnd, int(w_tcp)))
            self.last_update_timestamp_ns = now_ns
            force = True
        return WindowOutcome(self.cwnd * self.mtu, force)

    def initial_window_length(self) -> int:
        return self.cwnd * self.mtu

    def max_window_length(self) -> int:
        return self.max_cwnd * self.mtu


CongestionFactory = Callable[[CongestionParams, int], CongestionControl]


def _make_static(params: CongestionParams, now_ns: int) -> CongestionControl:
    return StaticWindowCongestionControl(params)


def _make_cubic(params: CongestionParams, now_ns: int) -> CongestionControl:
    return CubicCongestionControl(params, now_ns)


_REGISTRY: dict[str, CongestionFactory] = {"static": _make_static, "cubic": _make_cubic}


def register_congestion_control(name: str, factory: CongestionFactory) -> None:
    """Make a custom strategy selectable as ``cc=<name>``."""
    _REGISTRY[name] = factory


def congestion_control_from_param(value: str | None, params: CongestionParams, now_ns: int) -> CongestionControl:
    """The strategy for a channel's ``cc=`` value; ``None`` means ``static``."""
    name = value or "static"
    factory = _REGISTRY.get(name)
    if factory is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unsupported congestion control: cc={name} (known: {known})")
    return factory(params, now_ns)
