"""The management commands of the `flowbroker` CLI against a `flowbroker serve` daemon, as an operator
runs them: tables, --json, runtime thresholds, stop-all/start-all, policy, and clear errors."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flowbroker.broker.cli import _log_level, main
from flowbroker.client import blocking
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening

MiB = 1024 * 1024




class Daemon:
    def __init__(self, url: str, admin: list[str], token_file: Path):
        self.url = url
        self.admin = admin  # --admin-url and --token-file for every management command
        self.token_file = token_file

    def cli(self, *args: str, ok: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([FLOWBROKER, *args, *self.admin], capture_output=True, text=True, timeout=30,
                                env={**os.environ, **(env or {})})
        if ok:
            assert result.returncode == 0, result.stderr
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json").stdout)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.1)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    port, admin_port = free_port(), free_port()
    token_file = tmp_path / "admin-token"
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[server]\nport = {port}\nmemory_quota = 1073741824\n\n'
                      f'[admin]\nport = {admin_port}\ntoken_file = "{token_file}"\n\n[udp]\nendpoint = "127.0.0.1:0"\n')
    broker = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, broker)
        wait_listening(admin_port, broker)
        yield Daemon(f"flowbroker://127.0.0.1:{port}",
                     ["--admin-url", f"http://127.0.0.1:{admin_port}", "--token-file", str(token_file)], token_file)
    finally:
        err = stop(broker)
    assert broker.returncode == 0, err
    # the startup lines once each: where it listens, where the admin API and its token are
    assert err.count(f"flowbroker listening on 127.0.0.1:{port}") == 1
    assert err.count(f"admin API on http://127.0.0.1:{admin_port}, token in {token_file} (generated at start, mode 0600)") == 1
    assert err.count(f"metrics on http://127.0.0.1:{admin_port}/metrics (no token required)") == 1
    # those two lines only (the http:// form: the UDP endpoint's port 0 may get the same number, in UDP's space)
    assert "Running on" not in err and err.count(f"http://127.0.0.1:{admin_port}") == 2


def _publish(daemon: Daemon, *messages: str, background: bool = False) -> subprocess.Popen[str]:
    proc = subprocess.Popen([FLOWBROKER, "publish", "--url", daemon.url, "--timeout", "30", "-k", "orders", *messages],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not background:
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    return proc


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    return err


def _me(daemon: Daemon, client: str = "flowbroker-cli") -> list[dict[str, Any]]:
    return [c for c in daemon.json("connections")["connections"] if c["client_name"] == client]


def test_queues_and_queue_set_release_a_blocked_publisher(daemon: Daemon) -> None:
    assert daemon.cli("queues").stdout.strip() == "no queues"
    _publish(daemon, "a", "b", "c")
    table = daemon.cli("queues").stdout.splitlines()
    assert table[0].split()[:3] == ["QUEUE", "MESSAGES", "BYTES"]
    assert table[1].split()[:2] == ["orders", "3"] and "no" in table[1].split()

    shown = daemon.cli("queue", "set", "orders", "--flow-stop-count", "2", "--flow-resume-count", "1").stdout
    assert "saturated       yes" in shown and "flow_stop_count: 3 > 2" in shown
    [orders] = daemon.json("queues")["queues"]
    assert orders["saturated"] is True and orders["thresholds"]["flow_stop_count"] == 2

    blocked = _publish(daemon, "d", background=True)  # held by the saturated queue: it waits for completion
    daemon.wait_for(lambda: any(c["flow"]["stopped"] for c in _me(daemon)))
    [publisher] = _me(daemon)
    assert publisher["role"] == "producer" and publisher["flow"]["blocking_queues"] == ["orders"]
    assert publisher["producer"]["transfers_held"] == 1 and publisher["peer"].startswith("127.0.0.1:")
    connections = daemon.cli("connections").stdout
    assert "stopped" in connections and "orders" in connections
    shown = daemon.json("queue", "show", "orders")
    assert shown["held_transfers"] == 1 and shown["flow_stopped_producers"][0]["connection"] == publisher["id"]
    assert blocked.poll() is None

    shown = daemon.json("queue", "set", "orders", "--flow-stop-size", "10MiB", "--flow-stop-count", "0",
                        "--max-size", "20MiB")
    assert shown["thresholds"]["flow_stop_size"] == 10 * MiB and shown["thresholds"]["max_size"] == 20 * MiB
    assert shown["saturated"] is False
    assert "published 1 message(s)" in _finish(blocked)


def test_stop_all_start_all_and_policy_set(daemon: Daemon) -> None:
    _publish(daemon, "warm-up")
    assert daemon.cli("producers", "stop-all").stdout.startswith("all producers stopped")
    assert daemon.json("policy", "show")["producers_stopped"] is True
    held = _publish(daemon, "held", background=True)
    daemon.wait_for(lambda: any(c["flow"]["admin_stopped"] for c in _me(daemon)))
    [publisher] = _me(daemon)
    assert publisher["producer"]["buffer_size"] == 50 * MiB  # aggressive: 5 % of 1 GiB, clamped to max_size

    answer = daemon.json("policy", "set", "aggressive", "--quota", "400MiB", "--min-size", "1MiB")
    assert answer["policy"]["policy"] == "aggressive" and answer["policy"]["quota"] == 400 * MiB
    share = 20 * MiB - 10_000  # the 20 MiB pool but its reserve for wait grants (max_connections bytes)
    assert answer["granted"]["connections"] == [
        {"connection": publisher["id"], "client_name": "flowbroker-cli", "buffer_size": share,
         "state": "producer", "window": 50 * MiB}  # what it was promised before stays charged until used
    ]
    daemon.wait_for(lambda: _me(daemon)[0]["producer"]["buffer_size"] == share)
    assert held.poll() is None  # still held by the operator's stop

    out = daemon.cli("producers", "start-all").stdout
    assert out.startswith("all producers started (1 flow-controlled")
    assert "published 1 message(s)" in _finish(held)
    shown = daemon.cli("policy", "show").stdout
    assert "quota" in shown and "400MiB" in shown and "STOPPED" not in shown
    assert "pool" in shown and "20MiB" in shown and "committed" in shown and "promised" in shown
    assert daemon.json("queue", "show", "orders")["depth"]["count"] == 2

    answer = daemon.json("policy", "set", "static", "--static-size", "2MiB")
    assert answer["policy"]["policy"] == "static" and answer["policy"]["static_size"] == 2 * MiB


def test_errors_are_clear_and_exit_non_zero(daemon: Daemon) -> None:
    admin_url = daemon.admin[:2]  # --admin-url only: the token from the environment

    def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([FLOWBROKER, *args], capture_output=True, text=True, timeout=30,
                              env={**os.environ, **env})

    token = daemon.token_file.read_text().strip()
    flag = cli("queues", *admin_url, "--token", token, env={})
    assert flag.returncode == 2 and "--token is no longer accepted" in flag.stderr and "FLOWBROKER_ADMIN_TOKEN" in flag.stderr
    assert "no queues" not in flag.stdout
    bad = cli("queues", *admin_url, env={"FLOWBROKER_ADMIN_TOKEN": "also-not-the-token"})
    assert bad.returncode != 0 and "HTTP 403" in bad.stderr and "token is wrong" in bad.stderr
    assert "(token from FLOWBROKER_ADMIN_TOKEN)" in bad.stderr and "Traceback" not in bad.stderr
    bad = cli("queues", "--json", *admin_url, env={"FLOWBROKER_ADMIN_TOKEN": "also-not-the-token"})
    assert bad.returncode == 1 and bad.stdout == ""  # no half JSON document before the error
    good = cli("queues", *admin_url, env={"FLOWBROKER_ADMIN_TOKEN": token})
    assert good.returncode == 0 and good.stdout.strip() == "no queues"
    wrong_file = daemon.token_file.with_name("wrong-token")
    wrong_file.write_text("not-the-token-at-all\n")
    bad = cli("queues", *admin_url, "--token-file", str(wrong_file), env={"FLOWBROKER_ADMIN_TOKEN": token})
    assert bad.returncode != 0 and "HTTP 403" in bad.stderr  # an explicit --token-file wins over the environment
    good = cli("queues", *admin_url, env={"FLOWBROKER_ADMIN_TOKEN_FILE": str(daemon.token_file)})
    assert good.returncode == 0 and good.stdout.strip() == "no queues"
    missing = daemon.cli("queue", "show", "nope", ok=False)
    assert missing.returncode != 0 and "no queue named 'nope'" in missing.stderr
    _publish(daemon, "x")
    invalid = daemon.cli("policy", "set", "aggressive", "--min-size", "0", ok=False)
    assert invalid.returncode != 0 and "min_size" in invalid.stderr and "Traceback" not in invalid.stderr
    unreachable = cli("queues", "--admin-url", f"http://127.0.0.1:{free_port()}",
                      env={"FLOWBROKER_ADMIN_TOKEN": "whatever-token"})
    assert unreachable.returncode != 0 and "cannot reach the admin API" in unreachable.stderr
    no_token = subprocess.run([FLOWBROKER, "queues", *admin_url, "--token-file", str(daemon.token_file) + ".missing"],
                              capture_output=True, text=True, timeout=30, env={**os.environ, "FLOWBROKER_ADMIN_TOKEN": ""})
    assert no_token.returncode != 0 and "no admin token" in no_token.stderr and ".missing" in no_token.stderr


def test_every_management_command_has_help() -> None:
    runner = CliRunner()
    for command in (["queues"], ["queue"], ["queue", "show"], ["queue", "set"], ["queue", "purge"],
                    ["queue", "delete"], ["connections"], ["producers"],
                    ["producers", "stop-all"], ["producers", "start-all"], ["policy"], ["policy", "show"],
                    ["policy", "set"], ["exchanges"], ["exchange"], ["exchange", "delete"], ["connection"],
                    ["connection", "close"]):
        result = runner.invoke(main, [*command, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, command
        if command in (["queues"], ["queue", "set"], ["policy", "set"], ["exchange", "delete"]):
            assert "--admin-url" in result.output and "FLOWBROKER_ADMIN_TOKEN" in result.output
            assert "--token-file" in result.output and "--token " not in result.output  # the refused flag is hidden


def test_admin_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        admin_port = busy.getsockname()[1]
        result = subprocess.run([FLOWBROKER, "serve", "--port", "0", "--admin-port", str(admin_port), "--no-udp"],
                                capture_output=True, text=True, timeout=30,
                                env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode != 0
    assert f"[admin] cannot listen on 127.0.0.1:{admin_port}" in result.stderr and "Traceback" not in result.stderr
    assert "another broker running? --admin-port or [admin] port to choose another" in result.stderr, result.stderr


@pytest.mark.parametrize("args, says", [
    # 192.0.2.1 (TEST-NET-1) is no address of this host: binding it is EADDRNOTAVAIL, not "in use"
    (["--admin-host", "192.0.2.1"], "[admin] cannot listen on 192.0.2.1:0: Cannot assign requested address "
                                    "(is 192.0.2.1 an address of this host? --admin-host or [admin] host)"),
    (["--no-admin", "--metrics-endpoint", "192.0.2.1:0"],
     "[metrics] cannot listen on 192.0.2.1:0: Cannot assign requested address (is 192.0.2.1 an address of this "
     "host? --metrics-endpoint or [metrics] endpoint)"),
    (["--no-admin", "--udp-endpoint", "192.0.2.1:0"],
     "[udp] cannot bind the UDP endpoint 192.0.2.1:0: Cannot assign requested address (is 192.0.2.1 an address "
     "of this host? --udp-endpoint HOST:PORT or [udp] endpoint; --no-udp to run without it)"),
])
def test_each_listeners_error_says_what_to_change(tmp_path: Path, args: list[str], says: str) -> None:
    """Every listener names its own options in the hint that follows the cause (a tester: the admin and
    metrics ports said nothing, the UDP endpoint "choose another" for an address the host does not have)."""
    extra = ["--admin-port", "0"] if "--no-admin" not in args else []
    extra += ["--no-udp"] if "--udp-endpoint" not in args else []
    result = subprocess.run([FLOWBROKER, "serve", "--port", "0", *extra, *args],
                            capture_output=True, text=True, timeout=30, env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode != 0
    assert says in result.stderr and "Traceback" not in result.stderr, result.stderr


# -- issue 8: listings stream page by page, names are escaped, exchanges are deleted -----------


def test_listings_stream_every_page_and_follow_limit_and_after(daemon: Daemon) -> None:
    names = [f"q{i:04d}" for i in range(1100)]  # more than one page of 1000
    with blocking.connect(daemon.url, client_name="loader", timeout=10) as conn:
        for name in reversed(names):
            conn.declare_queue(name)
    lines = daemon.cli("queues").stdout.splitlines()
    assert lines[0].startswith("QUEUE") and [line.split()[0] for line in lines[1:]] == names
    listing = daemon.json("queues")
    assert [q["name"] for q in listing["queues"]] == names and listing["next"] is None
    first = daemon.json("queues", "--limit", "5")
    assert [q["name"] for q in first["queues"]] == names[:5] and first["next"] == names[4]
    rest = daemon.json("queues", "--after", first["next"], "--limit", "1000")
    assert [q["name"] for q in rest["queues"]] == names[5:1005] and rest["next"] == names[1004]
    lines = daemon.cli("queues", "--after", names[1097]).stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == names[1098:]
    connections = daemon.json("connections", "--limit", "1")
    assert len(connections["connections"]) <= 1


def test_control_characters_in_names_are_escaped_in_tables(daemon: Daemon) -> None:
    # (C0 controls are refused in names; C1's CSI, U+009B, is the 8-bit ESC [, and U+2028 ends a line)
    evil_queue = "evil\x9b2J\u2028FAKE ROW"
    evil_client = "client\r\x07\u202e"
    with blocking.connect(daemon.url, client_name=evil_client, timeout=10) as conn:
        conn.declare_queue(evil_queue)
        table = daemon.cli("queues").stdout
        assert "\x9b" not in table and "\u2028" not in table and "\r" not in table and "\x07" not in table
        assert table.splitlines()[1].split()[0] == "evil\\x9b2J\\u2028FAKE"  # one row, the escape shown
        rows = daemon.cli("connections").stdout
        assert "client\\r\\x07\\u202e" in rows and "\r" not in rows and "\u202e" not in rows
        shown = daemon.cli("queue", "show", evil_queue).stdout
        assert "\x9b" not in shown and "evil\\x9b2J\\u2028FAKE ROW" in shown
        # JSON keeps the names as they are: JSON strings escape them
        assert [q["name"] for q in daemon.json("queues")["queues"]] == [evil_queue]
        missing = daemon.cli("queue", "show", "no\x1bpe", ok=False)
        assert "\x1b" not in missing.stderr and "no\\x1bpe" in missing.stderr


def test_exchanges_list_and_delete(daemon: Daemon) -> None:
    with blocking.connect(daemon.url, timeout=10) as conn:
        conn.declare_queue("q")
        conn.declare_exchange("ex/1", "fanout")
        conn.bind("q", "ex/1")
    lines = daemon.cli("exchanges").stdout.splitlines()
    assert lines[0].split() == ["EXCHANGE", "KIND", "BUILTIN", "BINDING-KEYS"]
    assert [line.split() for line in lines[1:]] == [
        ["amq.direct", "direct", "yes", "0"], ["amq.fanout", "fanout", "yes", "0"],
        ["amq.topic", "topic", "yes", "0"], ["ex/1", "fanout", "no", "1"]]
    assert daemon.cli("exchange", "delete", "ex/1").stdout.strip() == "exchange ex/1 deleted (1 binding(s) removed)"
    again = daemon.cli("exchange", "delete", "ex/1", ok=False)
    assert again.returncode == 1 and "HTTP 404: no exchange named 'ex/1'" in again.stderr
    builtin = daemon.cli("exchange", "delete", "amq.direct", ok=False)
    assert builtin.returncode == 1 and "cannot be deleted" in builtin.stderr
    assert [e["name"] for e in daemon.json("exchanges")["exchanges"]] == ["amq.direct", "amq.fanout", "amq.topic"]


# -- issue 10: the CLI people expect -------------------------------------------------------------


def test_publish_during_stop_all_reports_sent_not_completed_with_exit_3(daemon: Daemon) -> None:
    """The message is enqueued and later delivered: the outcome says so (exit 3), not an error to retry."""
    _publish(daemon, "warm-up")
    daemon.cli("producers", "stop-all")
    began = time.monotonic()
    held = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "--timeout", "0.5", "-k", "orders", "held"],
                          capture_output=True, text=True, timeout=30)
    took = time.monotonic() - began
    assert held.returncode == 3, held.stderr
    assert "1 message(s) sent and enqueued, not yet completed after 0.5 s" in held.stderr
    assert took < 4, took  # --timeout 0.5 (and the CLI's start), not 0.5 + the SDK's close_timeout of 5 s
    assert "* (a broker-wide stop: `flowbroker producers stop-all`, or the broker's memory alarm)" in held.stderr
    assert "would duplicate them" in held.stderr and "Traceback" not in held.stderr
    as_json = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "--timeout", "0.5", "-k", "orders", "--json",
                              "held too"], capture_output=True, text=True, timeout=30)
    assert as_json.returncode == 3
    assert json.loads(as_json.stdout) == {
        "outcome": "not_completed", "exit_code": 3, "requested": 1, "sent": 1, "completed": 0, "failed": 0,
        "not_completed": 1, "not_sent": 0, "flow_stopped": ["*"], "error": None}
    daemon.cli("producers", "start-all")
    daemon.wait_for(lambda: daemon.json("queue", "show", "orders")["depth"]["count"] == 3)
    got = subprocess.run([FLOWBROKER, "consume", "--url", daemon.url, "-n", "3", "--json", "orders"],
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    lines = [json.loads(line) for line in got.stdout.splitlines()]
    assert [m["body"] for m in lines] == ["warm-up", "held", "held too"]  # each once: nothing to retry
    assert lines[0] == {"exchange": "", "routing_key": "orders", "redelivered": False, "body": "warm-up", "headers": {}}
    done = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "-k", "orders", "--json", "a", "b"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and json.loads(done.stdout)["outcome"] == "completed"
    assert json.loads(done.stdout)["completed"] == 2 and done.stderr.count("published") == 0


def test_publish_errors_exit_1_and_name_what_was_not_sent(daemon: Daemon) -> None:
    refused = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "--no-declare", "--exchange", "nope",
                              "-k", "x", "--json", "m"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    outcome = json.loads(refused.stdout)
    assert outcome["outcome"] == "error" and outcome["error"] and outcome["exit_code"] == 1
    assert refused.stderr == ""  # --json: the JSON alone, which has the error
    # routed to no queue: refused, not "published" (it was exit 0 with the message in no queue)
    lost = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "--exchange", "amq.topic", "-k",
                           "no.binding.here", "--json", "m"], capture_output=True, text=True, timeout=30)
    assert lost.returncode == 1, lost.stdout + lost.stderr
    assert json.loads(lost.stdout)["failed"] == 1 and "Unroutable" in lost.stdout


def test_publish_json_prints_the_json_alone_whatever_the_outcome(daemon: Daemon) -> None:
    """--json: one JSON document on stdout and nothing on stderr, exit status as without it (a tester: a
    publish not completed during stop-all wrote the text outcome to stderr beside the JSON)."""
    daemon.cli("producers", "stop-all")
    held = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "--timeout", "0.5", "-k", "pj", "--json", "one"],
                          capture_output=True, text=True, timeout=30)
    assert held.returncode == 3 and json.loads(held.stdout)["outcome"] == "not_completed"
    assert held.stderr == ""
    daemon.cli("producers", "start-all")
    refused = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "--no-declare", "--exchange", "nope",
                              "-k", "x", "--json", "m"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and json.loads(refused.stdout)["exit_code"] == 1
    assert refused.stderr == ""
    unreachable = subprocess.run([FLOWBROKER, "publish", "--url", f"flowbroker://127.0.0.1:{free_port()}",
                                  "--timeout", "1", "-k", "x", "--json", "m"], capture_output=True, text=True, timeout=30)
    assert unreachable.returncode == 1 and json.loads(unreachable.stdout)["error"]
    assert unreachable.stderr == ""


def test_exchange_declare_takes_json(daemon: Daemon) -> None:
    """management.md: every management command takes --json; `exchange declare` said "No such option"."""
    declared = subprocess.run([FLOWBROKER, "exchange", "declare", "jx", "--kind", "topic", "--url", daemon.url,
                               "--json"], capture_output=True, text=True, timeout=30)
    assert declared.returncode == 0, declared.stderr
    assert json.loads(declared.stdout) == {"exchange": "jx", "kind": "topic"} and declared.stderr == ""
    assert [e["kind"] for e in daemon.json("exchanges")["exchanges"] if e["name"] == "jx"] == ["topic"]
    clash = subprocess.run([FLOWBROKER, "exchange", "declare", "jx", "--kind", "fanout", "--url", daemon.url,
                            "--json"], capture_output=True, text=True, timeout=30)
    assert clash.returncode == 1 and clash.stdout == "" and "exists as" in clash.stderr


def test_version_quiet_verbose_url_from_the_environment_and_ranges(daemon: Daemon) -> None:
    version = subprocess.run([FLOWBROKER, "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.strip() == "flowbroker 0.1.0"
    env = {**os.environ, "FLOWBROKER_URL": daemon.url}
    sent = subprocess.run([FLOWBROKER, "publish", "-k", "env", "hello"], capture_output=True, text=True, timeout=30,
                          env=env)
    assert sent.returncode == 0 and "published 1 message(s)" in sent.stderr
    got = subprocess.run([FLOWBROKER, "consume", "-n", "1", "env"], capture_output=True, text=True, timeout=30, env=env)
    assert got.stdout == "hello\n"
    declared = subprocess.run([FLOWBROKER, "exchange", "declare", "logs", "--kind", "fanout"], capture_output=True,
                              text=True, timeout=30, env=env)
    assert declared.returncode == 0 and "exchange logs (fanout) declared" in declared.stdout
    for args in (["publish", "-k", "q", "-n", "-3", "m"], ["publish", "-k", "q", "-n", "0", "m"],
                 ["consume", "-n", "-1", "q"], ["consume", "--prefetch", "0", "q"]):
        refused = subprocess.run([FLOWBROKER, *args], capture_output=True, text=True, timeout=30, env=env)
        assert refused.returncode == 2 and "Invalid value" in refused.stderr, args
    runner = CliRunner()
    help_text = runner.invoke(main, ["--help"]).output
    assert "-q, --quiet" in help_text and "-v, --verbose" in help_text and "--version" in help_text
    assert "FLOWBROKER_URL" in runner.invoke(main, ["publish", "--help"]).output


def test_log_level_options() -> None:
    assert [_log_level(v, q) for v, q in ((0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (0, 5), (1, 1))] == [
        logging.INFO, logging.DEBUG, logging.DEBUG, logging.WARNING, logging.ERROR, logging.ERROR, logging.INFO]


def test_queue_purge_and_delete(daemon: Daemon) -> None:
    _publish(daemon, "a", "b")
    out = daemon.cli("queue", "purge", "orders").stdout
    assert out.strip() == "queue orders purged (2 message(s) dropped)"
    assert daemon.json("queue", "show", "orders")["depth"]["count"] == 0
    _publish(daemon, "c")
    assert daemon.json("queue", "delete", "orders") == {"queue": "orders", "deleted": 1}
    assert daemon.cli("queues").stdout.strip() == "no queues"
    missing = daemon.cli("queue", "delete", "orders", ok=False)
    assert missing.returncode == 1 and "no queue named 'orders'" in missing.stderr


def test_queue_set_a_stop_alone_keeps_the_resume_ratio(daemon: Daemon) -> None:
    _publish(daemon, "a")  # declares "orders" with the defaults: stop 80 %, resume 70 % of 100 MiB
    shown = daemon.json("queue", "set", "orders", "--flow-stop-size", "10MiB")["thresholds"]
    assert shown["flow_stop_size"] == 10 * MiB and shown["flow_resume_size"] == 10 * MiB * 7 // 8
    refused = daemon.cli("queue", "set", "orders", "--flow-stop-size", "1MiB", "--flow-resume-size", "2MiB", ok=False)
    assert refused.returncode == 1 and "flow_resume_size" in refused.stderr


def test_the_admin_cli_on_the_broker_port_says_so(daemon: Daemon) -> None:
    port = daemon.url.rsplit(":", 1)[1]
    wrong = subprocess.run([FLOWBROKER, "queues", "--admin-url", f"http://127.0.0.1:{port}", "--token-file",
                            str(daemon.token_file)], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert f"http://127.0.0.1:{port} is the flowbroker broker port, not its admin API" in wrong.stderr
    assert daemon.admin[1] + "/api/" in wrong.stderr  # where the admin API is
    assert len(wrong.stderr.splitlines()) == 1
    refused = subprocess.run([FLOWBROKER, "queues", "--admin-url", f"http://127.0.0.1:{free_port()}"],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, "FLOWBROKER_ADMIN_TOKEN": "whatever-token"})
    assert refused.returncode == 1 and "Connection refused" in refused.stderr


def test_without_a_token_the_cli_still_names_a_wrong_port_or_a_refused_one(daemon: Daemon, tmp_path: Path) -> None:
    """The token is looked up for the URL's port (docs/management.md): where no broker wrote one, the
    wrong port or a port nobody listens on is said before a missing token is (which it used to say instead)."""
    env = {**os.environ, "HOME": str(tmp_path), "FLOWBROKER_ADMIN_TOKEN": ""}
    port = daemon.url.rsplit(":", 1)[1]
    for url in (f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"):  # without a scheme: http:// is meant
        wrong = subprocess.run([FLOWBROKER, "queues", "--admin-url", url], capture_output=True, text=True,
                               timeout=30, env=env)
        assert wrong.returncode == 1 and len(wrong.stderr.splitlines()) == 1, wrong.stderr
        assert f"http://127.0.0.1:{port} is the flowbroker broker port, not its admin API" in wrong.stderr
    refused_port = free_port()
    refused = subprocess.run([FLOWBROKER, "queues", "--admin-url", f"http://127.0.0.1:{refused_port}"],
                             capture_output=True, text=True, timeout=30, env=env)
    assert refused.returncode == 1
    assert f"cannot reach the admin API at http://127.0.0.1:{refused_port}: Connection refused" in refused.stderr
    admin = subprocess.run([FLOWBROKER, "queues", "--admin-url", daemon.admin[1]], capture_output=True, text=True,
                           timeout=30, env=env)  # the admin API itself, and no token for it here
    assert admin.returncode == 1 and "no admin token" in admin.stderr and "Traceback" not in admin.stderr
    other = subprocess.run([FLOWBROKER, "queues", "--admin-url", "ftp://127.0.0.1:21"], capture_output=True,
                           text=True, timeout=30, env=env)
    assert other.returncode == 1 and "the admin API is http:// or https://" in other.stderr


def test_queue_set_takes_time_thresholds_as_durations(daemon: Daemon) -> None:
    _publish(daemon, "old")  # nobody consumes it: its age grows
    shown = daemon.json("queue", "set", "orders", "--flow-stop-age", "0.3s", "--flow-resume-age", "100ms",
                        "--flow-stop-drain-time", "2")
    t = shown["thresholds"]
    assert (t["flow_stop_age"], t["flow_resume_age"], t["flow_stop_drain_time"], t["flow_resume_drain_time"]) == (
        0.3, 0.1, 2.0, 2.0)
    daemon.wait_for(lambda: daemon.json("queue", "show", "orders")["saturated"])
    shown = daemon.json("queue", "show", "orders")
    assert shown["stop_reason"]["threshold"] == "flow_stop_age" and shown["stop_reason"]["limit"] == 300
    assert shown["drain"]["oldest_ready_age"] > 0.3
    assert "flow time       stop drain 2 s/age 0.3 s" in daemon.cli("queue", "show", "orders").stdout
    bad = daemon.cli("queue", "set", "orders", "--flow-stop-age", "soon", ok=False)
    assert bad.returncode == 2 and "not a duration" in bad.stderr
    assert daemon.json("queue", "set", "orders", "--flow-stop-age", "0")["saturated"] is False


def test_connection_close_ends_a_client_with_connection_forced(daemon: Daemon) -> None:
    """The operator's remedy for a client holding what others wait for (a tester found none)."""
    with blocking.connect(daemon.url, timeout=10, client_name="hog") as conn:
        conn_id = conn.welcome.connection_id
        out = daemon.cli("connection", "close", str(conn_id), "--reason", "holds the pool").stdout
        assert out.strip() == f"connection {conn_id} closed"
        daemon.wait_for(lambda: conn.is_closed, 5)
        assert conn.close_error is not None and "closed by an operator: holds the pool" in str(conn.close_error)
    again = daemon.cli("connection", "close", str(conn_id), ok=False)
    assert again.returncode == 1 and f"HTTP 404: no connection {conn_id}" in again.stderr


