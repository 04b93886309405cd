"""The streaming source: micro-batches of a queue's messages, settled when Spark commits the batch.

Why the driver holds the consumer: settlement is by delivery tag on the connection that received the
message, and Spark's `commit(end)` runs on the driver. So the driver's reader keeps one blocking-SDK
consumer for the query; `latestOffset` takes up to `maxBatchSize` messages into the next batch (waiting
`pollTimeout` for the first), `partitions` hands their rows to the tasks inside the input partitions,
and `commit(end)` acknowledges every message of the batches up to `end`. Nothing is acknowledged before
its batch's output is committed (`commit(end)`, or the next `latestOffset(start)`, which Spark calls
only after the batch ending at `start` is in its commit log), so a query killed at any point loses nothing: its connection closes,
the broker requeues every unsettled message in its place (flagged redelivered), and the restarted query
replays the batch its checkpoint planned but did not commit with the first messages it is given,
which are those. That is at-least-once: a batch whose output was written but whose commit was not
recorded is written again (`redelivered` is true on its rows, for a sink that deduplicates).

Credit: the consumer's `prefetch` bounds the messages delivered and not yet settled (Spark plans batch
n + 1 before it commits batch n, so `maxBatchSize` is at most half of it) and `bufferSize` the bytes
the broker may have delivered that the source has not taken yet; the broker never has more in flight
to Spark.

An offset is `{"taken": n}`: messages the query has taken into batches since its first batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from flowbroker.client import blocking
from flowbroker.spark.options import OptionError, ReadOptions

__all__ = ["QueueStreamReader", "MessagesPartition", "SOURCE_SCHEMA", "PARTITION_ROWS"]

log = logging.getLogger("flowbroker.spark")

SOURCE_SCHEMA = "value binary, headers map<string,string>, exchange string, routingKey string, redelivered boolean"
"""A header value that is not text reaches Spark as text: bytes decoded as UTF-8 (invalid bytes as
backslash escapes), numbers and booleans in Python's `str`."""

PARTITION_ROWS = 4096
"""Rows per input partition: a batch of more is split, so that its tasks run in parallel."""

Row = tuple[bytes, dict[str, str] | None, str, str, bool]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return str(value)


def _row(message: blocking.BlockingMessage) -> Row:
    headers = {k: _text(v) for k, v in message.headers.items()} if message.headers else None
    return (message.body, headers, message.exchange, message.routing_key, message.redelivered)


class MessagesPartition(InputPartition):
    """A slice of a micro-batch: its rows travel with it from the driver to the task."""

    def __init__(self, rows: list[Row]) -> None:
        super().__init__(len(rows))
        self.rows = rows


class QueueStreamReader(DataSourceStreamReader):
    """`spark.readStream.format("flowbroker").option("queue", ...)`; see the module's docstring."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        self._conn: blocking.BlockingConnection | None = None
        self._consumer: blocking.BlockingConsumer | None = None
        self._held: list[tuple[int, blocking.BlockingMessage]] = []
        """Messages taken into batches and not yet settled, with their offset, oldest first."""
        self._next: int | None = None
        """The offset the next message taken gets (None until Spark said where the query is)."""

    # The reader is pickled to the tasks for read(): only the options go (the connection stays here).
    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "_conn": None, "_consumer": None, "_held": [], "_next": None}

    def _open(self) -> blocking.BlockingConsumer:
        if self._consumer is None:
            options = self.options
            self._conn = blocking.connect(options.url, client_name=f"flowbroker-spark source {options.queue}",
                                          timeout=options.connect_timeout, **options.connect_arguments())
            consumer = self._conn.consumer(options.queue, prefetch=options.prefetch, buffer_size=options.buffer_size)
            consumer.subscribe(timeout=options.connect_timeout)
            self._consumer = consumer
        return self._consumer

    def _take(self, count: int, timeout: float, *, all_of_them: bool = False) -> int:
        """Take up to `count` messages into `_held`: wait at most `timeout` for the first, then take what
        is buffered; with `all_of_them`, wait up to `timeout` in all for the `count`. Returns how many."""
        consumer = self._open()
        assert self._next is not None
        taken = 0
        deadline = time.monotonic() + timeout
        while taken < count:
            wait = max(0.0, deadline - time.monotonic()) if taken == 0 or all_of_them else 0.0
            messages = consumer.receive_many(count - taken, wait)
            if not messages:
                break
            for message in messages:
                self._held.append((self._next, message))
                self._next += 1
            taken += len(messages)
        return taken

    def initialOffset(self) -> dict[str, int]:
        return {"taken": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        """`maxBatchSize` messages a batch. So the limit Spark passes is ReadAllAvailable only for the
        triggers that make one last batch and end the query (`availableNow`, `once`), which
        `latestOffset` refuses."""
        return ReadMaxRows(self.options.max_batch_size)

    def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
        if isinstance(limit, ReadAllAvailable):
            # Spark ends such a query after its last batch without committing that batch to the source
            # (commit(end) comes only with a next batch): its messages were never settled and came back,
            # redelivered, at every run, and the queue never drained (a tester's cron-style reader).
            raise OptionError(
                "trigger(availableNow=True) and trigger(once=True) cannot read a flowbroker queue: Spark ends "
                "the query after its last batch without committing it to the source, so those messages would "
                "never be settled and would come back at every run. To read what is there and stop: start the "
                "query with the default trigger, call query.processAllAvailable(), then query.stop() "
                "(docs/spark.md)")
        # Spark asks for the next batch's end only once the batch ending at `start` has run and is in its
        # commit log (micro-batches run one at a time): its messages can be settled now, without waiting
        # for `commit(start)`, which Spark calls only once it has planned another batch (so the last
        # batch before a quiet spell would stay unsettled, and be redelivered if the query stopped then).
        self.commit(start)
        if self._next is None or self._next < start["taken"]:
            self._next = start["taken"]
        count = self.options.max_batch_size
        if isinstance(limit, ReadMaxRows):
            count = min(count, limit.max_rows)
        self._take(count, self.options.poll_timeout)
        return {"taken": self._next}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        first, last = start["taken"], end["taken"]
        rows = [_row(m) for offset, m in self._held if first <= offset < last]
        missing = last - first - len(rows)
        if missing > 0:
            # A batch the checkpoint planned and did not commit, replayed after a restart: the previous
            # run's connection is gone, so its messages are back at the head of the queue, redelivered.
            self._next = first + len(rows)
            got = self._take(missing, self.options.replay_timeout, all_of_them=True)
            rows += [_row(m) for offset, m in self._held[-got:]] if got else []
            if got < missing:
                log.warning("flowbroker source %s: replaying offsets %d-%d found %d of %d messages",
                            self.options.queue, first, last, len(rows), last - first)
            self._next = max(self._next, last)
        return [MessagesPartition(rows[at:at + PARTITION_ROWS]) for at in range(0, len(rows), PARTITION_ROWS)]

    def read(self, partition: InputPartition) -> Iterator[Row]:
        assert isinstance(partition, MessagesPartition)
        return iter(partition.rows)

    def commit(self, end: dict[str, int]) -> None:
        last = end["taken"]
        done = [m for offset, m in self._held if offset < last]
        if done and self._consumer is not None:
            self._consumer.ack_many(done)
            self._held = [(offset, m) for offset, m in self._held if offset >= last]

    def stop(self) -> None:
        """The query stops: close the connection, so the broker requeues what was never committed."""
        conn, self._conn, self._consumer, self._held = self._conn, None, None, []
        if conn is not None:
            conn.close()
