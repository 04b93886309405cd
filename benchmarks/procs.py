"""What the benchmark scripts share: a free port, waiting for the broker to listen, a process's RSS and CPU
time, stopping the broker by its pid."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(proc: subprocess.Popen[bytes], port: int, seconds: float = 15.0) -> subprocess.Popen[bytes]:
    """Return `proc` once something accepts on 127.0.0.1:port; kill it if nothing does within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"broker did not start within {seconds:.0f} s")


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
