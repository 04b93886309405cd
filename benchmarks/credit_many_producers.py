"""Many producers under the aggressive credit policy against one slow consumer, on 127.0.0.1.

A broker process (`flowbroker serve --credit-policy aggressive --memory-quota Q`), one queue, a consumer
process paced to a fixed rate, and N producer connections (default 200) spread over a few processes,
each connection a trio task with its own `flowbroker.client.connect`, sending numbered messages
`producer_id:seq` as fast as credit allows. Connections join in a ramp, so the aggressive policy
recomputes every buffer and pushes it as they come (5 % of Q / N, clamped to [min, max]); a share of
them leave midway (after a flush) and rejoin as new producers, to resize every buffer under load.

Every second it prints the broker's RSS and its growth over idle, the queue depth (count / bytes, from
a short-lived connection's `declare_queue`), the sum of the buffers the broker granted (each producer
process sums `conn.sender_window.window` over its live connections once a second; the parent adds the
processes up) and the number of live producer connections. After the load the consumer drains the
queue at full speed, and the script checks that every message a producer saw completed by `flush()`
arrived exactly once (no loss, no duplicate, nothing unknown), that no message was refused, and the
target: peak RSS <= idle + the queue's stop size + the peak sum of granted buffers + 64 MiB.

The queue's hard limit (default max_size 100 MiB, stop at 80 %) refuses whatever goes beyond it, and
the depth can reach stop size + everything in flight (the granted buffers, each overflowed by at most
one message). So the default clamp [10 MiB, 50 MiB] cannot work for 200 connections (200 x 10 MiB in
flight); this benchmark sets the clamp with --min-buffer/--max-buffer (a [credit] table in a generated
TOML file) and picks the quota so that even the bytes in flight during the ramp fit in the queue's headroom:
while the queue is saturated no credit comes back, so connections keep what they were granted before a
shrink (before the credit pool, every newcomer added its share on top; now the pool charges those
promises, so the granted sum stays within 5 % of Q and newcomers get what is left or wait); the default Q = 64 MiB gives 16 KiB per connection at N = 200,
under min_size, so the floor (32 KiB) applies there, the share is inside the clamp up to N = 100 and at
max_size up to N = 3. With --quota 256MiB the ramp can put ~47 MiB in flight on top of the 80 MiB stop size
and the queue's 100 MiB hard limit refuses messages (QUEUE_FULL).

    python benchmarks/credit_many_producers.py [--quota 64MiB] [--seconds 30] [--producers 200] ... [--keep]

The broker's config and log go to a temporary directory (flowbroker-bench-*), removed at the end unless
--keep is given or the run failed (it raised, a check above failed, or the broker logged an error): then
the script prints the directory's path and keeps it.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

import flowbroker.client as fb
from flowbroker.policies.credit import CreditPolicyConfig, aggressive_size
from flowbroker.policies.overflow import Thresholds
from flowbroker.broker.cli import parse_size
from procs import free_port, rss, stop_broker

MiB = 1024 * 1024
KiB = 1024
QUEUE = "many"
TARGET_SLACK = 64 * MiB


# -- the broker process -------------------------------------------------------------------------


def start_broker(port: int, quota: int, config: Path, log: Any) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("flowbroker")
    cmd = [str(exe), "serve", "--port", str(port), "--host", "127.0.0.1", "--no-admin", "--no-udp", "--credit-policy", "aggressive",
           "--memory-quota", str(quota), "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the broker exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    stop_broker(proc)
    raise RuntimeError("broker did not start within 15 s")


async def _declare(url: str, arguments: dict[str, int]) -> dict[str, Any]:
    async with await fb.connect(url, flow_control=False, client_name="bench-probe", timeout=5) as conn:
        result: dict[str, Any] = await conn.declare_queue(QUEUE, **arguments, timeout=5)  # type: ignore[arg-type]
        return result


async def _depth(url: str) -> tuple[int, int]:
    with trio.fail_after(5):
        async with await fb.connect(url, flow_control=False, client_name="bench-probe", timeout=5) as conn:
            result = await conn.declare_queue(QUEUE, timeout=5)
    return int(result["count"]), int(result["size"])


# -- the schedule, shared by every process --------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    url: str
    t0: float  # time.monotonic() of second 0 (CLOCK_MONOTONIC is shared by the processes of one machine)
    seconds: float
    ramp: float
    producers: int
    processes: int
    size: int
    window: int
    churn_every: int  # every churn_every-th connection leaves and rejoins (0: none)
    leave_at: float
    rejoin_after: float
    flush_timeout: float

    def join_at(self, index: int) -> float:
        return self.t0 + self.ramp * index / max(1, self.producers)

    def churns(self, index: int) -> bool:
        return self.churn_every > 0 and index % self.churn_every == self.churn_every - 1


@dataclass
class Incarnation:
    """One producer connection's life: what it sent, and whether flush() saw all of it completed."""

    producer_id: str
    sent: int = 0
    completed: int = 0
    failed: int = 0
    flushed: bool = False
    error: str = ""


