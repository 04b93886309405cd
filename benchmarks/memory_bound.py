"""The broker's memory bound against clients that try to break it (issue 8, item 3).

Runs a broker process with a small memory quota and, one scenario at a time, clients that try to make
it grow; prints the broker's RSS every second and its peak beside the bound the docs promise:

  unpaced    producers without flow control publish 64 KiB messages as fast as they can into a queue
             whose limits are off (max_size 0, no thresholds): the memory alarm must refuse them
             (RESOURCE_EXHAUSTED) once the bytes held reach the watermark.
  producers  1,000 flow-controlled producer connections, half of them idle, the rest publishing into a
             queue nobody consumes: the queue's stop threshold holds them, and the credit granted
             (provisional grants included) stays within the policy's pool.
  slowloris  30 connections each begin an 8 MiB TRANSFER and send it a byte at a time: the partial-frame
             budget and the frame deadline bound what they hold.
  queues     100,000 queues declared with a binding each (max_queues, max_bindings).
  fanout     4 flow-controlled SDK producers publish 1-byte bodies to a fanout exchange over 600 queues
             nobody consumes: past the memory alarm, what they send is parked, one copy each
             (broker/parking.py), not copied into 600 queues (a tester: 7.6 times the bound's growth).

The bound printed is idle RSS + memory watermark + credit pool + partial-frame budget + 84 KiB per
connection + 5.5 KiB per queue the broker allows (see docs/architecture.md, "Bounded everything").
The 84 KiB per connection are two terms of that bound: the 64 KiB of undecoded input every connection
may hold outside the partial-frame budget (one read, broker/server.py RECEIVE_SIZE, the budget's
`allowance` in broker/framebudget.py), and about 20 KiB of session state (sockets, tasks, the session;
measured on 2026-11-26 with a throwaway script: 300 to 2,000 idle SDK connections grew a broker process
by 18-20 KiB each, 1,000 that had each published one 1 KiB message, since purged, by 21 KiB each). The 5.5 KiB per queue is what the queues scenario measures (5.3 KiB on
2026-11-28, idle + 519.4 MiB; 3.9 KiB on 2026-11-26, before the queue's drain and pacing state), rounded up; a
queue with a long non-ASCII name costs more (docs/architecture.md). Nothing here asserts: it prints.

    python benchmarks/memory_bound.py [unpaced|producers|slowloris|queues|fanout|all] [--seconds 20] [--quota 256MiB]
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

import flowbroker.client as fb
from flowbroker.broker.cli import parse_size
from flowbroker.broker.server import RECEIVE_SIZE
from flowbroker.protocol import PROTOCOL_VERSION, Connection, Hello, Role
from procs import free_port, rss, stop_broker, wait_listening

MiB = 1024 * 1024
PARTIAL_BUDGET = 64 * MiB  # [server] max_partial_frame_bytes default (docs/configuration.md)
SESSION = 20 * 1024  # a connection's session state, measured (see above)
PER_CONNECTION = RECEIVE_SIZE + SESSION  # its free read allowance (64 KiB) + its session state
PER_QUEUE = 5632  # an empty queue with one binding, short names (measured by the queues scenario: 5.3 KiB, 2026-11-28)
MAX_QUEUES = 100_000  # [server] max_queues default


def start_broker(port: int, config: str, folder: Path) -> subprocess.Popen[bytes]:
    path = folder / "flowbroker.toml"
    path.write_text(config)
    exe = Path(sys.executable).with_name("flowbroker")
    proc = subprocess.Popen([str(exe), "serve", "--config", str(path), "--port", str(port), "--no-admin", "--no-udp"],
                            stderr=subprocess.DEVNULL)
    return wait_listening(proc, port)


class RssWatch:
    """Samples the broker's RSS every 0.1 s in a thread; prints it once a second."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last_print = time.monotonic()
        start = last_print
        while not self._stop.wait(0.1):
            try:
                value = rss(self.pid)
            except Exception:
                return
            self.peak = max(self.peak, value)
            if time.monotonic() - last_print >= 1:
                last_print = time.monotonic()
                print(f"  t={last_print - start:5.1f}s  broker RSS {value / MiB:8.1f} MiB", flush=True)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- the attacks --------------------------------------------------------------------------------


async def unpaced(url: str, seconds: float) -> str:
    body = b"u" * 65536
    counts = {"sent": 0, "refused": 0}
    async with await fb.connect(url, client_name="setup", flow_control=False) as conn:
        await conn.declare_queue("sink", max_size=0, flow_stop_size=0, flow_resume_size=0)

    async def one(i: int) -> None:
        async with await fb.connect(url, client_name=f"unpaced-{i}", flow_control=False) as conn:
            producer = conn.producer(routing_key="sink", window=64)
            end = trio.current_time() + seconds
            while trio.current_time() < end:
                await producer.send(body, timeout=30)
                counts["sent"] += 1
            try:
                await producer.flush(timeout=30)
            except fb.FlowbrokerError:
                pass
            counts["refused"] += producer.stats.failed

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
    return f"sent {counts['sent']:,} messages of 64 KiB, refused {counts['refused']:,}"


