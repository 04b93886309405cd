"""DELETE_EXCHANGE with the SDK (async and blocking) against a real broker on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flowbroker.client as fb
from flowbroker.client import blocking
from flowbroker.protocol import ErrorCode


async def test_delete_exchange_unbinds_and_keeps_the_queues(start_flowbroker: Any) -> None:
    broker = await start_flowbroker()
    async with await fb.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("logs")
        await conn.declare_exchange("events", "topic")
        await conn.bind("logs", "events", "app.#")
        await conn.bind("logs", "events", "db.*")
        producer = conn.producer(exchange="events", routing_key="app.start")
        await producer.send(b"kept")
        await producer.flush(timeout=5)

        assert await conn.delete_exchange("events", timeout=5) == {"exchange": "events", "bindings": 2}
        assert "events" not in broker.core.exchanges
        with pytest.raises(fb.RequestError) as info:
            await conn.delete_exchange("events", timeout=5)
        assert info.value.code is ErrorCode.NOT_FOUND
        with pytest.raises(fb.RequestError) as info:
            await conn.delete_exchange("amq.fanout", timeout=5)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT

        # The queue and its message stay; the connection carries on.
        async with conn.consumer("logs") as consumer:
            msg = await consumer.receive(timeout=5)
            assert msg.body == b"kept"
            await msg.ack()
        assert not conn.is_closed


async def test_blocking_delete_exchange(start_flowbroker: Any) -> None:
    broker = await start_flowbroker()

    def run() -> dict[str, Any]:
        with blocking.connect(broker.url, client_name="sync", timeout=5) as conn:
            conn.declare_exchange("fan", "fanout")
            return conn.delete_exchange("fan", timeout=5)

    assert await trio.to_thread.run_sync(run) == {"exchange": "fan", "bindings": 0}
    assert "fan" not in broker.core.exchanges
