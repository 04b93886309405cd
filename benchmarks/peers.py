"""flowbroker against its peers, side by side in one run (issue 16): NATS core pub/sub, NATS JetStream and
RabbitMQ, each only when installed.

One producer process and one consumer process per run, N messages of 1 KiB (default 200,000), R rounds
(default 3); each round runs every system once, in an order that alternates from round to round (forward,
then backward) so that drift on a shared machine falls on all of them. Each run starts its own server on
free ports of 127.0.0.1, with its data under a temporary directory, and stops it afterwards (only the
processes this script started are ever signalled).

  flowbroker      `flowbroker serve` (default settings: flow control on, memory-only queue), its SDK;
                  the producer's window is the SDK's (1,000 uncompleted transfers), consumer prefetch 2,000.
  flowbroker-latency  the same, with the queue declared with a latency bound as well as the default size
                  one: flow_stop_drain_time 0.03 s, flow_resume_drain_time 0.02 s (docs/policies.md, "Time
                  thresholds"). The size watermark alone lets the backlog wander up to 80 MiB whenever the
                  consumer falls behind for a while; this bounds it at about 30 ms of the consumer's pace.
  flowbroker-paced  the default queue on a broker with `[queues] pace_producers = true` (docs/policies.md,
                  "Pacing"): the producer's completions wait while the queue holds more than twice the
                  consumer's prefetch ready, until it is down to the prefetch. No stop, no threshold to set.
  nats-core       `nats-server` (Debian's package), `nats-py`: plain publish/subscribe on one subject.
                  Nothing paces the producer and nothing is kept: a slow subscriber loses messages.
  nats-jetstream  the same server with -js: a stream in memory (--jetstream-storage), the producer's
                  `publish_async` with at most 1,000 PubAcks pending (as flowbroker's window), a pull
                  consumer fetching batches of 1,000 and acking each message (explicit acks).
  rabbitmq        `rabbitmq-server` (Debian's package; its own node, epmd and Mnesia dir, no plugins),
                  `pika`'s BlockingConnection: a non-durable classic queue, transient messages, no publisher
                  confirms (pika's blocking confirms are one round trip per message), basic_consume with
                  manual acks and prefetch 2,000. RabbitMQ's own credit flow paces the publisher.

Per system it prints msgs/s (the median of the rounds and each round; first publish to last receipt), MB/s,
publish-to-receive latency p50/p99 (every 10th message; CLOCK_MONOTONIC written into the first 8 bytes of the
body, shared by all processes on one Linux machine), and the CPU time per message received of each process:
the server (its whole process tree, read from /proc through psutil before and after the run), the producer
and the consumer (each its own, from the start of its connection to its last message). Then a markdown table
for docs/performance.md. A system that is not installed is named with the command that installs it.

    python benchmarks/peers.py [--messages 200000] [--rounds 3] [--size 1024] [--systems flowbroker,rabbitmq]

Client libraries: `pip install -e '.[bench]'` (nats-py, pika). Servers: `apt-get install -y nats-server
rabbitmq-server` (Debian starts neither here, where policy-rc.d forbids it; elsewhere stop the package's own
service with `systemctl disable --now rabbitmq-server nats-server`: this script runs its own instances).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio

import flowbroker.client as fb
from procs import free_port, stop_broker, wait_listening

STAMP = struct.Struct("<Q")
QUEUE = "bench"
SUBJECT = "bench"
STREAM = "BENCH"
WINDOW = 1000  # the producer's uncompleted transfers / pending PubAcks
PREFETCH = 2000  # the consumer's
SAMPLE_EVERY = 10  # latency of every 10th message
IDLE_SECONDS = 10.0  # a consumer that has received nothing for this long stops (NATS core may drop)
SYSTEMS = ("flowbroker", "flowbroker-latency", "flowbroker-paced", "nats-core", "nats-jetstream", "rabbitmq")
# flowbroker-latency's queue: saturated while its backlog would take over 30 ms to drain at the consumers'
# measured pace, clear again under 20 ms
LATENCY_STOP, LATENCY_RESUME = 0.03, 0.02


# -- what is installed ---------------------------------------------------------------------------


def missing(system: str) -> str | None:
    """None when `system` can run here; otherwise what is missing and the command that installs it.
    Servers are looked up on PATH only (so that a PATH without them shows this message)."""
    needs: list[str] = []
    if system in ("nats-core", "nats-jetstream"):
        if shutil.which("nats-server") is None:
            needs.append("nats-server not on PATH: apt-get install -y nats-server")
        if importlib.util.find_spec("nats") is None:
            needs.append("nats-py not importable: pip install nats-py (or pip install -e '.[bench]')")
    elif system == "rabbitmq":
        if shutil.which("rabbitmq-server") is None:
            needs.append("rabbitmq-server not on PATH: apt-get install -y rabbitmq-server")
        if importlib.util.find_spec("pika") is None:
            needs.append("pika not importable: pip install pika (or pip install -e '.[bench]')")
    return "; ".join(needs) or None


# -- servers ------------------------------------------------------------------------------------


@dataclass
class Server:
    """A server this script started: the processes to stop (in order) and where clients connect."""

    url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def cpu_seconds(self) -> float:
        """User + system CPU of the started processes and all their descendants (beam.smp's threads are
        counted in its process; erl_child_setup and the like as children)."""
        total = 0.0
        for proc in self.procs:
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    t = p.cpu_times()
                    total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        for proc in self.procs:
            stop_broker(proc)  # SIGTERM, SIGKILL after 10 s


DEFAULT_GC_SERVE = """\
import sys
import flowbroker.broker.cli as cli
if not callable(getattr(cli, "_tune_garbage_collector", None)):
    sys.exit("broker/cli.py has no _tune_garbage_collector any more: --default-gc cannot turn it off")
