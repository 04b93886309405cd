"""The `flowbroker` data source: what Spark looks up by name, and the one call that registers it.

Why registration is a call: PySpark finds a Python data source only once it is registered on the
session (`spark.dataSource.register`); `flowbroker.spark.register(spark)` does that for the name
`flowbroker`. Options are checked here, on the driver, so a bad option fails `save()` or `start()`
before any task runs, and so does an unreachable broker; the `queue` option's queue is declared here
if missing; the batch job's id (the base of its producer ids) is made here too, once.
"""

from __future__ import annotations

import uuid
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, DataSourceStreamWriter, DataSourceWriter
from pyspark.sql.types import StructType

from flowbroker.client import blocking
from flowbroker.spark.messages import Layout
from flowbroker.spark.options import OptionError, ReadOptions, WriteOptions
from flowbroker.spark.source import SOURCE_SCHEMA, QueueStreamReader
from flowbroker.spark.writer import BatchArrowWriter, BatchWriter, StreamArrowWriter, StreamWriter, writer_state

__all__ = ["FlowbrokerDataSource", "register", "NAME"]

NAME = "flowbroker"


def _prepare(options: WriteOptions) -> None:
    """Before any task: reach the broker (with either option: an unreachable one fails `save()` on the
    driver, not in a task), and declare the queue of the `queue` option if it is missing (with the
    broker's defaults; an existing queue is left as it is), as `flowbroker publish` does.

    Why declare rather than let the tasks fail: a message the broker refuses (no such queue) counts as
    taken under its producer id and sequence (docs/protocol.md, "Idempotent producers"); the broker
    refuses its resend again while it keeps the refusal, but only the newest 4,096, so a large partition's
    retry could still find rows that are plain duplicates. An exchange cannot be declared without knowing
    its kind: a missing one fails the tasks, and their retries, with NotFound."""
    with blocking.connect(options.url, client_name="flowbroker-spark driver", timeout=options.connect_timeout,
                          **options.connect_arguments()) as conn:
        if options.exchange == "":
            conn.declare_queue(options.routing_key)


def _layout(schema: StructType, options: WriteOptions) -> Layout:
    types = {field.name: field.dataType.simpleString() for field in schema.fields}
    return Layout.of(schema.fieldNames(), types, options.routing_key_column)


class FlowbrokerDataSource(DataSource):
    """`format("flowbroker")`: batch and streaming writes to a queue or exchange, streaming reads of a queue."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        # Spark asks for the schema at `readStream...load()` (never for a write), from a worker whose
        # error it reports with our message; a bad option found only in streamReader() surfaces at
        # start() behind PySpark's own UnboundLocalError, with our OptionError as its chained cause.
        ReadOptions.parse(self.options)
        return SOURCE_SCHEMA

    def reader(self, schema: StructType) -> Any:
        """A batch read (`spark.read`): refused with what to do instead (PySpark's own error was a bare
        traceback, a tester). A queue is consumed, not scanned: its messages go once, settled."""
        raise OptionError('format("flowbroker") reads only as a stream: spark.readStream.format("flowbroker")'
                          '.option("queue", ...).load(); for a one-off read of what is there, start the '
                          'query, call query.processAllAvailable(), then query.stop() (docs/spark.md)')

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise OptionError('mode("overwrite") is not supported: messages are appended to a queue, never '
                              'replaced; use mode("append") (a tester: it was accepted, and appended)')
        options = WriteOptions.parse(self.options)
        layout = _layout(schema, options)
        _prepare(options)
        state = writer_state(options, layout, options.job_id or uuid.uuid4().hex)
        return BatchArrowWriter(state) if options.arrow else BatchWriter(state)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        if overwrite:
            raise OptionError('outputMode("complete") is not supported: messages are appended to a queue, '
                              'never replaced; use outputMode("append")')
        options = WriteOptions.parse(self.options)
        layout = _layout(schema, options)
        _prepare(options)
        state = writer_state(options, layout, options.job_id or "")
        return StreamArrowWriter(state) if options.arrow else StreamWriter(state)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QueueStreamReader(ReadOptions.parse(self.options))


def register(spark: SparkSession) -> None:
    """Make `format("flowbroker")` known to `spark`, and make `spark` the calling thread's active session.

    Why the active session: Spark (4.3) looks a Python data source up through the active session of the
    JVM thread that runs `save()` or `start()`, and a Python thread other than the one that built the
    session has none, so it finds no `flowbroker` there (DATA_SOURCE_NOT_FOUND). Call `register(spark)`
    once in each thread that writes or reads; registering again is harmless."""
    spark.dataSource.register(FlowbrokerDataSource)
    jvm = getattr(spark, "_jvm", None)
    if jvm is not None:  # a classic session (Spark Connect has no JVM here, and no such lookup)
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(getattr(spark, "_jsparkSession"))