@dataclass
class ProcState:
    live: dict[str, fb.Connection] = field(default_factory=dict)
    sent: int = 0


# -- producer processes ---------------------------------------------------------------------------


def producer_process(plan: Plan, proc_index: int, samples: Any, results: Any) -> None:
    """Run this process's share of the producer connections; report per-second samples and, at the end,
    one record per connection incarnation."""
    mine = [i for i in range(plan.producers) if i % plan.processes == proc_index]
    state = ProcState()
    done: list[Incarnation] = []
    end = plan.t0 + plan.seconds

    async def sleep_until(at: float) -> None:
        await trio.sleep(max(0.0, at - time.monotonic()))

    async def session(producer_id: str, until: float) -> None:
        inc = Incarnation(producer_id)
        done.append(inc)
        pad = b"." * max(0, plan.size - len(producer_id) - 12)
        prefix = producer_id.encode() + b":"
        try:
            async with await fb.connect(plan.url, client_name=f"bench-{producer_id}", timeout=30) as conn:
                state.live[producer_id] = conn
                try:
                    producer = conn.producer(routing_key=QUEUE, window=plan.window)
                    seq = 0
                    while True:
                        left = until - time.monotonic()
                        if left <= 0:
                            break
                        try:
                            await producer.send(prefix + str(seq).encode() + b"|" + pad, timeout=left)
                        except fb.FlowControlTimeout:
                            break  # nothing was sent: the deadline passed while waiting for credit
                        seq += 1
                        inc.sent = seq
                        state.sent += 1
                    try:
                        await producer.flush(timeout=plan.flush_timeout)
                        inc.flushed = True
                    except fb.FlowControlTimeout as exc:
                        inc.error = f"flush: {exc}"
                    except fb.PublishError as exc:
                        inc.error = f"refused: {type(exc).__name__}: {exc}"
                    stats = producer.stats
                    inc.completed, inc.failed = stats.completed, stats.failed
                finally:
                    state.live.pop(producer_id, None)
        except fb.FlowbrokerError as exc:
            inc.error = inc.error or f"{type(exc).__name__}: {exc}"

    async def connection(index: int) -> None:
        await sleep_until(plan.join_at(index))
        if plan.churns(index):
            # Leave at a spread of times in the middle of the load, rejoin as a new producer.
            leave = plan.t0 + plan.leave_at + (index % 7) * 0.3
            await session(f"p{index}.0", leave)
            await sleep_until(max(time.monotonic(), leave) + plan.rejoin_after)
            if time.monotonic() < end - 1:
                await session(f"p{index}.1", end)
        else:
            await session(f"p{index}.0", end)

    async def sampler() -> None:
        # Second k is sampled at t0 + k: the sum of the buffers this process was granted, live
        # connections, messages sent so far.
        k = 0
        while True:
            await sleep_until(plan.t0 + k)
            granted = sum(conn.sender_window.window for conn in state.live.values())
            samples.put((k, proc_index, granted, len(state.live), state.sent))
            k += 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            async with trio.open_nursery() as conns:
                for index in mine:
                    conns.start_soon(connection, index)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        results.put(("producers", proc_index, [vars(inc) for inc in done]))


# -- the consumer process ----------------------------------------------------------------------------


