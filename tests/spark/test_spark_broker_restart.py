"""A broker that crashes and comes back mid-job: queues live in memory, so what it held is gone, and the
job must fail rather than report success (docs/spark.md, "When the broker is down or restarts mid-job")."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from flowbroker.client import blocking
from tests.spark.harness import Broker, start_broker, stop_broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    running = start_broker(tmp_path_factory.mktemp("broker"))
    try:
        yield running
    finally:
        stop_broker(running)


def test_a_job_whose_broker_crashes_and_restarts_fails(spark, broker, tmp_path):
    with blocking.connect(broker.url, timeout=10) as conn:
        conn.declare_queue("held", flow_stop_count=500, flow_resume_count=400)  # nobody reads: the job waits
    df = spark.range(0, 5000, numPartitions=1).selectExpr("cast(id as string) as value")
    restarted: list[Broker] = []

    def crash_and_restart() -> None:  # beside the job: save() stays on the session's own thread
        deadline = time.monotonic() + 60
        while broker.api("/api/queues/held")["depth"]["count"] < 500 and time.monotonic() < deadline:
            time.sleep(0.2)  # until the task is flow-stopped
        broker.proc.kill()  # a crash: no CLOSE, so the task's idempotent connection reconnects
        broker.proc.wait()
        stop_broker(broker)  # closes its stderr
        restarted.append(start_broker(tmp_path, port=broker.port))

    thread = threading.Thread(target=crash_and_restart, daemon=True)
    thread.start()
    try:
        with pytest.raises(Exception) as failure:
            (df.write.format("flowbroker").option("url", broker.url).option("queue", "held")
             .option("reconnectTimeout", "20").mode("append").save())
        thread.join(60)
        assert restarted, "the broker was not restarted"
        text = str(failure.value)
        assert "SEQUENCE_GAP" in text or "SequenceGap" in text, text[:3000]
    finally:
        for running in restarted:
            stop_broker(running)
