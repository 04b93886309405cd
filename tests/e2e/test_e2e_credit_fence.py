"""BUFFER_LIMIT end to end: a promise left by a shrink drains at once for an idle producer.

Under ``aggressive`` every new producer shrinks the earlier ones' grants. An idle producer never sends
the bytes its old, larger limit allowed, so before BUFFER_LIMIT that limit stayed promised forever,
and once the idle producers' promises filled the pool a newcomer waited (WAIT_GRANT) for a share that
never came. The SDK now answers a shrink with BUFFER_LIMIT, the broker lowers the idle producers'
limits to their new grants, and the newcomer gets its share. Real sockets on 127.0.0.1."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import trio

import flowbroker.client as fb

MiB = 1024 * 1024
IDLE = 4  # producers that send one message, then stay connected and idle
MESSAGES = 40


async def test_a_producer_after_idle_ones_gets_its_share_at_once(start_flowbroker: Any) -> None:
    # pool 5 % of 64 MiB = 3.2 MiB; shares clamped to [64 KiB, 1 MiB]: three idle producers get
    # 1 MiB each, the fourth what is left, and the fifth finds every byte promised unless the
    # earlier ones' limits come down with their grants.
    broker = await start_flowbroker(
        server={"memory_quota": 64 * MiB, "max_message_size": 65536, "max_connections": 50},
        credit={"policy": "aggressive", "min_size": 64 * 1024, "max_size": MiB},
    )
    credit = broker.core.credit
    async with AsyncExitStack() as stack:
        for i in range(IDLE):
            conn = await stack.enter_async_context(await fb.connect(broker.url, client_name=f"idle{i}"))
            if i == 0:
                await conn.declare_queue("q")
            producer = conn.producer(routing_key="q")
            await producer.send(b"hello", timeout=5)
            await producer.flush(timeout=5)
        late = await stack.enter_async_context(await fb.connect(broker.url, client_name="late"))
        producer = late.producer(routing_key="q")
        with trio.fail_after(5):  # before BUFFER_LIMIT: forever (the late producer waits for a share)
            for n in range(MESSAGES):
                await producer.send(b"m" * 8000)
            await producer.flush()
        assert credit.waiting() == 0
        assert credit.total_committed() <= credit.pool
        # every idle producer's window came down to its grant: nothing stays promised beyond it
        for conn_id in credit.producers():
            assert credit.window_of(conn_id) == credit.size_of(conn_id)