def consumer_process(url: str, rate: float, prefetch: int, drain: Any, finish: Any, results: Any) -> None:
    """Receive at `rate` msgs/s until `drain` is set, then at full speed; stop once `finish` is set and
    nothing arrived for half a second. Records every message id it received."""

    async def run() -> dict[str, Any]:
        seqs: dict[str, list[int]] = collections.defaultdict(list)
        received = 0
        redelivered = 0
        malformed = 0
        first = time.monotonic()
        drain_started: float | None = None
        drain_count = 0
        async with await fb.connect(url, flow_control=False, client_name="bench-consumer", timeout=10) as conn:
            async with conn.consumer(QUEUE, prefetch=prefetch) as consumer:
                results.put(("consumer-ready",))
                while True:
                    try:
                        msg = await consumer.receive(timeout=0.5)
                    except fb.ReceiveTimeout:
                        if finish.is_set():
                            break
                        continue
                    ident, sep, _ = msg.body.partition(b"|")
                    producer_id, colon, seq = ident.rpartition(b":")
                    if not sep or not colon:
                        malformed += 1
                    else:
                        seqs[producer_id.decode()].append(int(seq))
                    redelivered += msg.redelivered
                    received += 1
                    await msg.ack()
                    if drain_started is None:
                        if drain.is_set():
                            drain_started = time.monotonic()
                            drain_count = received
                        else:
                            delay = first + received / rate - time.monotonic()
                            if delay > 0:
                                await trio.sleep(delay)
        drained = received - drain_count if drain_started is not None else 0
        return {
            "received": received,
            "redelivered": redelivered,
            "malformed": malformed,
            "seqs": dict(seqs),
            "drained": drained,
            "drain_seconds": (time.monotonic() - drain_started) if drain_started else 0.0,
        }

    try:
        result = trio.run(run)
    except BaseException as exc:
        results.put(("consumer", {"error": f"{type(exc).__name__}: {exc}"}))
        raise
    results.put(("consumer", result))


# -- the parent --------------------------------------------------------------------------------------


