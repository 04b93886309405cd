"""Spark data source for flowbroker: `flowbroker.spark.register(spark)`, then `format("flowbroker")`.

Batch and streaming writes (`df.write` / `df.writeStream`) send rows as messages through flow-controlled
producers, exactly once through task retries and replays; `spark.readStream` reads a queue in
micro-batches settled when Spark commits them. docs/spark.md has the options and the guarantees.

Needs the `spark` extra (`pip install 'flowbroker[spark]'`: pyspark and pyarrow); the rest of flowbroker
installs and runs without it.
"""

try:
    import pyarrow  # noqa: F401  (PySpark's Python data sources need it)
    import pyspark  # noqa: F401
except ImportError as exc:  # say what to install rather than which module is missing
    raise ImportError(f"flowbroker.spark needs the spark extra: pip install 'flowbroker[spark]' ({exc})") from exc

from flowbroker.spark.datasource import NAME, FlowbrokerDataSource, register
from flowbroker.spark.messages import Layout, LayoutError
from flowbroker.spark.options import OptionError, ReadOptions, WriteOptions
from flowbroker.spark.writer import FlowbrokerWriteError, PartitionWritten

__all__ = [
    "register",
    "NAME",
    "FlowbrokerDataSource",
    "WriteOptions",
    "ReadOptions",
    "OptionError",
    "Layout",
    "LayoutError",
    "FlowbrokerWriteError",
    "PartitionWritten",
]
