"""The `flowbroker` command: run the daemon, and try it by hand.

`flowbroker serve` runs on embedded defaults; a TOML file (`--config`) and flags override them.
SIGINT and SIGTERM shut down cleanly: completions already due are sent and every connection is
closed with a reason.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from flowbroker.broker.logsafe import logsafe
from flowbroker.broker.config import DEFAULT_TOKEN_FILE, ConfigError, load_config

if TYPE_CHECKING:
    from flowbroker.broker.server import BrokerServer

# trio, the server and the SDK are imported by the commands that use them: the management
# commands only talk HTTP and should start fast.

__all__ = ["main", "parse_size"]


def parse_size(value: str) -> int:
    """Sizes on the command line: plain bytes or with a KiB/MiB/GiB (or K/M/G) suffix. ValueError if not."""
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * factor)
    return int(text)


class SizeParam(click.ParamType):  # type: ignore[type-arg]  # generic only in newer click stubs
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_size(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size (examples: 1048576, 512KiB, 10MiB, 2GiB)", param, ctx)
        assert size is not None
        return size


SIZE = SizeParam()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """flowbroker: a message broker whose producers are paced by credit."""
    level = logging.WARNING - 10 * min(verbose, 2) if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML configuration file (every key: docs/configuration.md).")
@click.option("--host", help="Address to listen on [default: 127.0.0.1].")
@click.option("--port", type=int, help="TCP port for clients [default: 5680].")
@click.option("--memory-quota", type=SIZE, help="Memory the credit policies share out, e.g. 2GiB [default: 1/4 of RAM].")
@click.option("--credit-policy", type=click.Choice(["none", "static", "dynamic", "aggressive"]),
              help="Producer credit policy [default: aggressive].")
@click.option("--idle-timeout", type=float, help="Seconds of silence before a peer is declared dead [default: 60].")
@click.option("--admin-host", help="Address of the management HTTP API [default: 127.0.0.1].")
@click.option("--admin-port", type=int, help="Port of the management HTTP API (0 = any free) [default: 5681].")
@click.option("--admin/--no-admin", "admin_enabled", default=None, help="Serve the management HTTP API [default: on].")
def serve(config_path: Path | None, host: str | None, port: int | None, memory_quota: int | None,
          credit_policy: str | None, idle_timeout: float | None, admin_host: str | None, admin_port: int | None,
          admin_enabled: bool | None) -> None:
    """Run the broker until SIGINT or SIGTERM."""
    overrides: dict[str, dict[str, Any]] = {
        "server": {"host": host, "port": port, "memory_quota": memory_quota, "idle_timeout": idle_timeout},
        "credit": {"policy": credit_policy},
        "admin": {"host": admin_host, "port": admin_port, "enabled": admin_enabled},
    }
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None
    import trio

    from flowbroker.broker.admin import AdminStartError

    try:
        trio.run(_serve, config)
    except Exception as exc:  # trio wraps what a nursery raised in exception groups
        admin_error = _find(exc, AdminStartError)
        if admin_error is not None:
            raise click.ClickException(str(admin_error)) from None
        os_error = _find(exc, OSError)
        if isinstance(os_error, OSError):
            raise click.ClickException(
                f"cannot listen on {config.server.host}:{config.server.port}: {os_error.strerror or os_error}"
            ) from None
        raise


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first `kind` in `exc` or, depth first, in the exception groups it is wrapped in."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find(inner, kind)
            if found is not None:
                return found
    return None


async def _serve(config: Any) -> None:
    import trio

    from flowbroker.broker.server import BrokerServer

    server = BrokerServer(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, server)
        port = await nursery.start(server.serve)
        print(f"flowbroker listening on {config.server.host}:{port}", file=sys.stderr, flush=True)
        if server.admin_port is not None:
            print(f"admin API on http://{config.admin.host}:{server.admin_port}", file=sys.stderr, flush=True)
        await server.shutdown_requested.wait()
    logging.getLogger("flowbroker").info("stopped")


async def _stop_on_signal(server: BrokerServer) -> None:
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logging.getLogger("flowbroker").info("received %s: shutting down", signal.Signals(signum).name)
            server.shutdown()
            return


@main.command()
@click.option("--url", default="flowbroker://127.0.0.1:5680", show_default=True, help="Broker to connect to.")
@click.option("--exchange", default="", show_default=True, help="Exchange ('' routes to the queue named by the key).")
@click.option("--routing-key", "-k", required=True, help="Routing key (the queue name on the default exchange).")
@click.option("--declare/--no-declare", default=True, show_default=True,
              help="Declare the queue named by the routing key first (default exchange only).")
@click.option("--count", "-n", type=int, default=1, show_default=True, help="How many copies of each message to send.")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds a send may wait for credit.")
@click.argument("messages", nargs=-1)
def publish(url: str, exchange: str, routing_key: str, declare: bool, count: int, timeout: float,
            messages: tuple[str, ...]) -> None:
    """Publish MESSAGES (or lines from stdin) and wait until the broker completed them all."""
    import trio

    import flowbroker.client as fb

    bodies = [m.encode() for m in messages] or [line.rstrip("\n").encode() for line in sys.stdin]

    async def run() -> int:
        async with await fb.connect(url, client_name="flowbroker-cli") as conn:
            if declare and exchange == "":
                await conn.declare_queue(routing_key)
            producer = conn.producer(exchange=exchange, routing_key=routing_key)
            with click.progressbar(length=len(bodies) * count, label="publishing", file=sys.stderr) as bar:
                for _ in range(count):
                    for body in bodies:
                        await producer.send(body, timeout=timeout)
                        bar.update(1)
            await producer.flush(timeout=timeout)
            return len(bodies) * count

    try:
        sent = trio.run(run)
    except Exception as exc:  # every SDK error is a FlowbrokerError; show it without a traceback
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    click.echo(f"published {sent} message(s)", err=True)


@main.command()
@click.option("--url", default="flowbroker://127.0.0.1:5680", show_default=True, help="Broker to connect to.")
@click.option("--count", "-n", type=int, default=0, help="Stop after this many messages (0: until interrupted).")
@click.option("--prefetch", type=int, default=100, show_default=True, help="Unsettled deliveries allowed.")
@click.option("--timeout", type=float, default=0.0, help="Stop after this many idle seconds (0: wait forever).")
@click.argument("queue")
def consume(url: str, count: int, prefetch: int, timeout: float, queue: str) -> None:
    """Print messages from QUEUE, one per line, acknowledging each after it is printed."""
    import trio

    import flowbroker.client as fb

    async def run() -> None:
        received = 0
        async with await fb.connect(url, client_name="flowbroker-cli") as conn:
            async with conn.consumer(queue, prefetch=prefetch) as consumer:
                while not count or received < count:
                    try:
                        msg = await consumer.receive(timeout=timeout or None)
                    except fb.ReceiveTimeout:
                        return
                    click.echo(msg.body.decode(errors="replace"))
                    await msg.ack()
                    received += 1

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


# -- management: the admin HTTP API (docs/management.md) -----------------------------------------

DEFAULT_ADMIN_URL = "http://127.0.0.1:5681"
TOKEN_ENV = "FLOWBROKER_ADMIN_TOKEN"
PAGE_SIZE = 1000
"""Objects asked for per request when listing: the admin API's maximum `limit`."""
THRESHOLD_OPTIONS = ("flow_stop_count", "flow_resume_count", "flow_stop_size", "flow_resume_size",
                     "max_count", "max_size", "overflow")
