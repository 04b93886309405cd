"""Durable against memory-only, end to end, in the same run: a broker process, a producer process and a
consumer process on 127.0.0.1, 1 KiB messages, flow control on (the producer's window: 1000 transfers).

Each round runs the throughput scenario twice on fresh brokers, once with the queue declared durable (its
journal in a temporary directory on this machine's disk, fsync "always") and once memory-only, alternating
which goes first so that drift on a shared machine falls on both. Prints each run's end-to-end msgs/s, the
durable runs' group commits and fsyncs per second (from the broker's own count, logged at shutdown), and the
ratio of the means.

    python benchmarks/durable_throughput.py [--count 200000] [--rounds 3] [--size 1024] [--data-dir DIR]

The brokers' journals and logs go under --data-dir DIR, kept afterwards; without it, under a temporary
directory (flowbroker-bench-*) that is removed at the end, or kept (and named) if the run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import flowbroker.client as fb
from broker_throughput import QUEUE, consumer_main, producer_main
from procs import free_port, stop_broker, wait_listening

JOURNAL_LINE = re.compile(r"journal: (\d+) commits, (\d+) fsyncs, (\d+) records, (\d+) bytes written")


async def declare(url: str, durable: bool) -> None:
    async with await fb.connect(url, client_name="bench-probe") as conn:
        await conn.declare_queue(QUEUE, durable=durable)


def run(args: argparse.Namespace, durable: bool, data_dir: Path) -> dict[str, float]:
    port = free_port()
    url = f"flowbroker://127.0.0.1:{port}"
    log = data_dir / f"broker-{port}.log"
    exe = Path(sys.executable).with_name("flowbroker")
    with open(log, "wb") as err:
        broker = wait_listening(subprocess.Popen(
            [str(exe), "serve", "--port", str(port), "--no-admin", "--no-udp", "--no-metrics", "--memory-quota",
             args.quota, "--data-dir", str(data_dir / f"data-{port}")], stderr=err), port)
    ctx = mp.get_context("spawn")
    try:
        trio.run(declare, url, durable)
        pq, cq = ctx.Queue(), ctx.Queue()
        consumer = ctx.Process(target=consumer_main, args=(url, args.count, 0.0, 10, cq))
        consumer.start()
        time.sleep(1.5)  # subscribed before the first message
        producer = ctx.Process(target=producer_main,
                               args=(url, args.count, args.size, 0.0, float("inf"), args.window, pq))
        producer.start()
        c: dict[str, Any] | None = None
        while c is None:
            try:
                c = cq.get(timeout=0.5)
            except queue.Empty:
                if not consumer.is_alive():
                    raise RuntimeError("the consumer process died") from None
        p = pq.get(timeout=120)
        producer.join()
        consumer.join()
    finally:
        stop_broker(broker)
    elapsed = c["last"] - p["start"]
    out = {"msgs": c["received"] / elapsed, "seconds": elapsed}
    found = JOURNAL_LINE.search(log.read_text())
    if durable:
        if found is None:
            raise RuntimeError(f"the durable broker logged no journal counters ({log})")
        commits, fsyncs = int(found.group(1)), int(found.group(2))
        out.update(commits=commits / elapsed, fsyncs=fsyncs / elapsed, per_commit=args.count / max(1, commits))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--quota", default="200MiB")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the brokers' journals and logs go, kept afterwards "
                             "[default: a temporary directory, removed at the end unless the run fails]")
    args = parser.parse_args()
    base = args.data_dir or Path(tempfile.mkdtemp(prefix="flowbroker-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    failed = False
    try:
        for r in range(args.rounds):
            for durable in ((True, False) if r % 2 == 0 else (False, True)):
                res = run(args, durable, base)
                results[durable].append(res)
                line = f"round {r + 1} {'durable    ' if durable else 'memory-only'}: {res['msgs']:,.0f} msgs/s"
                if durable:
                    line += (f", {res['commits']:,.0f} commits/s, {res['fsyncs']:,.0f} fsyncs/s, "
                             f"{res['per_commit']:.0f} messages per commit")
                print(line, flush=True)
    except Exception:
        failed = True
        raise
    finally:
        if args.data_dir is None:
            if failed:
                print(f"the run failed: its brokers' logs and journals are kept under {base}", file=sys.stderr)
            else:
                shutil.rmtree(base, ignore_errors=True)
    durable_mean = statistics.mean(r["msgs"] for r in results[True])
    memory_mean = statistics.mean(r["msgs"] for r in results[False])
    where = f"under {base}" if args.data_dir is not None else "in a temporary directory, now removed"
    print(f"\n{args.count:,} messages of {args.size} B per run, {args.rounds} round(s), journals {where}")
    print(f"durable {durable_mean:,.0f} msgs/s, memory-only {memory_mean:,.0f} msgs/s: "
          f"durable is {durable_mean / memory_mean:.0%} of memory-only")


if __name__ == "__main__":
    main()
