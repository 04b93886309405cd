"""The `flowbroker` command: run the daemon, and try it by hand.

`flowbroker serve` runs on embedded defaults; a TOML file (`--config`) and flags override them.
SIGINT, SIGTERM and SIGHUP shut down cleanly: completions already due are sent and every connection is
closed with a reason.

This module holds the click commands only: the admin HTTP client is broker/adminclient.py, how its
answers are printed broker/cliformat.py, and publish's outcomes and exit codes broker/clioutcome.py.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import json
import logging
import os
import signal
import socket
import sys
import urllib.parse
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from flowbroker.broker.adminclient import DEFAULT_ADMIN_URL, TOKEN_ENV, AdminClient
from flowbroker.broker.cliformat import (
    CONNECTION_HEADERS,
    QUEUE_HEADERS,
    connection_row,
    policy_text,
    print_json,
    printable,
    queue_row,
    queue_text,
    stream_json,
    stream_table,
)
from flowbroker.broker.clioutcome import EXIT_COMPLETED, EXIT_ERROR, PublishOutcome, message_json
from flowbroker.broker.config import DEFAULT_TOKEN_FILE, ConfigError, load_config, parse_size
from flowbroker.policies.credit import CreditPolicy
from flowbroker.protocol.names import EXCHANGE_DIRECT, EXCHANGE_KINDS, OVERFLOW_POLICIES, QUEUE_ARGUMENTS

if TYPE_CHECKING:
    from flowbroker.broker.server import BrokerServer

# trio, the server and the SDK are imported by the commands that use them: the management
# commands only talk HTTP and should start fast.

__all__ = ["main", "parse_size"]

F = TypeVar("F", bound=Callable[..., Any])


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


def parse_duration(text: str) -> float:
    """Seconds from "0.5", "0.5s", "500ms" or "2m" (the time thresholds); ValueError otherwise."""
    text = text.strip().lower()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0)):
        if text.endswith(suffix):
            text, unit = text[: -len(suffix)], scale
            break
    else:
        unit = 1.0
    seconds = float(text) * unit
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(text)
    return seconds


class DurationParam(click.ParamType):  # type: ignore[type-arg]
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_duration(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a duration (examples: 0.5s, 500ms, 2, 1m; 0 = off)", param, ctx)


DURATION = DurationParam()


BROKER_URL_ENV = "FLOWBROKER_URL"
DEFAULT_BROKER_URL = "flowbroker://127.0.0.1:5680"


def _log_level(verbose: int, quiet: int) -> int:
    """INFO by default; each -v one level more (DEBUG), each -q one less (WARNING, then ERROR)."""
    return min(max(logging.INFO - 10 * verbose + 10 * quiet, logging.DEBUG), logging.ERROR)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flowbroker", prog_name="flowbroker", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True,
              help="More logging: -v also logs at DEBUG (every connection opened and closed).")
@click.option("-q", "--quiet", count=True, help="Less logging: -q warnings and errors only, -qq errors only.")
def main(verbose: int, quiet: int) -> None:
    """flowbroker: a message broker whose producers are paced by credit.

    Logs go to stderr at INFO unless -v or -q say otherwise."""
    logging.basicConfig(level=_log_level(verbose, quiet), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


USER_ENV, PASSWORD_ENV = "FLOWBROKER_USER", "FLOWBROKER_PASSWORD"


def _broker_auth() -> tuple[str, str] | None:
    """The broker credentials of publish, consume and exchange declare: FLOWBROKER_USER and
    FLOWBROKER_PASSWORD (environment, never flags, which `ps` shows), as SCRAM-SHA-256; without
    FLOWBROKER_USER, none (the broker's loopback user, on its own host; docs/security.md)."""
    user = os.environ.get(USER_ENV)
    if not user:
        return None
    password = os.environ.get(PASSWORD_ENV, "")
    if not password:  # an empty password would only count as one more failed login at the broker
        raise click.ClickException(f"{USER_ENV} is set ({printable(user)!r}) but {PASSWORD_ENV} is not: set both, "
                                   f"or unset {USER_ENV} to connect as the loopback user")
    return user, password


def _url_option(func: F) -> F:
    """--url of the broker port (the SDK's protocol), from FLOWBROKER_URL when not given."""
    return click.option("--url", envvar=BROKER_URL_ENV, default=DEFAULT_BROKER_URL, show_default=True,
                        show_envvar=True, help="Broker to connect to (its protocol port, not the admin API).")(func)


# Allocations between two collections of the youngest generation (CPython's default: 700). Every
# message in flight is a few container objects, so at 100,000 msgs/s the default collected about 400
# times a second, each pass walking what the queues hold; at 50,000 a collection frees the few cycles
# that form (exception tracebacks, closed connections) a few times a second. The gain is largest when
# queues are deep (docs/performance.md, "The garbage collector").
GC_GENERATION0_THRESHOLD = 50_000
# The middle generation collected every third youngest collection instead of every eleventh, so a pass of
# it walks at most about 150,000 survivors, not 550,000: with 600,000 messages arriving, its worst pass
# went from 143-161 ms to 45-53 ms (a tester saw 90-150 ms stalls of every connection), the collector's
# total time the same or less. The oldest generation is looked at every 51st middle collection (153
# youngest ones, as often as CPython's 10 x 11 = 110 did), and still only once the heap grew by a quarter.
GC_GENERATION1_THRESHOLD = 2
GC_GENERATION2_THRESHOLD = 50


def _tune_garbage_collector() -> None:
    """The broker process's own setting, not the SDK's: an application embedding the SDK or a
    BrokerServer keeps its own. What start-up allocated (modules, config) is moved out of the collector's
    sight with gc.freeze(), so the older generations' passes walk only what the broker made since."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GENERATION0_THRESHOLD, GC_GENERATION1_THRESHOLD, GC_GENERATION2_THRESHOLD)


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML configuration file (every key: docs/configuration.md).")
@click.option("--host", help="Address to listen on [default: 127.0.0.1].")
@click.option("--port", type=int, help="TCP port for clients, 0 = any free port [default: 5680].")
@click.option("--memory-quota", type=SIZE, help="Memory the credit policies share out, e.g. 2GiB [default: 1/4 of RAM].")
@click.option("--credit-policy", type=click.Choice([p.value for p in CreditPolicy]),
              help="Producer credit policy [default: aggressive].")
@click.option("--idle-timeout", type=float, help="Seconds of silence before a peer is declared dead [default: 60].")
@click.option("--admin-host", help="Address of the management HTTP API [default: 127.0.0.1].")
@click.option("--admin-port", type=int, help="Port of the management HTTP API (0 = any free) [default: 5681].")
@click.option("--admin/--no-admin", "admin_enabled", default=None, help="Serve the management HTTP API [default: on].")
@click.option("--udp-endpoint", metavar="HOST:PORT",
              help="UDP endpoint of the Aeron data path (port 0 = any free) [default: 127.0.0.1:5682].")
@click.option("--udp/--no-udp", "udp_enabled", default=None, help="Serve the UDP data path [default: on].")
@click.option("--metrics-endpoint", metavar="HOST:PORT",
              help="Serve GET /metrics on a port of its own (port 0 = any free) [default: on the admin port].")
@click.option("--metrics/--no-metrics", "metrics_enabled", default=None,
              help="Serve GET /metrics for Prometheus [default: on].")
@click.option("--pace-producers/--no-pace-producers", "pace_producers", default=None,
              help="Hold back the completions of a producer whose queue is behind its consumers "
                   "(docs/policies.md, \"Pacing\") [default: off].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where durable queues are journalled [default: $XDG_STATE_HOME/flowbroker, else "
                   "~/.local/state/flowbroker].")
@click.option("--port-file", type=click.Path(dir_okay=False, path_type=Path),
              help='Once listening, write {"port": N, "admin_port": M or null, "udp_port": U or null, '
                   '"metrics_port": P or null, "tls_port": T or null} to this file as JSON (for scripts that start it '
                   "with --port 0 / --admin-port 0 / --udp-endpoint 127.0.0.1:0 / [tls] port = 0); removed when the "
                   "broker stops.")
def serve(config_path: Path | None, host: str | None, port: int | None, memory_quota: int | None,
          credit_policy: str | None, idle_timeout: float | None, admin_host: str | None, admin_port: int | None,
          admin_enabled: bool | None, udp_endpoint: str | None, udp_enabled: bool | None,
          metrics_endpoint: str | None, metrics_enabled: bool | None, pace_producers: bool | None,
          data_dir: Path | None, port_file: Path | None) -> None:
    """Run the broker until SIGINT, SIGTERM or SIGHUP. It logs where it listens, and where its admin API and the
    admin token are."""
    overrides: dict[str, dict[str, Any]] = {
        "server": {"host": host, "port": port, "memory_quota": memory_quota, "idle_timeout": idle_timeout},
        "credit": {"policy": credit_policy},
        "queues": {"pace_producers": pace_producers},
        "admin": {"host": admin_host, "port": admin_port, "enabled": admin_enabled},
        "udp": {"endpoint": udp_endpoint, "enabled": udp_enabled},
        "metrics": {"endpoint": metrics_endpoint, "enabled": metrics_enabled},
        "storage": {"data_dir": str(data_dir) if data_dir is not None else None},
    }
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None
    import trio

    from flowbroker.broker.admin import AdminStartError
    from flowbroker.broker.listen_hints import listen_hint
    from flowbroker.broker.journalshell import StorageStartError
    from flowbroker.broker.server import TlsStartError, UdpStartError

    _tune_garbage_collector()
    try:
        trio.run(_serve, config, port_file)
    except Exception as exc:  # trio wraps what a nursery raised in exception groups
        start_error = (_find(exc, AdminStartError) or _find(exc, PortFileError) or _find(exc, UdpStartError)
                       or _find(exc, TlsStartError) or _find(exc, StorageStartError))
        if start_error is not None:
            raise click.ClickException(str(start_error)) from None
        config_error = _find(exc, ConfigError)  # found only once the broker runs: a [tls] file it cannot load
        if config_error is not None:
            raise click.ClickException(f"configuration error: {config_error}") from None
        os_error = _find(exc, OSError)
        if isinstance(os_error, OSError):
            hint = listen_hint(os_error, config.server.host, "--host or [server] host", "--port or [server] port")
            raise click.ClickException(
                f"cannot listen on {config.server.host}:{config.server.port}: {os_error.strerror or os_error} ({hint})"
            ) from None
        raise


CLI_CONNECT_SECONDS = 35.0
"""The longest `publish` and `consume` wait to connect: past a login the broker delays for its address's
failures (its turn is at most 30 s away, docs/security.md), so that the SDK's hint, "a longer timeout
waits for the turn", holds for them too (they connected within 10 s at most, a tester)."""


def _connect_timeout(timeout: float) -> float:
    """`--timeout` as the connect's deadline: at least 1 s, at most CLI_CONNECT_SECONDS."""
    return min(CLI_CONNECT_SECONDS, max(timeout, 1.0))


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


class PortFileError(Exception):
    """--port-file cannot be written; the broker stops."""


def _write_port_file(path: Path, port: int, admin_port: int | None, udp_port: int | None = None,
                     metrics_port: int | None = None, tls_port: int | None = None) -> None:
    """{"port": ..., "admin_port": ..., "udp_port": ..., "metrics_port": ..., "tls_port": ...} to `path`,
    atomically: a script polling for it never reads half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    ports = {"port": port, "admin_port": admin_port, "udp_port": udp_port, "metrics_port": metrics_port,
             "tls_port": tls_port}
    try:
        tmp.write_text(json.dumps(ports) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PortFileError(f"--port-file {path}: cannot be written: {exc.strerror or exc}") from None


async def _serve(config: Any, port_file: Path | None = None) -> None:
    import trio

    from flowbroker.broker.server import BrokerServer

    server = BrokerServer(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, server)
        # The server logs where it listens, and the admin API where it is and where its token is (once
        # each: printing them here too doubled them).
        port = await nursery.start(server.serve)
        if port_file is not None:
            _write_port_file(port_file, port, server.admin_port, server.udp_port, server.metrics_port,
                             server.tls_port)
        try:
            await server.shutdown_requested.wait()
        finally:
            if port_file is not None:
                port_file.unlink(missing_ok=True)
    logging.getLogger("flowbroker").info("stopped")


async def _stop_on_signal(server: BrokerServer) -> None:
    import trio

    # SIGHUP too: a broker run in a terminal that closes stops as cleanly as one told to (it does not
    # reload its configuration: restart it for that).
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            logging.getLogger("flowbroker").info("received %s: shutting down", signal.Signals(signum).name)
            server.shutdown()
            return


async def _stdin_lines() -> AsyncGenerator[bytes, None]:
    """Standard input's lines without their newline, read as they come (a worker thread reads what is
    there, up to 64 KiB at a time, so neither a pipe's bulk nor a terminal's one line waits for more)."""
    import trio

    stdin = sys.stdin
    if stdin is None:  # closed (a cron job's `<&-`): no lines
        return
    try:
        fd = stdin.fileno()
    except (AttributeError, OSError, ValueError):  # a text stream without a descriptor below it (a test's)
        for line in stdin:
            yield line.rstrip("\n").encode()
        return
    # os.read on the descriptor, not the buffered reader's read1: a worker thread left blocked in that held
    # its lock when Ctrl-C ended the interpreter, which aborted (SIGABRT, "could not acquire lock for
    # <stdin> at interpreter shutdown"; a tester, 3 of 21 runs)
    pending = bytearray()  # the line being read (appended to: a long line is not copied at every read)
    while True:
        chunk = await trio.to_thread.run_sync(os.read, fd, 65536, abandon_on_cancel=True)
        if not chunk:
            break
        pending += chunk
        if b"\n" in chunk:
            *lines, tail = bytes(pending).split(b"\n")
            pending = bytearray(tail)
            for line in lines:  # a CRLF line without its CR, as text mode read it (a tester)
                yield line[:-1] if line.endswith(b"\r") else line
    if pending:
        yield bytes(pending)


def _interrupted_early(exit_code: int, line: str | None) -> Callable[[F], F]:
    """A Ctrl-C that lands before the command's own handling of it (while it imports or connects): its
    documented exit status and line, not click's bare "Aborted!" and 1 (a tester: consume exited 1,
    publish printed no counts)."""

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except KeyboardInterrupt:
                if line is not None:
                    click.echo(line, err=True)
                sys.exit(exit_code)
        return wrapped  # type: ignore[return-value]
    return wrap


@main.command()
@_url_option
@click.option("--exchange", default="", show_default=True, help="Exchange ('' routes to the queue named by the key).")
@click.option("--routing-key", "-k", required=True, help="Routing key (the queue name on the default exchange).")
@click.option("--declare/--no-declare", default=True, show_default=True,
              help="Declare the queue named by the routing key first (default exchange only).")
@click.option("--count", "-n", type=click.IntRange(min=1), default=1, show_default=True,
              help="How many copies of each message to send.")
@click.option("--timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds a send may wait for credit, and then the whole batch for its completions (and "
                   "connecting: at least 1, at most 35).")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON document on stdout.")
@click.argument("messages", nargs=-1)
@_interrupted_early(EXIT_ERROR, "Error: interrupted (Ctrl-C) before anything was sent: 0 of the message(s) sent")
def publish(url: str, exchange: str, routing_key: str, declare: bool, count: int, timeout: float, as_json: bool,
            messages: tuple[str, ...]) -> None:
    """Publish MESSAGES (or lines from stdin) and wait until the broker completed them all.

    Exit status: 0 every message completed; 1 an error (refused, not sent, connection lost); 3 every
    message sent, but not all completed by the deadline: the broker holds their completion during a flow
    stop (a saturated queue; on `*`, a broker-wide stop: `producers stop-all` or the memory alarm), they
    are enqueued and will be delivered, so publishing them again would duplicate them."""
    import trio

    import flowbroker.client as fb

    auth = _broker_auth()
    # The outcome alone, as a line or as JSON: the SDK's own warnings (a block ended with messages in flight)
    # said the same beside it on stderr (testers: with --json, and at a Ctrl-C), unless -v asks for them.
    if as_json or not click.get_current_context().find_root().params.get("verbose"):
        logging.getLogger("flowbroker.client").setLevel(logging.ERROR)
    # Lines from stdin are sent as they are read, when each is sent once: `yes | flowbroker publish` held
    # every line in memory before sending any (a tester). Copies (-n) of a stream are sent after it is read.
    streaming = not messages and count == 1
    if not messages and sys.stdin is not None and sys.stdin.isatty() and not as_json:
        click.echo("reading messages from standard input, one per line; end with Ctrl-D", err=True)
    bodies = ([m.encode() for m in messages] if messages else
              [] if streaming or sys.stdin is None else [line.rstrip("\n").encode() for line in sys.stdin])
    outcome = PublishOutcome(requested=len(bodies) * count)
    declare_refused: list[str] = []  # why its own declare of the queue was refused (said beside a NotFound)

    async def run() -> None:
        # The connection within the same deadline (_connect_timeout), and no second wait at the end: what
        # flush() did not see completed is reported, not waited for again (close_timeout).
        async with await fb.connect(url, client_name="flowbroker-cli", auth=auth, timeout=_connect_timeout(timeout),
                                    close_timeout=0.5) as conn:
            if declare and exchange == "":
                try:
                    await conn.declare_queue(routing_key)
                except fb.RequestError as exc:
                    # A user who may write the queue but not configure it publishes to it as it is (if it
                    # does not exist, the message is refused NotFound): publish failed for such a user,
                    # naming its own declare (a tester).
                    if exc.code is not fb.ErrorCode.UNAUTHORIZED:
                        raise
                    declare_refused.append(str(exc))
            # mandatory: a message the exchange routes to no queue is a refusal (Unroutable), not "published"
            producer = conn.producer(exchange=exchange, routing_key=routing_key, mandatory=True)
            try:
                # The bar only on a terminal: piped, it would print just its label among the outcome's lines;
                # with --json the JSON is all that is printed.
                bar = (click.progressbar(length=outcome.requested, label="publishing", file=sys.stderr)
                       if sys.stderr is not None and sys.stderr.isatty() and not as_json and not streaming else None)
                with bar if bar is not None else contextlib.nullcontext():
                    for _ in range(count):
                        for body in bodies:
                            await producer.send(body, timeout=timeout)
                            if bar is not None:
                                bar.update(1)
                if streaming:
                    # (closed at once when it stops early: not left to the garbage collector)
                    async with contextlib.aclosing(_stdin_lines()) as lines:
                        async for body in lines:
                            outcome.requested += 1
                            # A refusal comes a round trip after its send, mostly while the next line is
                            # read: that line is not sent (counted as not sent). Checked only after the next
                            # send, it was sent and refused too (a tester: lines a second apart to a missing
                            # exchange).
                            if producer.statistics().failed:
                                break
                            await producer.send(body, timeout=timeout)
                            if producer.statistics().failed:  # refused (a queue deleted, say): stop reading
                                # (it read on: `yes | publish` to a missing queue ran for ever, every line
                                # refused and dropped, nothing printed; a tester)
                                break
                await producer.flush(timeout=timeout)
            except fb.FlowControlTimeout as exc:
                outcome.timeout, outcome.flow_stopped = exc.timeout, list(exc.destinations)
            finally:
                stats = producer.stats
                # the SDK counts a refused message as completed (and failed)
                outcome.sent, outcome.completed, outcome.failed = stats.sent, stats.completed - stats.failed, stats.failed
                if not outcome.flow_stopped and stats.completed < stats.sent:  # (interrupted: what held them)
                    outcome.flow_stopped = sorted(conn.flow_state.destinations)

    try:
        trio.run(run)
    except KeyboardInterrupt:  # Ctrl-C: what was sent is said, not only click's "Aborted!" (a tester)
        outcome.error = "interrupted (Ctrl-C): the counts say what was sent and completed before it"
    except Exception as exc:  # every SDK error is a FlowbrokerError; show it without a traceback
        # Closing may report the transfers a flow stop still holds: the outcome already says so.
        if outcome.timeout is None or isinstance(exc, fb.PublishError):
            outcome.error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, fb.NotFound) and declare_refused:  # (it said only "no queue named", a tester)
                outcome.error += f" (its declare was refused: {declare_refused[0]})"
    if as_json:  # the JSON alone (it has the outcome, the counts and the error): no text beside it on stderr
        click.echo(outcome.as_json())
    elif outcome.exit_code == EXIT_COMPLETED:
        click.echo(outcome.text(), err=True)
    else:
        click.echo(("Error: " if outcome.exit_code == EXIT_ERROR else "Not completed: ") + outcome.text(), err=True)
    if outcome.exit_code != EXIT_COMPLETED:
        sys.exit(outcome.exit_code)


N_WINDOW = 500
"""`consume -n N`: the most messages it leaves unacknowledged, so the most the broker delivers ahead."""


@main.command()
@_url_option
@click.option("--count", "-n", type=click.IntRange(min=0), default=0,
              help="Stop after this many messages (0: until interrupted).")
@click.option("--prefetch", type=click.IntRange(min=1), default=100, show_default=True,
              help="Unsettled deliveries allowed (with --count: at most it, and at most 500).")
@click.option("--timeout", type=click.FloatRange(min=0), default=0.0,
              help="Stop after this many idle seconds (0: wait forever).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per message and line: body (or body_base64), headers, exchange, routing_key, "
                   "redelivered.")
@click.argument("queue")
@_interrupted_early(0, None)  # (as a Ctrl-C later: it stops on its own terms, nothing printed unacknowledged)
def consume(url: str, count: int, prefetch: int, timeout: float, as_json: bool, queue: str) -> None:
    """Print messages from QUEUE, one per line, acknowledging each after it is printed."""
    import trio

    import flowbroker.client as fb

    auth = _broker_auth()
    stdout = sys.stdout
    # One line on an error, as publish's: the SDK's warning of the broker's ERROR (a queue deleted under
    # it) said the same beside the Error line (a tester), unless -v asks for it.
    if not click.get_current_context().find_root().params.get("verbose"):
        logging.getLogger("flowbroker.client").setLevel(logging.ERROR)

    @trio.lowlevel.enable_ki_protection
    def show(line: str, msg: Any, shown: list[Any]) -> None:
        """Print one message's line and note it printed, with Ctrl-C held off (trio raises it at the next
        await instead): raised inside the write, the line could be in the output buffer, printed at exit,
        and its message never acknowledged, so it came back redelivered (`consume | slow-reader` stopped by
        Ctrl-C, a tester); between the write and the note, the same."""
        stdout.write(line + "\n")
        stdout.flush()
        shown[0] = msg

    async def run() -> None:
        received = 0
        # -n N takes no more than N: each acknowledgement lets the broker deliver one more, so the last
        # `window` messages are acknowledged together once the N-th is printed (or at any earlier exit),
        # the CANCEL with them. Acknowledged one by one, up to `window` more were delivered and given back
        # at the close, and came back flagged redelivered though nothing had seen them (a tester: 50 with
        # -n 50). At most N_WINDOW: the broker handles that final SETTLE, its refill and the CANCEL within
        # one turn of its reader; 2,000 and more took longer, and the refill was written before the CANCEL
        # came (another tester).
        window = min(prefetch, count, N_WINDOW) if count else prefetch
        printed: list[Any] = []  # printed, acknowledged at the end
        shown: list[Any] = [None]  # the message whose line was written last, until it is acknowledged
        async with await fb.connect(url, client_name="flowbroker-cli", auth=auth,
                                    timeout=_connect_timeout(timeout or CLI_CONNECT_SECONDS)) as conn:
            async with conn.consumer(queue, prefetch=window) as consumer:
                await consumer.subscribe()
                # the prefetch in force: the broker lowers it to its max_prefetch (with -n 12000 and its
                # 10,000, acknowledging nothing before the 10,001st waited for ever, a tester)
                window = min(window, consumer.prefetch_in_force or window)
                ack_from = count - window if count else None
                try:
                    while not count or received < count:
                        try:
                            msg = await consumer.receive(timeout=timeout or None)
                        except fb.ReceiveTimeout:
                            return
                        # escaped as the tables are: a body cannot drive the terminal or forge a line
                        line = (message_json(msg.body, msg.headers, msg.exchange, msg.routing_key, msg.redelivered)
                                if as_json else printable(msg.body.decode(errors="replace"), backslash=False))
                        show(line, msg, shown)
                        received += 1
                        if ack_from is not None and received > ack_from:
                            printed.append(msg)
                        else:
                            await msg.ack()
                        shown[0] = None
                finally:
                    # Ctrl-C too: what was printed is acknowledged. Without yielding, so the SETTLE goes out
                    # with the CANCEL that leaving the consumer sends: a message the acknowledgement lets the
                    # broker deliver meanwhile is dropped unsent by the CANCEL, and not flagged redelivered.
                    last = shown[0]
                    for msg in printed if last is None or last in printed else [*printed, last]:
                        if msg.settled is not None:
                            continue
                        try:
                            msg.settle_nowait(fb.Outcome.ACK)
                        except fb.FlowbrokerError:  # the connection is gone: the error that ended it is told
                            break

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # The reader went away (`consume Q | head -3`): the line that failed is not acknowledged, but those
        # written before it were, and may have waited unread in the pipe. Said in a line, not as a bare
        # "BrokenPipeError" (a tester); stdout pointed at /dev/null, so the exit's own flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise click.ClickException(
            "the output was closed (broken pipe): the messages written before it were acknowledged, and its "
            "reader may not have read the last of them; to take exactly N messages use -n N") from None
    except Exception as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


# -- management: the admin HTTP API (docs/management.md) -----------------------------------------

THRESHOLD_OPTIONS = QUEUE_ARGUMENTS


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
                          f"without a configured token writes ({DEFAULT_TOKEN_FILE}, {{port}} the --admin-url's port)."),
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



@main.command()
@_list_options
@click.option("--saturated", is_flag=True, help="Only the saturated queues (over a stop threshold).")
@_admin_options
def queues(limit: int, after: str | None, saturated: bool, **options: Any) -> None:
    """List queues by name: depth, thresholds, saturation, held transfers, flow-stopped producers.
    Fetched and printed page by page (the API's cursor), so any number of queues streams."""
    client, as_json = _client(options)
    pages = client.pages("/api/queues", "queues", after, limit, {"saturated": "true"} if saturated else None)
    if as_json:
        stream_json("queues", pages)
    else:
        stream_table(QUEUE_HEADERS, pages, queue_row, "no saturated queues" if saturated else "no queues")


@main.group()
def queue() -> None:
    """Show, change, purge or delete one queue while the broker runs."""


def _queue_path(name: str) -> str:
    return "/api/queues/" + urllib.parse.quote(name, safe="")


@queue.command("show")
@click.argument("name")
@_admin_options
def queue_show(name: str, **options: Any) -> None:
    """Everything about queue NAME, with its subscriptions and counters."""
    client, as_json = _client(options)
    answer = client.request("GET", _queue_path(name))
    print_json(answer) if as_json else click.echo(queue_text(answer))


@queue.command("set")
@click.argument("name")
@click.option("--flow-stop-size", type=SIZE, help="Saturate when the queue holds more bytes than this (0 = off).")
@click.option("--flow-resume-size", type=SIZE,
              help="Clear when under this many bytes (default: the queue's resume/stop ratio kept).")
@click.option("--flow-stop-count", type=int, help="Saturate when the queue holds more messages than this (0 = off).")
@click.option("--flow-resume-count", type=int,
              help="Clear when under this many messages (default: the queue's resume/stop ratio kept).")
@click.option("--flow-stop-drain-time", type=DURATION,
              help="Saturate when the ready backlog would take longer than this to drain at the consumers' "
                   "measured rate, e.g. 0.5s (0 = off; docs/policies.md).")
@click.option("--flow-resume-drain-time", type=DURATION,
              help="Clear when the drain time is under this (default: the queue's resume/stop ratio kept).")
@click.option("--flow-stop-age", type=DURATION,
              help="Saturate when the oldest ready message is older than this, e.g. 2s (0 = off).")
@click.option("--flow-resume-age", type=DURATION,
              help="Clear when the oldest ready message is younger than this (default: the ratio kept).")
@click.option("--max-size", type=SIZE, help="Hard limit in bytes (0 = unlimited).")
@click.option("--max-count", type=int, help="Hard limit in messages (0 = unlimited).")
@click.option("--overflow", type=click.Choice(OVERFLOW_POLICIES), help="What the hard limit does.")
@_admin_options
def queue_set(name: str, **options: Any) -> None:
    """Change NAME's thresholds now: a raised one releases held producers at once, a lowered one stops
    the next transfers. A stop given without its resume keeps the queue's resume/stop ratio (its
    hysteresis); a resume above its stop is refused."""
    changes = {k: options.pop(k) for k in THRESHOLD_OPTIONS}
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        raise click.UsageError("give at least one threshold, e.g. --flow-stop-size 10MiB")
    for key, value in changes.items():
        if isinstance(value, int) and value < 0:
            raise click.BadParameter(f"must be >= 0, got {value}", param_hint="--" + key.replace("_", "-"))
    client, as_json = _client(options)
    answer = client.request("PATCH", _queue_path(name), changes)
    print_json(answer) if as_json else click.echo(queue_text(answer))



@queue.command("delete")
@click.argument("name")
@_admin_options
def queue_delete(name: str, **options: Any) -> None:
    """Delete queue NAME with its messages and bindings; its consumers get NOT_FOUND."""
    client, as_json = _client(options)
    answer = client.request("DELETE", _queue_path(name))
    if as_json:
        print_json(answer)
    else:
        click.echo(f"queue {printable(answer['queue'])} deleted ({answer['deleted']} message(s) dropped)")


@queue.command("purge")
@click.argument("name")
@_admin_options
def queue_purge(name: str, **options: Any) -> None:
    """Drop every ready message of queue NAME; deliveries not yet settled stay with their consumers."""
    client, as_json = _client(options)
    answer = client.request("POST", _queue_path(name) + "/purge")
    if as_json:
        print_json(answer)
    else:
        click.echo(f"queue {printable(answer['queue'])} purged ({answer['purged']} message(s) dropped)")


@main.command()
@_list_options
@_admin_options
def connections(limit: int, after: str | None, **options: Any) -> None:
    """List connections by id: role, producer buffer and unacked bytes, flow state, consumer buffers.
    Fetched and printed page by page."""
    client, as_json = _client(options)
    pages = client.pages("/api/connections", "connections", after, limit)
    if as_json:
        stream_json("connections", pages)
    else:
        stream_table(CONNECTION_HEADERS, pages, connection_row, "no connections")


@main.group()
def connection() -> None:
    """One connection: close it."""


@connection.command("close")
@click.argument("conn_id", metavar="ID", type=click.IntRange(min=1))
@click.option("--reason", default="", help="Said to the client in its ERROR and CLOSE, and logged.")
@_admin_options
def connection_close(conn_id: int, reason: str, **options: Any) -> None:
    """Close connection ID (as `connections` lists it): the client gets ERROR + CLOSE CONNECTION_FORCED
    within a second; its unsettled deliveries are requeued and its credit goes back to the pool."""
    from urllib.parse import quote

    client, as_json = _client(options)
    query = f"?reason={quote(reason)}" if reason else ""
    answer = client.request("DELETE", f"/api/connections/{conn_id}{query}")
    if as_json:
        print_json(answer)
    else:
        click.echo(f"connection {answer['connection']} closed")


@main.command()
@_list_options
@_admin_options
def exchanges(limit: int, after: str | None, **options: Any) -> None:
    """List exchanges by name: kind, built-in or not, number of binding keys."""
    client, as_json = _client(options)
    pages = client.pages("/api/exchanges", "exchanges", after, limit)
    if as_json:
        stream_json("exchanges", pages)
    else:
        stream_table(["EXCHANGE", "KIND", "BUILTIN", "BINDING-KEYS"], pages,
                      lambda e: [e["name"], e["kind"], "yes" if e["builtin"] else "no", e["binding_keys"]],
                      "no exchanges")


@main.command()
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--count", "-n", type=click.IntRange(min=0), default=0,
              help="Refresh this many times, then exit (0: until Ctrl-C).")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Queues shown: saturated first, then the deepest.")