F = TypeVar("F", bound=Callable[..., Any])


class AdminClient:
    """The admin API over HTTP with the standard library; every failure is a ClickException.

    The token comes from `token_file` when one is given (--token-file, FLOWBROKER_ADMIN_TOKEN_FILE),
    else from FLOWBROKER_ADMIN_TOKEN, else from the file a broker without a configured token writes.
    Never from the command line, where `ps` shows it to every user of the host."""

    def __init__(self, url: str, token_file: str | None, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        from_env = os.environ.get(TOKEN_ENV, "").strip()
        if token_file is None and from_env:
            self.token, self.token_source = from_env, TOKEN_ENV
            return
        path = Path(token_file or DEFAULT_TOKEN_FILE).expanduser()
        try:
            self.token = path.read_text().strip()
        except OSError as exc:
            raise click.ClickException(
                f"no admin token: set {TOKEN_ENV} or pass --token-file, or run where the broker wrote "
                f"its generated token ({_printable(path)}: {exc.strerror or exc})"
            ) from None
        if not self.token:
            raise click.ClickException(f"no admin token: {_printable(path)} is empty")
        self.token_source = str(path)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json",
                     "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                raise click.ClickException(self._describe(exc.code, exc.read())) from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or exc.reason
            raise click.ClickException(
                f"cannot reach the admin API at {self.url}: {reason} (is the broker running with its admin API on?)"
            ) from None
        except (TimeoutError, OSError) as exc:
            raise click.ClickException(f"admin API at {self.url}: {exc}") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            raise click.ClickException(f"admin API at {self.url} answered something that is not JSON") from None
        if not isinstance(answer, dict):
            raise click.ClickException(f"admin API at {self.url} answered an unexpected {type(answer).__name__}")
        return answer

    def _describe(self, status: int, raw: bytes) -> str:
        try:
            error = json.loads(raw)["error"]
            message = f"{error['message']}"
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:200] or "no details"
        text = f"admin API: HTTP {status}: {_printable(message, backslash=False)}"
        if status in (401, 403):
            text += f" (token from {_printable(self.token_source)})"
        return text

    def pages(self, path: str, key: str, after: str | None, limit: int) -> Iterator[tuple[list[dict[str, Any]], Any]]:
        """Follow the API's cursor: (objects, next cursor) for each page of `path`'s list `key`,
        from after `after` (the start when None), until the end or `limit` objects (0: no limit).
        The last cursor is where a later `--after` would go on (None: nothing is left)."""
        cursor: Any = after
        remaining = limit
        while True:
            query: dict[str, Any] = {"limit": min(PAGE_SIZE, remaining) if limit else PAGE_SIZE}
            if cursor is not None:
                query["after"] = cursor
            answer = self.request("GET", f"{path}?{urllib.parse.urlencode(query)}")
            items, cursor = answer[key], answer.get("next")
            yield items, cursor
            remaining -= len(items)
            if cursor is None or (limit and remaining <= 0):
                return


