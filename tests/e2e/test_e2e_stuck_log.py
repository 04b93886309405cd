"""A stuck consumer is a WARNING at most once per 10 s over all connections: each connection's timer said
"connection N is stuck" every stuck_timeout while it lasted, so a thousand stuck consumers were a thousand
lines each time (and any client can be one: subscribe, never acknowledge). The metrics count every one."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

import flowbroker.client as fc

STUCK = 5
LIMIT = 10.0


async def test_many_stuck_consumers_make_one_warning(start_flowbroker: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="flowbroker.broker")
    broker = await start_flowbroker(server={"stuck_timeout": 0.5, "idle_timeout": 30.0})
    async with await fc.connect(broker.url, client_name="feeder", timeout=LIMIT) as feeder:
        async with trio.open_nursery() as nursery:
            stuck = trio.Semaphore(0)
            done = trio.Event()

            async def stuck_consumer(i: int) -> None:
                async with await fc.connect(broker.url, client_name=f"stuck{i}", timeout=LIMIT) as conn:
                    await conn.declare_queue(f"jobs{i}")
                    await conn.set_buffer_size(2048)  # room for one 1 KiB message
                    async with conn.consumer(f"jobs{i}", prefetch=100):
                        async with feeder.producer(routing_key=f"jobs{i}") as producer:
                            for _ in range(4):
                                await producer.send(b"x" * 1024, timeout=LIMIT)
                        stuck.release()
                        await done.wait()  # never receives: its buffer stays full

            for i in range(STUCK):
                nursery.start_soon(stuck_consumer, i)
            for _ in range(STUCK):
                await stuck.acquire()
            sessions = broker.core.sessions.values
            with trio.fail_after(LIMIT):  # every one's timer has found it stuck
                while sum(1 for s in sessions() if s.client_name.startswith("stuck")
                          and s.consumer_stalled(broker.core.clock_ns()) is not None) < STUCK:
                    await trio.sleep(0.1)
                await trio.sleep(1.5)  # three stuck_timeouts more: each would have been said again
            done.set()
    lines = [r for r in caplog.records if "is stuck" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]
