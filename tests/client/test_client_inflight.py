"""The connection as a shell over the producer half (protocol/producer.py, whose properties are tested
without I/O in tests/protocol/test_protocol_producer.py): COMPLETEs counted to the right producers over
real sockets, ERRORs routed to the producer of the transfer, a COMPLETE that cannot be right closing the
connection as a protocol violation; and the writer's frames of queued messages."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import flowbroker.client as fc
from flowbroker.client.connection import Connection, TRANSFER_BATCH
from flowbroker.client.producer import Producer
from flowbroker.protocol import PROTOCOL_VERSION, Complete, Error, ErrorCode, Hello, Role, Welcome, message_size
from flowbroker.protocol import Connection as ProtocolConnection

BODY = b"x" * 68


async def test_out_of_order_completions_across_two_producers(start_broker) -> None:
    """A held queue keeps one producer's transfers while the other's complete above them (COMPLETE
    ranges); each producer's counts stay exact, and releasing the held ones moves the cumulative point
    over both producers' runs."""
    broker = await start_broker(buffer_size=1 << 20)
    broker.held_queues.add("slow")
    async with await fc.connect(broker.url, timeout=5) as conn:
        slow = conn.producer(routing_key="slow")
        fast = conn.producer(routing_key="fast")
        for _ in range(3):
            await slow.send(BODY)  # 1-3
        for _ in range(4):
            await fast.send(BODY)  # 4-7
        await slow.send(BODY)  # 8
        await fast.send(BODY)  # 9
        await fast.flush(timeout=5)  # completed by ranges above the held 1-3 and 8
        assert (slow.outstanding, slow.stats.completed) == (4, 0)
        assert (fast.outstanding, fast.stats.completed, fast.stats.sent) == (0, 5, 5)
        fake = await broker.connection()
        assert fake.held == [1, 2, 3, 8]
        await fake.complete([2])  # COMPLETE(0, [(2, 2), (4, 7), (9, 9)]): splits slow's first run
        with trio.fail_after(5):
            while slow.outstanding != 3:
                await trio.sleep(0.01)
        assert conn._ledger.cumulative == 0
        await fake.complete([1])  # COMPLETE(2, [(4, 7), (9, 9)])
        with trio.fail_after(5):
            while slow.outstanding != 2:
                await trio.sleep(0.01)
        assert conn._ledger.cumulative == 2 and slow.stats.completed == 2
        assert conn._producer_of(3) is slow and conn._producer_of(4) is None and conn._producer_of(8) is slow
        await fake.complete([3, 8])  # the rest of the held ones: COMPLETE(9, [])
        await slow.flush(timeout=5)
        assert (slow.outstanding, slow.stats.completed, slow.stats.sent) == (0, 4, 4)
        assert conn._ledger.cumulative == 9 and conn._ledger.runs() == []
        await fast.send(BODY)
        await fast.flush(timeout=5)
        assert fast.stats.completed == 6 and conn._ledger.runs() == []