@_admin_options
def top(interval: float, count: int, limit: int, **options: Any) -> None:
    """A live view of queues and flow state, refreshed every second: the saturated and deepest queues
    against their stop/resume watermarks, and every flow-stopped producer with what stops it and since
    when. --json prints one JSON document per refresh, one per line."""
    from flowbroker.broker.clitop import run_top

    client, as_json = _client(options)
    run_top(client, interval=interval, count=count, limit=limit, as_json=as_json)


@main.group()
def exchange() -> None:
    """Declare or delete an exchange."""


@exchange.command("declare")
@click.argument("name")
@click.option("--kind", type=click.Choice(EXCHANGE_KINDS), default=EXCHANGE_DIRECT, show_default=True)
@_url_option
@click.option("--json", "as_json", is_flag=True,
              help='Print the broker\'s answer as one JSON document on stdout: {"exchange": NAME, "kind": KIND}.')
def exchange_declare(name: str, kind: str, url: str, as_json: bool) -> None:
    """Declare exchange NAME of KIND (over the broker protocol, as the SDK does); an existing one of the
    same kind is kept."""
    import trio

    import flowbroker.client as fb

    auth = _broker_auth()
    answer: dict[str, Any] = {}

    async def run() -> None:
        async with await fb.connect(url, client_name="flowbroker-cli", auth=auth) as conn:
            answer.update(await conn.declare_exchange(name, kind))

    try:
        trio.run(run)
    except Exception as exc:  # every SDK error is a FlowbrokerError; show it without a traceback
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    if as_json:
        print_json(answer or {"exchange": name, "kind": kind})
    else:
        click.echo(f"exchange {printable(name)} ({kind}) declared")


