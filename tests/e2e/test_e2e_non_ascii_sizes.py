"""Messages whose headers and names are not ASCII, over real sockets: the SDK's TRANSFER frames stay within
max_frame_size (a burst of messages with a 36 KB header of CJK text made frames of 9-17 MB, and the
broker closed a well-behaved producer's connection with FRAME_TOO_LARGE, a tester), and the broker's
messages keep the queue's and the exchange's own name objects rather than a decoded copy each (each held
an uncharged copy: 1.6 times the memory bound's bytes with 255-character names, a tester)."""

from __future__ import annotations

from typing import Any

import flowbroker.client as fc
from flowbroker.protocol.frames import Headers

LIMIT = 30.0


async def test_a_burst_of_messages_with_large_non_ascii_headers_is_sent_in_frames_the_broker_takes(
        start_flowbroker: Any) -> None:
    broker = await start_flowbroker()
    headers: Headers = {"description": "\u6f22" * 12_000}  # 12,000 characters, 36,000 bytes in UTF-8
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("cjk", max_size=1 << 30, flow_stop_size=1 << 30, flow_resume_size=1 << 29)
        producer = conn.producer(routing_key="cjk", window=1000)
        for i in range(600):  # sent as fast as credit allows: batched into the writer's frames
            await producer.send(b"%d" % i, headers=headers, timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
        assert not conn.is_closed
    assert broker.core.queues["cjk"].count == 600


async def test_held_messages_keep_the_queues_and_the_exchanges_own_names(start_flowbroker: Any) -> None:
    broker = await start_flowbroker()
    name = "\U0001f600" * 60 + "-queue"
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue(name)
        await conn.declare_exchange("\u00e9v\u00e9nements", "fanout")
        await conn.bind(name, "\u00e9v\u00e9nements", "")
        for producer in (conn.producer(routing_key=name), conn.producer("\u00e9v\u00e9nements", "k")):
            variants: list[Headers | None] = [None, {"h": "v"}]  # the one-queue fast path and the general one
            for headers in variants:
                await producer.send(b"x", headers=headers, timeout=LIMIT)
            await producer.flush(timeout=LIMIT)
    queue = broker.core.queues[name]
    exchange = broker.core.exchanges["\u00e9v\u00e9nements"]
    messages = list(queue.store)
    assert len(messages) == 4
    assert all(m.routing_key is queue.name for m in messages[:2])  # the default exchange: the queue's name
    assert all(m.exchange is exchange.name for m in messages[2:])
