"""Fuzz a broker process with hostile frames (10^6 by default) while a well-behaved client works beside them.

The long run of tests/e2e/test_e2e_fuzz.py, with the same generator (tests/e2e/hostile.py): a broker
process (`flowbroker serve --no-admin --no-udp --memory-quota QUOTA`, otherwise the default configuration),
a bystander process (an SDK producer and consumer on a queue of their own, bursts of 5 messages 1 ms apart)
and this process, whose N hostile connections play valid and mutated frames of every kind as fast as the
broker takes them, reconnecting whenever the broker closes one. It prints:

- hostile frames sent, frames/s, bytes; connections opened and closed by the broker; errors the broker
  answered, by code (and the first text of each);
- the bystander: messages, whether every one arrived exactly once and in order, its worst stall (the
  longest gap between two receipts while hostile traffic ran) and its end-to-end latency (p50, p99, max);
- the broker's RSS at start, peak (sampled every 0.2 s) and end, and whether it still serves.

Latency uses CLOCK_MONOTONIC (time.monotonic_ns), shared by all processes on one Linux machine.

    python benchmarks/fuzz_broker.py [--frames 1000000] [--connections 4] [--seed 1] [--quota 1GiB]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import trio

# The hostile-frame generator is the fuzz test's (tests/e2e/hostile.py), imported as a package from
# the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowbroker.client as fc  # noqa: E402
from tests.e2e.hostile import (  # noqa: E402
    BYSTANDER_QUEUE,
    Bystander,
    HostileStats,
    WEIGHTS,
    Move,
    hostile_connection,
    moves,
    percentile,
    strategy_corpus,
)
from procs import cpu_seconds, free_port, rss, stop_broker, wait_listening  # noqa: E402

MiB = 1024 * 1024


def start_broker(port: int, quota: str, profile: str | None) -> subprocess.Popen[bytes]:
    """`flowbroker serve` on `port`, under cProfile (writing `profile` when it stops) if asked."""
    exe = str(Path(sys.executable).with_name("flowbroker"))  # the console script is a Python file
    run = [sys.executable, "-m", "cProfile", "-o", profile, exe] if profile else [exe]
    cmd = [*run, "serve", "--port", str(port), "--no-admin", "--no-udp", "--memory-quota", quota]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    return wait_listening(proc, port)


# -- the bystander process ----------------------------------------------------------------------


def bystander_main(url: str, stop: Any, out: Any) -> None:
    """Produce and consume on the bystander's queue until `stop` is set; put what it saw on `out`."""

    async def run() -> dict[str, Any]:
        async with await fc.connect(url, client_name="bystander", timeout=10) as conn:
            await conn.declare_queue(BYSTANDER_QUEUE, flow_stop_count=200, flow_resume_count=100)
            b = Bystander(conn, timeout=30)
            async with trio.open_nursery() as nursery:
                await nursery.start(b.consume)
                nursery.start_soon(b.produce)
                while not stop.is_set():
                    await trio.sleep(0.05)
                await b.finish()
                nursery.cancel_scope.cancel()
            return {"sent": b.sent, "received": len(b.sequences), "losses": b.losses(),
                    "arrivals": b.arrivals, "latencies": b.latencies_ns, "closed": conn.is_closed}

    out.put(trio.run(run))


# -- the hostile side ---------------------------------------------------------------------------


async def hostile(port: int, args: argparse.Namespace, broker_pid: int) -> tuple[HostileStats, float, float, int]:
    """Play `args.frames` hostile frames over `args.connections` slots; returns the merged stats, the
    start and end (time.monotonic) and the broker's peak RSS while it ran."""
    corpus = strategy_corpus(args.corpus, args.seed)
    frames: int = args.frames
    seconds: float = args.seconds
    slots = [HostileStats() for _ in range(args.connections)]
    peak = [rss(broker_pid)]

    def done() -> bool:
        return sum(s.frames_sent for s in slots) >= frames or time.monotonic() >= start + seconds

    async def sample() -> None:
        next_report = time.monotonic() + 10
        while True:
            peak[0] = max(peak[0], rss(broker_pid))
            if time.monotonic() >= next_report:
                next_report += 10
                sent = sum(s.frames_sent for s in slots)
                print(f"  ... {sent:,} frames sent, broker RSS {rss(broker_pid) / MiB:.0f} MiB", flush=True)
            await trio.sleep(0.2)

    without = frozenset(args.without)
    start = time.monotonic()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        async with trio.open_nursery() as players:
            for i, stats in enumerate(slots):
                log: deque[Move] = deque(maxlen=1)
                players.start_soon(hostile_connection, port, moves(args.seed + i, corpus, None, without), stats,
                                    done, log)
        end = time.monotonic()
        nursery.cancel_scope.cancel()
    total = HostileStats()
    for stats in slots:
        total.merge(stats)
    return total, start, end, peak[0]


