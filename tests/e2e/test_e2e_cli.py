"""The `flowbroker` command as a person runs it: serve as a daemon, publish, consume, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening





def test_serve_publish_consume_and_sigterm(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[server]\nport = {port}\nidle_timeout = 30.0\n\n[credit]\npolicy = "static"\n\n'
                      f'[admin]\nport = 0\ntoken_file = "{tmp_path / "admin-token"}"\n\n[udp]\nendpoint = "127.0.0.1:0"\n')
    url = f"flowbroker://127.0.0.1:{port}"
    broker = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, broker)
        pub = subprocess.run([FLOWBROKER, "publish", "--url", url, "-k", "greetings", "hello", "world", "-n", "2"],
                             capture_output=True, text=True, timeout=30)
        assert pub.returncode == 0, pub.stderr
        assert "published 4 message(s)" in pub.stderr
        con = subprocess.run([FLOWBROKER, "consume", "--url", url, "--count", "4", "greetings"],
                             capture_output=True, text=True, timeout=30)
        assert con.returncode == 0, con.stderr
        assert con.stdout.splitlines() == ["hello", "world", "hello", "world"]
        evil = "two\nlines \x1b]0;title\x07\x1b[31mred"
        pub = subprocess.run([FLOWBROKER, "publish", "--url", url, "-k", "greetings", evil],
                             capture_output=True, text=True, timeout=30)
        assert pub.returncode == 0, pub.stderr
        con = subprocess.run([FLOWBROKER, "consume", "--url", url, "--count", "1", "greetings"],
                             capture_output=True, text=True, timeout=30)
        assert con.returncode == 0 and "\x1b" not in con.stdout and "\x07" not in con.stdout  # no raw control bytes
        assert con.stdout.splitlines() == [r"two\nlines \x1b]0;title\x07\x1b[31mred"]  # one line, escaped
        # -n takes no more than it prints: all the rest came back flagged redelivered (a tester); then as
        # many as it acknowledged one by one, the broker refilling the prefetch (another: 50 with -n 50)
        bodies = [f"m{i:02d}" for i in range(40)]
        pub = subprocess.run([FLOWBROKER, "publish", "--url", url, "-k", "greetings", *bodies],
                             capture_output=True, text=True, timeout=30)
        assert pub.returncode == 0, pub.stderr
        got = []
        for n in (1, 2, 10, 27):
            con = subprocess.run([FLOWBROKER, "consume", "--url", url, "--count", str(n), "--json", "greetings"],
                                 capture_output=True, text=True, timeout=30)
            assert con.returncode == 0, con.stderr
            got += [(m["body"], m["redelivered"]) for m in map(json.loads, con.stdout.splitlines())]
        assert got == [(body, False) for body in bodies]
        missing = subprocess.run([FLOWBROKER, "consume", "--url", url, "--count", "1", "nope"],
                                 capture_output=True, text=True, timeout=30)
        assert missing.returncode != 0 and "no queue named 'nope'" in missing.stderr
    finally:
        err = stop(broker)
    assert broker.returncode == 0, err
    assert "received SIGTERM: shutting down" in err


def test_bad_config_value_is_named(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[queues]\nflow_stop_percent = 120\n")
    result = subprocess.run([FLOWBROKER, "serve", "--config", str(config)], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "[queues] flow_stop_percent = 120: must be a number in [0, 100]" in result.stderr


def test_publish_and_consume_log_in_with_the_environments_user(tmp_path: Path) -> None:
    port = free_port()
    users = tmp_path / "users.json"
    add = subprocess.run([FLOWBROKER, "user", "add", "cli", "--password-stdin", "--users-file", str(users)],
                         input="s3cret\n", capture_output=True, text=True, timeout=30)
    assert add.returncode == 0, add.stderr
    add = subprocess.run([FLOWBROKER, "user", "add", "writer", "--password-stdin", "--users-file", str(users),
                          "--configure", "^$", "--write", ".*", "--read", "^$"],
                         input="wr1ter\n", capture_output=True, text=True, timeout=30)
    assert add.returncode == 0, add.stderr
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[server]\nport = {port}\n\n[admin]\nenabled = false\n\n[udp]\nenabled = false\n\n'
                      f'[auth]\nloopback_user = ""\nusers_file = "{users}"\nfailed_login_delay = 0.1\n')
    url = f"flowbroker://127.0.0.1:{port}"
    broker = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config)], stderr=subprocess.PIPE, text=True)
    env = {**os.environ, "FLOWBROKER_USER": "cli", "FLOWBROKER_PASSWORD": "s3cret"}
    try:
        wait_listening(port, broker)
        refused = subprocess.run([FLOWBROKER, "publish", "--url", url, "-k", "q", "x"], capture_output=True,
                                 text=True, timeout=30, env={k: v for k, v in env.items() if k != "FLOWBROKER_USER"})
        assert refused.returncode != 0 and "FLOWBROKER_USER and FLOWBROKER_PASSWORD" in refused.stderr
        no_password = {k: v for k, v in env.items() if k != "FLOWBROKER_PASSWORD"}
        for command in (["publish", "-k", "q", "x"], ["consume", "--count", "1", "q"], ["exchange", "declare", "e"]):
            half = subprocess.run([FLOWBROKER, *command, "--url", url], capture_output=True, text=True, timeout=30,
                                  env=no_password)  # not sent as an empty password: said before connecting
            assert half.returncode == 1 and "FLOWBROKER_USER is set ('cli') but FLOWBROKER_PASSWORD is not" in half.stderr
        pub = subprocess.run([FLOWBROKER, "publish", "--url", url, "-k", "q", "hello"], capture_output=True,
                             text=True, timeout=30, env=env)
        assert pub.returncode == 0, pub.stderr
        con = subprocess.run([FLOWBROKER, "consume", "--url", url, "--count", "1", "q"], capture_output=True,
                             text=True, timeout=30, env=env)
        assert con.returncode == 0 and con.stdout.splitlines() == ["hello"], con.stderr
        # A user who may write the queue but not configure it: publish declares nothing and sends (it failed
        # on its own declare, a tester); to a queue that does not exist, the message is refused.
        writer = {**os.environ, "FLOWBROKER_USER": "writer", "FLOWBROKER_PASSWORD": "wr1ter"}
        pub = subprocess.run([FLOWBROKER, "publish", "--url", url, "-k", "q", "from the writer"], capture_output=True,
                             text=True, timeout=30, env=writer)
        assert pub.returncode == 0, pub.stderr
        missing = subprocess.run([FLOWBROKER, "publish", "--url", url, "-k", "nope", "x"], capture_output=True,
                                 text=True, timeout=30, env=writer)
        assert missing.returncode == 1 and "no queue named 'nope'" in missing.stdout + missing.stderr
        # and says why it did not make it (it said only "no queue named", a tester)
        assert "(its declare was refused: " in missing.stdout + missing.stderr
        con = subprocess.run([FLOWBROKER, "consume", "--url", url, "--count", "1", "q"], capture_output=True,
                             text=True, timeout=30, env=env)
        assert con.returncode == 0 and con.stdout.splitlines() == ["from the writer"], con.stderr
    finally:
        err = stop(broker)
    assert "2 user(s) in" in err and "login refused" in err


def test_every_command_has_help() -> None:
    for command in ([], ["serve"], ["publish"], ["consume"], ["user"], ["user", "add"]):
        result = subprocess.run([FLOWBROKER, *command, "--help"], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0 and "Usage:" in result.stdout


def test_port_file_tells_the_ports_chosen_with_port_0_and_goes_with_the_broker(tmp_path: Path) -> None:
    """`serve --port 0 --admin-port 0 --port-file F` (and [udp] endpoint port 0): F says the three ports once
    listening, and the `admin API on` and `UDP data path on` lines say the same; F is removed when the broker stops. -q silences the INFO lines."""
    port_file = tmp_path / "ports.json"
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[admin]\ntoken_file = "{tmp_path / "admin-token"}"\n\n[udp]\nendpoint = "127.0.0.1:0"\n')
    broker = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config), "--port", "0", "--admin-port", "0",
                               "--port-file", str(port_file)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert time.monotonic() < deadline and broker.poll() is None, "no port file"
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        assert set(ports) == {"port", "admin_port", "udp_port", "metrics_port", "tls_port"}
        assert ports["port"] > 0 and ports["admin_port"] > 0 and ports["udp_port"] > 0
        assert ports["metrics_port"] == ports["admin_port"]  # /metrics on the admin port by default
        pub = subprocess.run([FLOWBROKER, "publish", "-k", "q", "x"], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "FLOWBROKER_URL": f"flowbroker://127.0.0.1:{ports['port']}"})
        assert pub.returncode == 0, pub.stderr
    finally:
        err = stop(broker)
    assert broker.returncode == 0, err
    assert f"admin API on http://127.0.0.1:{ports['admin_port']}, token in" in err
    assert f"flowbroker UDP data path on 127.0.0.1:{ports['udp_port']}" in err
    assert f"metrics on http://127.0.0.1:{ports['admin_port']}/metrics (no token required)" in err
    assert not port_file.exists()
    quiet = subprocess.run([FLOWBROKER, "-q", "serve", "--config", str(config), "--port", "0", "--admin-port", "0",
                            "--port-file", str(tmp_path / "no" / "such" / "dir")], capture_output=True, text=True,
                           timeout=30)
    assert quiet.returncode == 1 and quiet.stderr.startswith("Error: --port-file ")
    assert "cannot be written" in quiet.stderr and "INFO" not in quiet.stderr


def test_sighup_stops_the_broker_cleanly_and_removes_its_port_file(tmp_path: Path) -> None:
    port_file = tmp_path / "ports.json"
    broker = subprocess.Popen([FLOWBROKER, "serve", "--port", "0", "--admin-port", "0", "--no-udp",
                               "--port-file", str(port_file)], stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "HOME": str(tmp_path)})
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert broker.poll() is None and time.monotonic() < deadline, "the broker did not start"
            time.sleep(0.05)
        broker.send_signal(signal.SIGHUP)
        _, err = broker.communicate(timeout=15)
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.communicate()
    assert broker.returncode == 0 and "received SIGHUP: shutting down" in err, err
    assert not port_file.exists()


def test_a_broker_port_in_use_is_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        result = subprocess.run([FLOWBROKER, "serve", "--port", str(port), "--no-admin", "--no-udp", "--data-dir",
                                 str(tmp_path)], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "HOME": str(tmp_path)})
    finally:
        holder.close()
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr, result.stderr


def test_serve_on_an_address_this_host_does_not_have_says_so(tmp_path: Path) -> None:
    """It said "another broker running?", the hint for a port in use (a tester). 192.0.2.1 is TEST-NET-1:
    documentation only, never an address of a real host."""
    out = subprocess.run([FLOWBROKER, "serve", "--host", "192.0.2.1", "--port", "0", "--no-admin", "--no-udp",
                          "--no-metrics", "--data-dir", str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "is 192.0.2.1 an address of this host?" in out.stderr and "another broker" not in out.stderr, out.stderr


def test_serve_on_a_host_name_that_does_not_resolve_says_so(tmp_path: Path) -> None:
    """It said "another broker running?" for a name resolution failure too (a tester). .invalid never resolves."""
    out = subprocess.run([FLOWBROKER, "serve", "--host", "nosuch.invalid", "--port", "0", "--no-admin", "--no-udp",
                          "--no-metrics", "--data-dir", str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "is nosuch.invalid a name this host can resolve?" in out.stderr and "another broker" not in out.stderr, out.stderr
