"""End-to-end broker benchmark: a broker process, a producer process and a consumer process on 127.0.0.1.

Scenarios (flow control on, 1 KiB messages by default):
  throughput  the producer sends N messages as fast as credit and its window (default 1000, the SDK's)
              allow; prints end-to-end msgs/s and MB/s (first send to last delivery), p50/p99
              publish-to-deliver latency, broker peak RSS. While the consumer keeps up, latency is what
              is in flight (about window / rate); once it falls behind, the queue fills to its stop
              threshold and latency is that (stop size / rate): --window and --flow-stop-size.
  paced       the producer sends at a fixed rate (default 5,000 msgs/s); prints the same. trio's timers
              wake in whole milliseconds (epoll), so the producer sends each millisecond's messages
              together, and the SDK writes them as one frame when the producer sleeps. (Yielding
              after every send instead, so each message is written alone, measured worse at 5,000
              msgs/s: p50 0.93-0.96 ms against 0.57-0.65 ms, and 1.6x the CPU per message.)
Every scenario but overload also prints the CPU time each process spent per message delivered.
  overload    the producer is 10x faster than the consumer for 30 s; prints the broker's RSS every
              second beside its idle RSS, the queue depth, and the target (idle + stop size + 32 MiB).
              The stop size is --flow-stop-size (resume at 7/8 of it), default the broker's (80 MiB).
  tls         the throughput scenario in --rounds pairs, plain TCP and TLS (the broker's [tls] port, a
              certificate from a CA made for the run with trustme) in alternating order; prints each run's
              msgs/s and broker CPU per message, and the medians' difference.
  metrics     the throughput scenario in --rounds pairs, each pair one run with a scraper fetching the
              broker's GET /metrics every second (--scrape-every) and one without, in alternating order
              (off/on, on/off, ...) so that drift on a shared machine falls on both; every run's broker
              serves /metrics ([metrics] endpoint on a port of its own). Prints each run's msgs/s, the
              scrapes made and their mean time, and the means' difference.

Latency uses CLOCK_MONOTONIC (time.monotonic_ns), shared by all processes on one Linux machine: the
producer writes it into the first 8 bytes of each body and the consumer subtracts.

    python benchmarks/broker_throughput.py [throughput|paced|overload|all] [--count N] [--rate R] ...
    python benchmarks/broker_throughput.py metrics [--rounds 3] [--scrape-every 1] [--count N]
    python benchmarks/broker_throughput.py tls [--rounds 3] [--count N]

The tls scenario's CA, key and certificates are written to a temporary directory (bench-tls-*) for each
run and removed when the run ends.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import trio

import flowbroker.client as fb
from flowbroker.broker.cli import parse_size
from procs import cpu_seconds, free_port, rss, stop_broker, wait_listening

STAMP = struct.Struct("<Q")
MiB = 1024 * 1024
QUEUE = "bench"


# -- the broker process -------------------------------------------------------------------------


def start_broker(port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("flowbroker")
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--no-admin", "--no-udp", *extra], stderr=subprocess.DEVNULL)
    return wait_listening(proc, port)


TLS_CA_ENV = "BENCH_TLS_CA"  # the run's CA (PEM) for flowbroker+tls:// URLs, inherited by the workers


async def bench_connect(url: str, **options: Any) -> fb.Connection:
    """fb.connect, trusting the run's CA for a flowbroker+tls:// URL."""
    if url.startswith("flowbroker+tls://"):
        import ssl
        options["ssl_context"] = ssl.create_default_context(cafile=os.environ[TLS_CA_ENV])
    return await fb.connect(url, **options)


def tls_broker_args(folder: Path, tls_port: int) -> list[str]:
    """A CA and a certificate for localhost in `folder`, and the --config that serves them on `tls_port`."""
    import trustme
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(folder / "cert.pem"))
    cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    os.environ[TLS_CA_ENV] = str(folder / "ca.pem")
    (folder / "broker.toml").write_text(
        f'[tls]\nenabled = true\nport = {tls_port}\ncert_file = "{folder / "cert.pem"}"\n'
        f'key_file = "{folder / "key.pem"}"\n')
    return ["--config", str(folder / "broker.toml")]


