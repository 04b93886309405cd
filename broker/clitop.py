"""`flowbroker top`: a live terminal view of queues and flow state, for an operator on a server without
a browser (the web console's view in a terminal; docs/management.md, "flowbroker top").

Each refresh asks the admin API for the broker, one page of queues, one page of the saturated queues
and one page of connections (at most SCAN of each, the API's largest page), so a refresh costs the
broker what three list requests cost, however many queues it has. It shows the queues that matter
first: saturated ones (wherever their names sort), then the deepest, and every flow-stopped producer
with the queue (or broker-wide stop) holding it and since when.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from flowbroker.broker.adminclient import PAGE_SIZE, AdminClient
from flowbroker.broker.cliformat import limit_text, printable, seconds_text, size_text, table_text

__all__ = ["SCAN", "snapshot", "render", "run_top"]

SCAN = PAGE_SIZE
"""Queues and connections read per refresh: one page of each (the first SCAN by name / id)."""

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: each frame replaces the last on a terminal


def _queue_order(q: dict[str, Any]) -> tuple[bool, int, int, str]:
    """Saturated first, then by depth in messages and bytes, then by name."""
    return (not q["saturated"], -q["depth"]["count"], -q["depth"]["bytes"], q["name"])


def snapshot(client: AdminClient, limit: int) -> dict[str, Any]:
    """What one refresh shows, as JSON-ready data: the broker, the `limit` queues that matter most of
    the first SCAN and the first SCAN saturated ones (a saturated queue is shown however many queues
    sort before it), and every flow-stopped producer among the first SCAN connections."""
    broker = client.request("GET", "/api/broker")
    queues = client.request("GET", f"/api/queues?limit={SCAN}")
    saturated = client.request("GET", f"/api/queues?saturated=true&limit={SCAN}")
    connections = client.request("GET", f"/api/connections?limit={SCAN}")
    listed = {q["name"]: q for q in queues["queues"]}
    listed.update((q["name"], q) for q in saturated["queues"])  # the later view of a queue on both
    ranked = sorted(listed.values(), key=_queue_order)
    # A stop-all tells every flow-controlled connection, but one that only consumes holds nothing back
    stopped = [c for c in connections["connections"] if c["flow"]["stopped"] and c["role"] != "consumer"]
    return {
        "broker": broker,
        "queues": ranked[:limit],
        "queues_shown_of": len(ranked),
        "queues_total": broker.get("queues"),
        "saturated": broker["saturated_queues"],
        "flow_stopped": [
            {
                "connection": c["id"],
                "client_name": c["client_name"],
                "stopped_for_seconds": c["flow"]["stopped_for_seconds"],
                "destinations": [d["destination"] for d in c["flow"]["destinations"]],
                # one a destination, in their order: BY and REASON read as pairs (a sorted set of reasons
                # showed "BY tq,*  REASON admin,flow_stop_count", a tester)
                "reasons": [d["threshold"] for d in c["flow"]["destinations"]],
                "buffer_size": c["producer"]["buffer_size"],
                "unacked_bytes": c["producer"]["unacked_bytes"],
                "transfers_held": c["producer"]["transfers_held"],
            }
            for c in stopped
        ],
        "connections_total": broker.get("connections"),
        # the flow-stopped producers are those of the first SCAN connections: said so when there are more
        # (29 stopped past them read as "flow-stopped producers 0", a tester)
        "connections_cut": connections.get("next") is not None,
    }


QUEUE_HEADERS = ("QUEUE", "MESSAGES", "BYTES", "STOP", "RESUME", "SATURATED", "HELD", "STOPPING")
PRODUCER_HEADERS = ("CONNECTION", "CLIENT", "STOPPED FOR", "BY", "REASON", "BUFFER", "UNACKED", "HELD")


def _threshold(q: dict[str, Any], stop: bool) -> str:
    t = q["thresholds"]
    count = t["flow_stop_count" if stop else "flow_resume_count"]
    size = t["flow_stop_size" if stop else "flow_resume_size"]
    return f"{limit_text(count)}/{limit_text(size, size=True)}"  # count/size, as `flowbroker queues` shows them


def _of_connections(snap: dict[str, Any]) -> str:
    return f" of the first {SCAN} connections" if snap.get("connections_cut") else ""


def render(snap: dict[str, Any], *, at: str) -> str:
    """The frame for a terminal: a header line, the queues table, the flow-stopped producers."""
    broker = snap["broker"]
    stops = []
    if broker.get("producers_stopped"):
        stops.append("STOP-ALL IN FORCE")
    header = (
        f"{printable(broker.get('name'))}  {at}  queues {snap['queues_total']} "
        f"(saturated {snap['saturated']})  connections {snap['connections_total']}  "
        f"flow-stopped producers {len(snap['flow_stopped'])}{_of_connections(snap)}  "
        f"credit policy {broker.get('credit_policy')}"
        + ("  " + " ".join(stops) if stops else "")
    )
    lines = [header, ""]
    if snap["queues"]:
        rows = [
            [
                q["name"], q["depth"]["count"], size_text(q["depth"]["bytes"]), _threshold(q, True),
                _threshold(q, False),
                seconds_text(q["saturated_for_seconds"]) if q["saturated"] else "no",
                q["held_transfers"], q["flow_stopped_producers_total"],
            ]
            for q in snap["queues"]
        ]
        lines.append(table_text(QUEUE_HEADERS, rows))
        if snap["queues_shown_of"] > len(snap["queues"]):
            lines.append(f"... {snap['queues_shown_of'] - len(snap['queues'])} more (--limit)")
    else:
        lines.append("no queues")
    lines.append("")
    if snap["flow_stopped"]:
        rows = [
            [
                p["connection"], p["client_name"], seconds_text(p["stopped_for_seconds"]),
                ",".join(p["destinations"]), ",".join(p["reasons"]), size_text(p["buffer_size"]),
                size_text(p["unacked_bytes"]), p["transfers_held"],
            ]
            for p in snap["flow_stopped"]
        ]
        lines.append(table_text(PRODUCER_HEADERS, rows))
    else:
        lines.append(f"no producer{_of_connections(snap)} is flow-stopped")
    return "\n".join(lines)


def run_top(client: AdminClient, *, interval: float, count: int, limit: int, as_json: bool,
            sleep: Callable[[float], None] = time.sleep) -> None:
    """Refresh every `interval` seconds, `count` times (0: until Ctrl-C). On a terminal each frame
    replaces the last; piped, frames follow each other separated by a blank line; --json prints one
    JSON document per refresh, one per line. An admin API that stops answering ends it with the
    usual one-line error (a ClickException from the client)."""
    clear = sys.stdout.isatty() and not as_json
    shown = 0
    try:
        while True:
            snap = snapshot(client, limit)
            if as_json:
                click.echo(json.dumps(snap, sort_keys=False))
            else:
                frame = render(snap, at=time.strftime("%H:%M:%S"))
                click.echo((CLEAR + frame) if clear else (frame + "\n"))
            shown += 1
            if count and shown >= count:
                return
            sleep(interval)
    except KeyboardInterrupt:
        return