cli._tune_garbage_collector = lambda: None  # CPython's default: youngest generation every 700, nothing frozen
sys.argv[0] = "flowbroker"
sys.exit(cli.main())
"""
"""`flowbroker serve` as its console script runs it, but with the interpreter's default garbage collector:
`serve` calls `_tune_garbage_collector` at start-up, looked up in its module when called, so replacing it
first leaves CPython's settings as they are (docs/performance.md, "The garbage collector")."""


def start_flowbroker(tmp: Path, paced: bool = False, default_gc: bool = False) -> Server:
    """`flowbroker serve` on a free port, its log and data under `tmp`; `paced`: --pace-producers;
    `default_gc`: with CPython's default garbage collector instead of serve's tuning (DEFAULT_GC_SERVE)."""
    port = free_port()
    exe = Path(sys.executable).with_name("flowbroker")
    run = [sys.executable, "-c", DEFAULT_GC_SERVE] if default_gc else [str(exe)]
    log = open(tmp / "flowbroker.log", "wb")
    proc = subprocess.Popen([*run, "serve", "--host", "127.0.0.1", "--port", str(port), "--no-admin", "--no-udp",
                             "--no-metrics", *(["--pace-producers"] if paced else []),
                             "--data-dir", str(tmp / "flowbroker-data")], stderr=log, stdout=log)
    log.close()
    return Server(f"flowbroker://127.0.0.1:{port}", [wait_listening(proc, port)])


