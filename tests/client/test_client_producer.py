"""Producer pacing (byte credit and window), deadlines, batching, publish errors and flow state."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

import flowbroker.client as fc
from flowbroker.protocol.frames import Headers
from flowbroker.protocol import (
    BufferAck,
    BufferControl,
    BufferLimit,
    Complete,
    Error,
    ErrorCode,
    FlowResumed,
    FlowStopped,
    message_size,
)
from flowbroker.protocol.credit import MESSAGE_OVERHEAD
from flowbroker.protocol.limits import MAX_HEADERS, MAX_KEY_BYTES

BODY = b"x" * 68
SIZE = message_size(BODY)  # the buffer sizes below are multiples of it


def test_body_size_constant() -> None:
    assert SIZE == 68 + MESSAGE_OVERHEAD


async def test_sends_are_batched_into_few_transfer_frames(start_broker) -> None:
    broker = await start_broker(buffer_size=10_000_000)
    async with await fc.connect(broker.url, timeout=5) as conn:
        producer = conn.producer(routing_key="q", window=5000)
        for i in range(2000):
            await producer.send(b"m%d" % i, headers={"i": i} if i % 2 else None)
        await producer.flush(timeout=10)
        fake = await broker.connection()
        frames = fake.transfer_frames
        ids = [f.first_id + k for f in frames for k in range(len(f.entries))]
        assert ids == list(range(1, 2001))  # contiguous from 1
        assert all(len(f.entries) <= 256 for f in frames)
        assert len(frames) <= 2000 // 50  # batched, not one frame per message
        bodies = [e.body for f in frames for e in f.entries]
        assert bodies == [b"m%d" % i for i in range(2000)]
        assert fake.violations == []
        assert producer.stats.completed == 2000 and producer.outstanding == 0


async def test_send_blocks_at_byte_buffer_one_message_overflow_and_resumes_on_ack(start_broker, io_clock) -> None:
    broker = await start_broker(buffer_size=2 * SIZE + SIZE // 2, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q")
            fake = await broker.connection()
            # 0, SIZE, 2 SIZE are all under 2.5 SIZE: three messages start, the third overflows to 3 SIZE.
            for _ in range(3):
                await producer.send(BODY, block=False)
            assert conn.sender_window.outstanding == 3 * SIZE
            with pytest.raises(fc.FlowControlled) as info:
                await producer.send(BODY, block=False)
            assert type(info.value) is fc.FlowControlled and info.value.limit == "buffer"

            sent_after: list[float] = []

            async def blocked_sender() -> None:
                await producer.send(BODY, timeout=30)
                sent_after.append(trio.current_time())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocked_sender)
                await trio.sleep(5)
                assert sent_after == []
                # A stale and a duplicated ack change nothing.
                await fake.ack(0)
                await trio.sleep(1)
                assert sent_after == [] and conn.sender_window.acked_position == 0
                await fake.complete([1])  # completes transfer 1 and acks its SIZE bytes
                await fake.wait_for(lambda: len(fake.transfers) == 4)
            assert conn.sender_window.acked_position == SIZE and conn.sender_window.outstanding == 3 * SIZE
            await fake.ack(SIZE)  # duplicate
            await trio.sleep(1)
            assert conn.sender_window.acked_position == SIZE
            assert fake.violations == []
    assert closing.value.unconfirmed == 3 and closing.value.failed == 0


async def test_window_limits_outstanding_transfers(start_broker, io_clock) -> None:
    broker = await start_broker(buffer_size=0, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q", window=10)
            for _ in range(10):
                await producer.send(BODY)
            with pytest.raises(fc.FlowControlled) as info:
                await producer.send(BODY, block=False)
            assert info.value.limit == "window"
            fake = await broker.connection()
            await fake.wait_for(lambda: len(fake.transfers) == 10)
            await fake.complete([1, 2, 3])
            with trio.fail_after(5):
                for _ in range(3):
                    await producer.send(BODY)
            with pytest.raises(fc.FlowControlTimeout):
                await producer.send(BODY, timeout=1)
    assert closing.value.unconfirmed == 10 and closing.value.failed == 0


async def test_flow_control_timeout_names_the_stopped_queue(start_broker, io_clock) -> None:
    broker = await start_broker(buffer_size=10 * SIZE)  # the window (4) is the limit here
    broker.held_queues.add("slow")
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            fake = await broker.connection()
            producer = conn.producer(routing_key="slow", window=4)
            async with producer.flow_events() as events:
                for _ in range(4):
                    await producer.send(BODY)
                await fake.wait_for(lambda: len(fake.held) == 4)
                await fake.send(FlowStopped("slow", "flow_stop_count", 4, 4, "queue over its stop threshold"))
                event = await events.get()
                assert event is not None and event.kind == "stopped" and event.destination == "slow"
                assert event.stop is not None and event.stop.threshold == "flow_stop_count"
                state = producer.flow_state
                assert state.is_stopped and state.destinations == ("slow",)
                assert state.stopped["slow"].limit == 4
                start = trio.current_time()
                with pytest.raises(fc.FlowControlTimeout) as info:
                    await producer.send(BODY, timeout=7)
                assert trio.current_time() - start == pytest.approx(7, abs=0.1)
                assert info.value.destinations == ("slow",) and info.value.destination == "slow"
                assert info.value.limit == "window" and info.value.timeout == 7
                assert isinstance(info.value, TimeoutError) and "slow" in str(info.value)
                # flush times out the same way while the transfers are held
                with pytest.raises(fc.FlowControlTimeout) as info:
                    await producer.flush(timeout=2)
                assert info.value.destinations == ("slow",)
                # Release: completion, then resume.
                await fake.release_held()
                await fake.send(FlowResumed("slow"), FlowResumed("slow"))  # the duplicate changes nothing
                event = await events.get()
                assert event is not None and event.kind == "resumed" and event.stopped == frozenset()
                await producer.flush(timeout=5)
                await producer.send(BODY, block=False)
            state = producer.flow_state
            assert not state.is_stopped and state.stop_count == 1 and state.resume_count == 1
            assert state.stopped_seconds >= 9
            assert producer.stats.blocked_count >= 1 and producer.stats.blocked_seconds >= 7
    assert closing.value.unconfirmed == 1 and closing.value.failed == 0


async def test_send_default_deadline_is_the_producer_send_timeout(start_broker, io_clock) -> None:
    broker = await start_broker(buffer_size=SIZE, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q", send_timeout=12)
            await producer.send(BODY)
            start = trio.current_time()
            with pytest.raises(fc.FlowControlTimeout):
                await producer.send(BODY)
            assert trio.current_time() - start == pytest.approx(12, abs=0.1)
    assert closing.value.unconfirmed == 1 and closing.value.failed == 0


async def test_flush_raises_queue_full_naming_the_queue(start_broker) -> None:
    broker = await start_broker(buffer_size=1 << 20)
    broker.full_queues.add("full")
    async with await fc.connect(broker.url, timeout=5) as conn:
        producer = conn.producer(routing_key="ok")
        await producer.send(b"a")
        tid = await producer.send(b"b", routing_key="full")
        await producer.send(b"c")
        with pytest.raises(fc.QueueFull) as info:
            await producer.flush(timeout=5)
        assert info.value.destination == "full" and info.value.transfer_id == tid
        assert info.value.code == ErrorCode.QUEUE_FULL and isinstance(info.value, fc.PublishError)
        assert producer.outstanding == 0 and producer.stats.failed == 1
        await producer.flush(timeout=5)  # reported once


async def test_a_whole_message_above_max_message_size_is_refused_locally(start_broker) -> None:
    broker = await start_broker(max_message_size=1000)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        producer = conn.producer(routing_key="q")
        # The body, the routing key ("q": 1 byte) and the exchange ("") make 1001 bytes.
        with pytest.raises(fc.MessageTooLarge, match="max_message_size 1000") as info:
            await producer.send(b"x" * 1000)
        assert (info.value.destination, info.value.limit, info.value.transfer_id) == ("q", "max_message_size", None)
        # Header keys and values count: strings in UTF-8, binary as is, 9 bytes for any other value.
        headers: Headers = {"k": "é", "b": b"12", "n": 7}  # 1 + 2, 1 + 2, 1 + 9
        with pytest.raises(fc.MessageTooLarge):
            await producer.send(b"x" * (999 - 16 + 1), headers)
        # And the exchange's name.
        named = conn.producer("ex", routing_key="k")
        with pytest.raises(fc.MessageTooLarge):
            await named.send(b"x" * (1000 - 3 + 1))
        assert producer.stats.sent == named.stats.sent == 0
        # At the limit, each is sent.
        await producer.send(b"x" * 999)
        await producer.send(b"x" * (999 - 16), headers)
        await named.send(b"x" * (1000 - 3))
        await producer.flush(timeout=5)
        await named.flush(timeout=5)
        assert len(fake.transfers) == 3


async def test_a_routing_key_over_max_key_bytes_is_refused_locally(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        producer = conn.producer()
        for key in ("k" * (MAX_KEY_BYTES + 1), "é" * (MAX_KEY_BYTES // 2) + "k"):  # counted in UTF-8 bytes
            with pytest.raises(fc.KeyTooLong, match=f"{MAX_KEY_BYTES + 1} bytes.*MAX_KEY_BYTES") as info:
                await producer.send(b"b", routing_key=key)
            assert (info.value.code, info.value.limit) == (ErrorCode.KEY_TOO_LONG, "MAX_KEY_BYTES")
        await producer.send(b"b", routing_key="k" * MAX_KEY_BYTES)
        await producer.send(b"b", routing_key="é" * (MAX_KEY_BYTES // 2))
        await producer.flush(timeout=5)
        assert len(fake.transfers) == 2


async def test_more_than_max_headers_is_refused_locally(start_broker) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        producer = conn.producer(routing_key="q")
        headers: Headers = {f"h{i}": i for i in range(MAX_HEADERS)}
        with pytest.raises(fc.TooManyHeaders, match=f"{MAX_HEADERS + 1} headers.*MAX_HEADERS") as info:
            await producer.send(b"b", {**headers, "more": 1})
        assert isinstance(info.value, fc.PublishError) and info.value.limit == "MAX_HEADERS"
        await producer.send(b"b", headers)
        await producer.flush(timeout=5)
        assert [len(entry.headers or {}) for entry, _ in fake.transfers.values()] == [MAX_HEADERS]
        assert not conn.is_closed


async def test_headers_of_the_wrong_types_are_refused_before_anything_is_sent(start_broker) -> None:
    """Connection.send refuses a frame the broker would refuse (protocol/frames.py check_frame), so a header
    value the protocol cannot carry must be refused by `send`, not end the connection in the writer."""
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        producer = conn.producer(routing_key="q")
        for headers in ({"h": [1, 2]}, {1: "v"}, {"h": {"nested": 1}}):
            with pytest.raises(TypeError, match="headers must be a dict of str keys"):
                await producer.send(b"b", headers)  # type: ignore[arg-type]
        await producer.send(b"b", {"s": "v", "b": b"v", "i": 1, "f": 1.5, "t": True, "n": None})
        await producer.flush(timeout=5)
        assert len(fake.transfers) == 1 and producer.stats.sent == 1
        assert not conn.is_closed


async def test_fields_a_transfer_entry_cannot_hold_are_refused_before_anything_is_sent(start_broker) -> None:
    """The writer sends TRANSFER frames without checking their entries again (`fields_checked`), so `send`
    must refuse what the broker would: a routing key or exchange that is not str, a body that is not
    exactly bytes. Refused at once; the connection stays open and the next message goes through."""

    class Body(bytes):
        pass

    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        producer = conn.producer(routing_key="q")
        for body, key in ((b"b", b"q"), (b"b", 7), (Body(b"b"), "q"), (bytearray(b"b"), "q")):
            with pytest.raises(TypeError, match="must be"):
                await producer.send(body, routing_key=key)  # type: ignore[arg-type]
        odd = conn.producer(7, "q")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="routing_key and exchange must be str"):
            await odd.send(b"b")
        await producer.send(b"ok")
        await producer.flush(timeout=5)
        assert [entry.body for entry, _ in fake.transfers.values()] == [b"ok"] and producer.stats.sent == 1
        assert not conn.is_closed


async def test_the_brokers_key_too_long_is_typed(start_broker) -> None:
    broker = await start_broker(auto_complete=False)
    async with await fc.connect(broker.url, timeout=5) as conn:
        fake = await broker.connection()
        producer = conn.producer(routing_key="q")
        tid = await producer.send(b"b")
        await fake.wait_for(lambda: tid in fake.transfers)
        await fake.send(Error(ErrorCode.KEY_TOO_LONG, "routing key too long", None, tid))
        await fake.complete()
        with pytest.raises(fc.KeyTooLong):
            await producer.flush(timeout=5)


async def test_buffer_control_resizes_live_credit(start_broker, io_clock) -> None:
    broker = await start_broker(buffer_size=SIZE, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q")
            await producer.send(BODY)
            assert not producer.has_credit()
            fake = await broker.connection()
            fake.sender_window.resize(10 * SIZE)
            await fake.send(BufferControl(0, 10 * SIZE))
            with trio.fail_after(5):
                while conn.sender_window.window != 10 * SIZE:
                    await trio.sleep(0.01)
            await producer.send(BODY, block=False)
            fake.sender_window.resize(0)
            await fake.send(BufferControl(0, 0))  # 0: no pacing by bytes
            await fake.wait_for(lambda: len(fake.transfers) == 2)
            for _ in range(20):
                await producer.send(BODY, timeout=5)
            await fake.wait_for(lambda: len(fake.transfers) == 22)
            assert fake.violations == []
    assert closing.value.unconfirmed == 22 and closing.value.failed == 0


async def test_buffer_control_is_answered_with_buffer_limit(start_broker) -> None:
    """The SDK answers each BUFFER_CONTROL (opaque 0, paced) with BUFFER_LIMIT naming it by count: the
    limit covers every byte it admitted, and after a shrink it starts nothing at or beyond it."""
    broker = await start_broker(buffer_size=10 * SIZE, auto_complete=False)
    with pytest.raises(fc.PublishFailures):  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q")
            for _ in range(5):
                await producer.send(BODY, timeout=5)
            fake = await broker.connection()
            await fake.send(BufferControl(0, 2 * SIZE))  # nothing acknowledged: 5 messages in flight
            await fake.wait_for(lambda: len(fake.frames(BufferLimit)) == 1)
            assert fake.frames(BufferLimit) == [BufferLimit(1, 2 * SIZE, 5 * SIZE)]
            assert not producer.has_credit()
            await fake.ack(3 * SIZE)  # 2 in flight: under the new size no more; the limit stays 5 * SIZE
            with trio.move_on_after(0.2):
                await producer.send(BODY)
            assert len(fake.transfers) == 5
            await fake.send(BufferControl(7, 100), BufferControl(0, 0), BufferControl(0, 10 * SIZE))
            await fake.wait_for(lambda: len(fake.frames(BufferLimit)) == 2)  # not for opaque 7, nor size 0
            assert fake.frames(BufferLimit)[1] == BufferLimit(3, 10 * SIZE, 3 * SIZE + 10 * SIZE)
            assert fake.violations == []


async def test_connection_close_fails_blocked_sender(start_broker) -> None:
    broker = await start_broker(buffer_size=SIZE, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q")
            await producer.send(BODY)
            fake = await broker.connection()
            async with trio.open_nursery() as nursery:

                async def close_soon() -> None:
                    await fake.wait_for(lambda: len(fake.transfers) == 1)
                    await fake.close(ErrorCode.SHUTDOWN, "stopping")

                nursery.start_soon(close_soon)
                with pytest.raises(fc.ConnectionClosed) as info:
                    await producer.send(BODY, timeout=math.inf)
            assert info.value.code == ErrorCode.SHUTDOWN
    assert closing.value.unconfirmed == 1 and closing.value.failed == 0


async def test_two_producers_cut_off_by_a_close_say_so_not_close_timeout(start_broker) -> None:
    broker = await start_broker(auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:
        async with await fc.connect(broker.url, timeout=5, close_timeout=0.2) as conn:
            for queue in ("a", "b"):
                await conn.producer(routing_key=queue).send(BODY)
            fake = await broker.connection()
            await fake.wait_for(lambda: len(fake.transfers) == 2)
            await fake.close(ErrorCode.SHUTDOWN, "stopping")
            with trio.fail_after(5):
                while not conn.is_closed:
                    await trio.sleep(0.01)
    assert closing.value.unconfirmed == 2
    assert "before the connection closed" in str(closing.value) and "close_timeout" not in str(closing.value)


async def test_broker_acking_unsent_bytes_is_a_protocol_violation(start_broker) -> None:
    broker = await start_broker(buffer_size=10 * SIZE, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q", window=1)
            await producer.send(BODY)
            fake = await broker.connection()
            await fake.wait_for(lambda: len(fake.transfers) == 1)
            await fake.send(BufferAck(0, 5 * SIZE, 5 * SIZE))  # only SIZE bytes were sent
            with pytest.raises(fc.ProtocolViolation):
                await producer.send(BODY, timeout=5)
            await fake.wait_for(lambda: fake.frames(Error) != [])
            assert fake.frames(Error)[0].code == ErrorCode.CREDIT_VIOLATION  # as the broker says it of a consumer
    assert closing.value.unconfirmed == 1 and closing.value.failed == 0


async def test_complete_naming_unsent_transfers_is_a_protocol_violation(start_broker) -> None:
    """A COMPLETE for ids never sent is refused at once (and cannot make the client loop to 2**63)."""
    broker = await start_broker(buffer_size=10 * SIZE, auto_complete=False)
    with pytest.raises(fc.PublishFailures) as closing:  # never completed: said, not lost
        async with await fc.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q", window=10)
            await producer.send(BODY)
            fake = await broker.connection()
            await fake.wait_for(lambda: len(fake.transfers) == 1)
            await fake.send(Complete(2**63, []))
            with pytest.raises(fc.ProtocolViolation, match="only 1 were sent"):
                with trio.fail_after(5):
                    await producer.flush()
            await fake.wait_for(lambda: fake.frames(Error) != [])
            assert fake.frames(Error)[0].code == ErrorCode.UNEXPECTED_FRAME
    assert closing.value.unconfirmed == 1 and closing.value.failed == 0


async def test_throughput_smoke(start_broker) -> None:
    """Not a benchmark: checks that batching keeps a 20k-message send loop well under a few seconds."""
    broker = await start_broker(buffer_size=4 << 20)
    async with await fc.connect(broker.url, timeout=5) as conn:
        producer = conn.producer(routing_key="q")
        start = trio.current_time()
        body = b"x" * 1024
        for _ in range(20_000):
            await producer.send(body)
        await producer.flush(timeout=30)
        elapsed = trio.current_time() - start
        fake = await broker.connection()
        assert len(fake.transfers) == 20_000 and fake.violations == []
    print(f"20k x 1 KiB through the fake broker: {20_000 / elapsed:,.0f} msgs/s")


def test_a_refusals_text_names_its_destination_without_calling_an_exchange_a_queue() -> None:
    from flowbroker.client.errors import NotFound, publish_error
    from flowbroker.protocol import ErrorCode

    error = publish_error(ErrorCode.NOT_FOUND, "no exchange named 'nope'", "nope", 7)
    assert isinstance(error, NotFound) and error.destination == "nope" and error.transfer_id == 7
    assert str(error) == "NOT_FOUND (destination 'nope'): no exchange named 'nope'"


async def test_a_producer_block_that_reported_its_unconfirmed_transfers_does_not_report_them_again(
        start_broker, io_clock) -> None:
    """Leaving a producer's block waits close_timeout and raises PublishFailures for what was not completed;
    leaving the connection's block used to wait close_timeout again and raise the same transfers again."""
    broker = await start_broker(buffer_size=0, auto_complete=False)
    async with await fc.connect(broker.url, timeout=5, close_timeout=2) as conn:
        with pytest.raises(fc.PublishFailures) as first:
            async with conn.producer(routing_key="q") as producer:
                for _ in range(5):
                    await producer.send(BODY)
        assert first.value.unconfirmed == 5
        began = trio.current_time()
    assert trio.current_time() - began < 2  # not a second close_timeout for the same transfers
    assert producer.statistics().outstanding == 5  # (still not completed: said once)


def test_an_error_names_at_most_ten_stopped_destinations_and_counts_the_rest() -> None:
    """With 200 flow-stopped queues a FlowControlTimeout's text was about 9,000 characters (a tester)."""
    from flowbroker.client.errors import FlowControlTimeout, stopped_suffix

    names = [f"queue-{i}" for i in range(200)]
    text = stopped_suffix(names)
    assert text.startswith("; flow-stopped: queue-0, queue-1,") and text.endswith("queue-9 and 190 more")
    error = FlowControlTimeout(f"send timed out after 1 s (x{text})", names, "buffer", 1.0)
    assert error.destinations == tuple(names) and len(str(error)) < 300
    assert stopped_suffix(["a", "b"]) == "; flow-stopped: a, b"


async def test_flush_on_a_connection_that_has_closed_raises_its_close(start_broker) -> None:
    """`flush()` with nothing outstanding returned normally on a connection that had given up reconnecting
    (a tester): every later call raises the close, as client.md says."""
    broker = await start_broker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        producer = conn.producer(routing_key="q")
        await producer.flush(timeout=5)
    with pytest.raises(fc.ConnectionClosed):
        await producer.flush(timeout=5)
