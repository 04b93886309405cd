"""deploy/: the systemd unit (checked by systemd-analyze), the Containerfile (no container engine here: what it
names is checked against the package and the CLI's defaults) and the configuration file both of them use."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

from flowbroker.broker.cli import main
from flowbroker.broker.config import BrokerConfig, load_config
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "flowbroker.service"
CONTAINERFILE = DEPLOY / "Containerfile"
CONFIG = DEPLOY / "flowbroker.toml"
ETC_CONFIG = "/etc/flowbroker/flowbroker.toml"
SYSTEM_UNITS = Path("/lib/systemd/system")


def _unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def _systemd_root(tmp_path: Path) -> Path:
    """A root for `systemd-analyze --root`: the unit where an admin installs it, the units it depends on, and an
    executable where ExecStart names the broker (verify checks that it exists and can be executed)."""
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    shutil.copy(UNIT, root / "etc/systemd/system/flowbroker.service")
    [exec_start] = _unit_settings()["ExecStart"]
    binary = root / shlex.split(exec_start)[0].lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!/bin/sh\nexec {FLOWBROKER} \"$@\"\n")
    binary.chmod(0o755)
    return root


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60)


def test_systemd_analyze_verify_accepts_the_unit_without_a_warning(tmp_path: Path) -> None:
    root = _systemd_root(tmp_path)
    done = _analyze("verify", f"--root={root}", "flowbroker.service")
    # verify exits 0 on unknown keys and bad values, only warning about them: any output is a defect
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr + done.stdout

    # ...and it would have said so: a misspelt key, a bad value, a missing executable
    unit = root / "etc/systemd/system/flowbroker.service"
    text = UNIT.read_text()
    unit.write_text(text.replace("NoNewPrivileges=yes", "NoNewPrivilegez=yes"))
    assert "Unknown key 'NoNewPrivilegez'" in _analyze("verify", f"--root={root}", "flowbroker.service").stderr
    unit.write_text(text.replace("Restart=on-failure", "Restart=sometimes"))
    assert "Failed to parse service restart" in _analyze("verify", f"--root={root}", "flowbroker.service").stderr
    unit.write_text(text)
    (root / shlex.split(_unit_settings()["ExecStart"][0])[0].lstrip("/")).unlink()
    missing = _analyze("verify", f"--root={root}", "flowbroker.service")
    assert missing.returncode != 0 and "is not executable" in missing.stderr


def test_the_unit_is_hardened(tmp_path: Path) -> None:
    settings = _unit_settings()
    for key, value in {
        "DynamicUser": "yes", "StateDirectory": "flowbroker", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
        "ProtectHome": "yes", "PrivateTmp": "yes", "PrivateDevices": "yes", "Restart": "on-failure",
        "CapabilityBoundingSet": "",
    }.items():
        assert settings.get(key) == [value], key
    done = _analyze("security", "--offline=yes", f"--root={_systemd_root(tmp_path)}", "flowbroker.service")
    level = re.search(r"Overall exposure level for flowbroker\.service: (\d+\.\d+)", done.stdout)
    assert level, done.stdout + done.stderr
    assert float(level.group(1)) <= 2.0, done.stdout  # systemd's scale: 0 (safe) to 10; 1.5 when written


def _serve_params(argv: list[str]) -> dict[str, object]:
    """How `flowbroker serve` parses argv (its own options, as click does), with the configuration path it names
    replaced by deploy/flowbroker.toml, which the unit and the container install there."""
    assert argv[:2] == ["flowbroker", "serve"] or (argv[0].endswith("/flowbroker") and argv[1] == "serve"), argv
    args = [str(CONFIG) if a == ETC_CONFIG else a for a in argv[2:]]
    assert str(CONFIG) in args, f"{argv} does not name {ETC_CONFIG}"
    serve = main.commands["serve"]
    with serve.make_context("serve", args) as ctx:
        return dict(ctx.params)


def test_the_unit_runs_flowbroker_serve_with_the_installed_configuration() -> None:
    [exec_start] = _unit_settings()["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/flowbroker/bin/flowbroker"  # docs/operations.md installs it there
    params = _serve_params(argv)
    assert params["config_path"] == CONFIG and all(v is None for k, v in params.items() if k != "config_path")
    config = load_config(CONFIG)
    [state] = _unit_settings()["StateDirectory"]
    assert Path(config.admin.token_file).parent == Path("/var/lib") / state  # the one writable place


def test_the_configuration_file_loads_and_keeps_the_admin_api_local() -> None:
    config = load_config(CONFIG)
    defaults = BrokerConfig()
    assert config.admin.host == "127.0.0.1" and config.admin.enabled and config.admin.token == ""
    assert (config.server.port, config.admin.port) == (defaults.server.port, defaults.admin.port)
    assert config.udp.address()[1] == defaults.udp.address()[1]
    # the file's keys exist (load_config would have refused unknown ones) and it says nothing twice
    assert set(tomllib.loads(CONFIG.read_text())) <= {"server", "queues", "credit", "admin", "udp", "metrics",
                                                      "storage"}
    # durable queues are journalled in the state directory, the only one the unit lets the broker write
    assert config.storage.journal_dir() == Path("/var/lib/flowbroker/journal")
    assert config.metrics.enabled and config.metrics.endpoint == "" and not config.metrics.require_token


def _instructions() -> list[tuple[str, str]]:
    """The Containerfile's instructions as (KEYWORD, arguments), continuation lines joined, comments left out."""
    lines: list[str] = []
    pending = ""
    for raw in CONTAINERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append(pending)
        pending = ""
    assert not pending, "a continuation line ends the file"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in lines]


