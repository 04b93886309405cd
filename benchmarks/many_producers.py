"""Many producers into one queue, one consumer (issue 16 item 2): what each added producer connection costs the
broker, beside the one-producer run of the same invocation.

For each layout a fresh broker (`flowbroker serve`, default settings: flow control on), one consumer process
(the SDK, prefetch 2,000, acking every message) and producer processes, each holding its share of the
connections (one trio task and one `flowbroker.client.connect` per connection, the SDK's window of 1,000
transfers each), all sending 1 KiB bodies as fast as credit allows. The messages (--messages, default
200,000) are split evenly over the connections; all producers start together once every connection is up.

Layouts (--layouts, default "1x1,10x1,4x25,4x250": processes x connections per process):
  1x1    one producer process, one connection (the baseline)
  10x1   10 producer processes, one connection each
  4x25   100 producer connections over 4 processes
  4x250  1,000 producer connections over 4 processes

Prints per layout msgs/s (first send to last receipt), p50/p99 publish-to-receive latency, and the broker's CPU
time per message (its process, read through psutil before and after the load); then the layouts side by side
with each one's rate and broker CPU relative to the first layout (the issue's target: 10x1 at >= 0.9x the rate
of 1x1, the broker's CPU per message no higher). --rounds R repeats the layouts in alternating order.
--producer-nice N runs the producer processes at that niceness (Linux shares CPU per runnable thread, so
10 producer processes take CPU from the broker and the consumer). --paced runs the broker with `[queues]
pace_producers = true` (docs/policies.md, "Pacing"). --default-gc runs the broker with CPython's default
garbage collector instead of the tuning `flowbroker serve` applies (broker/cli.py, `_tune_garbage_collector`:
the youngest generation every 50,000 allocations, start-up's objects frozen): the "default" rows of
docs/performance.md, "The garbage collector". --profile DIR records the broker under py-spy (when installed) into DIR/LAYOUT-ROUND.txt (collapsed stacks).

    python benchmarks/many_producers.py [--messages 200000] [--layouts 1x1,10x1,4x25,4x250] [--rounds 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

import flowbroker.client as fb
from peers import QUEUE, WINDOW, Server, consumer_main, percentile_ms, setup, start_flowbroker, wait_result, body, STAMP


def producers_main(url: str, connections: int, per_connection: list[int], size: int, up: Any, go: Any,
                   out: Any, nice: int = 0) -> None:
    """`connections` producer connections in one process, connection i sending per_connection[i] messages;
    set `up` once all are connected, start on `go`. `nice`: this process's niceness (os.nice)."""
    if nice:
        os.nice(nice)
    pad = b"x" * (size - STAMP.size)
    cpu = time.process_time()
    result: dict[str, float] = {}

    async def one(i: int, count: int, connected: list[int], all_up: trio.Event, started: trio.Event) -> None:
        # Each connection closes as soon as its messages are complete, as a producer that is done leaves:
        # under the default credit policy only about 30 producers hold a share at once (the rest wait,
        # docs/policies.md), and a waiting one gets its share when a holder leaves.
        async with await fb.connect(url, client_name=f"many-producer-{i}", timeout=120) as conn:
            producer = conn.producer(routing_key=QUEUE, window=WINDOW)
            connected[0] += 1
            if connected[0] == connections:
                all_up.set()
            await started.wait()
            for _ in range(count):
                await producer.send(body(pad), timeout=600)
            await producer.flush(timeout=600)

    async def run() -> None:
        connected = [0]
        all_up, started = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            for i, count in enumerate(per_connection):
                nursery.start_soon(one, i, count, connected, all_up, started)
            await all_up.wait()
            up.set()
            await trio.to_thread.run_sync(go.wait)
            result["start"] = time.monotonic()
            started.set()

    trio.run(run)
    result["cpu"] = time.process_time() - cpu
    out.put(result)


@dataclass
class Result:
    layout: str
    rate: float
    received: int
    p50_ms: float
    p99_ms: float
    broker_us: float
    producers_us: float  # all producer processes together
    consumer_us: float


