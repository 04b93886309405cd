"""The consumer's buffer between the connection's reader and the application: the reader never waits
for it (requests, completions and other frames get through while the application reads nothing), the
buffer is bounded by the prefetch in force and a broker that delivers past it is a protocol violation, a
close requeues what was received and never handed out. Also the settling side: ack is not a cancel point,
settled tags coalesce into ranges, and SETTLE frames never carry more than MAX_RANGES_PER_FRAME ranges."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

import flowbroker.client as fc
from flowbroker.client.connection import TRANSFER_BATCH
from flowbroker.protocol.ranges import to_ranges
from flowbroker.protocol import (
    BufferAck,
    Cancel,
    Close,
    Deliver,
    DeliveryEntry,
    Error,
    ErrorCode,
    Outcome,
    Settle,
    Subscribe,
    message_size,
)
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME, MAX_RANGES_PER_FRAME

BODY = b"b" * 20
SIZE = message_size(BODY)


def entries(first: int, count: int) -> list[DeliveryEntry]:
    return [DeliveryEntry(tag, "", "q", BODY, None, False) for tag in range(first, first + count)]


async def wait_until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(5):
        while not predicate():
            await trio.sleep(0.01)


async def test_the_reader_never_waits_for_an_application_that_does_not_read(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=10) as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 6)), Deliver(sub_id, entries(7, 4)))
            await wait_until(lambda: consumer.buffered == 10)
            # The application has read nothing; the reader still reads answers and completions.
            with trio.fail_after(5):
                await conn.declare_queue("other")
                producer = conn.producer(routing_key="other")
                await producer.send(b"x")
                await producer.flush()
            assert [(await consumer.receive(timeout=5)).delivery_tag for _ in range(10)] == list(range(1, 11))


async def test_a_delivery_past_the_prefetch_is_a_protocol_violation(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        consumer = conn.consumer("q", prefetch=4)
        await consumer.subscribe()
        sub_id = fake.frames(Subscribe)[0].subscription_id
        await fake.send(Deliver(sub_id, entries(1, 4)))
        for _ in range(2):
            await (await consumer.receive(timeout=5)).ack()
        # Two settled: two more fit (the broker may send them before it sees the SETTLE).
        await fake.send(Deliver(sub_id, entries(5, 2)))
        await wait_until(lambda: consumer.buffered == 4)
        assert not conn.is_closed
        await fake.send(Deliver(sub_id, entries(7, 1)))  # a fifth unsettled delivery
        await wait_until(lambda: conn.is_closed)
        error = conn.close_error
        assert isinstance(error, fc.ProtocolViolation) and error.code is ErrorCode.CREDIT_VIOLATION
        assert "subscription 1" in str(error) and "above its prefetch 4" in str(error)
        await fake.wait_for(lambda: fake.frames(Close) != [])
        assert fake.frames(Error)[0].code is ErrorCode.CREDIT_VIOLATION


async def test_prefetch_zero_is_bounded_by_the_prefetch_the_broker_reports(start_broker) -> None:
    broker = await start_broker(max_prefetch=3)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        consumer = conn.consumer("q", prefetch=0)
        await consumer.subscribe()
        assert consumer.prefetch_in_force == 3
        sub_id = fake.frames(Subscribe)[0].subscription_id
        await fake.send(Deliver(sub_id, entries(1, 4)))
        await wait_until(lambda: conn.is_closed)
        assert isinstance(conn.close_error, fc.ProtocolViolation)
        assert consumer.buffered == 0


async def test_close_requeues_what_was_never_handed_out(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=10, buffer_size=10 * SIZE) as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 10)))
            assert (await consumer.receive(timeout=5)).delivery_tag == 1  # handed out, never settled
            await wait_until(lambda: consumer.buffered == 9)
        await fake.wait_for(lambda: fake.frames(Cancel) != [])
        # The buffer is requeued; the message handed out is left to the broker's cancel.
        assert [(s.outcome, s.ranges) for s in fake.frames(Settle)] == [(Outcome.REQUEUE, [(2, 10)])]
        # Every message counts as processed, handed out or not, so the buffer acks return all of it.
        await fake.wait_for(lambda: any(a.acked_position == 10 * SIZE for a in fake.frames(BufferAck)))
        assert all(a.opaque == sub_id for a in fake.frames(BufferAck))
        # The reader goes on: it reads the answer to a request, and drops deliveries for the old
        # subscription.
        await fake.send(Deliver(sub_id, entries(11, 3)))
        with trio.fail_after(5):
            await conn.declare_queue("other")
        with pytest.raises(trio.EndOfChannel):
            await consumer.receive(timeout=1)


async def test_a_revoked_consumer_gives_its_dropped_bytes_back_to_the_connection_buffer(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.set_buffer_size(10 * SIZE)
        fake = await broker.connection()
        consumer = conn.consumer("q", prefetch=10)
        await consumer.subscribe()
        sub_id = fake.frames(Subscribe)[0].subscription_id
        await fake.send(Deliver(sub_id, entries(1, 10)))
        in_hand = await consumer.receive(timeout=5)
        await wait_until(lambda: consumer.buffered == 9)
        await fake.send(Error(ErrorCode.UNAUTHORIZED, "may no longer read queue 'q'", destination="q"))
        await wait_until(lambda: consumer.buffered == 0)
        with pytest.raises(fc.PublishError):
            await consumer.receive(timeout=5)
        with pytest.raises(fc.AlreadySettled, match="may no longer read the queue"):
            await in_hand.ack()  # the broker requeued it: the ack would settle nothing
        # The nine dropped, never handed out, count as processed on the connection's positions, as the
        # one in hand does: a tester's connection buffer leaked them, and its other consumers stalled
        # for good.
        assert conn.statistics().consumer_consumed_position == 10 * SIZE
        await fake.wait_for(lambda: any(a.opaque == 0 and a.acked_position >= 9 * SIZE for a in fake.frames(BufferAck)))


async def test_settling_after_the_consumer_closed_raises_already_settled(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        consumer = conn.consumer("q", prefetch=10)
        await consumer.subscribe()
        sub_id = fake.frames(Subscribe)[0].subscription_id
        await fake.send(Deliver(sub_id, entries(1, 2)))
        in_hand = await consumer.receive(timeout=5)
        await consumer.aclose()
        # The broker's cancel requeues it for another consumer: a tester's ack returned as if it had
        # settled it, and only the broker's warning said otherwise.
        with pytest.raises(fc.AlreadySettled, match="'q' is closed, and the broker requeued it"):
            await in_hand.ack()
        with pytest.raises(fc.AlreadySettled):
            in_hand.settle_nowait(Outcome.REJECT)
        assert in_hand.settled is None
        await conn.declare_queue("other")  # (a round trip: whatever the writer had is sent)
        assert [(s.outcome, s.ranges) for s in fake.frames(Settle)] == [(Outcome.REQUEUE, [(2, 2)])]
    # The connection closed too: ConnectionClosed, as the blocking API said (the trio one said
    # AlreadySettled when the consumer had closed first, a tester)
    with pytest.raises(fc.ConnectionClosed):
        await in_hand.ack()


async def test_what_was_buffered_is_handed_out_after_the_connection_closes(start_broker) -> None:
    broker = await start_broker()
    with trio.fail_after(10):
        async with await fc.connect(broker.url, timeout=5) as conn:
            fake = await broker.connection()
            consumer = conn.consumer("q", prefetch=5)
            await consumer.subscribe()
            sub_id = fake.frames(Subscribe)[0].subscription_id
            await fake.send(Deliver(sub_id, entries(1, 5)))
            await wait_until(lambda: consumer.buffered == 5)
            await conn.aclose()
            # What was buffered is still handed out, then iteration ends (closed normally).
            assert [m.delivery_tag async for m in consumer] == [1, 2, 3, 4, 5]


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
            with trio.CancelScope() as scope:
                scope.cancel()
                await consumer.receive(timeout=5)  # a cancelled receive takes nothing
            assert scope.cancelled_caught
            assert (await consumer.receive(timeout=0)).delivery_tag == 1  # receive(0) polls what is buffered
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
def test_to_ranges(tags: list[int], ranges: list[tuple[int, int]]) -> None:
    assert to_ranges(tags) == ranges


async def test_settle_frames_are_split_at_max_ranges_per_frame(start_broker) -> None:
    broker = await start_broker()
    count = 2 * MAX_RANGES_PER_FRAME + 200  # every other tag settled: one range each
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        async with conn.consumer("q", prefetch=2 * count) as consumer:
            sub_id = fake.frames(Subscribe)[0].subscription_id
            for first in range(1, 2 * count + 1, MAX_ENTRIES_PER_FRAME):
                await fake.send(Deliver(sub_id, entries(first, min(MAX_ENTRIES_PER_FRAME, 2 * count + 1 - first))))
            received = [await consumer.receive(timeout=5) for _ in range(2 * count)]
            for msg in received:  # without yielding: the writer takes them all at once
                if msg.delivery_tag % 2:
                    msg.settle_nowait(Outcome.ACK)

            def acked() -> list[int]:
                return [t for s in fake.frames(Settle) for lo, hi in s.ranges for t in range(lo, hi + 1)]

            await fake.wait_for(lambda: len(acked()) == count)
            assert sorted(acked()) == list(range(1, 2 * count, 2))
            assert all(len(s.ranges) <= MAX_RANGES_PER_FRAME for s in fake.frames(Settle))
            assert max(len(s.ranges) for s in fake.frames(Settle)) == MAX_RANGES_PER_FRAME


def test_transfer_frames_stay_under_max_entries_per_frame() -> None:
    assert TRANSFER_BATCH <= MAX_ENTRIES_PER_FRAME
