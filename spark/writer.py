"""The batch and streaming writers: each Spark task is one blocking-SDK producer with flow control on.

Why a producer per task and not a pool: a task's rows are the unit Spark retries, so the task's
producer id (the job's id and the partition) with the row's index in the partition as its sequence
is what lets the broker recognise a retried task's rows (docs/spark.md, "Exactly once"). Flow control
is the SDK's: a send waits while the broker grants no credit (a queue over its stop watermark holds the
task's completions), at most `timeout` seconds without any grant, and then the task fails with what
the broker said: which queue stopped it and by which threshold. A task returns only once the broker
has completed every one of its messages (`flush`), so a successful job has every row in the queue.

Spark's commit and abort have nothing to do: the messages are in the queues when `write()` returns, and
nothing can take back what a failed job already delivered (a re-submitted job with the same `jobId`
does not send those rows twice).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import trio
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)

from flowbroker.client import blocking
from flowbroker.client.errors import FlowControlTimeout, HandshakeError
from flowbroker.spark.messages import Layout, OutMessage
from flowbroker.spark.options import WriteOptions

__all__ = [
    "PartitionWritten",
    "check_one_broker_run",
    "FlowbrokerWriteError",
    "BatchWriter",
    "BatchArrowWriter",
    "StreamWriter",
    "StreamArrowWriter",
    "send_partition",
]

log = logging.getLogger("flowbroker.spark")


@dataclass
class PartitionWritten(WriterCommitMessage):
    """What one task sent: its producer id and how many rows (all completed by the broker); the broker
    runs it saw (WELCOME's run id, at its start and at its end), and whether the queue it wrote to is
    durable (None: an exchange, whose queues the task does not know)."""

    producer_id: str
    rows: int
    runs: tuple[str | None, ...] = ()
    durable: bool | None = None


def check_one_broker_run(job_id: str, messages: list[Any]) -> None:
    """Raise FlowbrokerWriteError if the job's partitions saw more than one broker run and wrote to a queue
    not known durable: a broker that restarted lost its memory-only queues, rows of partitions finished
    before included, while Spark's retries of the others succeeded on the new one (a tester: save()
    returned with 50-75 % of 100,000 rows gone). A durable queue's journal kept them: no failure."""
    written = [m for m in messages if isinstance(m, PartitionWritten)]
    runs = {run for m in written for run in m.runs if run is not None}
    if len(runs) > 1 and not all(m.durable for m in written):
        raise FlowbrokerWriteError(
            f"flowbroker job {job_id}: the broker restarted during the job ({len(runs)} broker runs seen); the "
            "queue is not durable, so what the old broker held is lost, rows of partitions written before "
            f"included. Re-submit it with option jobId={job_id}: the rows the new broker has are taken as "
            "duplicates and the lost ones sent again (or write to a durable queue to survive a restart)")


class FlowbrokerWriteError(RuntimeError):
    """A task could not send its rows: the broker granted no credit within `timeout` (the text names the
    flow-stopped queues and their thresholds) or refused messages (no such queue, ...)."""


def _stopped_reason(conn: blocking.BlockingConnection) -> str:
    try:
        stopped = conn.flow_state.stopped
    except Exception:  # the connection is gone: its own error says why
        return ""
    if not stopped:
        return ""
    parts = [f"{name} ({stop.threshold} {stop.limit}, at {stop.value})" for name, stop in stopped.items()]
    return "; the broker flow-stopped " + ", ".join(parts)


def send_partition(
    options: WriteOptions, producer_id: str, batches: Iterator[list[OutMessage]]
) -> PartitionWritten:
    """Send every message of `batches` in order through one flow-controlled producer, then wait for
    their completions. The n-th message of the partition is the producer's sequence n."""
    sent = 0
    with _connect(options, producer_id) as conn:
        first_run = conn.broker_run
        durable: bool | None = None
        if options.exchange == "":
            # Again in each task, not only on the driver: a retry after a broker restart must not find
            # the queue missing (a refused row is taken under its sequence: the next retry would succeed
            # without it).
            durable = conn.declare_queue(options.routing_key).get("durable") is True
        producer = conn.producer(options.exchange, options.routing_key, window=options.window,
                                 send_timeout=options.timeout, producer_id=producer_id, idempotent=True)
        try:
            with producer:
                for messages in batches:
                    for at in range(0, len(messages), options.batch_size):
                        sent += producer.send_batch(messages[at:at + options.batch_size], timeout=options.timeout)
                _flush(producer, options.timeout)
        except FlowControlTimeout as exc:
            raise FlowbrokerWriteError(f"{producer_id}: {exc}{_stopped_reason(conn)}") from exc
        runs = (first_run, conn.broker_run)  # (a reconnect within the task may have met another run)
    return PartitionWritten(producer_id, sent, runs, durable)


