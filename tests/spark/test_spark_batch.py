"""Batch writes through a real local Spark to a real broker: every row arrives once, as documented."""

from __future__ import annotations

import json

import pytest

from tests.spark.harness import drain


def test_a_value_column_becomes_the_body_and_every_row_arrives_once(spark, broker, queue):
    df = spark.range(0, 5000, numPartitions=4).selectExpr("cast(id as string) as value")
    df.write.format("flowbroker").option("url", broker.url).option("queue", queue).mode("append").save()
    bodies = sorted(int(m.body) for m in drain(broker.url, queue))
    assert bodies == list(range(5000))


def test_without_a_value_column_each_row_is_a_json_object(spark, broker, queue):
    df = spark.sql("select id, concat('n', id) as name, cast(concat('b', id) as binary) as raw, date'2026-11-25' as day "
                   "from range(3)")
    df.write.format("flowbroker").option("url", broker.url).option("queue", queue).mode("append").save()
    rows = sorted((json.loads(m.body) for m in drain(broker.url, queue)), key=lambda r: r["id"])
    assert rows[1] == {"id": 1, "name": "n1", "raw": "YjE=", "day": "2026-11-25"}
    assert len(rows) == 3


@pytest.mark.parametrize("arrow", ["true", "false"])
def test_key_and_headers_columns_become_headers_and_a_column_routes(spark, broker, arrow):
    from flowbroker.client import blocking

    with blocking.connect(broker.url, timeout=10) as conn:
        conn.declare_exchange(f"orders-{arrow}", "direct")
        for region in ("eu", "us"):
            conn.declare_queue(f"orders-{arrow}-{region}")
            conn.bind(f"orders-{arrow}-{region}", f"orders-{arrow}", region)
    df = spark.sql("select cast(cast(id as string) as binary) as value, concat('k', id) as key, "
                   "map('source', 'spark', 'n', cast(id as string)) as headers, "
                   "if(id % 2 = 0, 'eu', 'us') as region from range(10)")
    (df.write.format("flowbroker").option("url", broker.url).option("exchange", f"orders-{arrow}")
     .option("routingKeyColumn", "region").option("arrow", arrow).mode("append").save())
    eu = list(drain(broker.url, f"orders-{arrow}-eu"))
    us = list(drain(broker.url, f"orders-{arrow}-us"))
    def n(message: blocking.BlockingMessage) -> int:
        assert message.headers is not None
        return int(str(message.headers["n"]))

    assert sorted(n(m) for m in eu) == [0, 2, 4, 6, 8]
    assert sorted(n(m) for m in us) == [1, 3, 5, 7, 9]
    first = min(eu, key=n)
    assert first.headers == {"source": "spark", "n": "0", "key": "k0"} and first.routing_key == "eu"
    assert first.body == b"0"


def test_a_missing_queue_is_declared_before_any_task_runs(spark, broker):
    """Declared on the driver: a task refused NOT_FOUND would have its rows taken as refused, and its
    retry would find them duplicates and succeed with nothing in any queue."""
    df = spark.range(3).selectExpr("cast(id as string) as value")
    df.write.format("flowbroker").option("url", broker.url).option("queue", "declared-by-spark").mode("append").save()
    assert sorted(m.body for m in drain(broker.url, "declared-by-spark")) == [b"0", b"1", b"2"]


def test_an_unreachable_broker_fails_the_job_on_the_driver_naming_it(spark):
    from tests.e2e.daemon import free_port

    url = f"flowbroker://127.0.0.1:{free_port()}"
    df = spark.range(3).selectExpr("cast(id as string) as value")
    with pytest.raises(Exception, match="HandshakeError|refused"):
        df.write.format("flowbroker").option("url", url).option("queue", "q").option("connectTimeout", "2") \
            .mode("append").save()


def test_a_bad_option_fails_on_the_driver_naming_it(spark, broker):
    df = spark.range(3).selectExpr("cast(id as string) as value")
    with pytest.raises(Exception, match="routingkeycolum"):
        (df.write.format("flowbroker").option("url", broker.url).option("exchange", "x")
         .option("routingKeyColum", "region").mode("append").save())


def test_a_task_the_broker_paces_for_longer_than_timeout_fails_with_its_reason(spark, broker):
    from flowbroker.client import blocking

    with blocking.connect(broker.url, timeout=10) as conn:
        conn.declare_queue("nobody-reads", flow_stop_count=100, flow_resume_count=50)
    df = spark.range(0, 2000, numPartitions=1).selectExpr("cast(id as string) as value")
    with pytest.raises(Exception) as failure:
        (df.write.format("flowbroker").option("url", broker.url).option("queue", "nobody-reads")
         .option("timeout", "2").option("window", "50").mode("append").save())
    text = str(failure.value)
    assert "FlowbrokerWriteError" in text and "timed out after 2 s" in text, text
    assert "the broker flow-stopped nobody-reads (flow_stop_count 100, at " in text, text


def test_a_thread_that_registers_can_write(spark, broker, queue):
    """Spark looks Python data sources up through the thread's active session: register() sets it."""
    import threading

    import flowbroker.spark

    outcome: list[BaseException | None] = []

    def write() -> None:
        try:
            flowbroker.spark.register(spark)
            df = spark.range(3).selectExpr("cast(id as string) as value")
            df.write.format("flowbroker").option("url", broker.url).option("queue", queue).mode("append").save()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    thread.join(120)
    assert outcome == [None]
    assert sorted(m.body for m in drain(broker.url, queue)) == [b"0", b"1", b"2"]


def test_save_with_a_name_writes_to_that_queue(spark, broker, queue):
    spark.range(2).selectExpr("cast(id as string) as value").write.format("flowbroker") \
        .option("url", broker.url).mode("append").save(queue)
    assert sorted(m.body for m in drain(broker.url, queue)) == [b"0", b"1"]
