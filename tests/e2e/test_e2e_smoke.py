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