def start_nats(tmp: Path, jetstream: bool) -> Server:
    port = free_port()
    cmd = [shutil.which("nats-server") or "nats-server", "-a", "127.0.0.1", "-p", str(port),
           "-l", str(tmp / "nats.log")]
    if jetstream:
        cmd += ["-js", "-sd", str(tmp / "jetstream")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Server(f"nats://127.0.0.1:{port}", [wait_listening(proc, port)])


def start_rabbitmq(tmp: Path) -> Server:
    """A RabbitMQ node of its own: its own epmd on a free port (started here, so it is ours to stop), node
    name, ports, Mnesia and log dirs, an empty plugins file (no management plugin), HOME for its cookie."""
    found = shutil.which("rabbitmq-server") or "rabbitmq-server"
    # Debian's /usr/sbin/rabbitmq-server re-runs itself as the rabbitmq user; the script behind it runs as us.
    script = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
    exe = str(script) if script.exists() else found
    port, dist_port, epmd_port = free_port(), free_port(), free_port()
    home = tmp / "rabbitmq"
    home.mkdir()
    (home / "enabled_plugins").write_text("[].\n")
    env = dict(os.environ, HOME=str(home), ERL_EPMD_PORT=str(epmd_port), ERL_EPMD_ADDRESS="127.0.0.1",
               RABBITMQ_NODENAME=f"bench{port}@localhost", RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
               RABBITMQ_NODE_PORT=str(port), RABBITMQ_DIST_PORT=str(dist_port),
               RABBITMQ_MNESIA_BASE=str(home / "mnesia"), RABBITMQ_LOG_BASE=str(home / "log"),
               RABBITMQ_ENABLED_PLUGINS_FILE=str(home / "enabled_plugins"),
               RABBITMQ_PID_FILE=str(home / "rabbitmq.pid"), RABBITMQ_CONFIG_FILE=str(home / "rabbitmq"),
               RABBITMQ_ADVANCED_CONFIG_FILE=str(home / "advanced.config"))
    epmd = subprocess.Popen([shutil.which("epmd") or "/usr/lib/erlang/erts-13.1.5/bin/epmd", "-port", str(epmd_port),
                             "-address", "127.0.0.1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    server = Server(f"amqp://guest:guest@127.0.0.1:{port}/%2F", [])
    try:
        wait_listening(epmd, epmd_port)
        log = open(home / "stdout.log", "wb")
        node = subprocess.Popen([exe], env=env, stdout=log, stderr=log)
        log.close()
        server.procs = [node, epmd]
        wait_listening(node, port, seconds=60)
    except BaseException:
        server.procs = server.procs or [epmd]
        server.stop()
        raise
    return server


def start_server(system: str, tmp: Path) -> Server:
    if system.startswith("flowbroker"):
        return start_flowbroker(tmp, paced=system == "flowbroker-paced")
    if system in ("nats-core", "nats-jetstream"):
        return start_nats(tmp, system == "nats-jetstream")
    return start_rabbitmq(tmp)


# -- producers and consumers, one process each --------------------------------------------------


def body(pad: bytes) -> bytes:
    return STAMP.pack(time.monotonic_ns()) + pad


def producer_main(system: str, url: str, count: int, size: int, go: Any, out: Any) -> None:
    """Publish `count` messages once `go` is set; report the time of the first publish and the CPU time."""
    pad = b"x" * (size - STAMP.size)
    cpu = time.process_time()
    result: dict[str, float] = {}

    if system.startswith("flowbroker"):
        async def fb_run() -> None:
            async with await fb.connect(url, client_name="peers-producer") as conn:
                producer = conn.producer(routing_key=QUEUE, window=WINDOW)
                go.wait()
                result["start"] = time.monotonic()
                for _ in range(count):
                    await producer.send(body(pad), timeout=60)
                await producer.flush(timeout=300)
        trio.run(fb_run)
    elif system in ("nats-core", "nats-jetstream"):
        import nats

        async def nats_run() -> None:
            nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
            go.wait()
            result["start"] = time.monotonic()
            if system == "nats-core":
                for i in range(count):
                    await nc.publish(SUBJECT, body(pad))
                    if i % 1000 == 999:
                        await asyncio.sleep(0)  # let the client's flusher write
                await nc.flush(timeout=60)
            else:
                js = nc.jetstream(publish_async_max_pending=WINDOW)
                for _ in range(count):
                    await js.publish_async(SUBJECT, body(pad), wait_stall=60)
                await asyncio.wait_for(js.publish_async_completed(), timeout=300)
            await nc.close()
        asyncio.run(nats_run())
    else:
        import pika
        conn = pika.BlockingConnection(pika.URLParameters(url))
        channel = conn.channel()
        props = pika.BasicProperties(delivery_mode=1)
        go.wait()
        result["start"] = time.monotonic()
        for _ in range(count):
            channel.basic_publish("", QUEUE, body(pad), props)
        conn.close()
    result["cpu"] = time.process_time() - cpu
    out.put(result)


def consumer_main(system: str, url: str, count: int, ready: Any, out: Any) -> None:
    """Receive (and ack) `count` messages, or stop after IDLE_SECONDS without one; set `ready` once
    subscribed. Reports how many arrived, when the last did, latencies (ns) and the CPU time."""
    cpu = time.process_time()
    latencies: list[int] = []
    state = {"received": 0, "last": 0.0}

    def got(data: bytes) -> None:
        now = time.monotonic_ns()
        if state["received"] % SAMPLE_EVERY == 0:
            latencies.append(now - STAMP.unpack_from(data)[0])
        state["received"] += 1
        state["last"] = now / 1e9

    if system.startswith("flowbroker"):
        async def fb_run() -> None:
            async with await fb.connect(url, client_name="peers-consumer") as conn:
                async with conn.consumer(QUEUE, prefetch=PREFETCH) as consumer:
                    ready.set()
                    # `async for`, as an application consumes; a receive(timeout=...) per message would
                    # cost a cancel scope each. The idle deadline moves every 1,000 messages instead.
                    with trio.move_on_after(IDLE_SECONDS) as idle:
                        async for msg in consumer:
                            got(msg.body)
                            await msg.ack()
                            if state["received"] >= count:
                                break
                            if state["received"] % 1000 == 0:
                                idle.deadline = trio.current_time() + IDLE_SECONDS
        trio.run(fb_run)
    elif system in ("nats-core", "nats-jetstream"):
        import nats

        async def nats_run() -> None:
            nc = await nats.connect(url)
            if system == "nats-core":
                done = asyncio.Event()

                async def on_msg(msg: Any) -> None:
                    got(msg.data)
                    if state["received"] >= count:
                        done.set()
                await nc.subscribe(SUBJECT, cb=on_msg, pending_msgs_limit=count + 1,
                                   pending_bytes_limit=1024 * 1024 * 1024)
                await nc.flush()
                ready.set()
                while not done.is_set():
                    before = state["received"]
                    try:
                        await asyncio.wait_for(done.wait(), timeout=IDLE_SECONDS)
                    except asyncio.TimeoutError:
                        if state["received"] == before:
                            break
            else:
                js = nc.jetstream()
                psub = await js.pull_subscribe(SUBJECT, durable="bench", stream=STREAM)
                ready.set()
                while state["received"] < count:
                    try:
                        msgs = await psub.fetch(batch=int(min(PREFETCH // 2, count - state["received"])),
                                                timeout=IDLE_SECONDS)
                    except nats.errors.TimeoutError:
                        break
                    for msg in msgs:
                        got(msg.data)
                        await msg.ack()
            await nc.close()
        asyncio.run(nats_run())
    else:
        import pika
        conn = pika.BlockingConnection(pika.URLParameters(url))
        channel = conn.channel()
        channel.basic_qos(prefetch_count=PREFETCH)
        ready.set()
        for method, _props, data in channel.consume(QUEUE, inactivity_timeout=IDLE_SECONDS):
            if method is None:
                break
            got(data)
            channel.basic_ack(method.delivery_tag)
            if state["received"] >= count:
                break
        channel.cancel()
        conn.close()
    out.put({"received": state["received"], "last": state["last"], "latencies": latencies,
             "cpu": time.process_time() - cpu})


def setup(system: str, url: str, storage: str) -> None:
    """Declare what the run publishes into: the queue, the stream and its consumer."""
    if system.startswith("flowbroker"):
        async def fb_declare() -> None:
            async with await fb.connect(url, client_name="peers-setup") as conn:
                if system == "flowbroker-latency":
                    await conn.declare_queue(QUEUE, flow_stop_drain_time=LATENCY_STOP, flow_resume_drain_time=LATENCY_RESUME)
                else:
                    await conn.declare_queue(QUEUE)
        trio.run(fb_declare)
    elif system == "nats-jetstream":
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

        async def js_declare() -> None:
            nc = await nats.connect(url)
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType(storage)))
            await js.add_consumer(STREAM, ConsumerConfig(durable_name="bench", ack_policy=AckPolicy.EXPLICIT,
                                                         max_ack_pending=PREFETCH * 2))
            await nc.close()
        asyncio.run(js_declare())
    elif system == "rabbitmq":
        import pika
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_declare(QUEUE, durable=False)
        conn.close()


# -- one run, the rounds, the table -------------------------------------------------------------


@dataclass
class Run:
    rate: float  # msgs/s, first publish to last receipt
    received: int
    sent: int
    p50_ms: float
    p99_ms: float
    cpu_us: dict[str, float]  # server / producer / consumer, per message received


def percentile_ms(values: list[int], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] / 1e6 if ordered else float("nan")


def one_run(system: str, args: argparse.Namespace) -> Run:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=f"peers-{system}-") as tmp:
        server = start_server(system, Path(tmp))
        try:
            setup(system, server.url, args.jetstream_storage)
            ready, go = ctx.Event(), ctx.Event()
            pq, cq = ctx.Queue(), ctx.Queue()
            consumer = ctx.Process(target=consumer_main, args=(system, server.url, args.messages, ready, cq))
            producer = ctx.Process(target=producer_main,
                                   args=(system, server.url, args.messages, args.size, go, pq))
            consumer.start()
            producer.start()
            if not ready.wait(60):
                raise RuntimeError(f"{system}: the consumer did not subscribe within 60 s")
            time.sleep(0.5)  # the producer connected too (it waits for `go`)
            server_cpu = server.cpu_seconds()
            go.set()
            c = wait_result(cq, consumer, f"{system} consumer")
            server_cpu = server.cpu_seconds() - server_cpu
            p = wait_result(pq, producer, f"{system} producer")
            producer.join()
            consumer.join()
        finally:
            server.stop()
    received = max(1, c["received"])
    elapsed = c["last"] - p["start"]
    cpu = {"server": server_cpu, "producer": p["cpu"], "consumer": c["cpu"]}
    return Run(c["received"] / elapsed if elapsed > 0 else 0.0, c["received"], args.messages,
               percentile_ms(c["latencies"], 0.5), percentile_ms(c["latencies"], 0.99),
               {k: v / received * 1e6 for k, v in cpu.items()})


def wait_result(q: Any, proc: Any, what: str, seconds: float = 900) -> dict[str, Any]:
    """The next result on `q` from `proc`, or from any of them when `proc` is a list of processes (a child
    that put a large result on its queue cannot exit before it is read). Fails once they have all exited
    without one, or after `seconds` (then it ends them)."""
    procs = proc if isinstance(proc, list) else [proc]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            result: dict[str, Any] = q.get(timeout=0.2)
            return result
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                try:  # what the last one to exit put may still be on its way through the pipe
                    late: dict[str, Any] = q.get(timeout=5)
                    return late
                except queue.Empty:
                    codes = ", ".join(str(p.exitcode) for p in procs)
                    raise RuntimeError(f"the {what} process(es) exited without a result (exit code {codes})") from None
    for p in procs:
        p.kill()
    raise RuntimeError(f"the {what} process gave no result within {seconds:.0f} s")


def table(results: dict[str, list[Run]], size: int) -> list[str]:
    """The markdown table for docs/performance.md: one row per system that ran."""
    lines = ["| system | msgs/s (median) | msgs/s (rounds) | MB/s | p50 | p99 | CPU us/msg: server | producer "
             "| consumer | all three |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for system, runs in results.items():
        rate = statistics.median(r.rate for r in runs)
        cpu = {k: statistics.median(r.cpu_us[k] for r in runs) for k in ("server", "producer", "consumer")}
        lost = sum(r.sent - r.received for r in runs)
        name = system + (f" ({lost:,} of {sum(r.sent for r in runs):,} lost)" if lost else "")
        lines.append(
            f"| {name} | {rate:,.0f} | {' / '.join(f'{r.rate:,.0f}' for r in runs)} | {rate * size / 1e6:.1f} "
            f"| {statistics.median(r.p50_ms for r in runs):.1f} ms | {statistics.median(r.p99_ms for r in runs):.1f} ms "
            f"| {cpu['server']:.1f} | {cpu['producer']:.1f} | {cpu['consumer']:.1f} | {sum(cpu.values()):.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=1024, help="body bytes (at least 8: the timestamp)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all)")
    parser.add_argument("--jetstream-storage", choices=["memory", "file"], default="memory",
                        help="the JetStream stream's storage (flowbroker's default queue is memory-only)")
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SYSTEMS]
    if unknown or args.size < STAMP.size:
        parser.error(f"unknown system(s) {unknown}" if unknown else "--size must be at least 8")
    systems: list[str] = []
    for system in wanted:
        why = missing(system)
        if why:
            print(f"{system}: not installed ({why})", flush=True)
        else:
            systems.append(system)
    print(f"peers: {', '.join(systems) or 'nothing to run'}; {args.messages:,} messages of {args.size} B, "
          f"{args.rounds} round(s), 1 producer and 1 consumer process; {psutil.cpu_count()} cores", flush=True)
    results: dict[str, list[Run]] = {s: [] for s in systems}
    for round_ in range(args.rounds):
        for system in (systems if round_ % 2 == 0 else systems[::-1]):
            run = one_run(system, args)
            results[system].append(run)
            print(f"round {round_ + 1} {system}: {run.rate:,.0f} msgs/s, {run.received:,} of {run.sent:,} received, "
                  f"p50 {run.p50_ms:.1f} ms, p99 {run.p99_ms:.1f} ms, CPU us/msg "
                  + ", ".join(f"{k} {v:.1f}" for k, v in run.cpu_us.items()), flush=True)
    if systems:
        print()
        print("\n".join(table(results, args.size)))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # so a terminated run stops its servers
    main()