@exchange.command("delete")
@click.argument("name")
@_admin_options
def exchange_delete(name: str, **options: Any) -> None:
    """Delete exchange NAME and its bindings; the queues bound to it stay. The built-in amq.* cannot be deleted."""
    client, as_json = _client(options)
    answer = client.request("DELETE", "/api/exchanges/" + urllib.parse.quote(name, safe=""))
    if as_json:
        print_json(answer)
    else:
        click.echo(f"exchange {printable(answer['exchange'])} deleted ({answer['bindings']} binding(s) removed)")


@main.group()
def producers() -> None:
    """Stop or start every flow-controlled producer at once."""


def _producers_command(action: str, done: str) -> Callable[..., None]:
    def command(**options: Any) -> None:
        client, as_json = _client(options)
        answer = client.request("POST", f"/api/producers/{action}")
        if as_json:
            print_json(answer)
        else:
            click.echo(f"all producers {done} ({len(answer['connections'])} flow-controlled connection(s))")
    return command


producers.command("stop-all", help="Hold every new transfer of flow-controlled producers until start-all: "
                  "they are told they are flow-stopped on '*' (a broker-wide stop; the memory alarm uses it too).")(_admin_options(_producers_command("stop-all", "stopped")))
producers.command("start-all", help="Complete the held transfers and let every producer send again.")(
    _admin_options(_producers_command("start-all", "started")))


