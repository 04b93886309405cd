"""What the Spark tests share: a broker process on ephemeral ports, a local SparkSession, and draining
a queue with the blocking SDK.

The broker runs as its own process (so its RSS is its own, and Spark's Python workers reach it over real
sockets); Spark is a real local session, one per test module (`local[2]`, or `local[2,3]` where tasks
must be retried: local mode ignores spark.task.maxFailures), quiet, its Python workers on this venv's
Python so they import this checkout's flowbroker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from flowbroker.client import blocking
from tests.e2e.daemon import FLOWBROKER, stop


@dataclass
class Broker:
    proc: subprocess.Popen[str]
    port: int
    admin_port: int
    token: str
    tls_port: int | None = None  # with [tls] enabled in the config

    @property
    def url(self) -> str:
        return f"flowbroker://127.0.0.1:{self.port}"

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def api(self, path: str) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)


def start_broker(tmp: Path, config: str = "", port: int = 0) -> Broker:
    """`flowbroker serve` on `port` (0: any free; the admin API on any free port, UDP off) with `config`
    appended to its TOML file."""
    port_file = tmp / "ports.json"
    port_file.unlink(missing_ok=True)
    (tmp / "home").mkdir(exist_ok=True)
    conf = tmp / "flowbroker.toml"
    conf.write_text(f"[server]\nport = {port}\n[admin]\nport = 0\n[udp]\nenabled = false\n{config}")
    proc = subprocess.Popen([FLOWBROKER, "serve", "--config", str(conf), "--port-file", str(port_file)],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HOME": str(tmp / "home")})
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "the broker exited"
        assert time.monotonic() < deadline, "the broker wrote no port file within 30 s"
        time.sleep(0.05)
    time.sleep(0.05)  # written in one go, but let the writer finish
    ports = json.loads(port_file.read_text())
    token = (tmp / "home" / ".flowbroker" / f"admin-token-{ports['admin_port']}").read_text().strip()
    return Broker(proc, ports["port"], ports["admin_port"], token, ports.get("tls_port"))


def stop_broker(broker: Broker) -> None:
    if broker.proc.poll() is None:
        stop(broker.proc)
    elif broker.proc.stderr is not None:  # it was killed: its pipe is still ours to close
        broker.proc.stderr.close()


class CrashAndRestart:
    """Beside a job (its `save()` stays on the session's own thread): once `queue` holds `count` messages
    (the job's task flow-stopped there), kill -9 the broker (a crash: no CLOSE, so idempotent connections
    reconnect) and start another on its port. `wait()` gives the new broker; leaving stops it."""

    def __init__(self, broker: Broker, tmp: Path, queue: str = "held", count: int = 500):
        self.broker, self.tmp, self.queue, self.count = broker, tmp, queue, count
        self.restarted: list[Broker] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while self.broker.api(f"/api/queues/{self.queue}")["depth"]["count"] < self.count and time.monotonic() < deadline:
            time.sleep(0.2)
        self.broker.proc.kill()
        self.broker.proc.wait()
        stop_broker(self.broker)  # closes its stderr
        self.restarted.append(start_broker(self.tmp, port=self.broker.port))

    def __enter__(self) -> CrashAndRestart:
        self._thread.start()
        return self

    def wait(self) -> Broker:
        self._thread.join(60)
        assert self.restarted, "the broker was not restarted"
        return self.restarted[0]

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._thread.join(60)
        for running in self.restarted:
            stop_broker(running)


def spark_session(master: str = "local[2]") -> Any:
    """A quiet local SparkSession with the data source registered (the caller stops it)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import flowbroker.spark

    spark = (
        SparkSession.builder.master(master)
        .appName("flowbroker-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    flowbroker.spark.register(spark)
    return spark


def drain(url: str, queue: str, *, idle: float = 2.0, ack: bool = True) -> Iterator[blocking.BlockingMessage]:
    """Every message of `queue` until none comes for `idle` seconds."""
    with blocking.connect(url, timeout=10) as conn:
        with conn.consumer(queue, prefetch=5000) as consumer:
            while True:
                messages = consumer.receive_many(5000, idle)
                if not messages:
                    return
                yield from messages
                if ack:
                    consumer.ack_many(messages)


def declare(url: str, queue: str, **arguments: Any) -> None:
    with blocking.connect(url, timeout=10) as conn:
        conn.declare_queue(queue, **arguments)