async def _queue_count(url: str, stop_size: int | None = None) -> int:
    """Declare the queue (with `stop_size` as its flow_stop_size, resuming at 7/8 of it) and return its depth."""
    resume = stop_size * 7 // 8 if stop_size else None
    async with await bench_connect(url, flow_control=False, client_name="bench-probe") as conn:
        return int((await conn.declare_queue(QUEUE, flow_stop_size=stop_size, flow_resume_size=resume))["count"])


# -- worker processes ---------------------------------------------------------------------------


def producer_main(url: str, count: int, size: int, rate: float, seconds: float, window: int, out: Any,
                  drain: bool = False) -> None:
    """Send `count` messages (or until `seconds` pass), at `rate` msgs/s or as fast as credit allows;
    `drain`: then wait until every message sent is complete (nothing left in flight)."""

    async def run() -> dict[str, Any]:
        pad = b"x" * (size - STAMP.size)
        sent = 0
        cpu = time.process_time()
        async with await bench_connect(url, client_name="bench-producer") as conn:
            producer = conn.producer(routing_key=QUEUE, window=window)
            start = time.monotonic()
            end = start + seconds
            interval = 1.0 / rate if rate else 0.0
            min_sleep = 0.001 if rate > 2000 else 0.0
            while sent < count and time.monotonic() < end:
                if interval:
                    # Above 2,000 msgs/s, sleep only when a millisecond ahead: a sleep per message costs
                    # more scheduler work than the send itself at tens of thousands a second. Below it,
                    # sleep per message so that pacing adds no latency of its own.
                    delay = start + sent * interval - time.monotonic()
                    if delay > min_sleep:
                        await trio.sleep(delay)
                await producer.send(STAMP.pack(time.monotonic_ns()) + pad, timeout=60)
                sent += 1
            end_sending = time.monotonic()
            if seconds == float("inf") or drain:
                try:
                    await producer.flush(timeout=300)
                except fb.PublishError:
                    pass  # counted in `failed`
            failed = producer.statistics().failed
        return {"sent": sent, "start": start, "end": end_sending, "cpu": time.process_time() - cpu, "failed": failed}

    out.put(trio.run(run))


def consumer_main(url: str, count: int, per_second: float, sample_every: int, out: Any) -> None:
    """Receive `count` messages; `per_second` > 0 paces the consumer (a slow consumer)."""

    async def run() -> dict[str, Any]:
        latencies: list[int] = []
        received = 0
        cpu = time.process_time()
        first = time.monotonic()
        async with await bench_connect(url, client_name="bench-consumer") as conn:
            async with conn.consumer(QUEUE, prefetch=2000) as consumer:
                async for msg in consumer:
                    if received % sample_every == 0:
                        latencies.append(time.monotonic_ns() - STAMP.unpack_from(msg.body)[0])
                    received += 1
                    await msg.ack()
                    if per_second:
                        delay = first + received / per_second - time.monotonic()
                        if delay > 0:
                            await trio.sleep(delay)
                    if received >= count:
                        break
        return {"received": received, "last": time.monotonic(), "latencies": latencies,
                "cpu": time.process_time() - cpu}

    out.put(trio.run(run))