def run_layout(layout: str, args: argparse.Namespace, round_: int) -> Result:
    processes, per_process = (int(x) for x in layout.split("x"))
    connections = processes * per_process
    share, extra = divmod(args.messages, connections)
    counts = [share + (1 if i < extra else 0) for i in range(connections)]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="many-producers-") as tmp:
        server: Server = start_flowbroker(Path(tmp), paced=args.paced, default_gc=args.default_gc)
        spy: subprocess.Popen[bytes] | None = None
        children: list[Any] = []  # the client processes started here: ended if the run fails
        try:
            setup("flowbroker-latency" if args.latency_bound else "flowbroker", server.url, "memory")
            ready, go = ctx.Event(), ctx.Event()
            cq, pq = ctx.Queue(), ctx.Queue()
            consumer = ctx.Process(target=consumer_main, args=("flowbroker", server.url, args.messages, ready, cq))
            consumer.start()
            children.append(consumer)
            ups = []
            producers = []
            for p in range(processes):
                up = ctx.Event()
                proc = ctx.Process(target=producers_main, args=(
                    server.url, per_process, counts[p * per_process:(p + 1) * per_process], args.size, up, go, pq,
                    args.producer_nice))
                proc.start()
                children.append(proc)
                ups.append(up)
                producers.append(proc)
            if not ready.wait(60) or not all(up.wait(600) for up in ups):
                raise RuntimeError(f"{layout}: the clients did not connect within the time allowed")
            time.sleep(0.5)
            if args.profile:
                spy = subprocess.Popen([args.py_spy, "record", "--pid", str(server.procs[0].pid), "--format", "raw",
                                        "--rate", "200", "--output", str(Path(args.profile) / f"{layout}-{round_}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            cpu = server.cpu_seconds()
            go.set()
            c = wait_result(cq, consumer, "consumer")
            cpu = server.cpu_seconds() - cpu
            results = [wait_result(pq, producers, "producer", 600) for _ in producers]
            starts = [r["start"] for r in results]
            for proc in producers:
                proc.join()
            consumer.join()
        finally:
            if spy is not None:
                spy.send_signal(2)  # py-spy writes its output on SIGINT
                spy.wait(30)
            for child in children:  # a failed run leaves none behind (multiprocessing would wait for them)
                if child.is_alive():
                    child.kill()
                    child.join()
            server.stop()
    elapsed = c["last"] - min(starts)
    return Result(layout, c["received"] / elapsed, c["received"], percentile_ms(c["latencies"], 0.5),
                  percentile_ms(c["latencies"], 0.99), cpu / max(1, c["received"]) * 1e6,
                  sum(r["cpu"] for r in results) / max(1, c["received"]) * 1e6, c["cpu"] / max(1, c["received"]) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000, help="in all, split over the connections")
    parser.add_argument("--layouts", default="1x1,10x1,4x25,4x250", help="processes x connections per process")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--profile", metavar="DIR", help="record the broker with py-spy into DIR")
    parser.add_argument("--latency-bound", action="store_true",
                        help="declare the queue as peers.py's flowbroker-latency does (flow_stop_drain_time 0.03 s, "
                             "resume 0.02 s) instead of with the defaults (size watermarks only)")
    parser.add_argument("--paced", action="store_true",
                        help="run the broker with [queues] pace_producers = true, as peers.py's flowbroker-paced")
    parser.add_argument("--default-gc", action="store_true",
                        help="run the broker with CPython's default garbage collector (youngest generation every 700 "
                             "allocations, nothing frozen) instead of flowbroker serve's tuning (every 50,000, "
                             "start-up frozen)")
    parser.add_argument("--producer-nice", type=int, default=0,
                        help="the producer processes' niceness: how much CPU Linux gives them beside the broker")
    args = parser.parse_args()
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    args.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[Result]] = {layout: [] for layout in layouts}
    print("broker: " + ("CPython's default garbage collector (--default-gc)" if args.default_gc
                        else "flowbroker serve's garbage collector tuning"), flush=True)
    for round_ in range(args.rounds):
        for layout in (layouts if round_ % 2 == 0 else layouts[::-1]):
            r = run_layout(layout, args, round_)
            results[layout].append(r)
            print(f"round {round_ + 1} {layout} ({int(layout.split('x')[0]) * int(layout.split('x')[1]):,} producer "
                  f"connections): {r.rate:,.0f} msgs/s, {r.received:,} received, p50 {r.p50_ms:.1f} ms, p99 "
                  f"{r.p99_ms:.1f} ms; CPU per message: broker {r.broker_us:.2f} us, producers {r.producers_us:.2f} us, "
                  f"consumer {r.consumer_us:.2f} us", flush=True)
    base = layouts[0]
    base_rate = statistics.median(r.rate for r in results[base])
    base_cpu = statistics.median(r.broker_us for r in results[base])
    print("\n| producers (processes x connections) | msgs/s (median) | msgs/s (rounds) | vs " + base
          + " | broker CPU us/msg | vs " + base + " | producers CPU us/msg | consumer CPU us/msg |")
    print("|---|---|---|---|---|---|---|---|")
    for layout, rs in results.items():
        rate = statistics.median(r.rate for r in rs)
        cpu = statistics.median(r.broker_us for r in rs)
        # (a CPU time under the clock's tick, 10 ms, reads 0 for a short run: no ratio then)
        cpu_ratio = f"{cpu / base_cpu:.2f}x" if base_cpu > 0 else "n/a"
        print(f"| {layout} | {rate:,.0f} | {' / '.join(f'{r.rate:,.0f}' for r in rs)} | {rate / base_rate:.2f}x "
              f"| {cpu:.2f} | {cpu_ratio} | {statistics.median(r.producers_us for r in rs):.2f} "
              f"| {statistics.median(r.consumer_us for r in rs):.2f} |")


if __name__ == "__main__":
    main()
