"""How the `flowbroker` commands print what the admin API answers: sizes, tables that stream page by
page, one object's details. Every cell and value goes through `printable` (broker/logsafe.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click

from flowbroker.broker.logsafe import logsafe

def printable(value: object, *, backslash: bool = True) -> str:
    """`value` as text a client or queue name cannot use to move the cursor, clear the screen or forge
    a line of a table (broker/logsafe.py); not cut. `backslash=False` for the broker's error texts,
    which already show names with repr()."""
    return logsafe(value, None, backslash=backslash)


def print_json(answer: Any) -> None:
    click.echo(json.dumps(answer, indent=2, sort_keys=False))


def size_text(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def limit_text(n: int, size: bool = False) -> str:
    """A threshold: 0 means off."""
    if not n:
        return "-"
    return size_text(n) if size else str(n)


def seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def table_text(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    table = Table(headers)
    return "\n".join(table.lines(rows))


class Table:
    """An aligned table printed page by page: the header with the first page, and columns that only
    widen, so a long listing streams without holding it all. Every cell goes through printable."""

    def __init__(self, headers: Sequence[str]):
        self.headers = list(headers)
        self.widths = [len(h) for h in headers]
        self.started = False

    def lines(self, rows: Sequence[Sequence[Any]]) -> list[str]:
        cells = [[printable(c) for c in row] for row in rows]
        if not self.started:
            cells.insert(0, self.headers)
            self.started = True
        for row in cells:
            self.widths = [max(w, len(c)) for w, c in zip(self.widths, row)]
        return ["  ".join(c.ljust(w) for c, w in zip(row, self.widths)).rstrip() for row in cells]


def stream_json(key: str, pages: Iterator[tuple[list[dict[str, Any]], Any]]) -> None:
    """The whole listing as one JSON document shaped like an API page, `{key: [...], "next": ...}`,
    written as the pages arrive (nothing before the first one: a refused request prints only the error)."""
    started, cursor = False, None
    for items, cursor in pages:
        for item in items:
            click.echo((",\n  " if started else f'{{"{key}": [\n  ') + json.dumps(item), nl=False)
            started = True
    click.echo(f'\n], "next": {json.dumps(cursor)}}}' if started else f'{{"{key}": [], "next": {json.dumps(cursor)}}}')


def stream_table(headers: Sequence[str], pages: Iterator[tuple[list[dict[str, Any]], Any]],
                  row: Callable[[dict[str, Any]], list[Any]], empty: str) -> None:
    table = Table(headers)
    for items, _ in pages:
        if items:
            click.echo("\n".join(table.lines([row(item) for item in items])))
    if not table.started:
        click.echo(empty)


def producers_text(q: dict[str, Any]) -> str:
    """A queue's flow-stopped producers as `id:client`, and how many more the API did not list."""
    producers = q["flow_stopped_producers"]
    text = ", ".join(f"{p['connection']}:{p['client_name']}" for p in producers) or "-"
    more = q["flow_stopped_producers_total"] - len(producers)
    return f"{text} (+{more} more)" if more > 0 else text


QUEUE_HEADERS = ["QUEUE", "MESSAGES", "BYTES", "STOP n/size", "RESUME n/size", "MAX n/size", "OVERFLOW",
                 "SATURATED", "HELD", "FLOW-STOPPED PRODUCERS"]


def queue_row(q: dict[str, Any]) -> list[Any]:
    t = q["thresholds"]
    saturated = f"yes {seconds_text(q['saturated_for_seconds'])}" if q["saturated"] else "no"
    return [
        q["name"], q["depth"]["count"], size_text(q["depth"]["bytes"]),
        f"{limit_text(t['flow_stop_count'])}/{limit_text(t['flow_stop_size'], True)}",
        f"{limit_text(t['flow_resume_count'])}/{limit_text(t['flow_resume_size'], True)}",
        f"{limit_text(t['max_count'])}/{limit_text(t['max_size'], True)}", t["overflow"],
        saturated, q["held_transfers"], producers_text(q),
    ]



def _secs(value: float) -> str:
    """A time threshold: its seconds, or off (0)."""
    return f"{value:g} s" if value else "off"

_UNMEASURED_MS = 2**62
"""A time threshold's value when the consumers' rate is unmeasured or nil: an infinite drain time."""


def _reason_value(threshold: str, value: int) -> str:
    """A stop reason's value as a person reads it: a time threshold's in ms (or infinite), others as is.
    A slow-acking consumer's queue read 'flow_stop_drain_time: 4611686018427387904 > 500' (a tester)."""
    if threshold in ("flow_stop_drain_time", "flow_stop_age"):
        return "infinite (no consumption measured)" if value >= _UNMEASURED_MS else f"{value} ms"
    return str(value)