def overload_consumer_main(url: str, per_second: float, prefetch: int, deadline: float, out: Any) -> None:
    """The overload scenario's slow consumer: `per_second` until `deadline` (time.monotonic), recording
    every message's publish-to-deliver latency; then it drains what is left as fast as it can (not
    recorded) and stops after 2 s with nothing, so received + still queued = sent tells what was lost."""

    async def run() -> dict[str, Any]:
        latencies: list[int] = []
        received = 0
        async with await fb.connect(url, client_name="bench-consumer") as conn:
            async with conn.consumer(QUEUE, prefetch=prefetch) as consumer:
                first = 0.0  # paced from its first message, not from its start: no catching up in bursts
                while True:
                    try:
                        msg = await consumer.receive(timeout=2.0)
                    except fb.ReceiveTimeout:
                        if time.monotonic() > deadline:
                            break
                        continue
                    now = time.monotonic()
                    first = first or now
                    if now < deadline:
                        latencies.append(time.monotonic_ns() - STAMP.unpack_from(msg.body)[0])
                    received += 1
                    await msg.ack()
                    if now < deadline:
                        delay = first + received / per_second - time.monotonic()
                        if delay > 0:
                            await trio.sleep(delay)
        return {"received": received, "latencies": latencies}

    out.put(trio.run(run))


def percentile_ms(values: list[int], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] / 1e6 if ordered else float("nan")


# -- scenarios ----------------------------------------------------------------------------------


class Scraper:
    """GET `url` every `every` seconds in a thread, as Prometheus would, until stopped; counts the scrapes
    and the time each took (the broker builds the text on its event loop, so that is what it costs it)."""

    def __init__(self, url: str, every: float):
        self.url, self.every = url, every
        self.times: list[float] = []
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                self.bytes = len(resp.read())
            self.times.append(time.monotonic() - started)
            self._stop.wait(max(0.0, self.every - (time.monotonic() - started)))

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def scenario_flow(args: argparse.Namespace, rate: float, scrape_every: float | None = None,
                  tls: bool = False) -> tuple[float, float]:
    """One run; returns the end-to-end msgs/s and the broker's CPU microseconds per message. `scrape_every`: the broker serves /metrics on a port of its
    own, scraped that often (0: served, never scraped); None: as before, no metrics listener. `tls`: the
    clients use the broker's TLS port, with a CA and a key made for the run in a temporary directory
    that is removed when the run ends."""
    if not tls:
        return _flow_run(args, rate, scrape_every, None)
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tls_dir:
        try:
            return _flow_run(args, rate, scrape_every, Path(tls_dir))
        finally:
            os.environ.pop(TLS_CA_ENV, None)  # it named a file in tls_dir


