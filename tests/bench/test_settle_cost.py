"""benchmarks/settle_cost.py runs for real with a tiny N and prints a figure for each state (the
figures themselves are not asserted: they come from the script)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "settle_cost.py"


def test_both_states_are_measured() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--messages", "2000", "--batch", "50", "--repeat", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    states = re.findall(r"^settle_many, queue (clear|saturated): (\d+) ns per message$", proc.stdout, re.M)
    assert [s for s, _ in states] == ["clear", "saturated"] and all(int(ns) > 0 for _, ns in states), proc.stdout
