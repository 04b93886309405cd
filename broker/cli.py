"""The `flowbroker` command: run the daemon, and try it by hand.

`flowbroker serve` runs on embedded defaults; a TOML file (`--config`) and flags override them.
SIGINT and SIGTERM shut down cleanly: completions already due are sent and every connection is
closed with a reason.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click
import trio

from flowbroker.broker.config import ConfigError, load_config
from flowbroker.broker.server import BrokerServer

__all__ = ["main"]


def _size(value: str | None) -> int | None:
    """Sizes on the command line: plain bytes or with a KiB/MiB/GiB (or K/M/G) suffix."""
    if value is None:
        return None
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
            size = _size(str(value))
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
def serve(config_path: Path | None, host: str | None, port: int | None, memory_quota: int | None,
          credit_policy: str | None, idle_timeout: float | None) -> None:
    """Run the broker until SIGINT or SIGTERM."""
    overrides: dict[str, dict[str, Any]] = {
        "server": {"host": host, "port": port, "memory_quota": memory_quota, "idle_timeout": idle_timeout},
        "credit": {"policy": credit_policy},
    }
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None
    try:
        trio.run(_serve, config)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.server.host}:{config.server.port}: {exc.strerror}") from None


async def _serve(config: Any) -> None:
    server = BrokerServer(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, server)
        port = await nursery.start(server.serve)
        print(f"flowbroker listening on {config.server.host}:{port}", file=sys.stderr, flush=True)
        await server.shutdown_requested.wait()
    logging.getLogger("flowbroker").info("stopped")


async def _stop_on_signal(server: BrokerServer) -> None:
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