def _flow_run(args: argparse.Namespace, rate: float, scrape_every: float | None,
              tls_dir: Path | None) -> tuple[float, float]:
    tls = tls_dir is not None
    port = free_port()
    url = f"flowbroker://127.0.0.1:{port}"
    broker_args = ["--memory-quota", args.quota]
    if tls_dir is not None:
        tls_port = free_port()
        broker_args += tls_broker_args(tls_dir, tls_port)
        url = f"flowbroker+tls://localhost:{tls_port}"
    metrics_url = ""
    if scrape_every is not None:
        metrics_port = free_port()
        broker_args += ["--metrics-endpoint", f"127.0.0.1:{metrics_port}"]
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    broker = start_broker(port, broker_args)
    ctx = mp.get_context("spawn")
    scraper: Scraper | None = None
    try:
        trio.run(_queue_count, url, args.flow_stop_size)
        idle = rss(broker.pid)
        count = int(rate * args.seconds) if rate else args.count
        pq, cq = ctx.Queue(), ctx.Queue()
        consumer = ctx.Process(target=consumer_main, args=(url, count, 0.0, 1 if rate else 10, cq))
        consumer.start()
        time.sleep(1.5)  # the consumer is subscribed before the first message
        producer = ctx.Process(
            target=producer_main, args=(url, count, args.size, rate, float("inf"), args.window, pq)
        )
        if scrape_every:
            scraper = Scraper(metrics_url, scrape_every).__enter__()
        producer.start()
        broker_cpu = cpu_seconds(broker.pid)
        peak = idle
        # Read the result while sampling: a child that put a large result on a multiprocessing
        # queue cannot exit until the parent has read it.
        c = None
        while c is None:
            peak = max(peak, rss(broker.pid))
            try:
                c = cq.get(timeout=0.1)
            except queue.Empty:
                if not consumer.is_alive():
                    raise RuntimeError("the consumer process died") from None
        broker_cpu = cpu_seconds(broker.pid) - broker_cpu
        if scraper is not None:
            scraper.__exit__(None, None, None)
        p = pq.get(timeout=60)
        producer.join()
        consumer.join()
        elapsed = c["last"] - p["start"]
        label = f"paced at {rate:,.0f} msgs/s" if rate else "throughput"
        label += ", TLS" if tls else ""
        if scrape_every is not None:
            label += (f", /metrics scraped every {scrape_every:g} s" if scrape_every else ", /metrics not scraped")
        print(f"\n== {label}: broker + producer process + consumer process, {args.size} B messages ==")
        print(f"{c['received']:,} of {p['sent']:,} messages delivered in {elapsed:.2f} s: "
              f"{c['received'] / elapsed:,.0f} msgs/s, {c['received'] * args.size / elapsed / 1e6:.1f} MB/s end to end")
        lat = c["latencies"]
        print(f"publish->deliver latency over {len(lat):,} samples: p50 {percentile_ms(lat, 0.5):.3f} ms, "
              f"p99 {percentile_ms(lat, 0.99):.3f} ms")
        print(f"broker RSS: idle {idle / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB")
        cpu_used = {"broker": broker_cpu, "producer": p["cpu"], "consumer": c["cpu"]}
        per_msg = {name: used / max(1, c["received"]) * 1e6 for name, used in cpu_used.items()}
        print("CPU per message: " + ", ".join(f"{name} {us:.1f} us" for name, us in per_msg.items())
              + f" (all three: {sum(per_msg.values()):.1f} us; this machine has {psutil.cpu_count()} cores)")
        if scraper is not None:
            print(f"{len(scraper.times)} scrapes of {scraper.bytes:,} bytes, "
                  f"mean {statistics.mean(scraper.times) * 1e3:.1f} ms each" if scraper.times else "no scrape made")
        return float(c["received"] / elapsed), per_msg["broker"]
    finally:
        if scraper is not None:
            scraper.__exit__(None, None, None)
        stop_broker(broker)


def scenario_metrics(args: argparse.Namespace) -> None:
    """Throughput with and without a scraper, alternating runs, one broker process per run."""
    runs: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for scraped in ((False, True) if round_ % 2 == 0 else (True, False)):
            rate, broker_us = scenario_flow(args, 0.0, args.scrape_every if scraped else 0.0)
            runs[scraped].append(rate)
            cpu[scraped].append(broker_us)
    print(f"\n== metrics: {args.rounds} pair(s) of throughput runs, {args.count:,} messages each ==")
    for what, values, unit, fmt in (("msgs/s", runs, "msgs/s", ",.0f"), ("broker CPU", cpu, "us/msg", ".2f")):
        off, on = statistics.median(values[False]), statistics.median(values[True])
        print(f"{what}, not scraped: " + ", ".join(format(v, fmt) for v in values[False])
              + f" {unit} (median {format(off, fmt)})")
        print(f"{what}, scraped every {args.scrape_every:g} s: " + ", ".join(format(v, fmt) for v in values[True])
              + f" {unit} (median {format(on, fmt)})")
        print(f"{what}: scraped vs not, medians {(on - off) / off * 100:+.1f} %; spread of the unscraped runs "
              f"{(max(values[False]) - min(values[False])) / off * 100:.1f} % of their median")


def scenario_tls(args: argparse.Namespace) -> None:
    """Throughput over plain TCP and over TLS, alternating runs, one broker process per run."""
    runs: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for tls in ((False, True) if round_ % 2 == 0 else (True, False)):
            rate, broker_us = scenario_flow(args, 0.0, tls=tls)
            runs[tls].append(rate)
            cpu[tls].append(broker_us)
    print(f"\n== tls: {args.rounds} pair(s) of throughput runs, {args.count:,} messages each ==")
    for what, values, unit, fmt in (("msgs/s", runs, "msgs/s", ",.0f"), ("broker CPU", cpu, "us/msg", ".2f")):
        plain, tls_ = statistics.median(values[False]), statistics.median(values[True])
        print(f"{what}, plain: " + ", ".join(format(v, fmt) for v in values[False]) + f" {unit} (median {format(plain, fmt)})")
        print(f"{what}, TLS:   " + ", ".join(format(v, fmt) for v in values[True]) + f" {unit} (median {format(tls_, fmt)})")
        print(f"{what}: TLS vs plain, medians {(tls_ - plain) / plain * 100:+.1f} %")


