"""A broker that crashes and comes back mid-job: queues live in memory, so what it held is gone, and the
job must fail rather than report success (docs/spark.md, "When the broker is down or restarts mid-job")."""

from __future__ import annotations

import pytest

from flowbroker.client import blocking
from tests.spark.harness import CrashAndRestart


def test_a_job_whose_broker_crashes_and_restarts_fails(spark, broker, tmp_path):
    with blocking.connect(broker.url, timeout=10) as conn:
        conn.declare_queue("held", flow_stop_count=500, flow_resume_count=400)  # nobody reads: the job waits
    df = spark.range(0, 5000, numPartitions=1).selectExpr("cast(id as string) as value")
    with CrashAndRestart(broker, tmp_path) as crash:  # once the task is flow-stopped at 500
        with pytest.raises(Exception) as failure:
            (df.write.format("flowbroker").option("url", broker.url).option("queue", "held")
             .option("reconnectTimeout", "20").mode("append").save())
        crash.wait()
        text = str(failure.value)
        assert "SEQUENCE_GAP" in text or "SequenceGap" in text, text[:3000]
