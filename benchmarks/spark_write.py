"""Spark to flowbroker: rows/s of the data source beside the ceilings, and a paced job's broker memory.

    .venv/bin/python benchmarks/spark_write.py [--rows 1000000] [--size 1024] [--paced-rows 1000000]

In one run, with one broker process and one local SparkSession (local[2]), the same cached DataFrame of
`--rows` rows of `--size` bytes (a binary `value` column, 4 partitions) is written

1. by a Python data source that discards its rows (iterates the Arrow batches, counts them): the ceiling
   of Spark's Python writers on this machine;
2. to a queue through `format("flowbroker")` (Arrow writer, then the row writer), to a consumer process
   that keeps up (rows/s of `save()`, and until the consumer has received the last row);
3. by the flowbroker writer's own Python work alone (rows to messages, nothing sent), Arrow and rows;
4. by 4 SDK producer processes without Spark (the same rows, a quarter each), to the same consumer.

Then the paced case: a consumer at `--paced-rate` (5,000) msgs/s and a job of `--paced-rows` rows that
is not limited: every second the broker's RSS is sampled beside its bound, idle RSS + the queue's stop
size + the credit granted then (GET /api/policy) + 64 MiB, and the job must end once the consumer has
read (nearly) all of it. Prints one line per figure; exits 1 if the paced bound was crossed.

The broker's HOME (its admin token) is a temporary directory (spark-write-*), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from procs import free_port, rss, stop_broker, wait_listening

MIB = 1 << 20
QUEUE_STOP, QUEUE_RESUME = 64 * MIB, 48 * MIB
PACED_STOP, PACED_RESUME = 16 * MIB, 12 * MIB
"""The paced queue's watermarks: small beside the job, so that the job is paced for most of its rows."""


# -------------------------------------------------------------- helper processes (subcommands)

def consume(url: str, queue: str, count: int, rate: float) -> None:
    """Receive `count` messages (at most `rate` a second, 0: as fast as it can), then print
    {"received": n, "first": t0, "last": t1} (time.time())."""
    import trio

    import flowbroker.client as fc

    async def main() -> None:
        received, first = 0, 0.0
        async with await fc.connect(url, timeout=10) as conn:
            async with conn.consumer(queue, prefetch=2000) as consumer:
                start = time.monotonic()
                async for msg in consumer:
                    if not received:
                        first, start = time.time(), time.monotonic()
                    received += 1
                    await msg.ack()
                    if rate and received % 50 == 0:
                        due = start + received / rate
                        if due > time.monotonic():
                            await trio.sleep(due - time.monotonic())
                    if received == count:
                        break
        print(json.dumps({"received": received, "first": first, "last": time.time()}), flush=True)

    trio.run(main)


def produce(url: str, queue: str, count: int, size: int) -> None:
    """Send `count` messages of `size` bytes as fast as credit allows; print {"seconds": s}."""
    import trio

    import flowbroker.client as fc

    async def main() -> None:
        body = b"x" * size
        async with await fc.connect(url, timeout=10) as conn:
            producer = conn.producer(routing_key=queue, window=5000)
            start = time.monotonic()
            for _ in range(count):
                await producer.send(body, timeout=60)
            await producer.flush(timeout=60)
        print(json.dumps({"seconds": time.monotonic() - start}), flush=True)

    trio.run(main)


def _helper(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"helper failed: {out}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


# -------------------------------------------------------------- the broker

class Broker:
    def __init__(self, folder: Path) -> None:
        self.port, self.admin_port = free_port(), free_port()
        env = {**os.environ, "HOME": str(folder)}
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("flowbroker")), "serve", "--port", str(self.port),
             "--admin-port", str(self.admin_port), "--no-udp", "--memory-quota", "256MiB"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.proc, self.port)
        wait_listening(self.proc, self.admin_port)
        self.token = (folder / ".flowbroker" / f"admin-token-{self.admin_port}").read_text().strip()
        self.url = f"flowbroker://127.0.0.1:{self.port}"

    def api(self, path: str) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def declare(self, queue: str, stop: int = QUEUE_STOP, resume: int = QUEUE_RESUME) -> None:
        from flowbroker.client import blocking

        with blocking.connect(self.url, timeout=10) as conn:
            conn.declare_queue(queue, flow_stop_size=stop, flow_resume_size=resume, max_size=4 << 30)


# -------------------------------------------------------------- Spark