@main.group()
def policy() -> None:
    """Show or change the producer credit policy while the broker runs."""



@policy.command("show")
@_admin_options
def policy_show(**options: Any) -> None:
    """The credit policy in force and the buffers it grants now."""
    client, as_json = _client(options)
    answer = client.request("GET", "/api/policy")
    print_json(answer) if as_json else click.echo(policy_text(answer))


@policy.command("set")
@click.argument("name", required=False, type=click.Choice([p.value for p in CreditPolicy]))
@click.option("--quota", type=SIZE, help="Memory the policies share out, e.g. 2GiB.")
@click.option("--static-size", type=SIZE, help="static: every producer's buffer.")
@click.option("--min-size", type=SIZE, help="dynamic/aggressive: smallest buffer.")
@click.option("--max-size", type=SIZE, help="dynamic/aggressive: largest buffer.")
@click.option("--override-size", type=SIZE, help="> 0: every producer gets exactly this (0 = off).")
@click.option("--dynamic-percent", type=float, help="dynamic: percent of the quota per connection.")
@click.option("--dynamic-threshold-percent", type=float, help="dynamic: the pool, as a percent of the quota; producers beyond it wait for a share.")
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
    print_json(answer) if as_json else click.echo(policy_text(answer))


from flowbroker.broker.cliusers import user  # noqa: E402  (its own module: the users file, not the admin API)

main.add_command(user)
