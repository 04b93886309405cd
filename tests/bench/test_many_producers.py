"""benchmarks/many_producers.py, run for real with a tiny N: each layout (processes x connections) delivers
every message and the summary table parses, one row per layout beside the first. Figures are not asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "many_producers.py"


def test_layouts_deliver_everything_and_the_table_parses():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--messages", "2001", "--layouts", "1x1,2x3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # 2,001 messages over 6 connections: shares of 334 and 333, and every one arrives
    assert "round 1 1x1 (1 producer connections): " in out and "round 1 2x3 (6 producer connections): " in out, out
    assert out.count("2,001 received") == 2, out
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if line.startswith("|")]
    assert rows[0][:2] == ["producers (processes x connections)", "msgs/s (median)"] and len(rows[0]) == 8, rows[0]
    assert [r[0] for r in rows[2:]] == ["1x1", "2x3"], rows
    assert rows[2][3] == "1.00x" and rows[2][5] in ("1.00x", "n/a"), rows[2]  # the first layout is the baseline
    for row in rows[2:]:  # (2,001 messages may take the broker less than one 10 ms clock tick: CPU 0.00)
        assert len(row) == 8 and float(row[1].replace(",", "")) > 0 and float(row[4]) >= 0, row


def test_a_latency_bounded_queue_delivers_everything_too():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--messages", "2001", "--layouts", "2x1", "--latency-bound"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 1 2x1 (2 producer connections): " in proc.stdout and "2,001 received" in proc.stdout, proc.stdout


def test_default_gc_runs_the_broker_with_cpythons_collector_and_delivers_everything():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--messages", "2001", "--layouts", "1x1", "--default-gc"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broker: CPython's default garbage collector (--default-gc)" in proc.stdout, proc.stdout
    assert "round 1 1x1 (1 producer connections): " in proc.stdout and "2,001 received" in proc.stdout, proc.stdout
    # what the broker process it starts sets up before serving: trio.run stubbed out to report the collector
    probe = ("import gc, sys, trio\n"
             "def report(*args, **kwargs):\n"
             "    print(gc.get_threshold()[0], gc.get_freeze_count())\n"
             "    raise SystemExit(0)\n"
             "trio.run = report\n"
             f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
             "from peers import DEFAULT_GC_SERVE\n"
             "sys.argv = ['-c', 'serve', '--port', '0', '--no-admin', '--no-udp', '--no-metrics']\n"
             "exec(DEFAULT_GC_SERVE)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    default = subprocess.run([sys.executable, "-c", "import gc; print(gc.get_threshold()[0])"],
                             capture_output=True, text=True, timeout=60).stdout.strip()  # the interpreter's own
    assert out.returncode == 0 and out.stdout.split() == [default, "0"], out.stdout + out.stderr
