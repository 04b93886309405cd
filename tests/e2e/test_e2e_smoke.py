from __future__ import annotations

import trio

import flowbroker.client as fb


async def test_publish_consume_roundtrip(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("q")
        producer = conn.producer(routing_key="q")
        for i in range(100):
            await producer.send(b"m%d" % i)
        await producer.flush(timeout=5)
        got = []
        async with conn.consumer("q", prefetch=10) as consumer:
            async for msg in consumer:
                got.append(msg.body)
                await msg.ack()
                if len(got) == 100:
                    break
    assert got == [b"m%d" % i for i in range(100)]


async def test_cancel_requeues_unsettled_deliveries(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("q")
        producer = conn.producer(routing_key="q")
        for i in range(10):
            await producer.send(b"m%d" % i)
        await producer.flush(timeout=5)
        async with conn.consumer("q", prefetch=5) as consumer:
            first = await consumer.receive(timeout=5)
            await first.ack()
            with trio.fail_after(5):
                while broker.core.sessions[conn.connection_id].unsettled.__len__() < 4:
                    await trio.sleep(0.01)
        # leaving the consumer cancelled it: the 4 unsettled deliveries are ready again, in order
        with trio.fail_after(5):
            while broker.core.queues["q"].count != 9 or len(broker.core.queues["q"].store) != 9:
                await trio.sleep(0.01)
        async with conn.consumer("q", prefetch=100) as consumer:
            got = []
            for _ in range(9):
                msg = await consumer.receive(timeout=5)
                got.append((msg.body, msg.redelivered))
                await msg.ack()
    assert [b for b, _ in got] == [b"m%d" % i for i in range(1, 10)]
    flags = [r for _, r in got]
    redelivered = flags.index(False)  # m1..m4 (and m5 if it was delivered before the cancel)
    assert redelivered >= 4 and not any(flags[redelivered:])