def _refuse_token_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.UsageError(
            f"--token is no longer accepted: a token on the command line is visible to every user of the host "
            f"(ps, /proc). Put it in the environment ({TOKEN_ENV}) or in a file (--token-file)."
        )


def _admin_options(func: F) -> F:
    """--admin-url, --token-file and --json, shared by every management command (and the refused --token)."""
    for option in reversed((
        click.option("--admin-url", envvar="FLOWBROKER_ADMIN_URL", default=DEFAULT_ADMIN_URL, show_default=True,
                     show_envvar=True, help="The broker's admin API."),
        click.option("--token-file", envvar="FLOWBROKER_ADMIN_TOKEN_FILE", show_envvar=True,
                     help=f"File holding the admin token. Default: ${TOKEN_ENV} if set, else the file a broker "
                          f"without a configured token writes ({DEFAULT_TOKEN_FILE})."),
        click.option("--token", hidden=True, expose_value=False, callback=_refuse_token_flag),
        click.option("--json", "as_json", is_flag=True, help="Print the API's JSON answer (for scripts)."),
    )):
        func = option(func)
    return func


def _list_options(func: F) -> F:
    """--limit and --after for the commands that list (the API answers in pages; these follow them)."""
    func = click.option("--after", help="Start after this name (connections: id), e.g. a previous listing's `next`.")(func)
    func = click.option("--limit", type=click.IntRange(min=0), default=0,
                        help="Print at most this many (0: all, fetched page by page).")(func)
    return func


def _client(options: dict[str, Any]) -> tuple[AdminClient, bool]:
    return AdminClient(options["admin_url"], options["token_file"]), bool(options["as_json"])


def _printable(value: object, *, backslash: bool = True) -> str:
    """`value` as text a client or queue name cannot use to move the cursor, clear the screen or forge
    a line of a table (broker/logsafe.py); not cut. `backslash=False` for the broker's error texts,
    which already show names with repr()."""
    return logsafe(value, None, backslash=backslash)