def test_publish_sends_standard_inputs_lines_as_they_come(daemon: Daemon) -> None:
    """`yes | flowbroker publish` read every line into memory before sending any (a tester): lines are sent
    as they are read, so those written so far are in the queue while standard input is still open; -n
    copies of a stream, and a last line without its newline, still work."""
    pub = subprocess.Popen([FLOWBROKER, "publish", "--url", daemon.url, "-k", "stream", "--json"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert pub.stdin is not None
    try:
        pub.stdin.write(b"one\ntwo\n\nthree\n")
        pub.stdin.flush()
        daemon.wait_for(lambda: "stream" in [q["name"] for q in daemon.json("queues")["queues"]]
                        and daemon.json("queue", "show", "stream")["depth"]["count"] == 4)
        out, err = pub.communicate(b"four", timeout=30)  # no newline before the end (communicate closes stdin)
    finally:
        if pub.poll() is None:
            pub.kill()
    assert pub.returncode == 0, err
    assert json.loads(out)["requested"] == 5 and json.loads(out)["completed"] == 5
    copies = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "-k", "stream", "-n", "2", "--json"],
                            input=b"a\nb\n", capture_output=True, timeout=30)
    assert copies.returncode == 0 and json.loads(copies.stdout)["completed"] == 4
    got = subprocess.run([FLOWBROKER, "consume", "--url", daemon.url, "-n", "9", "--json", "stream"],
                         capture_output=True, text=True, timeout=30)
    assert [json.loads(line)["body"] for line in got.stdout.splitlines()] == [
        "one", "two", "", "three", "four", "a", "b", "a", "b"]


