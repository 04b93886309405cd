"""The SDK's consumer credit and per-message limits against a real `BrokerServer` over TCP on 127.0.0.1.

- A consumer whose application does not read must not stall the producers on its connection: the
  SDK's reader never waits for the application (issue 8, 6c).
- A consumer byte buffer turned on mid-stream must not stall: positions count from the start of the
  connection, whatever the size, on both ends (issue 8, 6a).
- A message over a per-message limit is refused by `send()` before anything is sent, with a typed error
  naming the limit, and the connection goes on.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

import flowbroker.client as fc
from flowbroker.protocol.frames import Headers
from flowbroker.protocol.limits import MAX_HEADERS, MAX_KEY_BYTES

STALL = 2.0
"""Seconds: the bound on a wait that must not stall (it takes milliseconds; generous for a busy machine)."""


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def test_a_consumer_that_does_not_read_does_not_stall_producers_on_its_connection(start_flowbroker) -> None:
    # More unsettled deliveries than the SDK's consumer buffer held before it stopped waiting (10,000):
    # the buffer is bounded by the prefetch the broker honours, and the reader never waits on it.
    prefetch = 12_000
    broker = await start_flowbroker(queues={"max_prefetch": prefetch})
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("inbox")
        await conn.declare_queue("outbox")
        async with conn.consumer("inbox", prefetch=0) as consumer:  # the application never reads
            inbox = conn.producer(routing_key="inbox")
            for i in range(prefetch + 500):
                await inbox.send(b"in-%d" % i)
            await inbox.flush(timeout=30)
            await wait_until(lambda: consumer.buffered == prefetch)  # the consumer's credit is used up
            assert consumer.prefetch_in_force == prefetch
            # Its buffer is full and the application still reads nothing: sends on the same connection
            # complete all the same.
            outbox = conn.producer(routing_key="outbox")
            for i in range(100):
                await outbox.send(b"out-%d" % i)
            await outbox.flush(timeout=STALL)
            assert consumer.buffered == prefetch
            # Nothing was lost: the consumer gets every message once it reads.
            got = []
            with trio.fail_after(30):
                async for msg in consumer:
                    got.append(msg.body)
                    await msg.ack()
                    if len(got) == prefetch + 500:
                        break
            assert got == [b"in-%d" % i for i in range(prefetch + 500)]


@pytest.mark.parametrize("level", ["connection", "subscription"])
async def test_a_buffer_turned_on_midstream_does_not_stall_the_consumer(start_flowbroker, level: str) -> None:
    broker = await start_flowbroker()
    async with (
        await fc.connect(broker.url, timeout=5, client_name="producer") as pconn,
        await fc.connect(broker.url, timeout=5, client_name="consumer") as cconn,
    ):
        await pconn.declare_queue("q")
        producer = pconn.producer(routing_key="q")
        async with cconn.consumer("q", prefetch=100) as consumer:
            for i in range(100):
                await producer.send(b"before-%d" % i)
            for i in range(100):
                msg = await consumer.receive(timeout=STALL)
                assert msg.body == b"before-%d" % i
                await msg.ack()
            # 100 deliveries (over 50 KB by message_size) counted by the broker while the size was 0;
            # a buffer of 8 KiB is full unless the first acknowledgement covers them.
            target = cconn if level == "connection" else consumer
            await target.set_buffer_size(8 * 1024)
            count = 10_000
            async with trio.open_nursery() as nursery:

                async def send_all() -> None:
                    for i in range(count):
                        await producer.send(b"after-%d" % i)
                    await producer.flush(timeout=60)

                nursery.start_soon(send_all)
                for i in range(count):
                    msg = await consumer.receive(timeout=STALL)  # a stall is a ReceiveTimeout
                    assert msg.body == b"after-%d" % i
                    await msg.ack()
    await wait_until(lambda: broker.core.queues["q"].count == 0)


async def test_messages_over_a_limit_are_refused_by_send_and_the_connection_goes_on(start_flowbroker) -> None:
    max_message = 4096
    broker = await start_flowbroker(server={"max_message_size": max_message})
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("q")
        producer = conn.producer(routing_key="q")
        headers: Headers = {"h%02d" % i: "v" for i in range(MAX_HEADERS)}  # 4 bytes each
        at_limit = b"x" * (max_message - len("q") - 4 * MAX_HEADERS)
        with pytest.raises(fc.TooManyHeaders, match="MAX_HEADERS"):
            await producer.send(b"b", {**headers, "one": "more"})
        with pytest.raises(fc.KeyTooLong, match="MAX_KEY_BYTES"):
            await producer.send(b"b", routing_key="é" * (MAX_KEY_BYTES // 2 + 1))
        with pytest.raises(fc.MessageTooLarge, match="max_message_size"):
            await producer.send(at_limit + b"x", headers)
        assert producer.stats.sent == 0  # refused before anything was sent
        # The whole message at the limit is taken, delivered, and the connection is still open.
        await producer.send(at_limit, headers)
        await producer.flush(timeout=STALL)
        async with conn.consumer("q") as consumer:
            msg = await consumer.receive(timeout=STALL)
            assert (msg.body, msg.headers) == (at_limit, headers)
            await msg.ack()
        assert not conn.is_closed


async def test_consumers_closed_with_deliveries_unsent_leave_the_connection_buffer_free(start_flowbroker) -> None:
    # Each consumer's close sends the settlement of what it read together with its CANCEL: the settlement
    # lets the broker deliver more, the CANCEL drops those deliveries before they are written. Their bytes
    # were charged to the connection's byte buffer and the client never saw them: kept, they filled the
    # buffer for good after four or five closes and the connection received nothing more (a tester).
    broker = await start_flowbroker()
    total = 3_000
    async with await fc.connect(broker.url, timeout=5) as pconn:
        await pconn.declare_queue("backlog")
        producer = pconn.producer(routing_key="backlog")
        for i in range(total):
            await producer.send(b"%05d" % i + b"x" * 1019)
        await producer.flush(timeout=30)
    seen: list[bytes] = []
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.set_buffer_size(256 * 1024)
        for _ in range(30):
            consumer = conn.consumer("backlog", prefetch=50)
            for _ in range(10):
                msg = await consumer.receive(timeout=STALL)  # a leaked buffer is a ReceiveTimeout here
                seen.append(msg.body[:5])
                await msg.ack()
            await consumer.aclose()
        async with conn.consumer("backlog", prefetch=500) as rest:
            while len(seen) < total:
                msg = await rest.receive(timeout=STALL)
                seen.append(msg.body[:5])
                await msg.ack()
        window = broker.core.sessions[conn.connection_id].deliveries.window
        await wait_until(lambda: window.position == window.acked_position)  # every byte sent acknowledged
    assert sorted(seen) == [b"%05d" % i for i in range(total)]  # every message once
    await wait_until(lambda: broker.core.queues["backlog"].count == 0)
