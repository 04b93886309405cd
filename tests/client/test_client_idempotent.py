"""Idempotent producers in the SDK against the scripted broker: what goes on the wire (producer id and
sequences), what a reconnect sends again (exactly the messages whose completion was not seen, in
sequence order, out-of-order completions included, before anything new), and the arguments refused."""

from __future__ import annotations

import gc

import pytest
import trio

import flowbroker.client as fc
from flowbroker.protocol import Complete, Error, ErrorCode

from tests.client.fakebroker import FakeBroker, FakeConn


def sequences(conn: FakeConn) -> list[tuple[str | None, int | None, bytes]]:
    return [(entry.producer_id, entry.sequence, entry.body) for entry, _ in conn.transfers.values()]


async def test_messages_carry_the_producer_id_and_sequences_from_0(start_broker) -> None:
    broker: FakeBroker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        plain = conn.producer(routing_key="q")
        producer = conn.producer(routing_key="q", producer_id="w", idempotent=True)
        await producer.send(b"a")
        await plain.send(b"plain")
        await producer.send(b"b")
        await producer.flush(timeout=5)
        await plain.flush(timeout=5)
        assert producer.producer_id == "w" and producer.idempotent and plain.producer_id is None
    fake = await broker.connection()
    assert sequences(fake) == [("w", 0, b"a"), (None, None, b"plain"), ("w", 1, b"b")]


async def test_a_reconnect_resends_what_was_not_completed_in_sequence_order_before_anything_new(start_broker) -> None:
    broker: FakeBroker = await start_broker()
    broker.held_queues.add("held")
    async with await fc.connect(broker.url, timeout=5, reconnect_timeout=5) as conn:
        producer = conn.producer(routing_key="held", producer_id="w", idempotent=True)
        for i in range(6):
            await producer.send(b"%d" % i)
        first = await broker.connection(0)
        await first.wait_for(lambda: len(first.transfers) == 6)
        # the broker completes 1 and 4 out of order (the others stay held): a COMPLETE with ranges only
        await first.send(Complete(0, [(2, 2), (5, 5)]))
        with trio.fail_after(5):
            while producer.outstanding != 4:
                await trio.sleep(0.01)
        broker.held_queues.clear()
        await first.stream.aclose()  # no CLOSE: the connection is lost
        second = await broker.connection(1)
        await producer.send(b"6", timeout=5)  # waits for the resend, then goes after it
        await producer.flush(timeout=5)
        assert conn.reconnects == 1 and conn.connection_id == 2
        stats = producer.statistics()
        assert (stats.sent, stats.completed, stats.in_flight) == (7, 7, 0)
    # every kept message again, in order: 1 and 4 too (completed out of order, so still kept: the broker
    # completes them as duplicates), then the new one
    assert sequences(second) == [("w", s, b"%d" % s) for s in range(7)]


async def test_a_second_live_producer_with_the_same_id_is_refused(start_broker) -> None:
    broker: FakeBroker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        first = conn.producer(routing_key="q", producer_id="w", idempotent=True)
        with pytest.raises(ValueError, match="in use"):
            conn.producer(routing_key="q", producer_id="w", idempotent=True)
        del first
        gc.collect()  # the first one is gone: its id is free again
        conn.producer(routing_key="q", producer_id="w", idempotent=True)


@pytest.mark.parametrize(
    "arguments",
    [
        {"producer_id": "w"},  # an id without idempotent=True
        {"producer_id": "", "idempotent": True},
        {"producer_id": "x" * 256, "idempotent": True},
        {"idempotent": True, "transport": "udp"},
    ],
)
async def test_arguments_that_cannot_make_an_idempotent_producer(start_broker, arguments: dict[str, object]) -> None:
    broker: FakeBroker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        with pytest.raises(ValueError):
            conn.producer(routing_key="q", **arguments)  # type: ignore[arg-type]


async def test_a_sequence_gap_is_raised_by_flush_typed(start_broker) -> None:
    broker: FakeBroker = await start_broker()
    broker.auto_complete = False
    async with await fc.connect(broker.url, timeout=5) as conn:
        producer = conn.producer(routing_key="q", producer_id="w", idempotent=True)
        await producer.send(b"a")
        fake = await broker.connection()
        await fake.wait_for(lambda: len(fake.transfers) == 1)
        await fake.send(Error(ErrorCode.SEQUENCE_GAP, "producer id 'w' sent sequence 0, expected sequence 5", None, 1))
        await fake.complete()
        with pytest.raises(fc.SequenceGap) as info:
            await producer.flush(timeout=5)
        assert info.value.code is ErrorCode.SEQUENCE_GAP and "expected sequence 5" in str(info.value)



async def test_a_request_in_flight_when_the_connection_is_lost_raises_and_the_producer_goes_on(start_broker) -> None:
    broker: FakeBroker = await start_broker()
    broker.answer_requests = False
    async with await fc.connect(broker.url, timeout=5, reconnect_timeout=5) as conn:
        producer = conn.producer(routing_key="q", producer_id="w", idempotent=True)
        first = await broker.connection(0)

        async def lose_it() -> None:
            await first.wait_for(lambda: any(type(f).__name__ == "DeclareQueue" for f in first.received))
            await first.stream.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lose_it)
            with pytest.raises(fc.ConnectionClosed, match="before the request was answered"):
                await conn.declare_queue("q", timeout=5)
        await producer.send(b"after", timeout=5)
        await producer.flush(timeout=5)
        assert conn.reconnects == 1 and not conn.is_closed and not conn.reconnecting
    second = await broker.connection(1)
    assert sequences(second) == [("w", 0, b"after")]
