"""Exactly once through task retries: a task that fails half way through its partition is retried
(master local[2,3]: up to 3 attempts per task) and every row is in the queue once; a job re-submitted
with the same jobId sends nothing twice."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
from pyspark import cloudpickle

from flowbroker.spark.datasource import FlowbrokerDataSource
from flowbroker.spark.writer import BatchArrowWriter, BatchWriter, StreamArrowWriter, StreamWriter
from tests.spark.harness import drain

SPARK_MASTER = "local[2,3]"


class FailingOnceSource(FlowbrokerDataSource):
    """The real data source, whose task for partition 1 raises on its first attempt after sending 3,000
    of its 4,000 rows (in 30 batches of 100): Spark retries the task, which sends all 4,000 again."""

    @classmethod
    def name(cls) -> str:
        return "flowbroker-failing-once"

    def writer(self, schema, overwrite):
        writer = super().writer(schema, overwrite)
        assert isinstance(writer, BatchWriter)
        return FailingOnceWriter(writer.state)

    def streamWriter(self, schema, overwrite):
        writer = super().streamWriter(schema, overwrite)
        assert isinstance(writer, StreamWriter)
        return (SlowStreamWriter if (writer.state.options.job_id or "").startswith("slow") else FailingStreamWriter)(
            writer.state)


class SlowStreamWriter(StreamArrowWriter):
    """Sends 100 rows every 50 ms: a micro-batch of 2 x 2,000 rows takes a second to write."""

    def batches(self, iterator):
        for messages in super().batches(iterator):
            time.sleep(0.05)
            yield messages


class FailingOnceWriter(BatchArrowWriter):
    def batches(self, iterator):
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None
        for n, messages in enumerate(super().batches(iterator)):
            if context.attemptNumber() == 0 and context.partitionId() == 1 and n == 30:
                raise RuntimeError("injected failure three quarters through partition 1")
            yield messages


class FailingStreamWriter(StreamArrowWriter):
    """Batch 1, partition 1 fails after 300 of its rows in every attempt while the file `marker` names
    (the `jobId` option, unused by a streaming write that has a query id) does not exist: the query fails; once it exists, the restarted query goes through."""

    def batches(self, iterator):
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None
        restarted = os.path.exists(self.state.options.job_id or "")
        for n, messages in enumerate(super().batches(iterator)):
            if context.getLocalProperty("streaming.sql.batchId") == "1" and context.partitionId() == 1 \
                    and n == 3 and not restarted:
                raise RuntimeError("injected failure in batch 1")
            yield messages


def test_a_task_retried_after_failing_half_way_leaves_every_row_once(spark, broker, queue):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]  # the workers cannot import tests/
    spark.dataSource.register(FailingOnceSource)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")  # the writer gets rows in small batches
    try:
        before = broker.api("/api/broker")["idempotence"]["duplicates"]
        df = spark.range(0, 8000, numPartitions=2).selectExpr("cast(id as string) as value")
        df.write.format("flowbroker-failing-once").option("url", broker.url).option("queue", queue).mode("append").save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert sorted(int(m.body) for m in drain(broker.url, queue)) == list(range(8000))
    # the first attempt had sent 3,000 rows of partition 1 and its retry sent them again: the broker dropped those
    duplicates = broker.api("/api/broker")["idempotence"]["duplicates"] - before
    assert 0 < duplicates <= 3000


@pytest.mark.parametrize("arrow", ["true", "false"])
def test_a_job_resubmitted_with_its_job_id_sends_nothing_twice(spark, broker, queue, arrow):
    df = spark.range(0, 1000, numPartitions=2).selectExpr("cast(id as string) as value")
    for _ in range(2):
        (df.write.format("flowbroker").option("url", broker.url).option("queue", queue)
         .option("jobId", f"nightly-load-{arrow}").option("arrow", arrow).mode("append").save())
    assert sorted(int(m.body) for m in drain(broker.url, queue)) == list(range(1000))
    df.write.format("flowbroker").option("url", broker.url).option("queue", queue).option("arrow", arrow).mode("append").save()
    assert len(list(drain(broker.url, queue))) == 1000  # a new job (its own id) is new messages


def test_a_micro_batch_replayed_from_the_checkpoint_lands_once(spark, broker, queue, tmp_path):
    """Batch 1's second task fails (in every attempt) after sending 300 rows, so the query fails; restarted
    from its checkpoint, it replays batch 1 with the same query id, batch id, partitions and rows, and
    the broker drops what the failed run had delivered."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    spark.dataSource.register(FailingOnceSource)
    folder = tmp_path / "in"
    folder.mkdir()
    for b in range(3):
        (folder / f"part-{b}.txt").write_text("".join(f"{b * 1000 + i}\n" for i in range(1000)))
    restarted = tmp_path / "restarted"

    def start() -> Any:
        return (spark.readStream.option("maxFilesPerTrigger", 1).text(str(folder)).repartition(2)
                .writeStream.format("flowbroker-failing-once").option("url", broker.url).option("jobId", str(restarted))
                .option("queue", queue).option("batchSize", "100")
                .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start())

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        before = broker.api("/api/broker")["idempotence"]["duplicates"]
        with pytest.raises(Exception, match="injected failure in batch 1"):
            start().awaitTermination(120)
        restarted.touch()
        second = start()
        assert second.awaitTermination(120)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert sorted(int(m.body) for m in drain(broker.url, queue)) == list(range(3000))
    assert broker.api("/api/broker")["idempotence"]["duplicates"] - before >= 300  # the replay resent them


