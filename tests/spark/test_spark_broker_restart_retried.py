"""A broker that crashes and comes back mid-job while Spark retries tasks (`local[2,4]`: four attempts, as a
cluster's default `spark.task.maxFailures`). The memory-only queue lost the partition finished before the
crash; the retry of the other succeeded on the new broker, and save() returned as if every row were in (a
tester: 50-75 % of 100,000 rows gone). Each partition reports the broker runs it saw (WELCOME's `run_id`),
and the job fails on the driver's commit when they differ (docs/spark.md)."""

from __future__ import annotations

import pytest

from flowbroker.client import blocking
from flowbroker.spark.writer import FlowbrokerWriteError, PartitionWritten, check_one_broker_run
from tests.spark.harness import CrashAndRestart

SPARK_MASTER = "local[2,4]"


def test_partitions_on_two_broker_runs_fail_the_job_unless_the_queue_is_durable() -> None:
    one = [PartitionWritten("j/0", 10, ("a", "a"), False), PartitionWritten("j/1", 10, ("a", "a"), False)]
    check_one_broker_run("j", one)
    two = [PartitionWritten("j/0", 10, ("a", "a"), False), PartitionWritten("j/1", 10, ("b", "b"), False)]
    with pytest.raises(FlowbrokerWriteError, match="the broker restarted during the job"):
        check_one_broker_run("j", two)
    within = [PartitionWritten("j/0", 10, ("a", "b"), None)]  # an exchange: durability unknown
    with pytest.raises(FlowbrokerWriteError):
        check_one_broker_run("j", within)
    check_one_broker_run("j", [PartitionWritten("j/0", 10, ("a", "a"), True),
                               PartitionWritten("j/1", 10, ("b", "b"), True)])  # durable: its journal kept them


def test_a_job_whose_broker_restarts_while_spark_retries_fails(spark, broker, tmp_path):
    with blocking.connect(broker.url, timeout=10) as conn:
        first_run = conn.broker_run
        conn.declare_queue("held", flow_stop_count=500, flow_resume_count=400)  # nobody reads: the job waits
    def rows_of(index: int, _: object) -> list[tuple[str]]:
        """Partition 0: 100 rows, all in at once; partition 1: 2,500 from 3 s later (partition 0 long
        done), flow-stopped at 500 until the crash."""
        if index == 0:
            return [(str(i),) for i in range(100)]
        import time as clock

        clock.sleep(3)
        return [(str(i),) for i in range(2500, 5000)]

    df = spark.createDataFrame(spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(rows_of),
                               "value string")
    with CrashAndRestart(broker, tmp_path) as crash:  # once the second task is flow-stopped at 500
        with pytest.raises(Exception) as failure:
            (df.write.format("flowbroker").option("url", broker.url).option("queue", "held")
             .option("jobId", "restarted-job").option("reconnectTimeout", "20").mode("append").save())
        restarted = crash.wait()
        text = str(failure.value)
        assert "the broker restarted during the job" in text and "jobId=restarted-job" in text, text[:3000]
        with blocking.connect(restarted.url, timeout=10) as conn:
            assert conn.broker_run not in (None, first_run)
            # the retried partition's rows are in; the first partition's 100 went with the old broker
            assert conn.declare_queue("held")["count"] == 2500
        # re-submitted with its jobId, as the error says: the lost rows again, the others as duplicates
        (df.write.format("flowbroker").option("url", restarted.url).option("queue", "held")
         .option("jobId", "restarted-job").mode("append").save())
        with blocking.connect(restarted.url, timeout=10) as conn:
            assert conn.declare_queue("held")["count"] == 2600
