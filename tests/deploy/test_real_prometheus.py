"""The deploy files against a real Prometheus (Debian's `prometheus`, `make system-tools` installs it) scraping a
real `flowbroker serve` under a small load: a queue saturated by a producer it keeps flow-stopped (no consumer),
a queue that flows (a consumer acknowledges), a queue that refuses at its hard limit, one that drops its head,
and a datagram the UDP endpoint refuses.

Prometheus runs deploy/prometheus/prometheus.yml and alerts.yml as shipped but for what a test must change:
scrape and evaluation every second, the broker's ephemeral admin port as the target, and every alert's `for:`
shortened to 2 s (the durations themselves are proven by promtool's unit tests, alerts_test.yml). Through its
HTTP API the test checks that the target is up, that every expression of the dashboard and of the rules parses
and evaluates without error, that each dashboard expression returns data, that every metric name the rules use
is served, and that the flow-stop alert (and the others this load causes) reach `firing` while the alerts of a
healthy broker do not."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

import flowbroker.client as fc
from flowbroker.client import blocking
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DEADLINE = 30.0  # seconds for any one condition to come true
T = TypeVar("T")

pytestmark = pytest.mark.slow


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = DEADLINE) -> T:
    """probe() until it returns something other than None or False, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


@dataclass
class Broker:
    url: str
    admin_port: int
    udp_port: int


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    port, admin_port = free_port(), free_port()
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[server]\nport = {port}\nmemory_quota = 1073741824\n\n'
                      f'[admin]\nport = {admin_port}\ntoken_file = "{tmp_path / "admin-token"}"\n\n'
                      f'[udp]\nendpoint = "127.0.0.1:0"\n\n'
                      # a share of its own for each producer: the default aggressive policy hands the whole
                      # pool to the two flow-controlled producers (FlowbrokerCreditNearlyAllGranted). (Before
                      # BUFFER_LIMIT a producer connecting after the flowing one also waited until that one had
                      # used up its earlier, larger promise: FlowbrokerProducersWaitingForCredit, for minutes.)
                      f'[credit]\npolicy = "static"\nstatic_size = 4194304\n')
    port_file = tmp_path / "ports.json"
    proc = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config), "--port-file", str(port_file)],
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, proc)
        wait_listening(admin_port, proc)
        ports = wait_for("the port file", lambda: json.loads(port_file.read_text()) if port_file.exists() else None)
        yield Broker(f"flowbroker://127.0.0.1:{port}", admin_port, int(ports["udp_port"]))
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err


class Prometheus:
    def __init__(self, port: int, proc: subprocess.Popen[str]):
        self.base = f"http://127.0.0.1:{port}"
        self.proc = proc

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as exc:  # 400/422 for a bad query: the body says why
            body = json.loads(exc.read())
        return body

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


@pytest.fixture
def prometheus(broker: Broker, tmp_path: Path) -> Iterator[Prometheus]:
    conf = tmp_path / "prometheus"
    conf.mkdir()
    shipped = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    for old, new, count in (("scrape_interval: 15s", "scrape_interval: 1s", 2),
                            ("evaluation_interval: 15s", "evaluation_interval: 1s", 1),
                            ("scrape_timeout: 10s", "scrape_timeout: 1s", 1),
                            ('"127.0.0.1:5681"', f'"127.0.0.1:{broker.admin_port}"', 1)):
        assert shipped.count(old) == count, old
        shipped = shipped.replace(old, new)
    (conf / "prometheus.yml").write_text(shipped)
    # alerts.yml as shipped but every `for:` shortened to 2 s, and the stops' own clocks (5 and 10 minutes)
    # to 2 s, so that alerts fire within the test
    rules, shortened = re.subn(r"^(\s+for: )\d+[smh]$", r"\g<1>2s", (DEPLOY / "prometheus" / "alerts.yml").read_text(),
                               flags=re.MULTILINE)
    assert shortened >= 8
    rules, clocks = re.subn(r"(_(?:flow_stopped|saturated)_seconds) >= \d+$", r"\1 >= 2", rules, flags=re.MULTILINE)
    assert clocks == 2
    (conf / "alerts.yml").write_text(rules)

    port = free_port()
    log = tmp_path / "prometheus.log"  # a file, not a pipe nobody reads while it runs
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={conf / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True)
    server = Prometheus(port, proc)
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"prometheus exited: {log.read_text()}"
            try:
                with urllib.request.urlopen(f"{server.base}/-/ready", timeout=1) as answer:
                    return bool(answer.status == 200)
            except OSError:
                return False
        wait_for("prometheus ready", ready)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise


