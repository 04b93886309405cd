"""The `flowbroker` data source: what Spark looks up by name, and the one call that registers it.

Why registration is a call: PySpark finds a Python data source only once it is registered on the
session (`spark.dataSource.register`); `flowbroker.spark.register(spark)` does that for the name
`flowbroker`. Options are checked here, on the driver, so a bad option fails `save()` or `start()`
before any task runs; the batch job's id (the base of its producer ids) is made here too, once.
"""

from __future__ import annotations

import uuid
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, DataSourceStreamWriter, DataSourceWriter
from pyspark.sql.types import StructType

from flowbroker.spark.messages import Layout
from flowbroker.spark.options import ReadOptions, WriteOptions
from flowbroker.spark.source import SOURCE_SCHEMA, QueueStreamReader
from flowbroker.spark.writer import BatchArrowWriter, BatchWriter, StreamArrowWriter, StreamWriter, writer_state

__all__ = ["FlowbrokerDataSource", "register", "NAME"]

NAME = "flowbroker"


def _layout(schema: StructType, options: WriteOptions) -> Layout:
    types = {field.name: field.dataType.simpleString() for field in schema.fields}
    return Layout.of(schema.fieldNames(), types, options.routing_key_column)


class FlowbrokerDataSource(DataSource):
    """`format("flowbroker")`: batch and streaming writes to a queue or exchange, streaming reads of a queue."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SOURCE_SCHEMA

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        options = WriteOptions.parse(self.options)
        state = writer_state(options, _layout(schema, options), options.job_id or uuid.uuid4().hex)
        return BatchArrowWriter(state) if options.arrow else BatchWriter(state)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        options = WriteOptions.parse(self.options)
        state = writer_state(options, _layout(schema, options), options.job_id or "")
        return StreamArrowWriter(state) if options.arrow else StreamWriter(state)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QueueStreamReader(ReadOptions.parse(self.options))


def register(spark: SparkSession) -> None:
    """Make `format("flowbroker")` known to `spark` (once per session; registering again is harmless)."""
    spark.dataSource.register(FlowbrokerDataSource)


