"""The generated admin token file (docs/management.md, "The credential"): one per admin port, written
only once the admin port is bound, a valid one reused. The bug this guards: a second `flowbroker serve`
whose admin port was taken rewrote the token file before failing, so the CLI of the broker already
running got 403 until that broker was restarted."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from flowbroker.broker.admin import resolve_token, reusable_token, write_token_file
from flowbroker.broker.config import AdminConfig
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening

GOOD = "reusable-token-0123456789abcdef"


def _serve(home: Path, port: int, admin_port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [FLOWBROKER, "serve", "--port", str(port), "--admin-port", str(admin_port), "--udp-endpoint", "127.0.0.1:0",
         "--data-dir", str(home / f"data-{port}")],  # (one broker per data directory, docs/storage.md)
        stderr=subprocess.PIPE, text=True, env={**os.environ, "HOME": str(home)},
    )


def _token(token_file: Path, proc: subprocess.Popen[str]) -> str:
    """The token file's content once the broker has written it: just after its admin port is bound, so a
    client that saw the port listen may look a moment too early (seen under load)."""
    deadline = time.monotonic() + 20
    while not (token_file.is_file() and token_file.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, f"{token_file} not written"
        time.sleep(0.05)
    return token_file.read_text()


def _cli(home: Path, admin_port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWBROKER_ADMIN")}
    return subprocess.run([FLOWBROKER, *args, "--admin-url", f"http://127.0.0.1:{admin_port}"],
                          capture_output=True, text=True, timeout=30, env={**env, "HOME": str(home)})


def test_a_broker_that_cannot_bind_the_admin_port_leaves_the_running_brokers_token(tmp_path: Path) -> None:
    admin_port = free_port()
    first = _serve(tmp_path, free_port(), admin_port)
    try:
        wait_listening(admin_port, first)
        token_file = tmp_path / ".flowbroker" / f"admin-token-{admin_port}"
        before = _token(token_file, first)
        assert _cli(tmp_path, admin_port, "queues").returncode == 0

        second = _serve(tmp_path, free_port(), admin_port)  # same admin port: must fail to start
        _, err = second.communicate(timeout=30)
        assert second.returncode != 0 and f"cannot listen on 127.0.0.1:{admin_port}" in err

        assert token_file.read_text() == before
        result = _cli(tmp_path, admin_port, "queues")  # the running broker's CLI still works
        assert result.returncode == 0, result.stderr
    finally:
        err = stop(first)
    assert f"token in {tmp_path}/.flowbroker/admin-token-{admin_port} (generated at start, mode 0600)" in err


def test_two_brokers_on_one_host_keep_their_own_token_files(tmp_path: Path) -> None:
    ports = [(free_port(), free_port()) for _ in range(2)]
    brokers = [_serve(tmp_path, port, admin_port) for port, admin_port in ports]
    try:
        for proc, (_, admin_port) in zip(brokers, ports):
            wait_listening(admin_port, proc)
        files = [tmp_path / ".flowbroker" / f"admin-token-{admin_port}" for _, admin_port in ports]
        assert _token(files[0], brokers[0]) != _token(files[1], brokers[1])
        for _, admin_port in ports:  # each CLI finds its broker's token from the URL's port
            result = _cli(tmp_path, admin_port, "queues")
            assert result.returncode == 0, result.stderr
    finally:
        for proc in brokers:
            stop(proc)


def test_a_restarted_broker_reuses_the_token_its_cli_has(tmp_path: Path) -> None:
    admin_port = free_port()
    token_file = tmp_path / ".flowbroker" / f"admin-token-{admin_port}"
    tokens = []
    for _ in range(2):
        proc = _serve(tmp_path, free_port(), admin_port)
        try:
            wait_listening(admin_port, proc)
            tokens.append(_token(token_file, proc))
        finally:
            err = stop(proc)
    assert tokens[0] == tokens[1]
    assert f"admin-token-{admin_port} (reused, mode 0600)" in err


def test_admin_port_zero_writes_the_file_of_the_bound_port(tmp_path: Path) -> None:
    port = free_port()
    proc = _serve(tmp_path, port, 0)
    try:
        wait_listening(port, proc)
        folder, deadline = tmp_path / ".flowbroker", time.monotonic() + 20
        while not (folder.is_dir() and any(folder.iterdir())):  # the admin port binds after the broker port
            assert proc.poll() is None and time.monotonic() < deadline, "no token file written"
            time.sleep(0.05)
        [token_file] = folder.iterdir()
        admin_port = int(token_file.name.removeprefix("admin-token-"))
        wait_listening(admin_port, proc)
        assert _cli(tmp_path, admin_port, "queues").returncode == 0
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("content", "mode", "reused"),
    [
        (GOOD, 0o600, True),
        (GOOD + "\n", 0o400, True),
        (GOOD, 0o644, False),  # others could read it: a fresh token, written 0600
        ("short", 0o600, False),  # not a valid token
        ("has a space in it 0123456789", 0o600, False),
        ("", 0o600, False),
    ],
)
def test_which_token_files_are_reused(tmp_path: Path, content: str, mode: int, reused: bool) -> None:
    config = AdminConfig(port=5681, token_file=str(tmp_path / "admin-token-{port}"))
    path = tmp_path / "admin-token-5681"
    path.write_text(content)
    path.chmod(mode)
    token, unwritten = resolve_token(config, 5681)
    assert (token == content.strip()) is reused
    assert unwritten is not reused
    assert path.read_text() == content  # resolving never writes: only a bound broker does


def test_a_missing_file_a_link_or_a_folder_is_not_reused(tmp_path: Path) -> None:
    assert reusable_token(tmp_path / "absent") is None
    target = tmp_path / "target"
    write_token_file(target, GOOD)
    assert reusable_token(target) == GOOD
    (tmp_path / "link").symlink_to(target)
    assert reusable_token(tmp_path / "link") is None
    (tmp_path / "dir").mkdir()
    assert reusable_token(tmp_path / "dir") is None


def test_a_configured_token_is_used_and_never_written(tmp_path: Path) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir()
    config = AdminConfig(token="configured-token-0123456789", token_file=str(folder / "t-{port}"))
    assert resolve_token(config, 5681) == ("configured-token-0123456789", False)
    assert not list(folder.iterdir())
