"""Helpers for tests that run `flowbroker` as a separate process, as a person would."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FLOWBROKER = str(Path(sys.executable).with_name("flowbroker"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[str]) -> None:
    """Until something accepts on 127.0.0.1:port; fails at once with its stderr if `proc` exited."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "broker exited"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listened on {port} within 20 s")


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM the broker we started, wait for its clean exit and return its stderr (SIGKILL if it
    has not exited within 15 s, and the test fails with TimeoutExpired)."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return str(err)
