"""`statistics()` on Producer, Consumer and Connection: frozen snapshots named in the credit vocabulary
(position, acked_position, window, limit), and the `stats` names of before issue 9 as aliases."""

from __future__ import annotations

import dataclasses

import pytest
import trio

import flowbroker.client as fc
from flowbroker.protocol import Deliver, DeliveryEntry, Subscribe, message_size

BODY = b"x" * 100


async def test_producer_and_connection_statistics(start_broker) -> None:
    broker = await start_broker(buffer_size=1 << 20, auto_complete=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        producer = conn.producer(routing_key="q", window=10)
        for _ in range(4):
            await producer.send(BODY)
        await fake.wait_for(lambda: len(fake.transfers) == 4)
        await fake.complete([1, 2])
        with trio.fail_after(5):
            while producer.outstanding != 2:
                await trio.sleep(0.01)
        stats = producer.statistics()
        size = message_size(BODY)
        assert (stats.sent, stats.completed, stats.failed, stats.in_flight, stats.transfer_window) == (4, 2, 0, 2, 10)
        assert (stats.position, stats.acked_position) == (4 * size, 2 * size)
        assert stats.window == conn.producer_buffer_size and stats.limit == stats.acked_position + stats.window
        assert stats.flow_stopped == 0 and stats.outstanding == stats.in_flight
        assert producer.stats == stats and fc.ProducerStats is fc.ProducerStatistics
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.sent = 0  # type: ignore[misc]
        whole = conn.statistics()
        assert (whole.transfers_sent, whole.transfers_completed, whole.transfers_in_flight) == (4, 2, 2)
        assert (whole.position, whole.acked_position, whole.window, whole.limit) == (
            stats.position, stats.acked_position, stats.window, stats.limit
        )
        assert whole.producers_active == 1 and whole.consumers == 0 and whole.frames_sent >= 2
        await fake.complete()
        await producer.flush(timeout=5)
        assert conn.statistics().transfers_in_flight == 0 and producer.statistics().completed == 4


async def test_consumer_statistics_and_the_stats_alias(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=50, buffer_size=1 << 20) as consumer:
            sub = fake.frames(Subscribe)[0]
            await fake.send(Deliver(sub.subscription_id, [DeliveryEntry(t, "", "q", BODY, None, False) for t in (1, 2, 3)]))
            first = await consumer.receive(timeout=5)
            await first.ack()
            await consumer.receive(timeout=5)
            stats = consumer.statistics()
            size = message_size(BODY)
            assert (stats.received, stats.unsettled, stats.buffered, stats.prefetch_in_force) == (3, 2, 1, 50)
            assert (stats.window, stats.position, stats.consumed_position) == (1 << 20, 3 * size, size)
            assert 0 <= stats.acked_position <= stats.consumed_position
            old = consumer.stats  # the name before issue 9, and its field names
            assert old == stats and fc.ConsumerStats is fc.ConsumerStatistics
            assert (old.buffer_size, old.received_bytes, old.processed_bytes, old.acked_bytes) == (
                stats.window, stats.position, stats.consumed_position, stats.acked_position
            )
            assert conn.statistics().consumers == 1