def test_the_containerfile_builds_on_python_3_11_slim_and_installs_the_package() -> None:
    instructions = _instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    copied: set[str] = set()
    for keyword, args in instructions:
        if keyword == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
                copied.add(source)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # everything `pip install /src` needs: the project file, the files it names, and every package folder
    needed = {"pyproject.toml", pyproject["project"]["readme"], *pyproject["project"]["license-files"],
              *pyproject["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= copied, f"not copied: {needed - copied}"
    assert ("RUN", "pip install --no-cache-dir /src && rm -rf /src") in instructions
    assert "flowbroker" in pyproject["project"]["scripts"]  # the command CMD runs


def test_the_container_exposes_the_cli_default_ports_and_runs_serve_as_a_user() -> None:
    instructions = _instructions()
    [exposed] = [args for keyword, args in instructions if keyword == "EXPOSE"]
    defaults = BrokerConfig()
    assert set(exposed.split()) == {
        f"{defaults.server.port}/tcp", f"{defaults.admin.port}/tcp", f"{defaults.udp.address()[1]}/udp",
    } == {"5680/tcp", "5681/tcp", "5682/udp"}

    keywords = [keyword for keyword, _ in instructions]
    assert keywords[-1] == "CMD" and keywords.count("USER") == 1
    [user] = [args for keyword, args in instructions if keyword == "USER"]
    uid, gid = user.split(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()  # numeric, so that runAsNonRoot can check it
    assert any(keyword == "RUN" and f"--uid {uid} --gid {gid}" in args and f"groupadd --system --gid {gid}" in args
               for keyword, args in instructions)
    assert keywords.index("USER") < keywords.index("CMD")

    argv = json.loads(instructions[-1][1])  # the exec form: SIGTERM reaches the broker, not a shell
    assert ("COPY", f"deploy/flowbroker.toml {ETC_CONFIG}") in instructions
    params = _serve_params(argv)
    assert params["admin_host"] == "0.0.0.0"  # else a published port cannot reach it
    assert params["port"] is None and params["admin_port"] is None and params["udp_endpoint"] is None
    env = " ".join(args for keyword, args in instructions if keyword == "ENV")
    assert f"FLOWBROKER_ADMIN_TOKEN_FILE={load_config(CONFIG).admin.token_file}" in env


def test_the_units_command_starts_a_broker_with_the_shipped_configuration(tmp_path: Path) -> None:
    """ExecStart's arguments, as written, on a copy of deploy/flowbroker.toml that differs only where this test
    must: ephemeral ports on 127.0.0.1 and a token file in tmp_path."""
    port, admin_port = free_port(), free_port()
    token_file = tmp_path / "admin-token"
    text = CONFIG.read_text()
    for old, new in (('host = "0.0.0.0"', 'host = "127.0.0.1"'), ("port = 5680", f"port = {port}"),
                     ("port = 5681", f"port = {admin_port}"), ('"0.0.0.0:5682"', '"127.0.0.1:0"'),
                     ('"/var/lib/flowbroker/admin-token"', json.dumps(str(token_file)))):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    config = tmp_path / "flowbroker.toml"
    config.write_text(text)
    args = [str(config) if a == ETC_CONFIG else a for a in shlex.split(_unit_settings()["ExecStart"][0])[1:]]
    broker = subprocess.Popen([FLOWBROKER, *args], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, broker)
        wait_listening(admin_port, broker)
        # the token file is written once the admin port is bound (docs/management.md): just after it listens
        deadline = time.monotonic() + 10
        while not token_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert token_file.stat().st_mode & 0o777 == 0o600
        # where deploy/prometheus/prometheus.yml scrapes it: the admin port, no token
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=10) as answer:
            assert answer.status == 200 and b"\nflowbroker_build_info{" in answer.read()
    finally:
        err = stop(broker)
    assert broker.returncode == 0, err
    assert f"flowbroker listening on 127.0.0.1:{port}" in err