def _connect(options: WriteOptions, producer_id: str) -> blocking.BlockingConnection:
    """The task's connection. A broker that refuses connections (down, or restarting) is tried again for up to
    `reconnectTimeout`, as a connection already open reconnects: a task that Spark started or retried
    while a crashed broker came back failed at once, and with 64 partitions Spark's four attempts were
    spent within a second of a 3 s outage (a tester). Any other handshake error is raised at once."""
    deadline = time.monotonic() + options.reconnect_timeout
    delay = 0.05
    while True:
        try:
            return blocking.connect(options.url, client_name=f"flowbroker-spark {producer_id}",
                                    timeout=options.connect_timeout, close_timeout=options.timeout,
                                    reconnect_timeout=options.reconnect_timeout, **options.connect_arguments())
        except HandshakeError as exc:
            if not _broker_not_there(exc) or time.monotonic() + delay > deadline:
                raise
            log.info("%s: %s; trying again for up to %g s (reconnectTimeout)", producer_id, exc,
                     deadline - time.monotonic())
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def _broker_not_there(exc: HandshakeError) -> bool:
    """Whether a failed handshake says the broker is not there (yet): the connection refused, or reset
    or closed before WELCOME (what a broker killed while it accepted the connection does: a tester's tasks
    failed at once on "Connection reset by peer" during the outage). A TLS failure or a refusal by the
    broker (its ERROR, a login refused) is not: it would fail again."""
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return False
        if isinstance(cause, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
            return True
        cause = cause.__cause__
    return False


def _flush(producer: blocking.BlockingProducer, timeout: float) -> None:
    """Wait for every completion, failing only after `timeout` seconds in which none came: a slow
    consumer the queue paces the task by is waited for as long as it goes on (a window of 10,000 rows
    handed over at once used to fail at `timeout` while they were still being completed)."""
    while True:
        completed = producer.statistics().completed
        try:
            producer.flush(timeout=timeout)
            return
        except FlowControlTimeout:
            if producer.statistics().completed == completed:
                raise


def _task() -> TaskContext:
    context = TaskContext.get()
    if context is None:  # write() runs in a task; anywhere else is a bug of ours or of Spark's
        raise RuntimeError("flowbroker's writer runs only inside a Spark task")
    return context


@dataclass(frozen=True)
class _WriterState:
    options: WriteOptions
    layout: Layout
    job_id: str
    """The producer ids' base: the job's (batch) or the query's (streaming) id."""


def _arrow_batches(layout: Layout, iterator: Iterator[Any]) -> Iterator[list[OutMessage]]:
    for batch in iterator:
        yield layout.messages(batch.to_pydict(), batch.num_rows)


def _row_batches(layout: Layout, iterator: Iterator[Any], size: int) -> Iterator[list[OutMessage]]:
    rows: list[Any] = []
    for row in iterator:
        rows.append(row)
        if len(rows) >= size:
            yield layout.row_messages(rows)
            rows = []
    if rows:
        yield layout.row_messages(rows)


class BatchWriter(DataSourceWriter):
    """`df.write.format("flowbroker")` with option arrow=false: rows as they come."""

    def __init__(self, state: _WriterState) -> None:
        self.state = state

    def producer_id(self) -> str:
        return f"{self.state.job_id}/{_task().partitionId()}"

    def batches(self, iterator: Iterator[Any]) -> Iterator[list[OutMessage]]:
        return _row_batches(self.state.layout, iterator, self.state.options.batch_size)

    def write(self, iterator: Iterator[Any]) -> PartitionWritten:
        return send_partition(self.state.options, self.producer_id(), self.batches(iterator))

    def commit(self, messages: list[Any]) -> None:
        check_one_broker_run(self.state.job_id, messages)
        rows = sum(m.rows for m in messages if isinstance(m, PartitionWritten))
        log.info("flowbroker job %s: %d rows in %d partitions", self.state.job_id, rows, len(messages))

    def abort(self, messages: list[Any]) -> None:
        written = [m for m in messages if isinstance(m, PartitionWritten)]
        log.warning("flowbroker job %s failed; %d partitions were written (%d rows) and stay where they were "
                    "sent; re-submit with option jobId=%s to send only the rest", self.state.job_id, len(written),
                    sum(m.rows for m in written), self.state.job_id)


class BatchArrowWriter(BatchWriter, DataSourceArrowWriter):
    """The same writer fed Arrow record batches, the default: no Row object per row (docs/spark.md, "Performance")."""

    def batches(self, iterator: Iterator[Any]) -> Iterator[list[OutMessage]]:
        return _arrow_batches(self.state.layout, iterator)


class StreamWriter(DataSourceStreamWriter):
    """`df.writeStream.format("flowbroker")`: one producer id per query, micro-batch and partition.

    Why the batch id is in the producer id rather than in the sequence: the broker takes a producer's
    sequences in order, 0, 1, 2, ..., and refuses a gap, but a task of batch n cannot know how many
    rows the same partition wrote in batch n - 1. With the batch in the id, the sequence is the row's
    index in the partition, as for a batch job, and a batch replayed from the checkpoint or rewritten
    by a straggler after `query.stop()` has the same ids and sequences as the first time."""

    def __init__(self, state: _WriterState) -> None:
        self.state = state

    def producer_id(self) -> str:
        context = _task()
        query = context.getLocalProperty("sql.streaming.queryId") or self.state.job_id
        batch = context.getLocalProperty("streaming.sql.batchId")
        return f"{query}/{batch}/{context.partitionId()}"

    def batches(self, iterator: Iterator[Any]) -> Iterator[list[OutMessage]]:
        return _row_batches(self.state.layout, iterator, self.state.options.batch_size)

    def write(self, iterator: Iterator[Any]) -> PartitionWritten:
        return send_partition(self.state.options, self.producer_id(), self.batches(iterator))

    def commit(self, messages: list[Any], batchId: int) -> None:
        check_one_broker_run(f"{self.state.job_id} batch {batchId}", messages)

    def abort(self, messages: list[Any], batchId: int) -> None:
        log.warning("flowbroker streaming batch %d aborted; what it sent stays, and its replay lands once", batchId)


class StreamArrowWriter(StreamWriter, DataSourceStreamArrowWriter):
    def batches(self, iterator: Iterator[Any]) -> Iterator[list[OutMessage]]:
        return _arrow_batches(self.state.layout, iterator)


def writer_state(options: WriteOptions, layout: Layout, job_id: str) -> _WriterState:
    return _WriterState(options, layout, job_id)

