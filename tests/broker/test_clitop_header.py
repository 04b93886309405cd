"""`flowbroker top`'s header says when its flow-stopped producers are of the first page of connections only
(29 stopped past the first 1,000 connections read as "flow-stopped producers 0" and "no producer is
flow-stopped", a tester)."""

from __future__ import annotations

from typing import Any

from flowbroker.broker.clitop import render


def _snap(cut: bool) -> dict[str, Any]:
    return {"broker": {"name": "b", "credit_policy": "aggressive"}, "queues": [], "queues_shown_of": 0,
            "queues_total": 3, "saturated": 0, "flow_stopped": [], "connections_total": 1130,
            "connections_cut": cut}


def test_the_flow_stopped_count_says_it_is_of_the_first_page_when_there_are_more_connections() -> None:
    frame = render(_snap(True), at="now")
    assert "flow-stopped producers 0 of the first 1000 connections" in frame.splitlines()[0]
    assert "no producer of the first 1000 connections is flow-stopped" in frame
    frame = render(_snap(False), at="now")
    assert "flow-stopped producers 0  credit policy" in frame and "no producer is flow-stopped" in frame
