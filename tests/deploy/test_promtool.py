"""deploy/prometheus with promtool (Debian's prometheus package; `make system-tools` installs it): the scrape
config and the rules are valid, and the rules' unit tests (alerts_test.yml: every alert fires and does not)
pass. The alert rules and the dashboard use only the metric names docs/metrics.md promises."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "flowbroker.json"
# up and the process_* series of prometheus-client are standard; the rest is docs/metrics.md's contract
STANDARD = {"up", "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_cpu_seconds_total",
            "process_open_fds", "process_max_fds", "process_start_time_seconds"}
NAME = re.compile(r"\b(flowbroker_[a-z0-9_]+|process_[a-z_]+|up)\b")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_promtool_check_config_accepts_the_scrape_config_and_its_rules() -> None:
    done = _promtool("check", "config", "deploy/prometheus/prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout and "SUCCESS: 17 rules found" in done.stdout


def test_promtool_check_rules() -> None:
    done = _promtool("check", "rules", "deploy/prometheus/alerts.yml")
    assert done.returncode == 0 and "SUCCESS: 17 rules found" in done.stdout, done.stdout + done.stderr


def test_promtool_test_rules_every_alert_fires_and_does_not(tmp_path: Path) -> None:
    done = _promtool("test", "rules", "deploy/prometheus/alerts_test.yml")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr

    tests = (PROMETHEUS / "alerts_test.yml").read_text()
    for alert in re.findall(r"^      - alert: (\w+)$", (PROMETHEUS / "alerts.yml").read_text(), re.MULTILINE):
        checks = re.findall(rf"alertname: {alert}\n        exp_alerts:( \[\])?", tests)
        assert "" in checks and " []" in checks, f"{alert}: alerts_test.yml must make it fire and not fire"

    # the unit tests can fail: the rules with the flow-stop alert's time doubled fail them
    shutil.copy(PROMETHEUS / "alerts_test.yml", tmp_path)
    rules = (PROMETHEUS / "alerts.yml").read_text()
    broken = rules.replace("expr: flowbroker_producer_flow_stopped_seconds >= 300",
                           "expr: flowbroker_producer_flow_stopped_seconds >= 600")
    assert broken != rules
    (tmp_path / "alerts.yml").write_text(broken)
    failed = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert failed.returncode != 0 and "FlowbrokerProducerFlowStopped" in failed.stdout + failed.stderr


def _documented_names() -> set[str]:
    return set(re.findall(r"^\| `(flowbroker_[a-z0-9_]+)` \|", (ROOT / "docs" / "metrics.md").read_text(),
                          re.MULTILINE))


def _used(text: str) -> set[str]:
    return set(NAME.findall(text))


def test_the_rules_use_only_documented_metric_names() -> None:
    documented = _documented_names()
    assert len(documented) > 40
    exprs = re.findall(r"^        expr: (.+)$", (PROMETHEUS / "alerts.yml").read_text(), re.MULTILINE)
    assert len(exprs) == 17
    used = set().union(*map(_used, exprs))
    assert used - documented - STANDARD == set()
    assert {"flowbroker_producer_flow_stopped_seconds", "up", "process_resident_memory_bytes"} <= used


def test_the_dashboard_uses_only_documented_metric_names() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = set().union(*map(_used, exprs))
    assert used - _documented_names() - STANDARD == set()
