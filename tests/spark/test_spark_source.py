"""The streaming source: every message of a queue reaches Spark, no more than the prefetch is ever in
flight, messages are settled once their batch is committed, and a query that fails and restarts from its
checkpoint loses nothing (the unsettled messages come back, flagged redelivered)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from flowbroker.client import blocking
from tests.spark.harness import drain


def _publish(url: str, queue: str, count: int) -> None:
    with blocking.connect(url, timeout=10) as conn:
        with conn.producer(routing_key=queue) as producer:
            producer.send_batch([(b"%d" % i, {"n": i}, None) for i in range(count)], timeout=30)


def test_every_message_reaches_spark_within_the_prefetch_and_is_settled(spark, broker, queue):
    _publish(broker.url, queue, 2000)
    query = (spark.readStream.format("flowbroker").option("url", broker.url).option("queue", queue)
             .option("prefetch", "200").load()
             .writeStream.format("memory").queryName("source_all").start())
    try:
        unsettled = []
        deadline = time.monotonic() + 120
        while spark.sql("select count(*) from source_all").first()[0] < 2000:
            assert time.monotonic() < deadline, "the source did not deliver 2,000 messages in 120 s"
            assert query.exception() is None
            view = broker.api(f"/api/queues/{queue}")
            unsettled += [s["unsettled"] for s in view["subscriptions"]]
            time.sleep(0.2)
        settle_by = time.monotonic() + 30  # the next trigger settles the last batch, while the query runs
        while (depth := broker.api(f"/api/queues/{queue}")["depth"]["count"]) and time.monotonic() < settle_by:
            time.sleep(0.2)
    finally:
        query.stop()
    rows = spark.sql("select value, headers, routingKey, redelivered from source_all").collect()
    assert sorted(int(r.value) for r in rows) == list(range(2000))
    assert all(r.headers == {"n": r.value.decode()} and r.routingKey == queue and not r.redelivered for r in rows)
    assert unsettled and max(unsettled) <= 200
    assert depth == 0  # all settled while the query ran


def test_a_query_that_fails_and_restarts_from_its_checkpoint_loses_nothing(spark, broker, queue, tmp_path):
    """Batch 3 fails in its sink; the restarted query replays it with the messages the broker gave back
    (redelivered) and goes on; the file sink's output has every message exactly once."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType

    _publish(broker.url, queue, 1000)
    marker = tmp_path / "failed-once"

    def fail_once(value: bytes) -> bytes:
        if int(value) == 350 and not marker.exists():
            marker.touch()
            raise RuntimeError("injected failure in the batch holding message 350")
        return value

    def start() -> Any:
        return (spark.readStream.format("flowbroker").option("url", broker.url).option("queue", queue)
                .option("prefetch", "200").option("maxBatchSize", "100").load()
                .select(F.udf(fail_once, BinaryType(), useArrow=False)("value").alias("value"), "redelivered")
                .writeStream.format("parquet").option("path", str(tmp_path / "out"))
                .option("checkpointLocation", str(tmp_path / "checkpoint")).start())

    first = start()
    with pytest.raises(Exception, match="injected failure"):
        first.awaitTermination(120)
    assert marker.exists()
    second = start()
    try:
        deadline = time.monotonic() + 120
        while _count(spark, tmp_path / "out") < 1000:
            assert time.monotonic() < deadline and second.exception() is None
            time.sleep(0.5)
    finally:
        second.stop()
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    assert sorted(int(r.value) for r in rows) == list(range(1000))
    assert any(r.redelivered for r in rows) and int(min(r.value for r in rows if r.redelivered)) <= 350
    assert list(drain(broker.url, queue, idle=1.0)) == []


def _count(spark, folder: Path) -> int:
    try:
        return int(spark.read.parquet(str(folder)).count())
    except Exception:  # no file written yet
        return 0


@pytest.mark.parametrize("option, value, message", [
    ("maxBatchSize", "51", r"maxBatchSize \(51\) cannot exceed half the prefetch \(100\)"),
    ("pollTimout", "1", "unknown flowbroker option"),
])
def test_a_bad_read_option_fails_load_with_its_name(spark, broker, queue, option, value, message):
    from pyspark.errors import AnalysisException

    reader = (spark.readStream.format("flowbroker").option("url", broker.url).option("queue", queue)
              .option("prefetch", "100").option(option, value))
    with pytest.raises(AnalysisException, match=message):
        reader.load()


def test_process_all_available_then_stop_reads_what_is_there_and_settles_it(spark, broker, queue):
    """The one-off read docs/spark.md gives: every message once, and the queue empty after."""
    _publish(broker.url, queue, 300)
    query = (spark.readStream.format("flowbroker").option("url", broker.url).option("queue", queue).load()
             .writeStream.format("memory").queryName("source_once").start())
    query.processAllAvailable()
    query.stop()
    assert sorted(int(r.value) for r in spark.sql("select value from source_once").collect()) == list(range(300))
    assert broker.api(f"/api/queues/{queue}")["depth"]["count"] == 0


@pytest.mark.parametrize("trigger", [{"availableNow": True}, {"once": True}])
def test_a_trigger_that_ends_without_committing_its_last_batch_is_refused_naming_what_to_do(
    spark, broker, queue, trigger
):
    """availableNow read 5,000 messages and ended without settling them: every run read them again,
    flagged redelivered, and the queue never drained (a tester)."""
    _publish(broker.url, queue, 10)
    query = (spark.readStream.format("flowbroker").option("url", broker.url).option("queue", queue).load()
             .writeStream.format("memory").queryName(f"source_{next(iter(trigger))}").trigger(**trigger).start())
    with pytest.raises(Exception, match="cannot read a flowbroker queue.*processAllAvailable"):
        query.awaitTermination(120)
    assert broker.api(f"/api/queues/{queue}")["depth"]["ready"] == 10  # nothing taken for good
