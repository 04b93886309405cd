"""Fan-out under the memory alarm, over real sockets (broker/parking.py): an SDK producer to a fanout of
many queues is paced by the alarm without its messages being copied into every queue while it is on
(each message held once, the copies of the one that raised the alarm aside), never refused, and once a
consumer drains the queues the connection's writer routes what was parked: every queue gets every
message, once, in order, though the producer sends nothing more to wake the broker."""

from __future__ import annotations

import pytest
import trio

import flowbroker.client as fb

QUEUES = 40
MESSAGES = 400
BODY = 1000
WATERMARK = 256 * 1024


async def declare_wide(admin: fb.Connection) -> None:
    """The fanout `wide` over QUEUES queues without limits (w0, w1, ...)."""
    await admin.declare_exchange("wide", "fanout")
    for i in range(QUEUES):
        await admin.declare_queue(f"w{i}", max_size=0, flow_stop_size=0, flow_resume_size=0)
        await admin.bind(f"w{i}", "wide")


@pytest.mark.parametrize("transport", ["tcp", "udp"])
async def test_an_sdk_producer_to_a_fanout_under_the_memory_alarm_is_parked_then_delivered_in_order(
        start_flowbroker, transport: str) -> None:
    broker = await start_flowbroker(server={"memory_watermark": WATERMARK},
                                    credit={"policy": "static", "static_size": 256 * 1024})
    memory = broker.core.memory
    peak = 0
    got: list[list[int]] = []

    async def watch_held() -> None:
        nonlocal peak
        while True:
            peak = max(peak, memory.held)
            await trio.sleep(0.002)

    async with await fb.connect(broker.url, client_name="admin") as admin:
        await declare_wide(admin)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_held)
            async with await fb.connect(broker.url, client_name="producer") as conn:
                async with conn.producer("wide", send_timeout=60, transport=transport) as producer:
                    async def produce() -> None:
                        for n in range(MESSAGES):
                            await producer.send(n.to_bytes(4, "big") + b"p" * (BODY - 4))
                        await producer.flush(timeout=60)

                    async with trio.open_nursery() as sending:
                        sending.start_soon(produce)
                        with trio.fail_after(30):  # the alarm comes on, and the producer is parked
                            while not (memory.alarm and any(s.parked for s in broker.core.sessions.values())):
                                await trio.sleep(0.01)
                        got[:] = [[] for _ in range(QUEUES)]

                        async def consume(i: int) -> None:  # every queue at once: each holds copies
                            async with admin.consumer(f"w{i}", prefetch=100) as consumer:
                                while len(got[i]) < MESSAGES:
                                    msg = await consumer.receive(timeout=30)
                                    got[i].append(int.from_bytes(msg.body[:4], "big"))
                                    await msg.ack()

                        with trio.fail_after(60):
                            async with trio.open_nursery() as consuming:
                                for i in range(QUEUES):
                                    consuming.start_soon(consume, i)
            nursery.cancel_scope.cancel()
    assert got == [list(range(MESSAGES))] * QUEUES
    # held: the watermark and the copies of the message that raised the alarm (QUEUES x its size), where
    # copying parked messages into every queue was QUEUES x the producer's 256 KiB grant
    assert peak < WATERMARK + 2 * QUEUES * (BODY + 1024), peak


async def test_writers_route_what_they_parked_one_slice_at_a_time(start_flowbroker, monkeypatch) -> None:
    """The alarm's clearing wakes every writer with messages parked: each routed a slice in the same
    scheduler pass, and a bystander waited for all of them (100 connections: 116-434 ms, a tester). They
    take turns (BrokerServer.parked_turn): between two runs of any other task, at most one slice."""
    from flowbroker.broker import core as core_module

    monkeypatch.setattr(core_module, "FANOUT_BUDGET", 40)  # a slice: one message to the 40 queues
    broker = await start_flowbroker(server={"memory_watermark": WATERMARK},
                                    credit={"policy": "static", "static_size": 64 * 1024})
    core = broker.core
    routed = [0]
    route_parked = core.route_parked

    def counted(session: object) -> None:
        routed[0] += 1
        route_parked(session)

    monkeypatch.setattr(core, "route_parked", counted)
    async with await fb.connect(broker.url, client_name="admin") as admin:
        await declare_wide(admin)
        async with trio.open_nursery() as nursery:
            async def produce(k: int) -> None:
                async with await fb.connect(broker.url, client_name=f"p{k}") as conn:
                    producer = conn.producer("wide", send_timeout=60)
                    for n in range(40):
                        await producer.send(b"%d" % n + b"p" * BODY)
                    await producer.flush(timeout=60)

            for k in range(8):
                nursery.start_soon(produce, k)
            with trio.fail_after(30):  # every producer has messages parked
                while sum(1 for s in core.sessions.values() if s.parked) < 8:
                    await trio.sleep(0.01)
            gaps: list[int] = []
            for i in range(QUEUES):  # the alarm clears
                core.queues[f"w{i}"].purge()
            with trio.fail_after(30):
                while any(s.parked for s in core.sessions.values()):
                    before = routed[0]
                    await trio.lowlevel.checkpoint()
                    gaps.append(routed[0] - before)
                    for i in range(QUEUES):  # (what was routed is taken away: the alarm stays off)
                        core.queues[f"w{i}"].purge()
    assert sum(gaps) >= 8 and max(gaps) <= 1, gaps