async def _declare_overload(url: str, drain_time: float | None, stop_size: int | None) -> int:
    """Declare the overload queue: the broker's default thresholds, or `stop_size` as its flow_stop_size
    (resuming at 7/8 of it, as --flow-stop-size does in the other scenarios), plus `flow_stop_drain_time`."""
    resume = stop_size * 7 // 8 if stop_size else None
    async with await fb.connect(url, flow_control=False, client_name="bench-probe") as conn:
        return int((await conn.declare_queue(QUEUE, flow_stop_size=stop_size, flow_resume_size=resume,
                                             flow_stop_drain_time=drain_time))["count"])


def _overload_label(args: argparse.Namespace, drain_time: float | None) -> str:
    size = None if args.flow_stop_size is None else f"flow_stop_size {args.flow_stop_size / MiB:g} MiB"
    if not drain_time:
        return size or "default thresholds"
    return f"flow_stop_drain_time {drain_time:g} s" + (f", {size}" if size else "")


def scenario_overload(args: argparse.Namespace) -> None:
    """The overload scenario with the default thresholds (or --flow-stop-size) and, given
    --flow-stop-drain-time, again with it (latency-bounded flow control), one after the other in the same run."""
    runs: list[float | None] = [None]
    if args.flow_stop_drain_time:
        runs.append(args.flow_stop_drain_time)
    results = [overload_run(args, drain_time) for drain_time in runs]
    print("\n== overload summary ==")
    for drain_time, (p50, p99, peak, idle, lost, refused) in zip(runs, results, strict=True):
        label = _overload_label(args, drain_time)
        print(f"{label:>30}: latency p50 {p50 / 1000:7.3f} s, p99 {p99 / 1000:7.3f} s; peak RSS {peak / MiB:7.1f} MiB "
              f"(idle + {(peak - idle) / MiB:.1f}); lost {lost}, refused {refused}")


