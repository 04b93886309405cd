"""Fuzz over real TCP: hostile connections against one broker while a well-behaved client works beside them.

Each example starts a broker in-process (127.0.0.1, port 0), a bystander (an SDK producer and consumer
on a queue of its own, tests/e2e/hostile.py) and 3-5 hostile connections that play valid and mutated
frames for EXAMPLE_SECONDS (tests/e2e/hostile.py lists the attacks). hypothesis draws the seed of the
moves, the number of connections, an attack to dwell on and a corpus of frames of every type with
random fields (protocol_strategies). The example then checks:

- no crash: the broker still serves (a new client gets an answer), the bystander's connection is open,
  nothing was logged at ERROR, no INTERNAL_ERROR was answered, every frame the broker sent decodes;
- no stall: the longest gap between two of the bystander's receipts while hostile traffic ran is under
  STALL_BOUND (generous, so that it never flakes on a busy machine; benchmarks/fuzz_broker.py prints
  the real figure), and the broker never left a hostile send waiting SEND_TIMEOUT;
- nothing lost: every bystander message arrived exactly once, in order, never redelivered;
- bounded: the test process's RSS (the broker is in it) grows by less than RSS_BOUND over the run, and
  every hostile connection is gone from the broker once its socket is closed.

One explicit example dwells on the topic attack ('#'-heavy bindings, then long routing keys). Examples
are derandomized (the same every run) and not shrunk (the outcome depends on timing, so a
shrunk example would not mean much, and each takes seconds): a failure prints the example's seed,
corpus and focus (hypothesis' "Falsifying example") and the last moves of every hostile connection.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import trio
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import flowbroker.client as fc
from flowbroker.broker.config import load_config
from flowbroker.broker.server import BrokerServer
from flowbroker.protocol import Frame
from tests.e2e.hostile import (
    BYSTANDER_QUEUE,
    SEND_TIMEOUT,
    WEIGHTS,
    Bystander,
    HostileStats,
    Move,
    hostile_connection,
    moves,
)
from tests.protocol.protocol_strategies import any_frame

EXAMPLE_SECONDS = 1.5
STALL_BOUND = 0.5
RSS_BOUND = 200 * 1024 * 1024
LIMIT = 5.0
MiB = 1024 * 1024

# Queues the hostile connections fill stay small, so that the broker's memory (and this process's RSS)
# stays far below the memory watermark: over it every producer, the bystander too, is held by design.
BROKER_CONFIG: dict[str, dict[str, Any]] = {
    "server": {"port": 0, "memory_quota": 1 << 30},
    "admin": {"enabled": False},
    "udp": {"enabled": False},
    "queues": {"max_size": 4 * MiB},
}

_process = psutil.Process()
_rss_baseline: list[int] = []  # this process's RSS before the first example


class LongestSteps(trio.abc.Instrument):
    """The longest task steps (time a task held the event loop without yielding): when the bystander
    stalls, they name the broker's task that did (or the test's own hostile or bystander tasks)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.longest: list[tuple[float, str]] = []

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.perf_counter() - self.started
        if took > 0.02:
            self.longest.append((took, task.name))
            self.longest.sort(reverse=True)
            del self.longest[5:]

    def describe(self) -> str:
        return ", ".join(f"{name} {took * 1000:.0f} ms" for took, name in self.longest) or "none over 20 ms"


@dataclass
class Run:
    """One example: what it was given and what happened, for the report of a failure."""

    seed: int
    connections: int
    focus: str | None
    corpus: list[Frame]
    logs: list[deque[Move]] = field(default_factory=list)
    stats: list[HostileStats] = field(default_factory=list)
    broker_errors: list[str] = field(default_factory=list)
    rss_peak: int = 0
    worst_gap: float = 0.0
    steps: LongestSteps = field(default_factory=LongestSteps)

    def total(self) -> HostileStats:
        total = HostileStats()
        for s in self.stats:
            total.merge(s)
        return total

    def report(self) -> str:
        t = self.total()
        lines = [
            f"fuzz example: seed={self.seed} connections={self.connections} focus={self.focus} "
            f"corpus of {len(self.corpus)} frames",
            f"hostile: {t.frames_sent} frames, {t.bytes_sent} bytes, {t.connections} connections "
            f"({t.closed_by_broker} closed by the broker, {t.refused_connects} refused), "
            f"{t.send_timeouts} sends that waited {SEND_TIMEOUT}s",
            f"errors answered: {dict(t.errors)}",
            f"bystander worst gap {self.worst_gap * 1000:.1f} ms; RSS peak +{self.rss_peak / MiB:.1f} MiB",
            f"longest task steps: {self.steps.describe()}",
        ]
        if self.broker_errors:
            lines.append("broker logged: " + " | ".join(self.broker_errors[:5]))
        if t.undecodable:
            lines.append("undecodable broker output: " + " | ".join(t.undecodable[:5]))
        for i, log in enumerate(self.logs):
            lines.append(f"-- hostile connection {i} (moves seed {self.seed + i}), its last {len(log)} moves:")
            lines += [f"   {m.describe()}" for m in log]
        return "\n".join(lines)