def _print_json(answer: Any) -> None:
    click.echo(json.dumps(answer, indent=2, sort_keys=False))


def _size_text(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def _limit(n: int, size: bool = False) -> str:
    """A threshold: 0 means off."""
    if not n:
        return "-"
    return _size_text(n) if size else str(n)


def _seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    table = Table(headers)
    return "\n".join(table.lines(rows))


class Table:
    """An aligned table printed page by page: the header with the first page, and columns that only
    widen, so a long listing streams without holding it all. Every cell goes through _printable."""

    def __init__(self, headers: Sequence[str]):
        self.headers = list(headers)
        self.widths = [len(h) for h in headers]
        self.started = False

    def lines(self, rows: Sequence[Sequence[Any]]) -> list[str]:
        cells = [[_printable(c) for c in row] for row in rows]
        if not self.started:
            cells.insert(0, self.headers)
            self.started = True
        for row in cells:
            self.widths = [max(w, len(c)) for w, c in zip(self.widths, row)]
        return ["  ".join(c.ljust(w) for c, w in zip(row, self.widths)).rstrip() for row in cells]


def _stream_json(key: str, pages: Iterator[tuple[list[dict[str, Any]], Any]]) -> None:
    """The whole listing as one JSON document shaped like an API page, `{key: [...], "next": ...}`,
    written as the pages arrive (nothing before the first one: a refused request prints only the error)."""
    started, cursor = False, None
    for items, cursor in pages:
        for item in items:
            click.echo((",\n  " if started else f'{{"{key}": [\n  ') + json.dumps(item), nl=False)
            started = True
    click.echo(f'\n], "next": {json.dumps(cursor)}}}' if started else f'{{"{key}": [], "next": {json.dumps(cursor)}}}')


def _stream_table(headers: Sequence[str], pages: Iterator[tuple[list[dict[str, Any]], Any]],
                  row: Callable[[dict[str, Any]], list[Any]], empty: str) -> None:
    table = Table(headers)
    for items, _ in pages:
        if items:
            click.echo("\n".join(table.lines([row(item) for item in items])))
    if not table.started:
        click.echo(empty)


def _producers_text(q: dict[str, Any]) -> str:
    """A queue's flow-stopped producers as `id:client`, and how many more the API did not list."""
    producers = q["flow_stopped_producers"]
    text = ", ".join(f"{p['connection']}:{p['client_name']}" for p in producers) or "-"
    more = q["flow_stopped_producers_total"] - len(producers)
    return f"{text} (+{more} more)" if more > 0 else text


QUEUE_HEADERS = ["QUEUE", "MESSAGES", "BYTES", "STOP n/size", "RESUME n/size", "MAX n/size", "OVERFLOW",
                 "SATURATED", "HELD", "FLOW-STOPPED PRODUCERS"]


def _queue_row(q: dict[str, Any]) -> list[Any]:
    t = q["thresholds"]
    saturated = f"yes {_seconds_text(q['saturated_for_seconds'])}" if q["saturated"] else "no"
    return [
        q["name"], q["depth"]["count"], _size_text(q["depth"]["bytes"]),
        f"{_limit(t['flow_stop_count'])}/{_limit(t['flow_stop_size'], True)}",
        f"{_limit(t['flow_resume_count'])}/{_limit(t['flow_resume_size'], True)}",
        f"{_limit(t['max_count'])}/{_limit(t['max_size'], True)}", t["overflow"],
        saturated, q["held_transfers"], _producers_text(q),
    ]


def _queue_text(q: dict[str, Any]) -> str:
    t = q["thresholds"]
    c = q["counters"]
    if q["saturated"]:
        reason = q["stop_reason"]
        saturated = (f"yes, for {_seconds_text(q['saturated_for_seconds'])} "
                     f"({reason['threshold']}: {reason['value']} > {reason['limit']})")
    else:
        saturated = "no"
    lines = [
        ("queue", q["name"]),
        ("depth", f"{q['depth']['count']} messages, {_size_text(q['depth']['bytes'])} ({q['depth']['ready']} ready)"),
        ("flow stop", f"count {_limit(t['flow_stop_count'])}, size {_limit(t['flow_stop_size'], True)}"),
        ("flow resume", f"count {_limit(t['flow_resume_count'])}, size {_limit(t['flow_resume_size'], True)}"),
        ("max", f"count {_limit(t['max_count'])}, size {_limit(t['max_size'], True)}, overflow {t['overflow']}"),
        ("saturated", saturated),
        ("held transfers", str(q["held_transfers"])),
        ("flow-stopped", _producers_text(q)),
        ("counters", f"enqueued {c['enqueued']}, dequeued {c['dequeued']}, rejected {c['rejected']}, "
                     f"dropped {c['dropped']}, flow stops {c['flow_stopped_count']}, held {c['held_total']}"),
    ]
    width = max(len(k) for k, _ in lines)
    out = [f"{k.ljust(width)}  {_printable(v)}" for k, v in lines]
    if q["subscriptions"]:
        more = q["subscriptions_total"] - len(q["subscriptions"])
        out.append(f"subscriptions (the first {len(q['subscriptions'])} of {q['subscriptions_total']})"
                   if more > 0 else "subscriptions")
        rows = [[s["connection"], s["subscription"], s["client_name"], s["prefetch"], s["unsettled"], s["delivered"],
                 _limit(s["buffer"]["size"], True), _size_text(s["buffer"]["unacked"])] for s in q["subscriptions"]]
        table = _table(["CONN", "SUB", "CLIENT", "PREFETCH", "UNSETTLED", "DELIVERED", "BUFFER", "UNACKED"], rows)
        out.extend("  " + line for line in table.splitlines())
    else:
        out.append(f"{'subscriptions'.ljust(width)}  -")
    return "\n".join(out)


@main.command()
@_list_options
@_admin_options
def queues(limit: int, after: str | None, **options: Any) -> None:
    """List queues by name: depth, thresholds, saturation, held transfers, flow-stopped producers.
    Fetched and printed page by page (the API's cursor), so any number of queues streams."""
    client, as_json = _client(options)
    pages = client.pages("/api/queues", "queues", after, limit)
    if as_json:
        _stream_json("queues", pages)
    else:
        _stream_table(QUEUE_HEADERS, pages, _queue_row, "no queues")


@main.group()
def queue() -> None:
    """Show one queue, or change its thresholds while the broker runs."""


def _queue_path(name: str) -> str:
    return "/api/queues/" + urllib.parse.quote(name, safe="")


@queue.command("show")
@click.argument("name")
@_admin_options
def queue_show(name: str, **options: Any) -> None:
    """Everything about queue NAME, with its subscriptions and counters."""
    client, as_json = _client(options)
    answer = client.request("GET", _queue_path(name))
    _print_json(answer) if as_json else click.echo(_queue_text(answer))


@queue.command("set")
@click.argument("name")
@click.option("--flow-stop-size", type=SIZE, help="Saturate when the queue holds more bytes than this (0 = off).")
@click.option("--flow-resume-size", type=SIZE, help="Clear when under this many bytes (default: = stop).")
@click.option("--flow-stop-count", type=int, help="Saturate when the queue holds more messages than this (0 = off).")
@click.option("--flow-resume-count", type=int, help="Clear when under this many messages (default: = stop).")
@click.option("--max-size", type=SIZE, help="Hard limit in bytes (0 = unlimited).")
@click.option("--max-count", type=int, help="Hard limit in messages (0 = unlimited).")
@click.option("--overflow", type=click.Choice(["reject", "drop-head"]), help="What the hard limit does.")
@_admin_options
def queue_set(name: str, **options: Any) -> None:
    """Change NAME's thresholds now: a raised one releases held producers at once, a lowered one stops
    the next transfers. A stop given without its resume gets resume = stop."""
    changes = {k: options.pop(k) for k in THRESHOLD_OPTIONS}
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        raise click.UsageError("give at least one threshold, e.g. --flow-stop-size 10MiB")
    for key, value in changes.items():
        if isinstance(value, int) and value < 0:
            raise click.BadParameter(f"must be >= 0, got {value}", param_hint="--" + key.replace("_", "-"))
    client, as_json = _client(options)
    answer = client.request("PATCH", _queue_path(name), changes)
    _print_json(answer) if as_json else click.echo(_queue_text(answer))


CONNECTION_HEADERS = ["ID", "CLIENT", "PEER", "ROLE", "BUFFER", "UNACKED", "HELD", "FLOW", "BLOCKING",
                      "SUBS", "UNSETTLED", "CONSUMER-BUF"]


def _connection_row(c: dict[str, Any]) -> list[Any]:
    p, flow, consumer = c["producer"], c["flow"], c["consumer"]
    if flow["stopped"]:
        state = f"stopped {_seconds_text(flow['stopped_for_seconds'])}"
        blocking = ", ".join(flow["blocking_queues"] + (["* (stop-all)"] if flow["admin_stopped"] else []))
    else:
        state, blocking = ("running" if c["flow_control"] else "not paced"), "-"
    buffer = _size_text(p["buffer_size"]) if c["flow_control"] else "-"
    return [
        c["id"], c["client_name"], c["peer"] or "-", c["role"], buffer, _size_text(p["unacked_bytes"]),
        p["transfers_held"], state, blocking, consumer["subscriptions_total"], consumer["unsettled"],
        _limit(consumer["buffer"]["size"], True),
    ]


@main.command()
@_list_options
@_admin_options
def connections(limit: int, after: str | None, **options: Any) -> None:
    """List connections by id: role, producer buffer and unacked bytes, flow state, consumer buffers.
    Fetched and printed page by page."""
    client, as_json = _client(options)
    pages = client.pages("/api/connections", "connections", after, limit)
    if as_json:
        _stream_json("connections", pages)
    else:
        _stream_table(CONNECTION_HEADERS, pages, _connection_row, "no connections")


@main.command()
@_list_options
@_admin_options
def exchanges(limit: int, after: str | None, **options: Any) -> None:
    """List exchanges by name: kind, built-in or not, number of binding keys."""
    client, as_json = _client(options)
    pages = client.pages("/api/exchanges", "exchanges", after, limit)
    if as_json:
        _stream_json("exchanges", pages)
    else:
        _stream_table(["EXCHANGE", "KIND", "BUILTIN", "BINDING-KEYS"], pages,
                      lambda e: [e["name"], e["kind"], "yes" if e["builtin"] else "no", e["binding_keys"]],
                      "no exchanges")


@main.group()
def exchange() -> None:
    """Declare or delete an exchange."""


@exchange.command("declare")
@click.argument("name")
@click.option("--kind", type=click.Choice(["direct", "fanout", "topic"]), default="direct", show_default=True)
@click.option("--url", default="flowbroker://127.0.0.1:5680", show_default=True, help="Broker to connect to.")
def exchange_declare(name: str, kind: str, url: str) -> None:
    """Declare exchange NAME of KIND (over the broker protocol, as the SDK does); an existing one of the
    same kind is kept."""
    import trio

    import flowbroker.client as fb

    async def run() -> None:
        async with await fb.connect(url, client_name="flowbroker-cli") as conn:
            await conn.declare_exchange(name, kind)

    try:
        trio.run(run)
    except Exception as exc:  # every SDK error is a FlowbrokerError; show it without a traceback
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    click.echo(f"exchange {_printable(name)} ({kind}) declared")


@exchange.command("delete")
@click.argument("name")
@_admin_options
def exchange_delete(name: str, **options: Any) -> None:
    """Delete exchange NAME and its bindings; the queues bound to it stay. The built-in amq.* cannot be deleted."""
    client, as_json = _client(options)
    answer = client.request("DELETE", "/api/exchanges/" + urllib.parse.quote(name, safe=""))
    if as_json:
        _print_json(answer)
    else:
        click.echo(f"exchange {_printable(answer['exchange'])} deleted ({answer['bindings']} binding(s) removed)")


@main.group()
def producers() -> None:
    """Stop or start every flow-controlled producer at once."""


def _producers_command(action: str, done: str) -> Callable[..., None]:
    def command(**options: Any) -> None:
        client, as_json = _client(options)
        answer = client.request("POST", f"/api/producers/{action}")
        if as_json:
            _print_json(answer)
        else:
            click.echo(f"all producers {done} ({len(answer['connections'])} flow-controlled connection(s))")
    return command


producers.command("stop-all", help="Hold every new transfer of flow-controlled producers (they are told "
                  "they are flow-stopped on '*') until start-all.")(_admin_options(_producers_command("stop-all", "stopped")))
producers.command("start-all", help="Complete the held transfers and let every producer send again.")(
    _admin_options(_producers_command("start-all", "started")))


@main.group()
def policy() -> None:
    """Show or change the producer credit policy while the broker runs."""


def _policy_text(answer: dict[str, Any]) -> str:
    settings = answer["policy"]
    pairs = [("policy", settings["policy"]), ("quota", _size_text(settings["quota"]))]
    pairs += [(k, _size_text(settings[k])) for k in ("static_size", "min_size", "max_size", "override_size")]
    pairs += [(k, f"{settings[k]} %") for k in settings if k.endswith("_percent")]
    if answer.get("producers_stopped"):
        pairs.append(("producers", "STOPPED (start-all releases them)"))
    granted, pool = answer["granted"], answer["pool"]
    pairs.append(("pool", f"{_size_text(pool['bytes'])} (share {_size_text(pool['share'])}, "
                          f"floor {_size_text(pool['floor'])}, reserve {_size_text(pool['reserve'])})"))
    pairs.append(("granted", f"{_size_text(granted['total'])} to {len(granted['connections'])} connection(s): "
                             f"{granted['producers']} producer(s), {granted['waiting']} waiting, "
                             f"{granted['provisional']} provisional"))
    pairs.append(("committed", f"{_size_text(answer['committed'])} (grants and older, larger windows)"))
    pairs.append(("promised", f"{_size_text(answer['promised_outstanding'])} producers may still send"))
    width = max(len(k) for k, _ in pairs)
    lines = [f"{k.ljust(width)}  {_printable(v)}" for k, v in pairs]
    if granted["connections"]:
        rows = [[g["connection"], g["client_name"] or "-", g["state"], _size_text(g["buffer_size"]),
                 _size_text(g["window"])] for g in granted["connections"]]
        lines.extend("  " + line for line in _table(["CONN", "CLIENT", "STATE", "BUFFER", "WINDOW"], rows).splitlines())
    return "\n".join(lines)


@policy.command("show")
@_admin_options
def policy_show(**options: Any) -> None:
    """The credit policy in force and the buffers it grants now."""
    client, as_json = _client(options)
    answer = client.request("GET", "/api/policy")
    _print_json(answer) if as_json else click.echo(_policy_text(answer))


@policy.command("set")
@click.argument("name", required=False, type=click.Choice(["none", "static", "dynamic", "aggressive"]))
@click.option("--quota", type=SIZE, help="Memory the policies share out, e.g. 2GiB.")
@click.option("--static-size", type=SIZE, help="static: every producer's buffer.")
@click.option("--min-size", type=SIZE, help="dynamic/aggressive: smallest buffer.")
@click.option("--max-size", type=SIZE, help="dynamic/aggressive: largest buffer.")
@click.option("--override-size", type=SIZE, help="> 0: every producer gets exactly this (0 = off).")
@click.option("--dynamic-percent", type=float, help="dynamic: percent of the quota per connection.")
@click.option("--dynamic-threshold-percent", type=float, help="dynamic: above this share, new ones get min.")
@click.option("--aggressive-percent", type=float, help="aggressive: percent of the quota shared by all producers.")
@_admin_options
def policy_set(name: str | None, **options: Any) -> None:
    """Switch to policy NAME and/or change its settings; every live producer buffer is recomputed and
    pushed at once. Settings not given keep their current values."""
    keys = ("quota", "static_size", "min_size", "max_size", "override_size", "dynamic_percent",
            "dynamic_threshold_percent", "aggressive_percent")
    settings: dict[str, Any] = {k: options.pop(k) for k in keys}
    settings = {k: v for k, v in settings.items() if v is not None}
    if name is not None:
        settings["policy"] = name
    if not settings:
        raise click.UsageError("give a policy name and/or a setting, e.g. `policy set aggressive --quota 2GiB`")
    client, as_json = _client(options)
    answer = client.request("PUT", "/api/policy", settings)
    _print_json(answer) if as_json else click.echo(_policy_text(answer))