def overload_run(args: argparse.Namespace, drain_time: float | None) -> tuple[float, float, int, int, int, int]:
    port = free_port()
    url = f"flowbroker://127.0.0.1:{port}"
    broker = start_broker(port, ["--memory-quota", args.quota])
    ctx = mp.get_context("spawn")
    # --flow-stop-size, else the broker's default (Qpid's: 80 % of the default 100 MiB queue limit)
    stop_size = 80 * MiB if args.flow_stop_size is None else args.flow_stop_size
    try:
        trio.run(_declare_overload, url, drain_time, args.flow_stop_size)
        time.sleep(0.5)
        idle = rss(broker.pid)
        pq, cq = ctx.Queue(), ctx.Queue()
        slow_rate = args.overload_consumer_rate
        deadline = time.monotonic() + 1.5 + args.overload_seconds
        consumer = ctx.Process(target=overload_consumer_main,
                               args=(url, slow_rate, args.overload_prefetch, deadline, cq))
        consumer.start()
        time.sleep(1.5)
        producer = ctx.Process(
            target=producer_main, args=(url, 10**12, args.size, 0.0, args.overload_seconds, args.window, pq, True)
        )
        producer.start()
        what = _overload_label(args, drain_time)
        print(f"\n== overload ({what}): producer unpaced, consumer {slow_rate:,.0f} msgs/s (prefetch "
              f"{args.overload_prefetch}), {args.overload_seconds:.0f} s ==")
        print(f"broker idle RSS {idle / MiB:.1f} MiB; target: stay under idle + stop size + 32 MiB = "
              f"{(idle + stop_size + 32 * MiB) / MiB:.1f} MiB")
        peak = idle
        started = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now_rss = rss(broker.pid)
            peak = max(peak, now_rss)
            depth = trio.run(_queue_count, url)
            print(f"t={time.monotonic() - started:5.1f}s  broker RSS {now_rss / MiB:7.1f} MiB "
                  f"(+{(now_rss - idle) / MiB:6.1f})  queue depth {depth:,} messages")
        p = pq.get(timeout=600)
        producer.join()
        c = cq.get(timeout=600)
        consumer.join()
        left = trio.run(_queue_count, url)
        sent_rate = p["sent"] / (p["end"] - p["start"])
        print(f"producer sent {p['sent']:,} messages ({sent_rate:,.0f} msgs/s average, paced by credit), "
              f"{p['failed']} refused; consumer received {c['received']:,}, {left} left in the queue")
        lat = c["latencies"]
        p50, p99 = percentile_ms(lat, 0.5), percentile_ms(lat, 0.99)
        print(f"latency while overloaded ({len(lat):,} messages): p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
              f"max {max(lat) / 1e6 if lat else float('nan'):.1f} ms")
        verdict = "within" if peak - idle <= stop_size + 32 * MiB else "OVER"
        print(f"peak RSS {peak / MiB:.1f} MiB = idle + {(peak - idle) / MiB:.1f} MiB: {verdict} the target")
        return p50, p99, peak, idle, p["sent"] - c["received"] - left, p["failed"]
    finally:
        stop_broker(broker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", nargs="?", default="all",
                        choices=["throughput", "paced", "overload", "metrics", "tls", "all"])
    parser.add_argument("--count", type=int, default=600_000, help="messages in the throughput scenario")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of the paced scenario")
    parser.add_argument("--rate", type=float, default=5000.0, help="msgs/s in the paced scenario")
    parser.add_argument("--size", type=int, default=1024, help="message body size in bytes")
    parser.add_argument("--quota", default="200MiB", help="broker memory quota (sizes producer credit)")
    parser.add_argument("--flow-stop-size", type=parse_size, default=None,
                        help="the queue's flow_stop_size (resume at 7/8 of it), in every scenario; default: the "
                             "broker's (80 MiB). Unpaced, the queue fills to it, so it sets the latency: stop size "
                             "/ rate; in overload it also sets the RSS target (idle + stop size + 32 MiB)")
    parser.add_argument("--window", type=int, default=1000,
                        help="the producer's window of uncompleted transfers (default: the SDK's, 1000). "
                             "Unpaced, it is what is in flight, so latency is about window / rate")
    parser.add_argument("--overload-seconds", type=float, default=30.0)
    parser.add_argument("--overload-consumer-rate", type=float, default=5000.0,
                        help="the slow consumer's rate in the overload scenario")
    parser.add_argument("--overload-prefetch", type=int, default=2000,
                        help="the slow consumer's prefetch: what sits in its client buffer adds prefetch / rate "
                             "to every message's latency, whatever the broker does")
    parser.add_argument("--flow-stop-drain-time", type=float, default=None,
                        help="overload: after the run with default thresholds, run again with the queue's "
                             "flow_stop_drain_time set to this (seconds; latency-bounded flow control)")
    parser.add_argument("--rounds", type=int, default=3, help="metrics scenario: pairs of runs (scraped, not)")
    parser.add_argument("--scrape-every", type=float, default=1.0, help="metrics scenario: seconds between scrapes")
    args = parser.parse_args()
    if args.scenario in ("throughput", "all"):
        scenario_flow(args, 0.0)
    if args.scenario in ("paced", "all"):
        scenario_flow(args, args.rate)
    if args.scenario in ("overload", "all"):
        scenario_overload(args)
    if args.scenario == "metrics":  # not in "all": it is six throughput runs
        scenario_metrics(args)
    if args.scenario == "tls":  # likewise
        scenario_tls(args)


if __name__ == "__main__":
    main()
