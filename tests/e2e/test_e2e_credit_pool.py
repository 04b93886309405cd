"""The credit pool end to end (issue 8, item 3): 50 SDK producer connections with flow control flood
a flow-stopped queue on a broker with a small quota, beside a well-behaved producer and consumer that
must lose nothing and must not stall; meanwhile the admin API, polled all along, never reports more
granted (or committed) than the pool."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

import trio
from tests.e2e.test_e2e_admin import TOKEN, ok

import flowbroker.client as fb

MiB = 1024 * 1024
STALL = 0.5  # seconds: the most the good pair may wait for any one message (it takes far less)
FLOODERS = 50
MESSAGES = 300


async def test_fifty_flow_controlled_producers_never_get_more_than_the_pool(start_flowbroker: Any) -> None:
    broker = await start_flowbroker(
        server={"memory_quota": 64 * MiB, "max_message_size": 65536, "max_connections": 200},
        credit={"policy": "aggressive", "min_size": 128 * 1024, "max_size": MiB},  # pool 5 % = 3.2 MiB: 25 shares
        admin={"token": TOKEN},
    )
    pool = (await ok(broker, "GET", "/api/policy"))["pool"]["bytes"]
    assert pool == 64 * MiB * 5 // 100
    seen = {"polls": 0, "granted": 0, "waiting": 0, "connections": 0}
    received: list[bytes] = []
    async with await fb.connect(broker.url, client_name="good") as good, \
            await fb.connect(broker.url, client_name="good-consumer", flow_control=False) as reader:
        await good.declare_queue("good")
        # Its stop above what the 51 producers' first messages fill (400 KB), so that each registers with the
        # pool before the queue saturates (a producer whose first message meets a saturated queue is paced,
        # not waiting for a share: with a 256 KiB stop the polls saw no one waiting in 1 CI run of 3)
        await good.declare_queue("flood", max_size=0, flow_stop_size=4 * MiB, flow_resume_size=2 * MiB)
        producer = good.producer(routing_key="good")
        await producer.send(b"good:-1", timeout=5)  # registers the good producer before the flood
        await producer.flush(timeout=5)

        async def sample() -> None:
            answer = await ok(broker, "GET", "/api/policy")
            granted = answer["granted"]
            assert granted["total"] == sum(c["buffer_size"] for c in granted["connections"])
            assert granted["total"] <= answer["committed"] <= pool, answer
            seen["polls"] += 1
            seen["granted"] = max(seen["granted"], granted["total"])
            seen["waiting"] = max(seen["waiting"], granted["waiting"])
            seen["connections"] = max(seen["connections"], len(granted["connections"]))

        async def poll() -> None:
            while True:
                await sample()
                await trio.sleep(0.02)

        async def flood(i: int) -> None:
            async with await fb.connect(broker.url, client_name=f"flood{i}") as conn:
                sender = conn.producer(routing_key="flood")
                n = 0
                while True:
                    try:
                        await sender.send(b"f" * 8000, timeout=0.2)
                    except fb.FlowControlTimeout:
                        pass  # held by the flow-stopped queue, or waiting for a share of the pool
                    n += 1

        async def consume() -> None:
            async with reader.consumer("good", prefetch=50) as consumer:
                while len(received) < MESSAGES + 1:
                    with trio.fail_after(STALL):
                        msg = await consumer.receive()
                    await msg.ack()
                    received.append(msg.body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            for i in range(FLOODERS):
                nursery.start_soon(flood, i)
            with trio.fail_after(10):
                while len(broker.core.credit) < FLOODERS + 1 or broker.core.queues["flood"].saturated is False:
                    seen["waiting"] = max(seen["waiting"], broker.core.credit.waiting())  # (the core's too)
                    await trio.sleep(0.01)
            async with trio.open_nursery() as pair:
                pair.start_soon(consume)
                for n in range(MESSAGES):
                    with trio.fail_after(STALL):
                        await producer.send(b"good:%d" % n)
                with trio.fail_after(STALL * 10):
                    await producer.flush()
            # once more with every flooder still connected: the good pair can finish in fewer polls than
            # it takes to see all 51 (it did, 4 polls, once the broker got faster)
            await sample()
            nursery.cancel_scope.cancel()
    assert received == [b"good:-1"] + [b"good:%d" % n for n in range(MESSAGES)]  # nothing lost, in order
    assert seen["polls"] > 0 and seen["connections"] >= FLOODERS + 1
    assert seen["granted"] <= pool
    assert seen["waiting"] > 0  # the flood asked for more than the pool: most of it waited



async def test_a_connection_the_pool_has_no_byte_for_is_refused_in_the_handshake(start_flowbroker: Any) -> None:
    """docs/configuration.md: a pool smaller than two bytes a connection slot can run out of the 1-byte
    grants, and the connection beyond is refused with RESOURCE_EXHAUSTED: in the handshake, so connect()
    raises (it used to get WELCOME with buffer 0, a sign of "not paced", and a CLOSE a moment later)."""
    broker = await start_flowbroker(admin={"token": TOKEN})
    await ok(broker, "PUT", "/api/policy", {"quota": 100})
    reserve = (await ok(broker, "GET", "/api/policy"))["pool"]["reserve"]
    assert 0 < reserve < 10
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(await fb.connect(broker.url, timeout=10)) for _ in range(reserve)]
        with pytest.raises(fb.HandshakeError) as refused:
            await fb.connect(broker.url, timeout=10)
        assert refused.value.code is fb.ErrorCode.RESOURCE_EXHAUSTED and "credit pool" in str(refused.value)
        assert not any(conn.is_closed for conn in opened)  # nobody else is touched


async def test_with_a_small_pool_a_second_producer_gets_a_share_while_the_first_stays_busy(
        start_flowbroker: Any) -> None:
    """The defaults with a 64 MiB quota: a pool of 3.2 MiB, under min_size (10 MiB). The first producer
    took the whole pool and the second waited for as long as the first stayed connected (three testers
    met it); now the pool is split between them."""
    broker = await start_flowbroker(server={"memory_quota": 64 * MiB}, admin={"token": TOKEN})
    async with await fb.connect(broker.url, client_name="first") as first, \
            await fb.connect(broker.url, client_name="second") as second:
        await first.declare_queue("busy", max_size=0, flow_stop_size=0, flow_stop_count=0)
        await first.declare_queue("late")
        busy = first.producer(routing_key="busy")
        stop = trio.Event()

        async def keep_busy() -> None:
            while not stop.is_set():
                await busy.send(b"b" * 1000, timeout=10)
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_busy)
            with trio.fail_after(10):
                while busy.statistics().completed < 500:
                    await trio.sleep(0.01)
            late = second.producer(routing_key="late")
            with trio.fail_after(10):
                for i in range(200):
                    await late.send(b"%d" % i, timeout=5)
                await late.flush(timeout=5)
            policy = await ok(broker, "GET", "/api/policy")
            stop.set()
        sizes = {c["client_name"]: c["buffer_size"] for c in policy["granted"]["connections"]}
        assert sizes["first"] > 1 and sizes["second"] > 1, sizes  # both hold a share
        assert policy["granted"]["waiting"] == 0
        await busy.flush(timeout=10)


async def test_a_producer_waiting_for_a_share_of_the_pool_is_told_so_by_its_timeout(start_flowbroker: Any) -> None:
    """Its FlowControlTimeout named no destination and nothing else (a tester): it says now that the
    broker's pool has no share for it yet."""
    broker = await start_flowbroker(server={"memory_quota": 12 * MiB},
                                    credit={"policy": "static", "static_size": 8 * MiB})
    async with await fb.connect(broker.url) as first, await fb.connect(broker.url) as second:
        await first.declare_queue("q", max_size=0, flow_stop_size=0)
        holder = first.producer(routing_key="q")
        await holder.send(b"x", timeout=5)
        await holder.flush(timeout=5)  # registered: 8 MiB of the 12 MiB pool; what is left is under one message
        waiter = second.producer(routing_key="q")
        await waiter.send(b"first", timeout=5)  # a waiting producer's one message (DCP's overflow rule)
        with pytest.raises(fb.FlowControlTimeout, match="granted this connection no buffer yet") as waited:
            await waiter.send(b"second", timeout=0.5)
        # the other reason a first message gets no grant: the broker has not read it (a tester's 2 MiB
        # message waited 27 s behind other connections' partial 8 MiB frames, told only about credit)
        assert "max_partial_frame_bytes" in str(waited.value)
