"""Congestion control: the receiver window, static and CUBIC."""

from __future__ import annotations

import pytest

from flowbroker.transport.congestion import (
    CongestionParams,
    CubicCongestionControl,
    StaticWindowCongestionControl,
    congestion_control_from_param,
)

MTU = 1408
TERM = 16 * 1024 * 1024


def track(cc: CubicCongestionControl | StaticWindowCongestionControl, now_ns: int, loss: bool) -> tuple[int, bool]:
    outcome = cc.on_track_rebuild(now_ns, 0, 0, 0, 0, 0, loss)
    return outcome.window_length, outcome.force_status_message


def test_static_window_is_min_of_rcv_wnd_and_half_a_term() -> None:
    assert StaticWindowCongestionControl(CongestionParams(TERM, MTU)).initial_window_length() == 128 * 1024
    small = StaticWindowCongestionControl(CongestionParams(64 * 1024, MTU, receiver_window=1 << 20))
    assert small.initial_window_length() == 32 * 1024
    assert track(small, 10**9, True) == (32 * 1024, False)  # loss does not change a static window
    assert not small.should_measure_rtt(10**12)


def test_cubic_starts_at_ten_mtus_and_shrinks_by_a_fifth_on_loss() -> None:
    cc = CubicCongestionControl(CongestionParams(TERM, MTU), now_ns=0)
    assert cc.initial_window_length() == 10 * MTU
    assert cc.max_window_length() == (128 * 1024 // MTU) * MTU
    window, force = track(cc, 1_000, True)
    assert (window, force) == (8 * MTU, True)
    assert cc.w_max == 10


def test_cubic_grows_back_along_the_cubic_curve_to_the_max_window() -> None:
    cc = CubicCongestionControl(CongestionParams(TERM, MTU), now_ns=0)
    track(cc, 1_000, True)  # cwnd 8, w_max 10, K = cbrt(10 * 0.2 / 0.4) ~ 1.71 s
    cc.on_rtt_measurement(2_000, 1_000_000)  # 1 ms RTT: at most one update per ms
    windows = []
    now = 1_000
    for _ in range(100):
        now += 100_000_000  # 100 ms steps
        windows.append(track(cc, now, False)[0] // MTU)
    assert windows == sorted(windows)  # monotone growth without loss
    assert windows[0] < 10  # concave region: still below w_max shortly after the loss
    assert windows[-1] == cc.max_cwnd  # convex region: reaches the ceiling
    # no update within one RTT of the last
    assert track(cc, now + 10, False) == (cc.max_cwnd * MTU, False)


def test_cubic_tcp_mode_is_never_slower_than_reno() -> None:
    plain = CubicCongestionControl(CongestionParams(TERM, MTU), now_ns=0)
    tcp = CubicCongestionControl(CongestionParams(TERM, MTU, tcp_mode=True), now_ns=0)
    for cc in (plain, tcp):
        track(cc, 0, True)
        cc.on_rtt_measurement(0, 1_000_000)
    assert track(tcp, 50_000_000, False)[0] > track(plain, 50_000_000, False)[0]


def test_cubic_rtt_measurement_schedule() -> None:
    cc = CubicCongestionControl(CongestionParams(TERM, MTU), now_ns=0)
    assert not cc.should_measure_rtt(5_000_000)
    assert cc.should_measure_rtt(10_000_001)
    cc.on_rtt_measurement_sent(10_000_001)
    assert not cc.should_measure_rtt(30_000_000)  # one outstanding measurement at a time
    assert cc.should_measure_rtt(1_010_000_002)  # ... unless it is lost for a second
    cc.on_rtt_measurement(1_020_000_000, 250_000)
    assert cc.rtt_ns == 250_000 and cc.outstanding_rtt_measurements == 0
    off = CubicCongestionControl(CongestionParams(TERM, MTU, measure_rtt=False), now_ns=0)
    assert not off.should_measure_rtt(10**12)


def test_registry_by_name() -> None:
    params = CongestionParams(TERM, MTU)
    assert isinstance(congestion_control_from_param(None, params, 0), StaticWindowCongestionControl)
    assert isinstance(congestion_control_from_param("cubic", params, 0), CubicCongestionControl)
    with pytest.raises(ValueError, match="unsupported congestion control: cc=bbr"):
        congestion_control_from_param("bbr", params, 0)
