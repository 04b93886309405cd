"""A Spark job paced by a consumer ten times slower: no task fails, the job finishes once the consumer
has nearly caught up, and the broker's RSS stays within its bound the whole time (the queue's stop size
plus the credit granted to the tasks plus 64 MiB over the idle broker), where the unpaced job would have
put ~180 MiB in the queue (message_size bytes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from flowbroker.client import blocking
from tests.spark.harness import Broker, start_broker, stop_broker

ROWS, ROW_BYTES = 120_000, 1024
CONSUMER_RATE = 5_000  # messages/s: the job alone writes ~50,000 rows/s of 1 KiB on this machine (2 cores)
STOP_SIZE, RESUME_SIZE = 8 << 20, 6 << 20
GRANT = 4 << 20  # the static credit policy's share per producer: each of the 2 tasks is one
MIB = 1 << 20


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    running = start_broker(tmp_path_factory.mktemp("broker"),
                           f'[credit]\npolicy = "static"\nstatic_size = {GRANT}\n')
    try:
        yield running
    finally:
        stop_broker(running)


class PacedConsumer(threading.Thread):
    """Reads the queue at CONSUMER_RATE messages a second, acknowledging as it goes."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.url, self.queue = url, queue
        self.count = 0
        self.done = threading.Event()

    def run(self) -> None:
        with blocking.connect(self.url, timeout=10) as conn, conn.consumer(self.queue, prefetch=1000) as consumer:
            start = time.monotonic()
            while not self.done.is_set() and self.count < ROWS:
                due = start + self.count / CONSUMER_RATE
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())
                messages = consumer.receive_many(100, 1.0)
                consumer.ack_many(messages)
                self.count += len(messages)


def test_a_job_paced_by_a_slow_consumer_stays_within_the_broker_bound(spark, broker):
    with blocking.connect(broker.url, timeout=10) as conn:
        conn.declare_queue("paced", flow_stop_size=STOP_SIZE, flow_resume_size=RESUME_SIZE, max_size=1 << 30)
    idle = broker.rss()
    consumer = PacedConsumer(broker.url, "paced")
    consumer.start()
    peak = [idle]
    stopped = threading.Event()

    def sample() -> None:
        while not stopped.is_set():
            peak[0] = max(peak[0], broker.rss())
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    df = spark.range(0, ROWS, numPartitions=2).selectExpr(f"cast(repeat('x', {ROW_BYTES}) as binary) as value")
    try:
        started = time.monotonic()
        df.write.format("flowbroker").option("url", broker.url).option("queue", "paced").mode("append").save()
        took = time.monotonic() - started
        read_by_then = consumer.count
        consumer.join(60)
    finally:
        consumer.done.set()
        stopped.set()
        sampler.join(5)
    assert consumer.count == ROWS
    bound = idle + STOP_SIZE + 2 * GRANT + 64 * MIB
    assert peak[0] <= bound, f"broker RSS peaked at {peak[0] / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB"
    # paced: the job could only finish once the consumer had read all but what the queue and credit hold
    held = (STOP_SIZE + 2 * GRANT) // (ROW_BYTES + 512)  # message_size: the body and 512
    assert read_by_then >= ROWS - held - 1000, (read_by_then, took)
    assert took >= (ROWS - held) / CONSUMER_RATE * 0.8