async def still_serves(url: str) -> bool:
    try:
        with trio.fail_after(10):
            async with await fc.connect(url, client_name="after-fuzz", timeout=10) as conn:
                await conn.declare_queue("after-fuzz")
        return True
    except Exception:
        return False


def worst_gap(arrivals: list[float], start: float, end: float) -> float:
    times = [start, *(t for t in arrivals if start < t <= end)]
    times.append(next((t for t in arrivals if t > end), end))
    return max(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=1_000_000, help="hostile frames to send")
    parser.add_argument("--connections", type=int, default=4, help="hostile connections at a time")
    parser.add_argument("--seed", type=int, default=1, help="seed of the moves (connection i plays seed + i)")
    parser.add_argument("--corpus", type=int, default=200, help="frames drawn from protocol_strategies")
    parser.add_argument("--quota", default="1GiB", help="the broker's --memory-quota (also its memory watermark)")
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop sending after this long anyway")
    parser.add_argument("--without", nargs="*", default=[], choices=sorted(WEIGHTS), metavar="KIND",
                        help=f"leave out these kinds of move ({', '.join(sorted(WEIGHTS))})")
    parser.add_argument("--profile-broker", metavar="FILE", help="run the broker under cProfile, stats to FILE")
    args = parser.parse_args()

    port = free_port()
    url = f"flowbroker://127.0.0.1:{port}"
    broker = start_broker(port, args.quota, args.profile_broker)
    ctx = mp.get_context("spawn")
    try:
        time.sleep(0.5)
        rss_start = rss(broker.pid)
        stop, out = ctx.Event(), ctx.Queue()
        bystander = ctx.Process(target=bystander_main, args=(url, stop, out))
        bystander.start()
        time.sleep(2.0)  # the bystander is flowing before the first hostile frame
        broker_cpu, own_cpu = cpu_seconds(broker.pid), time.process_time()
        stats, start, end, peak = trio.run(hostile, port, args, broker.pid)
        broker_cpu, own_cpu = cpu_seconds(broker.pid) - broker_cpu, time.process_time() - own_cpu
        rss_end_traffic = rss(broker.pid)
        stop.set()
        try:
            b = out.get(timeout=120)
        except queue.Empty:
            raise RuntimeError("the bystander process did not report") from None
        bystander.join()
        alive = broker.poll() is None and trio.run(still_serves, url)
        time.sleep(1.0)
        rss_end = rss(broker.pid) if broker.poll() is None else 0
    finally:
        stop_broker(broker)

    elapsed = end - start
    print(f"\n== fuzz: {stats.frames_sent:,} hostile frames from {args.connections} connections at a time, "
          f"seed {args.seed}, corpus {args.corpus}" + (f", without {' '.join(args.without)}" if args.without else "")
          + " ==")
    print(f"sent {stats.frames_sent:,} frames ({stats.bytes_sent / MiB:,.1f} MiB) in {elapsed:.1f} s: "
          f"{stats.frames_sent / elapsed:,.0f} frames/s; CPU: broker {broker_cpu:.1f} s, this process "
          f"(generating, sending, decoding the answers) {own_cpu:.1f} s")
    print(f"connections opened {stats.connections:,}, closed by the broker {stats.closed_by_broker:,}, "
          f"refused {stats.refused_connects:,}; sends that waited 2 s: {stats.send_timeouts}; "
          f"undecodable broker output: {len(stats.undecodable)}")
    print("errors answered by the broker, by code:")
    for code, count in stats.errors.most_common():
        print(f"  {code:<20} {count:>10,}  e.g. {stats.error_samples[code][:110]!r}")
    for text in stats.undecodable[:3]:
        print(f"  undecodable: {text}")
    lat = b["latencies"]
    gap = worst_gap(b["arrivals"], start, end)
    during = sum(1 for t in b["arrivals"] if start < t <= end)
    print(f"bystander: sent {b['sent']:,}, received {b['received']:,} ({during:,} while hostile traffic ran), "
          f"{'every one once, in order' if b['losses'] is None else b['losses']}; connection "
          f"{'closed' if b['closed'] else 'open'} at the end")
    print(f"bystander worst stall (longest gap between receipts while hostile traffic ran): {gap * 1000:.1f} ms")
    print(f"bystander end-to-end latency: p50 {percentile(lat, 0.5) / 1e6:.2f} ms, "
          f"p99 {percentile(lat, 0.99) / 1e6:.2f} ms, max {max(lat, default=0) / 1e6:.1f} ms")
    print(f"broker RSS: start {rss_start / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB, "
          f"after the traffic {rss_end_traffic / MiB:.1f} MiB, end {rss_end / MiB:.1f} MiB")
    print(f"broker still serving at the end: {'yes' if alive else 'NO'}")


if __name__ == "__main__":
    main()
