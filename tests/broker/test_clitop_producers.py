"""`flowbroker top`'s flow-stopped producers: BY names the destinations holding one, earliest first, and
REASON their thresholds in the same order. REASON was a sorted set, so a producer stopped by queue tq
(flow_stop_count) and then by a stop-all showed `BY tq,*  REASON admin,flow_stop_count` (a tester)."""

from __future__ import annotations

from typing import Any

from flowbroker.broker.clitop import PRODUCER_HEADERS, render, snapshot


class _Api:
    """The admin API's answers for one refresh: one producer held by tq, then by a stop-all, one by
    three queues, two of them for the same threshold."""

    def request(self, method: str, path: str) -> dict[str, Any]:
        if path == "/api/broker":
            return {"name": "b", "credit_policy": "aggressive", "queues": 0, "connections": 2,
                    "saturated_queues": 0, "producers_stopped": True}
        if path.startswith("/api/queues"):
            return {"queues": [], "next": None}
        assert path.startswith("/api/connections"), path
        return {"connections": [_producer(1, [("tq", "flow_stop_count"), ("*", "admin")]),
                                _producer(2, [("a", "flow_stop_age"), ("b", "flow_stop_count"),
                                              ("c", "flow_stop_age")])],
                "next": None}


def _producer(conn: int, destinations: list[tuple[str, str]]) -> dict[str, Any]:
    return {"id": conn, "client_name": f"p{conn}", "role": "producer",
            "flow": {"stopped": True, "stopped_for_seconds": 3.0,
                     "destinations": [{"destination": d, "threshold": t} for d, t in destinations]},
            "producer": {"buffer_size": 1024, "unacked_bytes": 0, "transfers_held": 0}}


def test_by_and_reason_are_in_the_same_order() -> None:
    snap = snapshot(_Api(), limit=20)  # type: ignore[arg-type]
    assert [(p["destinations"], p["reasons"]) for p in snap["flow_stopped"]] == [
        (["tq", "*"], ["flow_stop_count", "admin"]),
        (["a", "b", "c"], ["flow_stop_age", "flow_stop_count", "flow_stop_age"]),
    ]
    lines = render(snap, at="now").splitlines()
    header = next(line for line in lines if line.startswith("CONNECTION"))
    by, reason = header.index("BY"), header.index("REASON")
    rows = {line.split()[0]: line for line in lines[lines.index(header) + 1:]}
    assert PRODUCER_HEADERS.index("REASON") == PRODUCER_HEADERS.index("BY") + 1
    assert rows["1"][by:reason].split() == ["tq,*"] and rows["1"][reason:].split()[0] == "flow_stop_count,admin"
    assert rows["2"][by:reason].split() == ["a,b,c"]
    assert rows["2"][reason:].split()[0] == "flow_stop_age,flow_stop_count,flow_stop_age"
