"""benchmarks/peers.py, run for real with a tiny N: its flowbroker part prints a markdown table that parses
(so the lead can paste it into docs/performance.md), and a peer whose server is not on PATH is named as not
installed with the command that installs it, instead of failing the run. Figures are not asserted: they come
from the script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
COLUMNS = ["system", "msgs/s (median)", "msgs/s (rounds)", "MB/s", "p50", "p99", "CPU us/msg: server", "producer",
           "consumer", "all three"]


def parse_table(text: str) -> list[dict[str, str]]:
    """The markdown table's rows as dicts by column; raises if the header, the rule or a row is malformed."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    assert cells[0] == COLUMNS, cells[0]
    assert all(set(c) <= set("-") and c for c in cells[1]), cells[1]
    assert all(len(row) == len(COLUMNS) for row in cells[2:]), cells
    return [dict(zip(COLUMNS, row, strict=True)) for row in cells[2:]]


def number(cell: str) -> float:
    return float(cell.removesuffix(" ms").replace(",", ""))


def test_flowbroker_row_parses_and_missing_peers_are_named(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()  # PATH without nats-server and rabbitmq-server (nor anything else)
    env = {**os.environ, "PATH": str(empty)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--messages", "3000", "--rounds", "1",
                           "--systems", "flowbroker,flowbroker-latency,nats-core,nats-jetstream,rabbitmq"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "nats-core: not installed (nats-server not on PATH: apt-get install -y nats-server" in out, out
    assert "nats-jetstream: not installed (nats-server not on PATH: apt-get install -y nats-server" in out, out
    assert "rabbitmq: not installed (rabbitmq-server not on PATH: apt-get install -y rabbitmq-server" in out, out
    rows = parse_table(out)
    # every message arrived: no "lost" note
    assert [row["system"] for row in rows] == ["flowbroker", "flowbroker-latency"], rows
    for row in rows:
        assert number(row["msgs/s (median)"]) == number(row["msgs/s (rounds)"]) > 0  # one round: its own median
        assert number(row["MB/s"]) > 0
        assert 0 <= number(row["p50"]) <= number(row["p99"])  # (a quiet machine may round a p50 to 0.0 ms)
        parts = [number(row[k]) for k in ("CPU us/msg: server", "producer", "consumer")]
        # 3,000 messages take a process about one 10 ms clock tick, which psutil reads as 0 or 10 ms: a
        # part may be 0.0 (a fresh-clone CI run saw it), not all of them
        assert all(p >= 0 for p in parts) and sum(parts) > 0
        assert abs(sum(parts) - number(row["all three"])) <= 0.15  # each rounded to 0.1


def test_unknown_system_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--systems", "flowbroker,kafka"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown system(s) ['kafka']" in proc.stderr, proc.stderr
