"""`flowbroker serve` tunes its own process's garbage collector (broker/cli.py `_tune_garbage_collector`):
the youngest generation every 50,000 allocations, the middle one every third of those (a pass of it walked
up to 550,000 survivors when it came every eleventh: 143-161 ms with 600,000 messages arriving, every
connection stalled meanwhile; a tester saw 90-150 ms), the oldest every 51st middle one; start-up frozen."""

from __future__ import annotations

import subprocess
import sys

from flowbroker.broker import cli


def test_serve_sets_the_three_thresholds_and_freezes_start_up() -> None:
    probe = ("import gc, sys, trio\n"
             "def report(*args, **kwargs):\n"
             "    print(*gc.get_threshold(), gc.get_freeze_count() > 0)\n"
             "    raise SystemExit(0)\n"
             "trio.run = report\n"
             "from flowbroker.broker.cli import main\n"
             "main(['serve', '--port', '0', '--no-admin', '--no-udp', '--no-metrics'])\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(cli.GC_GENERATION0_THRESHOLD), "2", "50", "True"], out.stdout
