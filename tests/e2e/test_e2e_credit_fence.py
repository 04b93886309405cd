"""BUFFER_LIMIT end to end: a promise left by a shrink drains at once for an idle producer.

Under ``aggressive`` every new producer shrinks the earlier ones' grants. An idle producer never sends
the bytes its old, larger limit allowed, so before BUFFER_LIMIT that limit stayed promised forever,
and once the idle producers' promises filled the pool a newcomer waited (WAIT_GRANT) for a share that
never came. The SDK now answers a shrink with BUFFER_LIMIT, the broker lowers the idle producers'
limits to their new grants, and the newcomer gets its share. Real sockets on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

import flowbroker.client as fb
from flowbroker.protocol import ProducerLedger

MiB = 1024 * 1024
IDLE = 4  # producers that send one message, then stay connected and idle
MESSAGES = 40


async def _late_producer_sends(start_flowbroker: Any, *, slow: bool, check: Callable[[Any], None] = print) -> bool:
    """Four producers send one message each and stay connected, idle or (`slow`) sending a small message
    every 50 ms; then a fifth sends MESSAGES messages of 8000 bytes. Returns whether it could within 5 s
    (then `check(broker)` runs while everyone is still connected).

    Pool 5 % of 64 MiB = 3.2 MiB, shares clamped to [64 KiB, 1 MiB]: three early producers get 1 MiB
    each, the fourth what is left, and the fifth finds every byte promised unless the earlier ones'
    limits come down with their grants (a slow producer's would take minutes to be used up)."""
    broker = await start_flowbroker(
        server={"memory_quota": 64 * MiB, "max_message_size": 65536, "max_connections": 50},
        credit={"policy": "aggressive", "min_size": 64 * 1024, "max_size": MiB},
    )

    async def trickle(producer: fb.Producer) -> None:
        while True:
            await trio.sleep(0.05)
            await producer.send(b"tick", timeout=5)

    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        # cancelled before the stack closes the trickles' connections: a trickle that sent on a
        # connection already closed failed the test with ConnectionClosed (seen once under load)
        try:
            for i in range(IDLE):
                conn = await stack.enter_async_context(await fb.connect(broker.url, client_name=f"early{i}"))
                if i == 0:
                    await conn.declare_queue("q")
                producer = conn.producer(routing_key="q")
                await producer.send(b"hello", timeout=5)
                await producer.flush(timeout=5)
                if slow:
                    nursery.start_soon(trickle, producer)
            late = await stack.enter_async_context(await fb.connect(broker.url, client_name="late"))
            producer = late.producer(routing_key="q")
            with trio.move_on_after(5) as waited:  # before BUFFER_LIMIT: forever, or minutes (it waits for a share)
                for n in range(MESSAGES):
                    await producer.send(b"m" * 8000)
                await producer.flush()
            if waited.cancelled_caught:
                return False
            check(broker)
            return True
        finally:
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("slow", [False, True], ids=["idle", "slow"])
async def test_a_producer_after_idle_or_slow_ones_gets_its_share_at_once(start_flowbroker: Any, slow: bool) -> None:
    def check(broker: Any) -> None:
        credit = broker.core.credit
        assert credit.waiting() == 0
        assert credit.total_committed() <= credit.pool
        if not slow:  # every idle producer's window came down to its grant: nothing promised beyond it
            for conn_id in credit.producers():
                assert credit.window_of(conn_id) == credit.size_of(conn_id)

    assert await _late_producer_sends(start_flowbroker, slow=slow, check=check)


@pytest.mark.parametrize("slow", [False, True], ids=["idle", "slow"])
async def test_a_client_that_never_answers_keeps_the_old_behaviour(
        start_flowbroker: Any, monkeypatch: Any, slow: bool) -> None:
    """An SDK from before BUFFER_LIMIT (here: the answer switched off): the late producer waits for a
    share behind the early producers' old promises, as it did before. This is the reproduction: the
    test above fails the same way on the code before BUFFER_LIMIT."""
    monkeypatch.setattr(ProducerLedger, "buffer_limit", lambda self: None)
    assert not await _late_producer_sends(start_flowbroker, slow=slow)


@pytest.mark.parametrize("paced", ["aggressive", "static"])
async def test_switching_from_none_to_a_paced_policy_closes_no_busy_producer(start_flowbroker: Any, paced: str) -> None:
    """Under `none` the producers send unlimited; a switch to a paced policy while they send used to
    close them with CREDIT_VIOLATION: bytes sent before they saw the grant were checked against it.
    They are now checked from each producer's BUFFER_LIMIT answer on. Every message arrives, once."""
    broker = await start_flowbroker(
        server={"memory_quota": 64 * MiB}, credit={"policy": "none", "min_size": 4096, "max_size": 16384,
                                                    "static_size": 16384})
    sent = 20_000
    async with await fb.connect(broker.url, client_name="busy") as conn:
        await conn.declare_queue("q", max_count=0, flow_stop_count=0, flow_stop_size=0, max_size=0)
        producer = conn.producer(routing_key="q")
        for i in range(sent):
            await producer.send(b"%06d" % i + b"x" * 200, timeout=10)
            if i == 2_000:
                broker.core.set_credit_policy(policy=paced)  # as PUT /api/policy does, mid-stream
        await producer.flush(timeout=30)
        assert conn.producer_buffer_size <= 16384  # paced now
        assert broker.core.queues["q"].count == sent


async def test_switching_from_none_to_a_paced_policy_closes_no_producer_of_large_messages(start_flowbroker: Any) -> None:
    """With 1 MiB messages a producer under `none` has hundreds of megabytes received and never
    acknowledged (size 0) and up to its window of 1,000 admitted and not yet sent: the checks of a buffer
    turned on mid-stream, counted from the acknowledged position and capped at 64 MiB beside its answer,
    closed it with CREDIT_VIOLATION (a tester, 5 of 5 runs). Every message arrives, once."""
    broker = await start_flowbroker(server={"memory_quota": 1024 * MiB, "max_message_size": 4 * MiB},
                                    credit={"policy": "none", "static_size": MiB})
    body = b"x" * MiB
    async with await fb.connect(broker.url, client_name="large") as conn:
        await conn.declare_queue("big", max_count=0, flow_stop_count=0, flow_stop_size=0, max_size=0)
        received = 0
        async with conn.consumer("big", prefetch=50) as consumer, trio.open_nursery() as nursery:
            async def drain() -> None:
                nonlocal received
                async for msg in consumer:
                    await msg.ack()
                    received += 1

            nursery.start_soon(drain)
            producer = conn.producer(routing_key="big")
            for i in range(1500):
                await producer.send(body, timeout=30)
                if i == 1000:
                    broker.core.set_credit_policy(policy="static")  # as PUT /api/policy does, mid-stream
            await producer.flush(timeout=60)
            with trio.fail_after(60):
                while received < 1500:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert not conn.is_closed and conn.producer_buffer_size == MiB
