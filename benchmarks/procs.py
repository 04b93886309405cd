"""What the benchmark scripts share: a free port, a process's RSS and CPU time, stopping the broker by its pid."""

from __future__ import annotations

import signal
import socket
import subprocess

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def stop_broker(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the broker shuts down cleanly), then SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