async def producers(url: str, seconds: float) -> str:
    async with await fb.connect(url, client_name="setup") as conn:
        await conn.declare_queue("held", flow_stop_size=32 * MiB, flow_resume_size=24 * MiB)
    body = b"p" * 1024
    counts = {"sent": 0, "held": 0, "refused": 0}

    async def one(i: int, ready: trio.Event) -> None:
        # Leaving the block raises PublishFailures for what the stopped queue still holds: that is the
        # scenario's point (nobody consumes "held"), so it is counted, not raised (docs/client.md).
        try:
            async with await fb.connect(url, client_name=f"producer-{i}", timeout=60) as conn:
                ready.set()
                if i % 2:
                    await trio.sleep(seconds)  # idle: holds only its provisional grant
                    return
                producer = conn.producer(routing_key="held")
                with trio.move_on_after(seconds):
                    while True:
                        try:
                            await producer.send(body, timeout=1)
                            counts["sent"] += 1
                        except fb.FlowControlTimeout:
                            pass
        except fb.PublishFailures as exc:
            counts["held"] += exc.unconfirmed
            counts["refused"] += exc.failed

    async with trio.open_nursery() as nursery:
        for i in range(1000):
            ready = trio.Event()
            nursery.start_soon(one, i, ready)
            await ready.wait()
    return (f"1,000 connections (500 idle), {counts['sent']:,} messages of 1 KiB sent, {counts['held']:,} of them "
            f"not completed when the producers left (held by the stopped queue), {counts['refused']:,} refused")


async def slowloris(url: str, seconds: float) -> str:
    host, port = url.split("//")[1].split(":")
    closed = [0]

    async def one() -> None:
        stream = await trio.open_tcp_stream(host, int(port))
        proto = Connection(Role.CLIENT)
        try:
            await stream.send_all(proto.send(Hello(PROTOCOL_VERSION, "slowloris", True, [])))
            await stream.receive_some(65536)
            length = 8 * MiB - 16
            end = trio.current_time() + seconds
            # the start of a TRANSFER, then 4 MiB as fast as the broker reads it (the partial-frame budget
            # decides), then a byte every half second
            with trio.move_on_at(end):
                await stream.send_all(struct.pack(">I", length) + b"\x93\x0a\x01" + b"\x00" * (4 * MiB))
            while trio.current_time() < end:
                await stream.send_all(b"\x00")
                await trio.sleep(0.5)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed[0] += 1
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(30):
            nursery.start_soon(one)
    return f"30 slow connections, each sending up to 4 MiB of an 8 MiB frame; {closed[0]} cut off by the broker"


async def queues(url: str, seconds: float) -> str:
    made = [0]
    refused: list[str] = []
    async with await fb.connect(url, client_name="setup") as conn:
        await conn.declare_exchange("spread", "direct")

    async def declare(first: int, step: int) -> None:
        async with await fb.connect(url, client_name=f"declarer-{first}", request_timeout=60) as conn:
            for i in range(first, 100_000, step):
                try:
                    await conn.declare_queue(f"q{i}")
                    await conn.bind(f"q{i}", "spread", f"k{i}")
                except fb.RequestError as exc:
                    refused.append(str(exc))
                    return
                made[0] += 1

    async with trio.open_nursery() as nursery:
        for first in range(16):
            nursery.start_soon(declare, first, 16)
    return f"{made[0]:,} queues with a binding each" + (f"; then refused: {refused[0]}" if refused else "")


async def fanout(url: str, seconds: float) -> str:
    async with await fb.connect(url, client_name="setup") as conn:
        await conn.declare_exchange("wide", "fanout")
        for i in range(FANOUT_QUEUES):
            await conn.declare_queue(f"f{i}", max_size=0, flow_stop_size=0, flow_resume_size=0)
            await conn.bind(f"f{i}", "wide")
    counts = {"sent": 0, "unconfirmed": 0}

    async def one(i: int) -> None:
        # Leaving the blocks raises PublishFailures for what is still held or parked: that is the point.
        try:
            async with await fb.connect(url, client_name=f"fan-{i}", close_timeout=1) as conn:
                producer = conn.producer("wide", window=1000)
                with trio.move_on_after(seconds):  # the alarm stops them: a send waits for credit
                    while True:
                        await producer.send(b"f", timeout=seconds + 1)
                        counts["sent"] += 1
                counts["unconfirmed"] += producer.stats.in_flight
        except fb.FlowbrokerError:
            pass

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
    return (f"sent {counts['sent']:,} 1-byte messages to {FANOUT_QUEUES} queues each, "
            f"{counts['unconfirmed']:,} not completed when they stopped")


FANOUT_QUEUES = 600
SCENARIOS = {"unpaced": unpaced, "producers": producers, "slowloris": slowloris, "queues": queues, "fanout": fanout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", nargs="?", default="all", choices=[*SCENARIOS, "all"])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quota", type=parse_size, default=parse_size("256MiB"))
    args = parser.parse_args()
    quota = args.quota
    pool = quota * 5 // 100
    for name in SCENARIOS if args.scenario == "all" else [args.scenario]:
        port = free_port()
        config = f"[server]\nmemory_quota = {quota}\nmax_connections = 2000\n"
        with tempfile.TemporaryDirectory(prefix="memory-bound-") as folder:  # its config file: removed after
            proc = start_broker(port, config, Path(folder))
            try:
                time.sleep(0.5)
                idle = rss(proc.pid)
                connections = 1001 if name == "producers" else 31
                bound = idle + quota + pool + PARTIAL_BUDGET + connections * PER_CONNECTION + MAX_QUEUES * PER_QUEUE
                print(f"{name}: quota {quota / MiB:.0f} MiB (memory watermark = quota), pool {pool / MiB:.1f} MiB, "
                      f"idle RSS {idle / MiB:.1f} MiB", flush=True)
                with RssWatch(proc.pid) as watch:
                    outcome = trio.run(SCENARIOS[name], f"flowbroker://127.0.0.1:{port}", args.seconds)
                print(f"{name}: {outcome}")
                print(f"{name}: peak RSS {watch.peak / MiB:.1f} MiB = idle + {(watch.peak - idle) / MiB:.1f} MiB; "
                      f"bound {bound / MiB:.1f} MiB: {'within' if watch.peak <= bound else 'OVER'}", flush=True)
            finally:
                stop_broker(proc)


if __name__ == "__main__":
    main()
