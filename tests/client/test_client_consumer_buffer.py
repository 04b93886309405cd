"""The consumer's bounded buffer between the connection's reader and the application: the reader waits
while it is full (and reads nothing else), goes on once the application has taken enough, and a close
while it waits requeues what was received and never handed out, and lets it go on. Also the settling
side: ack is not a cancel point, and settled tags coalesce into ranges."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

import flowbroker.client as fc
from flowbroker.client.connection import coalesce
from flowbroker.protocol import BufferAck, Cancel, Deliver, DeliveryEntry, Outcome, Settle, Subscribe, message_size

BODY = b"b" * 20
SIZE = message_size(BODY)


def entries(first: int, count: int) -> list[DeliveryEntry]:
    return [DeliveryEntry(tag, "", "q", BODY, None, False) for tag in range(first, first + count)]


async def wait_until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(5):
        while not predicate():
            await trio.sleep(0.01)


async def test_reader_waits_while_the_buffer_is_full_and_resumes_as_it_drains(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=4) as consumer:  # the buffer holds prefetch messages
            sub_id = fake.frames(Subscribe)[0].subscription_id
            # The fake broker ignores prefetch: 10 messages, then 2 more in a second frame.
            await fake.send(Deliver(sub_id, entries(1, 10)), Deliver(sub_id, entries(11, 2)))
            await wait_until(lambda: len(consumer._backlog) == 6)
            await trio.sleep(0.2)
            # The reader waits with the rest of the first frame; it has not read the second one.
            assert [m.delivery_tag for m in consumer._buffered] == [1, 2, 3, 4]
            got = []
            for _ in range(12):
                got.append((await consumer.receive(timeout=5)).delivery_tag)
                assert len(consumer._buffered) <= 4
            assert got == list(range(1, 13))
            assert not consumer._backlog
            # The reader goes on with later frames.
            await fake.send(Deliver(sub_id, entries(13, 1)))
            assert (await consumer.receive(timeout=5)).delivery_tag == 13


async def test_close_while_the_reader_waits(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=4, buffer_size=10 * SIZE) as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 10)))
            await wait_until(lambda: len(consumer._backlog) == 6)
            assert (await consumer.receive(timeout=5)).delivery_tag == 1  # handed out, never settled
            assert [m.delivery_tag for m in consumer._buffered] == [2, 3, 4, 5]
        await fake.wait_for(lambda: fake.frames(Cancel) != [])
        # The buffer is requeued with the message the reader was offering (as the trio channel that
        # preceded the buffer handed it over); the rest of its frame is left to the broker's cancel.
        assert [(s.outcome, s.ranges) for s in fake.frames(Settle)] == [(Outcome.REQUEUE, [(2, 6)])]
        # Every message counts as processed, handed out or not, so the buffer acks return all of it.
        await fake.wait_for(lambda: any(a.acked_total == 10 * SIZE for a in fake.frames(BufferAck)))
        assert all(a.opaque == sub_id for a in fake.frames(BufferAck))
        # The reader went on: it reads the answer to a request, and drops deliveries for the old
        # subscription.
        await fake.send(Deliver(sub_id, entries(11, 3)))
        with trio.fail_after(5):
            await conn.declare_queue("other")
        with pytest.raises(trio.EndOfChannel):
            await consumer.receive(timeout=1)


async def test_connection_closes_while_the_reader_waits(start_broker) -> None:
    broker = await start_broker()
    with trio.fail_after(10):
        async with await fc.connect(broker.url, timeout=5) as conn:
            fake = await broker.connection()
            consumer = conn.consumer("q", prefetch=2)
            await consumer.subscribe()
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 5)))
            await wait_until(lambda: len(consumer._backlog) == 3)
            await conn.aclose()
            assert not consumer._backlog
            # What was buffered is still handed out, then iteration ends (closed normally).
            assert [m.delivery_tag async for m in consumer] == [1, 2]


async def test_receive_timeout_loses_nothing(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q") as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            with pytest.raises(fc.ReceiveTimeout):
                await consumer.receive(timeout=0.1)
            await fake.send(Deliver(sub_id, entries(1, 2)))
            await wait_until(lambda: len(consumer._buffered) == 2)
            with pytest.raises(fc.ReceiveTimeout):
                await consumer.receive(timeout=0)  # a cancelled receive takes nothing
            assert (await consumer.receive(timeout=5)).delivery_tag == 1
            assert (await consumer.receive(timeout=5)).delivery_tag == 2


async def test_settling_is_not_a_cancel_point_iterating_is(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q") as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 3)))
            first = await consumer.receive(timeout=5)
            await wait_until(lambda: len(consumer._buffered) == 2)
            with trio.CancelScope() as scope:
                scope.cancel()
                await first.ack()  # settles all the same
                assert first.settled is Outcome.ACK
                async for _ in consumer:  # but the next message is not handed out
                    raise AssertionError("iteration went on in a cancelled scope")
            assert scope.cancelled_caught
            for tag in (2, 3):  # nothing was lost
                msg = await consumer.receive(timeout=5)
                assert msg.delivery_tag == tag
                await msg.ack()

            def settled() -> list[int]:
                return sorted(t for s in fake.frames(Settle) for lo, hi in s.ranges for t in range(lo, hi + 1))

            await fake.wait_for(lambda: settled() == [1, 2, 3])


@pytest.mark.parametrize(
    ("tags", "ranges"),
    [
        ([5, 3, 4, 6], [(3, 6)]),  # consecutive, any order: one range
        ([1, 2, 3, 7], [(1, 3), (7, 7)]),
        ([1, 1, 2, 4], [(1, 2), (4, 4)]),  # a duplicate: as long as the gap it hides
        ([3, 1, 3, 2], [(1, 3)]),
        ([9], [(9, 9)]),
        ([], []),
    ],
)
def test_coalesce(tags: list[int], ranges: list[tuple[int, int]]) -> None:
    assert coalesce(tags) == ranges
