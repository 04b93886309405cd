"""`flowbroker queue show`'s line for a saturated queue: a time threshold's value in ms, or infinite."""

from __future__ import annotations

from typing import Any

from tests.broker.coreharness import Harness

from flowbroker.broker.cliformat import queue_text
from flowbroker.broker.views import queue_view


def saturated_view(threshold: str, limit: int, value: int) -> dict[str, Any]:
    h = Harness()
    h.consumer("admin").declare_queue("q")
    view = queue_view(h.core.queues["q"], h.now)
    view["saturated"], view["saturated_for_seconds"] = True, 3.0
    view["stop_reason"] = {"threshold": threshold, "limit": limit, "value": value}
    return view


def test_an_unmeasured_drain_time_reads_infinite_not_two_to_the_62() -> None:
    """A queue stopped by a drain time whose rate had decayed to nothing read
    'flow_stop_drain_time: 4611686018427387904 > 500' (a tester)."""
    text = queue_text(saturated_view("flow_stop_drain_time", 500, 2**62))
    assert "(flow_stop_drain_time: infinite (no consumption measured) > 500 ms)" in text
    assert "(flow_stop_age: 730 ms > 500 ms)" in queue_text(saturated_view("flow_stop_age", 500, 730))
    assert "(flow_stop_count: 31 > 30)" in queue_text(saturated_view("flow_stop_count", 30, 31))