class _ErrorRecords(logging.Handler):
    def __init__(self, sink: list[str]):
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(f"{record.name}: {record.getMessage()}"[:1000])


@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@example(seed=8, connections=3, focus="topic", corpus=[])
@given(
    seed=st.integers(0, 2**32 - 1),
    connections=st.integers(3, 5),
    focus=st.none() | st.sampled_from(sorted(WEIGHTS)),
    corpus=st.lists(any_frame, max_size=30),
)
def test_hostile_connections_neither_crash_stall_nor_cost_a_bystander_a_message(
    seed: int, connections: int, focus: str | None, corpus: list[Frame]
) -> None:
    if not _rss_baseline:
        _rss_baseline.append(_process.memory_info().rss)
    run = Run(seed, connections, focus, corpus)
    # The collector's full passes walk every object; frozen, pytest's and hypothesis' heap is left out,
    # so that the bystander's gaps measure the broker (and our clients), not the size of this process.
    gc.collect()
    gc.freeze()
    handler = _ErrorRecords(run.broker_errors)
    logging.getLogger("flowbroker").addHandler(handler)
    try:
        trio.run(_fuzz, run, instruments=[run.steps])
    except BaseException as exc:
        exc.add_note(run.report())
        raise
    finally:
        logging.getLogger("flowbroker").removeHandler(handler)
        gc.unfreeze()
    problems = []
    total = run.total()
    if run.worst_gap >= STALL_BOUND:
        problems.append(f"the bystander stalled {run.worst_gap:.3f}s (bound {STALL_BOUND}s)")
    if run.rss_peak >= RSS_BOUND:
        problems.append(f"RSS grew {run.rss_peak / MiB:.1f} MiB (bound {RSS_BOUND / MiB:.0f} MiB)")
    if run.broker_errors:
        problems.append(f"the broker logged {len(run.broker_errors)} error(s)")
    if total.errors["INTERNAL_ERROR"]:
        problems.append(f"the broker answered INTERNAL_ERROR {total.errors['INTERNAL_ERROR']} time(s): "
                        f"{total.error_samples['INTERNAL_ERROR']}")
    if total.undecodable:
        problems.append("the broker sent frames a client cannot decode")
    if total.send_timeouts:
        problems.append(f"the broker left {total.send_timeouts} hostile send(s) waiting {SEND_TIMEOUT}s")
    assert not problems, "; ".join(problems) + "\n" + run.report()


async def _fuzz(run: Run) -> None:
    server = BrokerServer(load_config(None, BROKER_CONFIG))
    sampler = trio.CancelScope()
    with trio.fail_after(EXAMPLE_SECONDS + 60):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            nursery.start_soon(_sample_rss, run, sampler)
            await _example(run, server, port)
            server.shutdown()
            sampler.cancel()


async def _example(run: Run, server: BrokerServer, port: int) -> None:
    url = f"flowbroker://127.0.0.1:{port}"
    async with await fc.connect(url, client_name="bystander", timeout=LIMIT) as conn:
        await conn.declare_queue(BYSTANDER_QUEUE, flow_stop_count=200, flow_resume_count=100)
        b = Bystander(conn, timeout=LIMIT)
        async with trio.open_nursery() as calm:
            await calm.start(b.consume)
            calm.start_soon(b.produce)
            await b.wait_for(20)
            start = time.monotonic()
            await _hostile_traffic(run, port)
            end = time.monotonic()
            await b.wait_for(20)  # still flowing after it
            await b.finish()
            calm.cancel_scope.cancel()
        run.worst_gap = b.worst_gap(start, end)
        lost = b.losses()
        assert lost is None, lost + "\n" + run.report()
        assert not conn.is_closed and conn.connection_id in server.core.sessions, (
            f"the bystander's connection was closed: {conn.close_error}\n{run.report()}")
        with trio.fail_after(LIMIT):  # every hostile connection is gone (we closed them all)
            while len(server.connections) > 1:
                await trio.sleep(0.01)
    async with await fc.connect(url, client_name="after", timeout=LIMIT) as after:  # still serving
        assert (await after.declare_queue("after", timeout=LIMIT))["queue"] == "after"


async def _hostile_traffic(run: Run, port: int) -> None:
    deadline = trio.current_time() + EXAMPLE_SECONDS
    with trio.fail_after(EXAMPLE_SECONDS + 3 * SEND_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i in range(run.connections):
                log: deque[Move] = deque(maxlen=12)
                stats = HostileStats()
                run.logs.append(log)
                run.stats.append(stats)
                source = moves(run.seed + i, run.corpus, run.focus)
                nursery.start_soon(hostile_connection, port, source, stats,
                                   lambda: trio.current_time() >= deadline, log)


async def _sample_rss(run: Run, scope: trio.CancelScope) -> None:
    with scope:
        while True:
            run.rss_peak = max(run.rss_peak, _process.memory_info().rss - _rss_baseline[0])
            await trio.sleep(0.05)