def test_publish_stops_reading_standard_input_at_the_first_refusal(daemon: Daemon) -> None:
    """Streaming to a queue that does not exist, every line was refused and dropped and publish read on for
    ever (`yes | flowbroker publish --no-declare`, killed after 10 minutes; a tester): it stops and says so."""
    pub = subprocess.Popen([FLOWBROKER, "publish", "--url", daemon.url, "-k", "no-such-queue", "--no-declare",
                            "--json"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert pub.stdin is not None
    try:
        deadline = time.monotonic() + 30
        while pub.poll() is None and time.monotonic() < deadline:
            try:
                pub.stdin.write(b"line\n" * 100)
                pub.stdin.flush()
            except BrokenPipeError:
                break
            time.sleep(0.05)
        ended = pub.wait(timeout=30)  # by itself, its input still open
        out, _ = pub.communicate(timeout=30)
        assert ended == 1
        outcome = json.loads(out)
        assert outcome["outcome"] == "error" and outcome["failed"] >= 1 and "NotFound" in outcome["error"]
    finally:
        if pub.poll() is None:
            pub.kill()
            pub.communicate(timeout=30)


def test_publish_with_standard_streams_closed_or_interrupted_says_how_it_ended(daemon: Daemon) -> None:
    """A closed stdin or stderr (a cron job's `<&-`, `2>&-`) failed with an AttributeError traceback, or with
    nothing published; Ctrl-C mid-stream printed only "Aborted!" (and sometimes aborted the interpreter: a
    worker thread blocked in the buffered stdin's read1 held its lock at shutdown). A tester, all three."""
    import signal

    def closed(fd: int) -> Callable[[], None]:
        return lambda: os.close(fd)

    no_stdin = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "-k", "closed", "--json"],
                              capture_output=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=closed(0), timeout=30)
    assert no_stdin.returncode == 0 and b"Traceback" not in no_stdin.stderr, no_stdin.stderr
    assert json.loads(no_stdin.stdout)["requested"] == 0
    no_stderr = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "-k", "closed", "--json", "hello"],
                               stdout=subprocess.PIPE, preexec_fn=closed(2), timeout=30)
    assert no_stderr.returncode == 0 and json.loads(no_stderr.stdout)["completed"] == 1
    pub = subprocess.Popen([FLOWBROKER, "publish", "--url", daemon.url, "-k", "interrupted", "--json"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert pub.stdin is not None
    try:
        pub.stdin.write(b"line\n" * 50)
        pub.stdin.flush()
        daemon.wait_for(lambda: "interrupted" in [q["name"] for q in daemon.json("queues")["queues"]]
                        and daemon.json("queue", "show", "interrupted")["depth"]["count"] == 50)
        pub.send_signal(signal.SIGINT)  # stdin still open: it was waiting for more lines
        out, err = pub.communicate(timeout=30)
    finally:
        if pub.poll() is None:
            pub.kill()
            pub.communicate(timeout=30)
    assert pub.returncode == 1, err
    outcome = json.loads(out)
    assert outcome["sent"] == 50 and outcome["completed"] == 50 and "interrupted (Ctrl-C)" in outcome["error"]


def test_publish_interrupted_says_how_it_ended_in_one_line(daemon: Daemon) -> None:
    """publish "says how it ended", in one line: interrupted during a stop-all, stderr had the SDK's
    timestamped WARNING (a block ended with a message in flight) before its own line (a tester)."""
    import signal

    daemon.cli("producers", "stop-all")
    try:
        pub = subprocess.Popen([FLOWBROKER, "publish", "--url", daemon.url, "-k", "held-line", "x"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            daemon.wait_for(lambda: any(c["producer"]["transfers_held"]
                                        for c in daemon.json("connections")["connections"]))
            pub.send_signal(signal.SIGINT)
            _, err = pub.communicate(timeout=30)
        finally:
            if pub.poll() is None:
                pub.kill()
                pub.communicate(timeout=30)
    finally:
        daemon.cli("producers", "start-all")
    assert pub.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: interrupted (Ctrl-C)"), err


def test_publish_reads_crlf_lines_without_their_cr(daemon: Daemon) -> None:
    """Lines of a Windows file kept their CR once stdin was read in bytes (a tester); text mode dropped it."""
    pub = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "-k", "crlf", "--json"],
                         input=b"a\r\nb\r\nc", capture_output=True, timeout=30)
    assert pub.returncode == 0, pub.stderr
    got = subprocess.run([FLOWBROKER, "consume", "--url", daemon.url, "-n", "3", "--json", "crlf"],
                         capture_output=True, text=True, timeout=30)
    assert [json.loads(line)["body"] for line in got.stdout.splitlines()] == ["a", "b", "c"]


def test_ctrl_c_while_consume_waits_for_a_slow_reader_acknowledges_every_line_it_printed(daemon: Daemon) -> None:
    """`flowbroker consume Q | slow-reader`, Ctrl-C while consume waits for the full pipe: the line it was
    writing could be in its output buffer (printed at exit) with its message never acknowledged, and it came
    again, redelivered, to the next consumer (a tester: the last line of 4 runs in 5). Whatever it printed is
    acknowledged when it stops: over five interrupted runs and a last consume, every message exactly once."""
    total = 60_000
    pub = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "-k", "ctrl-c"], capture_output=True,
                         input="".join("%05d\n" % i for i in range(total)), text=True, timeout=120)
    assert pub.returncode == 0, pub.stderr
    printed: list[str] = []
    for _ in range(5):
        consume = subprocess.Popen([FLOWBROKER, "consume", "--url", daemon.url, "ctrl-c"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a shell
        time.sleep(1.0)  # nothing reads: the pipe fills and consume waits in its write
        consume.send_signal(signal.SIGINT)
        out, err = consume.communicate(timeout=30)
        assert consume.returncode == 0, err
        printed += out.splitlines()
    rest = subprocess.run([FLOWBROKER, "consume", "--url", daemon.url, "--timeout", "2", "ctrl-c"], capture_output=True,
                          text=True, timeout=120)
    assert sorted(printed + rest.stdout.splitlines()) == ["%05d" % i for i in range(total)]  # none printed twice


def test_consume_into_a_reader_that_exits_early_says_so_in_a_line_and_keeps_the_unwritten(daemon: Daemon) -> None:
    """`consume Q | head -3` ended with a bare "Error: BrokenPipeError: [Errno 32] Broken pipe" (a tester).
    It says what happened and what to use instead; the line whose write failed is not acknowledged, so
    every message is either written into the pipe before it closed or still in the queue."""
    total = 2_000
    pub = subprocess.run([FLOWBROKER, "publish", "--url", daemon.url, "-k", "early"], capture_output=True,
                         input="".join("%05d\n" % i for i in range(total)), text=True, timeout=60)
    assert pub.returncode == 0, pub.stderr
    consume = subprocess.Popen([FLOWBROKER, "consume", "--url", daemon.url, "--timeout", "5", "early"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert consume.stdout is not None and consume.stderr is not None
    head = [consume.stdout.readline().decode().strip() for _ in range(3)]
    consume.stdout.close()  # the reader goes away
    err = consume.stderr.read().decode()
    consume.stderr.close()
    assert consume.wait(timeout=30) == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "output was closed (broken pipe)" in lines[0] and "-n N" in lines[0], err
    assert head == ["00000", "00001", "00002"]
    rest = subprocess.run([FLOWBROKER, "consume", "--url", daemon.url, "--timeout", "2", "early"],
                          capture_output=True, text=True, timeout=60).stdout.split()
    assert rest and int(rest[0]) > 2 and rest == ["%05d" % i for i in range(int(rest[0]), total)]
