"""`flowbroker top` against a `flowbroker serve` daemon: a saturated queue and the producer it holds
flow-stopped show up, refreshed, as a terminal, a pipe and --json see them."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import flowbroker.client.blocking as fb
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening


class Broker:
    def __init__(self, url: str, admin: list[str]):
        self.url = url
        self.admin = admin

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([FLOWBROKER, *args, *self.admin], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    port, admin_port = free_port(), free_port()
    token_file = tmp_path / "admin-token"
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[server]\nport = {port}\n\n[admin]\nport = {admin_port}\ntoken_file = "{token_file}"\n\n'
                      '[udp]\nendpoint = "127.0.0.1:0"\n')
    proc = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, proc)
        wait_listening(admin_port, proc)
        yield Broker(f"flowbroker://127.0.0.1:{port}",
                     ["--admin-url", f"http://127.0.0.1:{admin_port}", "--token-file", str(token_file)])
    finally:
        stop(proc)


@pytest.fixture
def held_producer(broker: Broker) -> Iterator[subprocess.Popen[str]]:
    """'orders' saturated (3 messages over a stop count of 2) and a publisher it holds flow-stopped (its
    message enqueued, so a depth of 4, its transfer held uncompleted)."""
    subprocess.run([FLOWBROKER, "publish", "--url", broker.url, "-k", "orders", "a", "b", "c"], check=True,
                   capture_output=True, timeout=30)
    subprocess.run([FLOWBROKER, "publish", "--url", broker.url, "-k", "quiet", "x"], check=True,
                   capture_output=True, timeout=30)
    broker.cli("queue", "set", "orders", "--flow-stop-count", "2", "--flow-resume-count", "1")
    proc = subprocess.Popen([FLOWBROKER, "publish", "--url", broker.url, "--timeout", "60", "-k", "orders", "d"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not json.loads(broker.cli("top", "--count", "1", "--json").stdout)["flow_stopped"]:
        assert time.monotonic() < deadline, "the publisher was never flow-stopped"
        time.sleep(0.1)
    try:
        yield proc
    finally:
        proc.kill()
        proc.communicate()


def test_json_names_the_saturated_queue_and_the_producer_it_stops(broker: Broker, held_producer: object) -> None:
    lines = broker.cli("top", "--count", "2", "--interval", "0.2", "--json").stdout.splitlines()
    assert len(lines) == 2  # one document per refresh
    snap = json.loads(lines[-1])
    assert [q["name"] for q in snap["queues"]] == ["orders", "quiet"]  # saturated first
    orders = snap["queues"][0]
    assert orders["saturated"] and orders["depth"]["count"] == 4 and orders["held_transfers"] == 1
    [stopped] = snap["flow_stopped"]
    assert stopped["destinations"] == ["orders"] and stopped["reasons"] == ["flow_stop_count"]
    assert stopped["client_name"] == "flowbroker-cli" and stopped["transfers_held"] == 1
    assert snap["saturated"] == 1 and snap["queues_total"] == 2


def test_a_saturated_queue_past_the_first_page_is_shown_and_counted(broker: Broker, held_producer: object) -> None:
    """1,000 queues named before 'orders' pushed it off the one page of queues a refresh reads: top said
    "saturated 0 of the first 1000" and did not show it, beside the producer it held (a tester; an
    attacker's queues could hide a saturated one). The saturated queues are read as a page of their own."""
    with fb.connect(broker.url) as conn:
        for i in range(1000):
            conn.declare_queue(f"a-{i:04}")
    snap = json.loads(broker.cli("top", "--count", "1", "--json").stdout)
    assert snap["queues_total"] == 1002 and snap["saturated"] == 1
    assert snap["queues"][0]["name"] == "orders" and snap["queues"][0]["saturated"]
    assert "queues 1002 (saturated 1)" in broker.cli("top", "--count", "1").stdout.splitlines()[0]
    listed = json.loads(broker.cli("queues", "--saturated", "--json").stdout)
    assert [q["name"] for q in listed["queues"]] == ["orders"] and listed["next"] is None
    rows = broker.cli("queues", "--saturated").stdout.splitlines()
    assert rows[0].startswith("QUEUE") and [r.split()[0] for r in rows[1:]] == ["orders"]
    broker.cli("queue", "set", "orders", "--flow-stop-count", "100", "--flow-resume-count", "50")
    assert broker.cli("queues", "--saturated").stdout.strip() == "no saturated queues"


def test_piped_frames_follow_each_other(broker: Broker, held_producer: object) -> None:
    out = broker.cli("top", "--count", "2", "--interval", "0.2", "--limit", "1").stdout
    assert "\x1b[" not in out  # no screen control when piped
    starts = [i for i, line in enumerate(out.splitlines()) if line.startswith("flowbroker ")]
    assert len(starts) == 2  # one frame per refresh, each opened by its header line
    frame = "\n".join(out.splitlines()[starts[-1]:])
    lines = frame.splitlines()
    assert "queues 2 (saturated 1)" in lines[0] and "flow-stopped producers 1" in lines[0]
    queue_row = next(line for line in lines if line.startswith("orders"))
    assert queue_row.split()[:5] == ["orders", "4", "2.0KiB", "2/80MiB", "1/70MiB"]  # 4 x (1 B + 512 B overhead); default size marks
    assert "... 1 more (--limit)" in frame  # 'quiet' left out by --limit 1
    producer_row = next(line for line in lines if "flowbroker-cli" in line)
    assert "orders" in producer_row and "flow_stop_count" in producer_row


def test_a_terminal_gets_each_frame_in_place(broker: Broker, held_producer: object) -> None:
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([FLOWBROKER, "top", "--count", "2", "--interval", "0.2", *broker.admin],
                            stdout=secondary, stderr=subprocess.DEVNULL)
    os.close(secondary)
    out = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the pty closes when top exits
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(primary)
    assert proc.wait(timeout=10) == 0
    assert out.count(b"\x1b[H\x1b[2J") == 2 and b"orders" in out


def test_an_unreachable_broker_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("unused-token-0123456789")
    result = subprocess.run([FLOWBROKER, "top", "--count", "1", "--admin-url", f"http://127.0.0.1:{free_port()}",
                             "--token-file", str(token)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "cannot reach the admin API" in result.stderr and "Traceback" not in result.stderr


def test_a_stop_all_lists_its_producers_not_its_consumers(broker: Broker, held_producer: object) -> None:
    """Every flow-controlled connection is told FLOW_STOPPED('*'), a consumer's too (it might publish next),
    but `top` lists the producers it holds: a consumer-only connection used to be listed and counted."""
    consumer = subprocess.Popen([FLOWBROKER, "consume", "--url", broker.url, "--timeout", "60", "quiet"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            roles = {c["id"]: c["role"] for c in json.loads(broker.cli("connections", "--json").stdout)["connections"]}
            consumers = [cid for cid, role in roles.items() if role == "consumer"]
            if consumers:
                break
            assert time.monotonic() < deadline, roles
            time.sleep(0.1)
        broker.cli("producers", "stop-all")
        try:
            connections = json.loads(broker.cli("connections", "--json").stdout)["connections"]
            assert all(c["flow"]["admin_stopped"] for c in connections if c["id"] in consumers)  # told, as said
            snap = json.loads(broker.cli("top", "--count", "1", "--json").stdout)
            listed = [p["connection"] for p in snap["flow_stopped"]]
            assert listed and not set(listed) & set(consumers)
            assert all(roles.get(cid) in ("producer", "both", "idle", None) for cid in listed)
        finally:
            broker.cli("producers", "start-all")
    finally:
        consumer.kill()
        consumer.communicate()