class Load:
    """The broker's clients: a flowing queue in a thread of its own, the rest on demand."""

    def __init__(self, url: str):
        self.url = url
        self.stopped_conn: blocking.BlockingConnection | None = None
        self.done = threading.Event()
        self.flowed = 0
        self.thread = threading.Thread(target=self._flow, name="flowing-load")

    def declare(self) -> None:
        with blocking.connect(self.url, client_name="deploy-setup", timeout=5) as conn:
            conn.declare_queue("saturated", flow_stop_count=5, flow_resume_count=2)
            conn.declare_queue("flowing")
            conn.declare_queue("limited", max_count=3, overflow="reject", flow_stop_count=0)
            conn.declare_queue("ring", max_count=3, overflow="drop-head", flow_stop_count=0)
        self.thread.start()

    def _flow(self) -> None:
        with blocking.connect(self.url, client_name="deploy-flowing", timeout=5, close_timeout=2) as conn:
            producer = conn.producer(routing_key="flowing")
            with conn.consumer("flowing", prefetch=10) as consumer:
                while not self.done.is_set():
                    producer.send(b"tick", timeout=5)
                    consumer.receive(timeout=5).ack()
                    self.flowed += 1
                    time.sleep(0.05)

    def overflow(self) -> None:
        """A legacy producer (no flow control: the only kind a hard limit refuses or drops for; a flow-controlled
        one is held at the stop watermark instead) overfills 'limited' (reject) and 'ring' (drop-head)."""
        with blocking.connect(self.url, client_name="deploy-legacy", flow_control=False, timeout=5) as conn:
            limited = conn.producer(routing_key="limited")
            limited.send_many([b"%d" % i for i in range(5)], timeout=5)
            with pytest.raises(fc.QueueFull):
                limited.flush(timeout=5)
            ring = conn.producer(routing_key="ring")
            ring.send_many([b"%d" % i for i in range(5)], timeout=5)
            ring.flush(timeout=5)

    def stop_a_producer(self) -> None:
        """A producer sends to 'saturated', which nobody consumes: past 5 messages the queue stops it, and its
        completions stay held while the connection lives."""
        conn = self.stopped_conn = blocking.connect(self.url, client_name="deploy-stopped", timeout=5,
                                                    close_timeout=1)
        producer = conn.producer(routing_key="saturated")
        producer.send_many([b"%d" % i for i in range(10)], timeout=5)
        wait_for("the producer flow-stopped", lambda: producer.flow_state.is_stopped)

    def close(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(timeout=15)
            assert not self.thread.is_alive(), "the flowing load did not end"
        if self.stopped_conn is not None:
            with pytest.raises(fc.PublishFailures):  # its held messages are not completed: the SDK says so
                self.stopped_conn.close(timeout=10)


def _dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every target, with Grafana's variables as a user selecting All sees them
    ($__rate_interval: 1m, a window that holds many 1 s scrapes)."""
    dashboard = json.loads((DEPLOY / "grafana" / "flowbroker.json").read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$instance", ".+").replace("$queue", ".+")
                    .replace("$__rate_interval", "1m"))
            assert "$" not in expr, f"{panel['title']}: a variable the test does not know: {expr}"
            found.append((f"{panel['title']} / {target['legendFormat']}", expr))
    return found


def _variable_selectors() -> list[tuple[str, str, str]]:
    """(variable, selector, label) of every `label_values(selector, label)` template variable."""
    dashboard = json.loads((DEPLOY / "grafana" / "flowbroker.json").read_text())
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"])
            assert match, variable["definition"]
            found.append((variable["name"], match.group(1).replace("$instance", ".+"), match.group(2)))
    return found


# Alerts that must fire under this load, and those that must not on a broker this healthy otherwise.
FIRING = {"FlowbrokerProducerFlowStopped", "FlowbrokerQueueSaturated", "FlowbrokerQueueRejecting",
          "FlowbrokerQueueDropping"}
QUIET = {"FlowbrokerDown", "FlowbrokerMemoryAlarm", "FlowbrokerMemoryNearWatermark", "FlowbrokerResidentMemoryHigh",
         "FlowbrokerResidentMemoryCritical", "FlowbrokerCreditViolations", "FlowbrokerProducersWaitingForCredit",
         "FlowbrokerProducersStoppedByOperator", "FlowbrokerConsumerStuck", "FlowbrokerCreditNearlyAllGranted",
         "FlowbrokerUdpLossHigh", "FlowbrokerUdpNakRateHigh", "FlowbrokerUdpDatagramsRefused"}


def test_real_prometheus_scrapes_the_broker_evaluates_the_dashboard_and_fires_the_flow_stop_alert(
        broker: Broker, prometheus: Prometheus) -> None:
    load = Load(broker.url)
    try:
        load.declare()
        wait_for("the target up", lambda: prometheus.query('up{job="flowbroker"} == 1') or None)
        # the counters' series scraped before the events that increase them, so that increase() sees them
        wait_for("a scrape of the queues' counters", lambda: prometheus.query(
            'flowbroker_queue_refused_transfers_total{queue="limited"} == 0') or None)
        load.overflow()
        load.stop_a_producer()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:  # not a registered session: refused
            udp.sendto(b"\x00" * 64, ("127.0.0.1", broker.udp_port))

        [target] = prometheus.get("/api/v1/targets")["data"]["activeTargets"]
        assert target["health"] == "up" and target["lastError"] == "", target
        assert target["labels"] == {"instance": f"127.0.0.1:{broker.admin_port}", "job": "flowbroker"}

        def all_firing() -> set[str] | None:
            now = _firing(prometheus)
            return now if now >= FIRING else None
        firing = wait_for("the alerts this load causes firing", all_firing)
        [stopped] = [a for a in prometheus.get("/api/v1/alerts")["data"]["alerts"]
                     if a["labels"]["alertname"] == "FlowbrokerProducerFlowStopped"]
        assert stopped["state"] == "firing" and stopped["labels"]["client_name"] == "deploy-stopped"
        assert "by: queue saturated (flow_stop_count); see" in stopped["annotations"]["description"]
        assert not (firing & QUIET), f"alerts of a healthy broker firing: {firing & QUIET}"

        # every rule loaded, evaluated, without an error (a many-to-many match, say, only shows at evaluation)
        rules = [r for g in prometheus.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        assert len(rules) == 17 and {r["name"] for r in rules} >= FIRING | QUIET
        for rule in rules:
            assert rule["health"] == "ok" and rule.get("lastError", "") == "", rule
            prometheus.query(rule["query"])  # parses and evaluates through the query API too
        # every metric name the rules use is one the broker serves
        names = set().union(*(re.findall(r"\b(flowbroker_[a-z0-9_]+|process_[a-z_]+)\b", r["query"]) for r in rules))
        for name in sorted(names):
            assert prometheus.query(f"count({name})"), f"{name}: the rules use it, the broker does not serve it"

        # every dashboard expression parses and returns data (rates over a minute of 1 s scrapes of this load).
        # None is exempt: the broker serves its counters at 0 before the first event (labelled ones too, for the
        # label values known in advance: docs/metrics.md), so the UDP and credit-violation rates are 0, not
        # absent, without UDP traffic or a violation (the refused datagram above moves the UDP counters: waited
        # for below); the saturated queue, the stopped producer and the legacy producer give the `> 0` and
        # per-producer ones their series.
        wait_for("the refused datagram counted", lambda: prometheus.query(
            "sum(flowbroker_udp_datagrams_refused_total) > 0 and sum(flowbroker_udp_datagrams_received_total) > 0")
            or None)
        wait_for("the flowing queue's rate", lambda: prometheus.query(
            'rate(flowbroker_queue_dequeued_messages_total{queue="flowing"}[1m]) > 0') or None)
        queries = _dashboard_queries()
        assert len(queries) > 50
        empty = [title for title, expr in queries if not prometheus.query(expr)]
        assert empty == [], f"dashboard queries without data: {empty}"
        for variable, selector, label in _variable_selectors():
            values = {r["metric"].get(label) for r in prometheus.query(selector)}
            assert None not in values and values, f"${variable}: {selector} has no {label}"
        queues = {r["metric"]["queue"] for r in prometheus.query('flowbroker_queue_messages{instance=~".+"}')}
        assert queues >= {"saturated", "flowing", "limited", "ring"}
    finally:
        load.close()
    assert load.flowed > 0


def _firing(prometheus: Prometheus) -> set[str]:
    alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
    return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