def queue_text(q: dict[str, Any]) -> str:
    t = q["thresholds"]
    c = q["counters"]
    if q["saturated"]:
        reason = q["stop_reason"]
        timed = reason["threshold"] in ("flow_stop_drain_time", "flow_stop_age")
        saturated = (f"yes, for {seconds_text(q['saturated_for_seconds'])} "
                     f"({reason['threshold']}: {_reason_value(reason['threshold'], reason['value'])} > "
                     f"{reason['limit']}{' ms' if timed else ''})")
    else:
        saturated = "no"
    lines = [
        ("queue", q["name"]),
        ("depth", f"{q['depth']['count']} messages, {size_text(q['depth']['bytes'])} ({q['depth']['ready']} ready)"),
        ("flow stop", f"count {limit_text(t['flow_stop_count'])}, size {limit_text(t['flow_stop_size'], True)}"),
        ("flow resume", f"count {limit_text(t['flow_resume_count'])}, size {limit_text(t['flow_resume_size'], True)}"),
        ("flow time", f"stop drain {_secs(t['flow_stop_drain_time'])}/age {_secs(t['flow_stop_age'])}, "
                      f"resume drain {_secs(t['flow_resume_drain_time'])}/age {_secs(t['flow_resume_age'])}; "
                      f"drain rate {q['drain']['rate']:.0f} msgs/s, oldest ready {q['drain']['oldest_ready_age']:.1f} s"),
        ("max", f"count {limit_text(t['max_count'])}, size {limit_text(t['max_size'], True)}, overflow {t['overflow']}"),
        ("saturated", saturated),
        ("held transfers", str(q["held_transfers"])),
        ("flow-stopped", producers_text(q)),
        ("counters", f"enqueued {c['enqueued']}, dequeued {c['dequeued']}, rejected {c['rejected']}, "
                     f"dropped {c['dropped']}, flow stops {c['flow_stopped_count']}, held {c['held_total']}"),
    ]
    width = max(len(k) for k, _ in lines)
    out = [f"{k.ljust(width)}  {printable(v)}" for k, v in lines]
    if q["subscriptions"]:
        more = q["subscriptions_total"] - len(q["subscriptions"])
        out.append(f"subscriptions (the first {len(q['subscriptions'])} of {q['subscriptions_total']})"
                   if more > 0 else "subscriptions")
        rows = [_subscription_row(s) for s in q["subscriptions"]]
        table = table_text(["CONN", "SUB", "CLIENT", "PREFETCH", "UNSETTLED", "DELIVERED", "BUFFER", "UNACKED"], rows)
        out.extend("  " + line for line in table.splitlines())
    else:
        out.append(f"{'subscriptions'.ljust(width)}  -")
    return "\n".join(out)


def _subscription_row(s: dict[str, Any]) -> list[Any]:
    group = s.get("multicast_group")
    if group is not None:  # a multicast group's: no connection; its members and channel instead
        return ["-", 0, f"group {group['group']} ({group['members']} members, {group['channel']})", s["prefetch"],
                s["unsettled"], s["delivered"], "-", "-"]
    return [s["connection"], s["subscription"], s["client_name"], s["prefetch"], s["unsettled"], s["delivered"],
            limit_text(s["buffer"]["size"], True), size_text(s["buffer"]["unacked"])]


CONNECTION_HEADERS = ["ID", "CLIENT", "PEER", "ROLE", "BUFFER", "UNACKED", "HELD", "FLOW", "BLOCKING",
                      "SUBS", "UNSETTLED", "CONSUMER-BUF"]


def connection_row(c: dict[str, Any]) -> list[Any]:
    p, flow, consumer = c["producer"], c["flow"], c["consumer"]
    if flow["stopped"]:
        state = f"stopped {seconds_text(flow['stopped_for_seconds'])}"
        broker_wide = [name for name, on in (("stop-all", flow["admin_stopped"]),
                                             ("memory alarm", flow.get("memory_stopped"))) if on]
        blocking = ", ".join(flow["blocking_queues"] + ([f"* ({' + '.join(broker_wide)})"] if broker_wide else []))
    elif p.get("credit_state") == "waiting":  # (absent from brokers before it was shown)
        state, blocking = "waiting for credit", "-"
    else:
        state, blocking = ("running" if c["flow_control"] else "not paced"), "-"
    buffer = size_text(p["buffer_size"]) if c["flow_control"] else "-"
    return [
        c["id"], c["client_name"], c["peer"] or "-", c["role"], buffer, size_text(p["unacked_bytes"]),
        p["transfers_held"], state, blocking, consumer["subscriptions_total"], consumer["unsettled"],
        limit_text(consumer["buffer"]["size"], True),
    ]


def policy_text(answer: dict[str, Any]) -> str:
    settings = answer["policy"]
    pairs = [("policy", settings["policy"]), ("quota", size_text(settings["quota"]))]
    pairs += [(k, size_text(settings[k])) for k in ("static_size", "min_size", "max_size", "override_size")]
    pairs += [(k, f"{settings[k]} %") for k in settings if k.endswith("_percent")]
    if answer.get("producers_stopped"):
        pairs.append(("producers", "STOPPED (start-all releases them)"))
    granted, pool = answer["granted"], answer["pool"]
    pairs.append(("pool", f"{size_text(pool['bytes'])} (share {size_text(pool['share'])}, "
                          f"floor {size_text(pool['floor'])}, reserve {size_text(pool['reserve'])})"))
    pairs.append(("granted", f"{size_text(granted['total'])} to {len(granted['connections'])} connection(s): "
                             f"{granted['producers']} producer(s), {granted['waiting']} waiting, "
                             f"{granted['provisional']} provisional"))
    pairs.append(("committed", f"{size_text(answer['committed'])} (grants and older, larger windows)"))
    pairs.append(("promised", f"{size_text(answer['promised_outstanding'])} producers may still send"))
    for user in answer.get("users", []):
        if user["cap"] is not None:
            pairs.append((f"user {user['user']}", f"{size_text(user['used'])} of its cap {size_text(user['cap'])} "
                                                  f"({user['credit_share_percent']:g} % of the shareable pool), "
                                                  f"{user['connections']} connection(s)"))
    width = max(len(k) for k, _ in pairs)
    lines = [f"{k.ljust(width)}  {printable(v)}" for k, v in pairs]
    if granted["connections"]:
        rows = [[g["connection"], g["client_name"] or "-", g["state"], size_text(g["buffer_size"]),
                 size_text(g["window"])] for g in granted["connections"]]
        lines.extend("  " + line for line in table_text(["CONN", "CLIENT", "STATE", "BUFFER", "WINDOW"], rows).splitlines())
    return "\n".join(lines)
