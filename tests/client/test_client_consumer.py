"""Consumer: delivery, settlement ranges, buffer acknowledgements (20 % / 50 KiB / 5 s timer)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import flowbroker.client as fc
from flowbroker.protocol.frames import Headers
from flowbroker.protocol import (
    BufferAck,
    BufferControl,
    Cancel,
    Deliver,
    DeliveryEntry,
    Ok,
    Outcome,
    Settle,
    Subscribe,
    message_size,
)
from flowbroker.protocol.credit import MESSAGE_OVERHEAD

BODY = b"y" * 68
SIZE = message_size(BODY)  # the buffer sizes below are multiples of it


def entries(first: int, count: int, body: bytes = BODY) -> list[DeliveryEntry]:
    return [DeliveryEntry(tag, "", "q", body, None, False) for tag in range(first, first + count)]


async def test_messages_and_settle_ranges(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=50) as consumer:
            sub = fake.frames(Subscribe)[0]
            assert (sub.queue, sub.prefetch, sub.buffer_size) == ("q", 50, 0)
            await fake.send(
                Deliver(sub.subscription_id, [DeliveryEntry(1, "ex", "rk", b"hello", {"h": 1}, True)] + entries(2, 6))
            )
            got = []
            for _ in range(7):
                got.append(await consumer.receive(timeout=5))
            first = got[0]
            assert (first.body, first.headers, first.exchange, first.routing_key, first.redelivered) == (
                b"hello",
                {"h": 1},
                "ex",
                "rk",
                True,
            )
            assert [m.delivery_tag for m in got] == list(range(1, 8))
            # settle without yielding in between: one SETTLE frame per outcome, coalesced
            for i in (0, 1, 2, 4):
                got[i].settle_nowait(Outcome.ACK)
            got[3].settle_nowait(Outcome.REJECT)
            await got[5].requeue()
            await fake.wait_for(lambda: len(fake.frames(Settle)) >= 3)
            settles = {s.outcome: s.ranges for s in fake.frames(Settle)}
            assert settles == {Outcome.ACK: [(1, 3), (5, 5)], Outcome.REJECT: [(4, 4)], Outcome.REQUEUE: [(6, 6)]}
            with pytest.raises(fc.AlreadySettled):
                await got[0].ack()
        await fake.wait_for(lambda: fake.frames(Cancel) != [])
        assert fake.frames(Cancel)[0].subscription_id == sub.subscription_id


async def test_async_iteration_and_unhandled_messages_requeued_on_close(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q") as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 5)))
            seen = []
            async for msg in consumer:
                seen.append(msg.delivery_tag)
                await msg.ack()
                if len(seen) == 2:
                    break
            # the reader may not have queued all five yet; wait until it has
            with trio.fail_after(5):
                while len(consumer._buffered) < 3:
                    await trio.sleep(0.01)
        await fake.wait_for(lambda: fake.frames(Cancel) != [])
        ranges = {(s.outcome, r) for s in fake.frames(Settle) for r in s.ranges}
        assert (Outcome.REQUEUE, (3, 5)) in ranges
        assert seen == [1, 2]


async def test_buffer_acks_after_twenty_percent_and_on_timer(start_broker, io_clock) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=0, buffer_size=10 * SIZE) as consumer:
            sub = fake.frames(Subscribe)[0]
            assert sub.buffer_size == 10 * SIZE
            await fake.send(Deliver(sub.subscription_id, entries(1, 5)))
            m1 = await consumer.receive(timeout=5)
            await m1.ack()  # SIZE processed: under 20 % of 10 SIZE
            await trio.sleep(1)
            assert fake.frames(BufferAck) == []
            m2 = await consumer.receive(timeout=5)  # moving on processes m1 only (already counted)
            await m2.reject()  # 2 SIZE = 20 %: an ack is due now
            await fake.wait_for(lambda: len(fake.frames(BufferAck)) == 1)
            ack = fake.frames(BufferAck)[0]
            assert (ack.opaque, ack.freed, ack.acked_position) == (sub.subscription_id, 2 * SIZE, 2 * SIZE)
            await consumer.receive(timeout=5)  # m3, never settled
            await consumer.receive(timeout=5)  # asking for m4 means m3 was handled: 3 SIZE
            t0 = trio.current_time()
            # SIZE pending: below the threshold, so only the 5 s timer returns it
            await fake.wait_for(lambda: len(fake.frames(BufferAck)) == 2, timeout=10)
            assert 3.0 <= trio.current_time() - t0 <= 6.5
            ack = fake.frames(BufferAck)[1]
            assert (ack.freed, ack.acked_position) == (SIZE, 3 * SIZE)


async def test_buffer_acks_every_fifty_kib_for_large_buffers(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=0, buffer_size=10 * 1024 * 1024) as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            body = b"z" * (1024 - MESSAGE_OVERHEAD)  # 1 KiB charged
            assert message_size(body) == 1024
            await fake.send(Deliver(sub_id, entries(1, 120, body)))
            for _ in range(120):
                await (await consumer.receive(timeout=5)).ack()
            await fake.wait_for(lambda: any(a.acked_position == 100 * 1024 for a in fake.frames(BufferAck)))
            # Acks are due at every 50 KiB processed. Acks due while the application has not yielded
            # coalesce (they are absolute), so 120 acks in a row may travel as one frame; none may be
            # sent before 50 KiB was processed or at a position that is not a 50 KiB step.
            totals = [a.acked_position for a in fake.frames(BufferAck)]
            assert totals[-1] == 100 * 1024
            assert all(t % (50 * 1024) == 0 and t > 0 for t in totals), totals


async def test_connection_level_buffer_and_midstream_resize(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        await conn.set_buffer_size(5 * SIZE)  # threshold SIZE: every message
        await fake.wait_for(lambda: fake.frames(BufferControl) != [])
        assert fake.frames(BufferControl)[0] == BufferControl(0, 5 * SIZE)
        async with conn.consumer("q") as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 2)))
            await (await consumer.receive(timeout=5)).ack()
            await fake.wait_for(lambda: len(fake.frames(BufferAck)) == 1)
            assert fake.frames(BufferAck)[0] == BufferAck(0, SIZE, SIZE)
            await consumer.set_buffer_size(20 * SIZE)
            await fake.wait_for(lambda: BufferControl(sub_id, 20 * SIZE) in fake.frames(BufferControl))


@pytest.mark.parametrize("level", ["connection", "subscription"])
async def test_a_buffer_turned_on_midstream_acknowledges_everything_processed(start_broker, level: str) -> None:
    """Positions count from the start, whatever the size: the broker counted the deliveries made while
    the buffer was off, so the first ack after turning it on must cover every one processed."""
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q") as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            opaque = 0 if level == "connection" else sub_id
            headers: Headers = {"k": "v"}
            await fake.send(Deliver(sub_id, entries(1, 3)), Deliver(sub_id, [DeliveryEntry(4, "", "q", BODY, headers, False)]))
            for _ in range(3):
                await (await consumer.receive(timeout=5)).ack()
            with trio.fail_after(5):
                while consumer.buffered < 1:  # the fourth arrived, not processed yet
                    await trio.sleep(0.01)
            assert fake.frames(BufferAck) == []  # no buffer: nothing acknowledged
            target = conn if level == "connection" else consumer
            await target.set_buffer_size(5 * SIZE)  # threshold SIZE
            await fake.wait_for(lambda: BufferControl(opaque, 5 * SIZE) in fake.frames(BufferControl))
            await fake.wait_for(lambda: fake.frames(BufferAck) != [])
            assert fake.frames(BufferAck) == [BufferAck(opaque, 3 * SIZE, 3 * SIZE)]
            await (await consumer.receive(timeout=5)).ack()
            fourth = message_size(BODY, headers)
            await fake.wait_for(lambda: len(fake.frames(BufferAck)) == 2)
            assert fake.frames(BufferAck)[1] == BufferAck(opaque, fourth, 3 * SIZE + fourth)


async def test_connection_failure_ends_iteration_with_the_error(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q") as consumer:
            await fake.close(fc.ErrorCode.SHUTDOWN, "stopping")
            with pytest.raises(fc.ConnectionClosed):
                async for _ in consumer:
                    pass


async def test_a_subscribe_not_answered_in_time_is_kept_and_taken_when_its_ok_comes(start_broker) -> None:
    """First use subscribes within the receive's deadline; a late OK is not lost: the subscription it
    made is the consumer's, and its messages arrive (no SUBSCRIBE is sent twice)."""
    broker = await start_broker(answer_requests=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        consumer = conn.consumer("q", prefetch=5)
        with pytest.raises(fc.ReceiveTimeout):
            await consumer.receive(timeout=0.2)
        with pytest.raises(fc.RequestTimeout):
            await consumer.subscribe(timeout=0.1)
        (sub,) = fake.frames(Subscribe)
        await fake.send(Ok(sub.request_id, {"queue": "q", "prefetch": 3}), Deliver(sub.subscription_id, entries(1, 2)))
        msg = await consumer.receive(timeout=5)
        assert msg.body == BODY and consumer.prefetch_in_force == 3
        assert len(fake.frames(Subscribe)) == 1
        assert consumer.stats.received == 2


async def test_a_consumer_closed_before_its_subscribe_is_answered_cancels_on_the_ok(start_broker) -> None:
    broker = await start_broker(answer_requests=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        consumer = conn.consumer("q")
        with pytest.raises(fc.ReceiveTimeout):
            await consumer.receive(timeout=0.2)
        await consumer.aclose()
        with pytest.raises(fc.ConsumerClosed, match="consumer of 'q' has no more messages: it was closed"):
            await consumer.receive(timeout=1)
        (sub,) = fake.frames(Subscribe)
        await fake.send(Ok(sub.request_id, {"queue": "q", "prefetch": 10}), Deliver(sub.subscription_id, entries(1, 1)))
        await fake.wait_for(lambda: fake.frames(Cancel) != [])
        assert fake.frames(Cancel)[0].subscription_id == sub.subscription_id
        assert consumer.subscription_id not in conn._consumers
