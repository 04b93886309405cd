"""`flowbroker top`'s header says when its saturated count is of the first page of queues only."""

from __future__ import annotations

from typing import Any

from flowbroker.broker.clitop import render


def _snap(total: int, shown: int) -> dict[str, Any]:
    return {"broker": {"name": "b", "credit_policy": "aggressive"}, "queues": [], "queues_shown_of": shown,
            "queues_total": total, "saturated": 0, "flow_stopped": [], "connections_total": 1}


def test_the_saturated_count_says_it_is_of_the_first_page_when_there_are_more_queues() -> None:
    """2,516 queues and a saturated one past the first 1,000 read as "saturated 0" beside a producer that
    queue held (a tester)."""
    assert "queues 2516 (saturated 0 of the first 1000)" in render(_snap(2516, 1000), at="now")
    assert "queues 3 (saturated 0)" in render(_snap(3, 3), at="now")
