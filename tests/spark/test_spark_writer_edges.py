"""What the writer refuses and waits for at its edges (testers, session 35): mode("overwrite") was accepted
and appended; a batch read failed with a bare PySpark traceback; a task that Spark started or retried while
a crashed broker came back failed at once instead of waiting `reconnectTimeout` for it."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from flowbroker.spark.options import WriteOptions
from flowbroker.spark.writer import _connect
from tests.spark.harness import Broker, start_broker, stop_broker


def test_overwrite_and_a_batch_read_are_refused_saying_what_to_do(spark, broker):
    df = spark.range(0, 3).selectExpr("cast(id as string) as value")
    with pytest.raises(Exception, match=r'mode\("overwrite"\) is not supported'):
        df.write.format("flowbroker").option("url", broker.url).option("queue", "edges").mode("overwrite").save()
    with pytest.raises(Exception, match="reads only as a stream: spark.readStream"):
        spark.read.format("flowbroker").option("url", broker.url).option("queue", "edges").load().collect()


def test_a_tasks_first_connect_waits_for_a_broker_that_comes_back(tmp_path: Path):
    with socket.socket() as probe, socket.socket() as other:  # ports nothing listens on (the first, for now)
        probe.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        port, never = probe.getsockname()[1], other.getsockname()[1]
    started: list[Broker] = []

    def come_back() -> None:
        time.sleep(1.5)
        started.append(start_broker(tmp_path, port=port))

    thread = threading.Thread(target=come_back, daemon=True)
    thread.start()
    try:
        options = WriteOptions.parse({"url": f"flowbroker://127.0.0.1:{port}", "queue": "q",
                                      "reconnectTimeout": "20"})
        began = time.monotonic()
        with _connect(options, "job/0") as conn:
            assert conn.broker_run is not None
        assert time.monotonic() - began >= 1.0  # it waited for the broker rather than failing at once
        refused = WriteOptions.parse({"url": f"flowbroker://127.0.0.1:{never}", "queue": "q",
                                      "reconnectTimeout": "0"})
        with pytest.raises(Exception, match="cannot connect"):  # reconnectTimeout 0: at once, as before
            _connect(refused, "job/1")
    finally:
        thread.join(30)
        for running in started:
            stop_broker(running)


def test_a_tasks_first_connect_waits_through_connections_reset_mid_handshake(tmp_path: Path):
    """A broker killed while it accepted a task's connection resets it before WELCOME: the task failed at
    once ("Connection reset by peer", a HandshakeError from trio's BrokenResourceError), not only a refused
    connection is retried for reconnectTimeout (a tester: a job failed 1 s into a 3 s outage)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    started: list[Broker] = []
    resets = 0

    def reset_then_come_back() -> None:
        nonlocal resets
        listener.settimeout(0.1)
        until = time.monotonic() + 1.5
        while time.monotonic() < until:  # accept and reset every connection, as a dying broker does
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()
            resets += 1
        listener.close()
        started.append(start_broker(tmp_path, port=port))

    thread = threading.Thread(target=reset_then_come_back, daemon=True)
    thread.start()
    try:
        options = WriteOptions.parse({"url": f"flowbroker://127.0.0.1:{port}", "queue": "q",
                                      "reconnectTimeout": "20"})
        with _connect(options, "job/0") as conn:
            assert conn.broker_run is not None
        assert resets >= 1
    finally:
        thread.join(30)
        for running in started:
            stop_broker(running)