def spark_session() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    import flowbroker.spark

    class DiscardWriter(DataSourceArrowWriter):
        def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
            rows = 0
            for batch in iterator:
                rows += batch.num_rows
            return WriterCommitMessage()

    class Discard(DataSource):
        @classmethod
        def name(cls) -> str:
            return "discard"

        def writer(self, schema: Any, overwrite: bool) -> DiscardWriter:
            return DiscardWriter()

    from flowbroker.spark.datasource import FlowbrokerDataSource
    from flowbroker.spark.writer import BatchArrowWriter, BatchWriter, PartitionWritten

    class ConvertOnly(FlowbrokerDataSource):
        """The flowbroker writer's own Python work (rows to messages), with nothing sent."""

        @classmethod
        def name(cls) -> str:
            return "convert-only"

        def writer(self, schema: Any, overwrite: bool) -> BatchWriter:
            real = super().writer(schema, overwrite)
            assert isinstance(real, BatchWriter)
            return (ConvertArrow if isinstance(real, BatchArrowWriter) else ConvertRows)(real.state)

    class ConvertRows(BatchWriter):
        def write(self, iterator: Iterator[Any]) -> PartitionWritten:
            return PartitionWritten("-", sum(len(m) for m in self.batches(iterator)))

    class ConvertArrow(BatchArrowWriter):
        def write(self, iterator: Iterator[Any]) -> PartitionWritten:
            return PartitionWritten("-", sum(len(m) for m in self.batches(iterator)))

    spark = (SparkSession.builder.master("local[2]").appName("spark_write")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    flowbroker.spark.register(spark)
    spark.dataSource.register(Discard)
    spark.dataSource.register(ConvertOnly)
    return spark


def _timed(action: Any) -> float:
    start = time.monotonic()
    action()
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--paced-rows", type=int, default=1_000_000)
    parser.add_argument("--paced-rate", type=float, default=5_000)
    args = parser.parse_args()
    # the broker's HOME, where it writes its admin token: removed once the broker has stopped
    with tempfile.TemporaryDirectory(prefix="spark-write-") as folder:
        return run(args, Path(folder))


def run(args: argparse.Namespace, folder: Path) -> int:
    rows, size = args.rows, args.size
    broker = Broker(folder)
    spark = spark_session()
    failed = False
    try:
        df = (spark.range(0, rows, numPartitions=4).selectExpr(f"cast(repeat('x', {size}) as binary) as value")
              .cache())
        df.count()  # materialised once: every writer below reads the same cached rows
        print(f"{rows:,} rows of {size} B, local[2], 4 partitions; broker RSS idle {rss(broker.proc.pid) / MIB:.0f} MiB")

        df.write.format("discard").mode("append").save()  # warms the Python workers up (they are reused)
        discard = _timed(lambda: df.write.format("discard").mode("append").save())
        print(f"discarding Python writer (Arrow): {rows / discard:,.0f} rows/s")

        warm = spark.range(0, 4000, numPartitions=4).selectExpr("cast(cast(id as string) as binary) as value")
        for arrow in ("true", "false"):  # the workers import flowbroker.spark and pyarrow's conversions once
            warm.write.format("convert-only").option("url", broker.url).option("queue", "unused") \
                .option("arrow", arrow).mode("append").save()
        for arrow in ("true", "false"):
            took = _timed(lambda: df.write.format("convert-only").option("url", broker.url).option("queue", "unused").option("arrow", arrow)
                          .mode("append").save())
            print(f"rows to messages only, nothing sent (arrow={arrow}): {rows / took:,.0f} rows/s")

        for arrow in ("true", "false"):
            queue = f"bench-{arrow}"
            broker.declare(queue)
            consumer = _helper("consume", broker.url, queue, rows, 0)
            started = time.time()
            took = _timed(lambda: df.write.format("flowbroker").option("url", broker.url).option("queue", queue)
                          .option("arrow", arrow).mode("append").save())
            got = _result(consumer, 600)
            print(f"flowbroker writer (arrow={arrow}): save() {rows / took:,.0f} rows/s "
                  f"({100 * discard / took:.0f} % of discarding), to the consumer's last "
                  f"{rows / (got['last'] - started):,.0f} rows/s")

        broker.declare("bench-sdk")
        consumer = _helper("consume", broker.url, "bench-sdk", rows, 0)
        started = time.time()
        producers = [_helper("produce", broker.url, "bench-sdk", rows // 4, size) for _ in range(4)]
        slowest = max(_result(p, 600)["seconds"] for p in producers)
        got = _result(consumer, 600)
        print(f"4 SDK producer processes, no Spark: {4 * (rows // 4) / slowest:,.0f} rows/s, "
              f"to the consumer's last {rows / (got['last'] - started):,.0f} rows/s")
        df.unpersist()

        failed = paced(spark, broker, args.paced_rows, size, args.paced_rate)
    finally:
        spark.stop()
        stop_broker(broker.proc)
    return 1 if failed else 0


def paced(spark: Any, broker: Broker, rows: int, size: int, rate: float) -> bool:
    """The paced case; returns True if the broker's RSS crossed its bound."""
    broker.declare("paced", PACED_STOP, PACED_RESUME)
    idle = rss(broker.proc.pid)
    consumer = _helper("consume", broker.url, "paced", rows, rate)
    samples: list[tuple[float, int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            samples.append((time.time(), rss(broker.proc.pid), int(broker.api("/api/policy")["granted"]["total"])))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    df = spark.range(0, rows, numPartitions=4).selectExpr(f"cast(repeat('x', {size}) as binary) as value")
    took = _timed(lambda: df.write.format("flowbroker").option("url", broker.url).option("queue", "paced")
                  .mode("append").save())
    ended = time.time()
    got = _result(consumer, rows / rate * 3 + 120)
    done.set()
    sampler.join(5)
    over = [(t, r, g) for t, r, g in samples if r > idle + PACED_STOP + g + 64 * MIB]
    peak = max(samples, key=lambda s: s[1]) if samples else (0.0, idle, 0)
    behind = got["last"] - ended
    # The job's last completions come once the queue is under its resume size: the consumer has that
    # much (and what the credit let in) still to read when the job ends.
    print(f"paced: consumer at {rate:,.0f} msgs/s, {rows:,} rows: job {took:.1f} s ({rows / took:,.0f} rows/s), "
          f"consumer done {behind:.1f} s after the job; broker RSS peak {peak[1] / MIB:.0f} MiB against a bound of "
          f"{(idle + PACED_STOP + peak[2] + 64 * MIB) / MIB:.0f} MiB (idle {idle / MIB:.0f} + stop {PACED_STOP / MIB:.0f}"
          f" + granted {peak[2] / MIB:.0f} + 64) in {len(samples)} one-second samples; "
          f"{len(over)} over it")
    return bool(over)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "consume":
        consume(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "produce":
        produce(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main())