def describe_clamp(policy: CreditPolicyConfig, producers: int) -> str:
    pool = policy.aggressive_pool_bytes
    share = pool // producers
    if share < policy.min_size:
        where = f"below min: every connection gets min_size {policy.min_size / KiB:.0f} KiB (floor)"
    elif share > policy.max_size:
        where = f"above max: every connection gets max_size {policy.max_size / KiB:.0f} KiB"
    else:
        where = "inside [min, max]"
    at_max = pool // policy.max_size  # connection counts up to this one get max_size
    return (f"pool 5 % x Q = {pool / MiB:.2f} MiB; at N={producers}: {share / KiB:.1f} KiB each, {where}; "
            f"clamp [{policy.min_size / KiB:.0f} KiB, {policy.max_size / KiB:.0f} KiB]; "
            f"N <= {at_max} hit max_size (ramp start)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quota", default="64MiB", help="broker memory quota Q (the pool is 5 %% of it)")
    parser.add_argument("--min-buffer", default="32KiB", help="aggressive clamp minimum ([credit] min_size)")
    parser.add_argument("--max-buffer", default="1MiB", help="aggressive clamp maximum ([credit] max_size)")
    parser.add_argument("--flow-stop-size", default=None, help="the queue's flow_stop_size (default: broker default)")
    parser.add_argument("--producers", type=int, default=200)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of the load")
    parser.add_argument("--ramp", type=float, default=6.0, help="seconds over which producers join")
    parser.add_argument("--churn-every", type=int, default=10, help="every Nth connection leaves and rejoins (0: off)")
    parser.add_argument("--leave-at", type=float, default=12.0, help="second at which churning connections leave")
    parser.add_argument("--rejoin-after", type=float, default=2.0)
    parser.add_argument("--consumer-rate", type=float, default=5000.0, help="the slow consumer's msgs/s")
    parser.add_argument("--prefetch", type=int, default=500)
    parser.add_argument("--size", type=int, default=1024, help="message body size in bytes")
    parser.add_argument("--window", type=int, default=1000, help="each producer's window of uncompleted transfers")
    parser.add_argument("--flush-timeout", type=float, default=90.0)
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (the broker's config and log) [default: removed at the end, "
                             "unless the run failed]")
    args = parser.parse_args()

    quota = parse_size(args.quota)
    min_buffer, max_buffer = parse_size(args.min_buffer), parse_size(args.max_buffer)
    policy = CreditPolicyConfig.from_mapping(
        {"quota": quota, "policy": "aggressive", "min_size": min_buffer, "max_size": max_buffer})
    queue_args: dict[str, int] = {}
    if args.flow_stop_size is not None:
        stop = parse_size(args.flow_stop_size)
        queue_args["flow_stop_size"] = stop
        queue_args["flow_resume_size"] = stop * 7 // 8
    thresholds = Thresholds(flow_stop_size=queue_args.get("flow_stop_size"),
                            flow_resume_size=queue_args.get("flow_resume_size"))  # the broker's defaults
    stop_size = thresholds.flow_stop_size
    policy_peak = max(n * aggressive_size(policy, n) for n in range(1, args.producers + 1))

    workdir = Path(tempfile.mkdtemp(prefix="flowbroker-bench-"))
    config = workdir / "broker.toml"
    config.write_text(f"[credit]\nmin_size = {min_buffer}\nmax_size = {max_buffer}\n")
    port = free_port()
    url = f"flowbroker://127.0.0.1:{port}"
    log_path = workdir / "broker.log"
    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    print(f"== {args.producers} producer connections in {args.processes} processes, aggressive policy, "
          f"Q = {quota / MiB:.0f} MiB, one consumer at {args.consumer_rate:,.0f} msgs/s, "
          f"{args.size} B messages, {args.seconds:.0f} s ==")
    print(describe_clamp(policy, args.producers))
    print(f"queue {QUEUE!r}: flow_stop_size {stop_size / MiB:.1f} MiB, resume {thresholds.flow_resume_size / MiB:.1f} "
          f"MiB, max_size {thresholds.max_size / MiB:.1f} MiB (overflow reject); "
          f"policy's largest possible granted sum over 1..{args.producers} connections: {policy_peak / MiB:.2f} MiB")
    # While the queue is saturated nothing is completed, so no credit comes back: a connection whose buffer
    # shrinks keeps what it already has in flight, and each newcomer adds its whole share. Connections that
    # join during saturation can therefore have sum(size(i) for i in 1..N) in flight, not just the pool.
    ramp_inflight = sum(aggressive_size(policy, i) for i in range(1, args.producers + 1))
    ramp_inflight += args.producers * (args.size + 64)
    headroom = thresholds.max_size - stop_size
    print(f"in flight if every connection joins while the queue is saturated: sum of shares at join "
          f"= {ramp_inflight / MiB:.2f} MiB; queue headroom max_size - stop = {headroom / MiB:.1f} MiB")
    if thresholds.max_size and ramp_inflight > headroom:
        print("WARNING: that exceeds the headroom: QUEUE_FULL refusals are possible during the ramp")

    keep = args.keep
    try:
        with open(log_path, "wb") as log:
            broker = start_broker(port, quota, config, log)
            try:
                passed = run(args, url, broker, ctx, procs, queue_args, stop_size, policy)
            finally:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                        p.join(5)
                stop_broker(broker)
        text = log_path.read_text(errors="replace").strip().splitlines()
        noteworthy = [line for line in text if " WARNING " in line or " ERROR " in line or "Traceback" in line]
        failed = not passed or any(" ERROR " in line or "Traceback" in line for line in noteworthy)
        keep = keep or failed
        if noteworthy:
            where = f" ({log_path}, kept)" if keep else " (removed with its temporary directory; --keep keeps it)"
            print(f"broker log{where}: {len(noteworthy)} warning/error line(s), first ones:")
            for line in noteworthy[:10]:
                print("   ", line[:200])
    except Exception:
        keep = True
        print(f"the run failed: the broker's log is kept at {log_path}", file=sys.stderr)
        raise
    finally:
        if keep:
            print(f"work directory kept (the broker's config and log): {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, url: str, broker: subprocess.Popen[bytes], ctx: Any, procs: list[Any],
        queue_args: dict[str, int], stop_size: int, policy: CreditPolicyConfig) -> bool:
    """The run; True when report() found it passed (exactly once, within both bounds)."""
    trio.run(_declare, url, queue_args)
    time.sleep(0.5)
    idle = rss(broker.pid)
    samples, results = ctx.Queue(), ctx.Queue()
    drain, finish = ctx.Event(), ctx.Event()
    consumer = ctx.Process(target=consumer_process,
                           args=(url, args.consumer_rate, args.prefetch, drain, finish, results))
    consumer.start()
    procs.append(consumer)
    got: dict[str, Any] = {}
    producer_records: list[dict[str, Any]] = []
    finished: set[int] = set()  # producer processes that reported their records

    def take(block_for: float) -> None:
        try:
            item = results.get(timeout=block_for)
        except queue.Empty:
            return
        if item[0] == "producers":
            finished.add(item[1])
            producer_records.extend(item[2])
            got.setdefault("producer_procs", 0)
            got["producer_procs"] += 1
        else:
            got[item[0]] = item[1] if len(item) > 1 else True

    deadline = time.monotonic() + 20
    while "consumer-ready" not in got and "consumer" not in got and time.monotonic() < deadline:
        take(0.2)
    if "consumer-ready" not in got:
        raise RuntimeError(f"the consumer did not subscribe: {got.get('consumer')}")

    plan = Plan(url=url, t0=time.monotonic() + 3.0, seconds=args.seconds, ramp=args.ramp,
                producers=args.producers, processes=args.processes, size=args.size, window=args.window,
                churn_every=args.churn_every, leave_at=args.leave_at, rejoin_after=args.rejoin_after,
                flush_timeout=args.flush_timeout)
    for i in range(args.processes):
        p = ctx.Process(target=producer_process, args=(plan, i, samples, results))
        p.start()
        procs.append(p)
    producers = procs[1:]

    print(f"broker idle RSS {idle / MiB:.1f} MiB")
    print(f"{'t':>4}  {'RSS MiB':>8} {'growth':>7}  {'queue msgs':>10} {'MiB':>6}  {'granted MiB':>11} "
          f"{'live':>4}  {'sent/s':>7}  {'target MiB':>10}")
    per_second: dict[int, dict[int, tuple[int, int, int]]] = collections.defaultdict(dict)
    last_known: dict[int, tuple[int, int, int]] = {}
    peak = idle
    peak_at = 0.0
    peak_granted = 0
    max_depth = (0, 0)
    last_sent = 0
    rows: list[tuple[int, int, int, int, int, int]] = []
    k = 1
    drain_set = False
    probe_failures = 0
    load_end = plan.t0 + plan.seconds
    while True:
        now = time.monotonic()
        # sample RSS often for the peak; print a row per second
        r = rss(broker.pid)
        if r > peak:
            peak, peak_at = r, now - plan.t0
        while True:
            try:
                sk, pi, granted, live, sent = samples.get_nowait()
            except queue.Empty:
                break
            per_second[sk][pi] = (granted, live, sent)
        take(0.0)
        if not drain_set and now >= load_end:
            drain.set()
            drain_set = True
            print(f"-- load ends at t={plan.seconds:.0f}: producers flush and leave, the consumer drains at full speed --")
        if now >= plan.t0 + k + 0.3:
            try:
                count, size = trio.run(_depth, url)
            except (trio.TooSlowError, fb.FlowbrokerError) as exc:
                print(f"{k:4d}  queue depth probe failed: {type(exc).__name__} (the broker did not answer within 5 s)")
                probe_failures += 1
                count, size = -1, 0
            r = rss(broker.pid)  # the row's RSS, taken with its queue depth
            if r > peak:
                peak, peak_at = r, time.monotonic() - plan.t0
            max_depth = max(max_depth, (size, count))
            row = per_second.get(k, {})
            for pi in range(args.processes):
                if pi in row:
                    last_known[pi] = row[pi]
                elif not producers[pi].is_alive() or pi in finished:
                    row[pi] = (0, 0, last_known.get(pi, (0, 0, 0))[2])  # that process has ended
            granted = sum(v[0] for v in row.values())
            live = sum(v[1] for v in row.values())
            sent = sum(v[2] for v in row.values())
            complete = len(row) == args.processes
            if complete:
                peak_granted = max(peak_granted, granted)
            target = idle + stop_size + peak_granted + TARGET_SLACK
            mark = "" if complete else f" (samples from {len(row)} of {args.processes} processes)"
            print(f"{k:4d}  {r / MiB:8.1f} {(r - idle) / MiB:+7.1f}  {count:10,d} {size / MiB:6.1f}  "
                  f"{granted / MiB:11.2f} {live:4d}  {sent - last_sent:7,d}  {target / MiB:10.1f}{mark}")
            rows.append((k, r, count, size, granted, live))
            if complete:
                last_sent = sent
            k += 1
            if all(not p.is_alive() for p in producers) and got.get("producer_procs", 0) == len(producers):
                if count == 0 or probe_failures > 20:
                    break
                if now > load_end + args.flush_timeout + args.drain_timeout:
                    print("TIMEOUT: the queue did not drain")
                    break
        if now > load_end + args.flush_timeout + args.drain_timeout + 30:
            print("TIMEOUT: producers did not finish")
            break
        time.sleep(0.1)
    finish.set()
    deadline = time.monotonic() + 30
    while "consumer" not in got and time.monotonic() < deadline:
        take(0.2)
    for p in procs:
        p.join(10)
    return report(args, got, producer_records, idle, peak, peak_at, peak_granted, stop_size, max_depth, policy)


