"""benchmarks/udp_datapath_cost.py runs for real with a tiny N, with and without PUBLISH_BATCH and
DELIVER_BATCH, and every message arrives (the script asserts that each was delivered and acked; the
figures are not asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "udp_datapath_cost.py"


@pytest.mark.parametrize("flag, kind", [
    ([], "PUBLISH_BATCH, DELIVER_BATCH"),
    (["--no-batches"], "PUBLISH_BATCH, one DELIVER each"),
    (["--no-publish-batch"], "one PUBLISH each, DELIVER_BATCH"),
])
def test_the_sans_io_path_is_measured_both_ways(flag: list[str], kind: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--messages", "3000", "--repeat", "1", *flag],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figure = re.search(rf"UDP consumer, {kind}\), 1024 B bodies: ([\d.]+) us CPU per message", proc.stdout)
    assert figure and float(figure.group(1)) > 0, proc.stdout


@pytest.mark.parametrize("flag", [[], ["--no-publish-batch"]])
def test_the_ingress_half_is_measured_both_ways(flag: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--part", "ingress", "--messages", "3000", "--repeat", "1",
                           *flag], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figure = re.search(r"producer ([\d.]+) us, broker ([\d.]+) us", proc.stdout)
    assert figure and float(figure.group(2)) > 0, proc.stdout