def test_a_micro_batch_stopped_half_way_and_rewritten_by_stragglers_lands_once(spark, broker, queue, tmp_path):
    """`query.stop()` in the middle of batch 0: its tasks go on writing the aborted batch to its end (Spark
    does not interrupt the Python workers; the queue had all 4,000 rows right after stop() returned), and
    the restarted query writes batch 0 again. Same ids and sequences: every row once."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    spark.dataSource.register(FailingOnceSource)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "part-0.txt").write_text("".join(f"{i}\n" for i in range(4000)))

    def start(available_now: bool) -> Any:
        stream = (spark.readStream.text(str(folder)).repartition(2)
                  .writeStream.format("flowbroker-failing-once").option("url", broker.url).option("queue", queue)
                  .option("jobId", "slow").option("batchSize", "100")
                  .option("checkpointLocation", str(tmp_path / "checkpoint")))
        return (stream.trigger(availableNow=True) if available_now else stream).start()

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        before = broker.api("/api/broker")["idempotence"]["duplicates"]
        first = start(False)
        deadline = time.monotonic() + 60
        while broker.api(f"/api/queues/{queue}")["depth"]["count"] < 500:  # batch 0 half way
            assert time.monotonic() < deadline, "batch 0 was not written"
            time.sleep(0.05)
        first.stop()
        time.sleep(3)  # stragglers
        second = start(True)
        assert second.awaitTermination(120)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert sorted(int(m.body) for m in drain(broker.url, queue)) == list(range(4000))
    duplicates = broker.api("/api/broker")["idempotence"]["duplicates"] - before
    assert duplicates >= 500, duplicates  # batch 0 was written again after the stop


def test_a_missing_exchange_fails_the_job_and_its_retries_do_not_succeed_without_the_rows(spark, broker):
    """The rows refused NOT_FOUND are taken under their sequences: the retry's resends were duplicates,
    and save() succeeded with nothing delivered (a tester, with 2 attempts a task). The broker now
    refuses them again, so every attempt fails and so does save()."""
    df = spark.createDataFrame([("1",), ("2",), ("3",)], "value string")
    with pytest.raises(Exception, match="no exchange named 'nowhere'"):
        (df.write.format("flowbroker").option("url", broker.url).option("exchange", "nowhere")
         .option("routingKey", "a").mode("append").save())


def test_with_an_exchange_an_unreachable_broker_fails_on_the_driver(spark):
    """The driver reached the broker only to declare a queue: with the exchange option a task failed
    instead, after its retries (the docs promise the driver's HandshakeError within connectTimeout)."""
    from tests.e2e.daemon import free_port

    df = spark.createDataFrame([("1",)], "value string")
    with pytest.raises(Exception, match="HandshakeError") as failed:
        (df.write.format("flowbroker").option("url", f"flowbroker://127.0.0.1:{free_port()}")
         .option("exchange", "amq.direct").option("routingKey", "a").option("connectTimeout", "2")
         .mode("append").save())
    assert "PythonException" not in type(failed.value).__name__