async def test_error_for_a_transfer_in_the_middle_of_a_run(start_broker) -> None:
    broker = await start_broker(buffer_size=1 << 20, auto_complete=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        first = conn.producer(routing_key="q")
        second = conn.producer(routing_key="q")
        ids = [await first.send(BODY) for _ in range(10)]  # one run, 1-10
        other = await second.send(BODY)  # 11
        assert ids == list(range(1, 11)) and other == 11
        assert conn._ledger.runs() == [(1, 10, first), (11, 11, second)]
        fake = await broker.connection()
        await fake.wait_for(lambda: len(fake.transfers) == 11)
        await fake.complete([7])  # splits the run: 1-6, (7), 8-10
        await fake.send(Error(ErrorCode.QUEUE_FULL, "queue q is full", None, 5, "q"))
        await fake.send(Error(ErrorCode.QUEUE_FULL, "queue q is full", None, 9, "q"))
        await fake.send(Error(ErrorCode.QUEUE_FULL, "late", None, 7, "q"))  # completed: not a producer's
        await fake.complete()
        with pytest.raises(fc.QueueFull) as info:
            await first.flush(timeout=5)
        assert info.value.transfer_id == 5 and info.value.destination == "q"
        assert first.stats.failed == 2 and first.stats.completed == 10 and first.outstanding == 0
        await second.flush(timeout=5)
        assert second.stats.failed == 0 and second.stats.completed == 1
        assert [e.ref_id for e in conn.connection_errors] == [7]


async def test_complete_range_naming_unsent_transfers_is_a_protocol_violation(start_broker) -> None:
    broker = await start_broker(buffer_size=1 << 20, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q")
            for _ in range(5):
                await producer.send(BODY)
            fake = await broker.connection()
            await fake.wait_for(lambda: len(fake.transfers) == 5)
            await fake.send(Complete(1, [(3, 3)]))
            with trio.fail_after(5):
                while producer.outstanding != 3:
                    await trio.sleep(0.01)
            await fake.send(Complete(1, [(4, 6)]))  # 6 was never sent
            with pytest.raises(fc.ProtocolViolation, match="only 5 were sent"):
                with trio.fail_after(5):
                    await producer.flush()
            assert producer.outstanding == 3  # the refused frame completed nothing
            await fake.wait_for(lambda: fake.frames(Error) != [])
            assert fake.frames(Error)[0].code == ErrorCode.UNEXPECTED_FRAME
    assert closing.value.unconfirmed == 3 and closing.value.failed == 0


async def test_writer_splits_frames_by_count_and_bytes(start_broker) -> None:
    """TRANSFER frames hold at most TRANSFER_BATCH messages and stay within the frame size (the fake
    broker's is 4 MiB), their ids contiguous and in order of sending."""
    broker = await start_broker(buffer_size=0, auto_complete=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        producer = conn.producer(routing_key="q", window=2000)
        big = b"b" * (100 * 1024)
        bodies = [big if i % 7 == 0 else b"%d" % i for i in range(1000)] + [big] * 100
        for body in bodies:
            await producer.send(body)
        fake = await broker.connection()
        await fake.wait_for(lambda: len(fake.transfers) == len(bodies))
        frames = fake.transfer_frames
        assert [f.first_id for f in frames] == [
            1 + sum(len(g.entries) for g in frames[:i]) for i in range(len(frames))
        ]
        assert [e.body for f in frames for e in f.entries] == bodies
        assert max(len(f.entries) for f in frames) == TRANSFER_BATCH
        limit = conn._proto.max_frame_size
        assert all(sum(message_size(e.body) for e in f.entries) < limit for f in frames)
        assert len([f for f in frames if len(f.entries) < 45]) >= 3  # the 100 large ones: about 40 a frame
        assert fake.violations == []
        await fake.complete()
        await producer.flush(timeout=5)


# -- the shell over the ledger, without sockets --------------------------------------------------


def _connection() -> Connection:
    """A Connection on no stream (never entered): enough for the transfer bookkeeping."""
    client, broker = ProtocolConnection(Role.CLIENT), ProtocolConnection(Role.BROKER)
    broker.receive_data(client.send(Hello(PROTOCOL_VERSION, "model", True, [], None)))
    broker.next_frame()
    welcome = Welcome(PROTOCOL_VERSION, 1, "model", 1 << 20, 1 << 20, 0, 0, "model")
    client.receive_data(broker.send(welcome))
    client.next_frame()
    return Connection(trio.testing.MemoryReceiveStream(), client, welcome)  # type: ignore[arg-type]


def test_completions_reach_each_producer_once() -> None:
    async def main() -> None:
        conn = _connection()
        a, b = Producer(conn, "", "a"), Producer(conn, "", "b")
        for producer in (a, a, b, a, b, b):
            conn._enqueue_transfer(producer, ("", "q", b"m", None, None, None), 1)
            producer._outstanding += 1
        conn._on_complete(Complete(1, [(3, 4), (6, 6)]))
        assert (a.outstanding, a.stats.completed, b.outstanding, b.stats.completed) == (1, 2, 1, 2)
        assert conn._producer_of(2) is a and conn._producer_of(5) is b and conn._producer_of(4) is None
        conn._on_complete(Complete(1, [(3, 4), (6, 6)]))  # repeated: nothing counted twice
        conn._on_complete(Complete(6, []))
        assert (a.outstanding, a.stats.completed, b.outstanding, b.stats.completed) == (0, 3, 0, 3)
        assert not conn.is_closed

    trio.run(main)


@pytest.mark.parametrize(
    "frame",
    [Complete(4, []), Complete(1, [(2, 4)]), Complete(0, [(1, 1), (4, 2**63)]), Complete(2, [(1, 1)])],
)
def test_a_complete_that_cannot_be_right_closes_the_connection_and_changes_nothing(frame: Complete) -> None:
    async def main() -> None:
        conn = _connection()
        producer = Producer(conn, "", "q")
        for _ in range(3):
            conn._enqueue_transfer(producer, ("", "q", b"m", None, None, None), 1)
            producer._outstanding += 1
        conn._on_complete(frame)
        assert conn.is_closed and isinstance(conn.close_error, fc.ProtocolViolation)
        assert producer.outstanding == 3 and conn._ledger.cumulative == 0 and conn._ledger.runs() == [(1, 3, producer)]

    trio.run(main)