def report(args: argparse.Namespace, got: dict[str, Any], records: list[dict[str, Any]], idle: int, peak: int,
           peak_at: float, peak_granted: int, stop_size: int, max_depth: tuple[int, int],
           policy: CreditPolicyConfig) -> bool:
    """Print the outcome; True when every message arrived exactly once and both bounds held."""
    c = got.get("consumer")
    print()
    incarnations = len(records)
    sent = sum(r["sent"] for r in records)
    refused = sum(r["failed"] for r in records)
    unflushed = [r for r in records if not r["flushed"]]
    print(f"producers: {incarnations} connection incarnations ({incarnations - args.producers} rejoins), "
          f"{sent:,} messages sent, {sent / args.seconds:,.0f} msgs/s average; refused by the broker: {refused}")
    for r in unflushed[:5]:
        print(f"   not confirmed by flush: {r['producer_id']} sent {r['sent']} completed {r['completed']}: {r['error']}")
    if not c or "error" in c:
        print(f"consumer failed: {c}")
        return False
    print(f"consumer: {c['received']:,} received ({c['redelivered']} redelivered, {c['malformed']} malformed); "
          f"drained {c['drained']:,} at full speed in {c['drain_seconds']:.1f} s; "
          f"max depth seen {max_depth[1]:,} msgs / {max_depth[0] / MiB:.1f} MiB")
    seqs: dict[str, list[int]] = c["seqs"]
    by_id = {r["producer_id"]: r for r in records}
    lost = dup = unknown = out_of_order = 0
    uncertain = 0  # sent but not confirmed complete by flush: may or may not have arrived
    examples: list[str] = []
    for pid, r in by_id.items():
        got_seqs = seqs.get(pid, [])
        counts = collections.Counter(got_seqs)
        d = sum(n - 1 for n in counts.values() if n > 1)
        u = sum(1 for s in counts if s >= r["sent"] or s < 0)
        out_of_order += sum(1 for a, b in zip(got_seqs, got_seqs[1:]) if b < a)
        if r["flushed"]:
            missing = [s for s in range(r["sent"]) if s not in counts]
        else:
            missing = []
            uncertain += r["sent"] - sum(1 for s in range(r["sent"]) if s in counts)
        lost += len(missing)
        dup += d
        unknown += u
        if (missing or d or u) and len(examples) < 5:
            examples.append(f"{pid}: sent {r['sent']}, lost {missing[:5]}, dups {d}, unknown {u}")
    for pid in seqs.keys() - by_id.keys():
        unknown += len(seqs[pid])
        examples.append(f"{pid}: {len(seqs[pid])} messages from a producer nobody reported")
    ok = lost == dup == unknown == refused == 0 and not unflushed and c["received"] == sent
    print(f"exactly once: {'OK' if ok else 'FAILED'} — {c['received']:,} received of {sent:,} sent; lost {lost}, "
          f"duplicated {dup}, unknown {unknown}, refused {refused}, unconfirmed-and-missing {uncertain}; "
          f"per-producer order inversions {out_of_order}")
    for e in examples:
        print("   ", e)
    bound = stop_size + peak_granted + args.producers * (args.size + 64)
    print(f"queue peak {max_depth[0] / MiB:.1f} MiB (sampled once a second) vs stop + peak granted + one message "
          f"per connection = {bound / MiB:.1f} MiB: {'within' if max_depth[0] <= bound else 'OVER'}")
    target = idle + stop_size + peak_granted + TARGET_SLACK
    verdict = "within" if peak <= target else "OVER"
    print(f"peak sum of granted buffers {peak_granted / MiB:.2f} MiB (policy pool {policy.aggressive_pool_bytes / MiB:.2f} MiB)")
    print(f"peak RSS {peak / MiB:.1f} MiB at t={peak_at:.1f} s = idle {idle / MiB:.1f} + {(peak - idle) / MiB:.1f} MiB; "
          f"target idle + stop {stop_size / MiB:.1f} + granted {peak_granted / MiB:.2f} + 64 MiB = "
          f"{target / MiB:.1f} MiB: {verdict} the target")
    return ok and max_depth[0] <= bound and peak <= target


if __name__ == "__main__":
    main()
