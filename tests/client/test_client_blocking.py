"""The blocking API, driven from a worker thread while the fake broker runs in the test's trio loop."""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.client import blocking
from flowbroker.protocol import Close, Deliver, DeliveryEntry, FlowStopped, Outcome, Settle, Subscribe


async def test_blocking_round_trip(start_broker) -> None:
    broker = await start_broker(buffer_size=1 << 20)
    broker.full_queues.add("full")

    def producer_side() -> list[int]:
        with blocking.connect(broker.url, client_name="sync", timeout=5) as conn:
            assert conn.declare_queue("q", max_count=10)["name"] == "q"
            producer = conn.producer(routing_key="q")
            ids = [producer.send(b"one", timeout=5), producer.send(b"two", {"k": "v"}, timeout=5)]
            assert producer.send_many([b"a", b"b", b"c"], timeout=5) == 3
            producer.flush(timeout=5)
            producer.send(b"x", routing_key="full", timeout=5)
            with pytest.raises(fc.QueueFull) as info:
                producer.flush(timeout=5)
            assert info.value.destination == "full"
            assert producer.stats.completed == 6
            assert producer.statistics() == producer.stats and producer.statistics().failed == 1
            whole = conn.statistics()
            assert (whole.transfers_sent, whole.transfers_completed) == (6, 6) and whole.consumers == 0
            return ids

    ids = await trio.to_thread.run_sync(producer_side)
    assert ids == [1, 2]
    fake = await broker.connection()
    await fake.wait_for(lambda: fake.frames(Close) != [])
    assert [e.body for e, _ in fake.transfers.values()] == [b"one", b"two", b"a", b"b", b"c", b"x"]


async def test_blocking_consumer_and_flow_state(start_broker) -> None:
    broker = await start_broker(buffer_size=100, auto_complete=False)
    conn = await trio.to_thread.run_sync(lambda: blocking.connect(broker.url, timeout=5, close_timeout=0.5))
    try:
        fake = await broker.connection()
        consumer = await trio.to_thread.run_sync(lambda: conn.consumer("q", prefetch=10).__enter__())
        sub_id = fake.frames(Subscribe)[0].subscription_id
        await fake.send(Deliver(sub_id, [DeliveryEntry(t, "", "q", b"m%d" % t, None, False) for t in (1, 2, 3)]))

        def consume() -> list[bytes]:
            bodies = []
            for _ in range(3):
                msg = consumer.receive(timeout=5)
                bodies.append(msg.body)
                msg.ack()
            with pytest.raises(fc.ReceiveTimeout):
                consumer.receive(timeout=0.2)
            stats = consumer.statistics()
            assert (stats.received, stats.unsettled, stats.prefetch_in_force) == (3, 0, 10) and consumer.stats == stats
            return bodies

        assert await trio.to_thread.run_sync(consume) == [b"m1", b"m2", b"m3"]

        def acked() -> set[int]:
            return {t for s in fake.frames(Settle) if s.outcome == Outcome.ACK for a, b in s.ranges for t in range(a, b + 1)}

        await fake.wait_for(lambda: acked() == {1, 2, 3})

        # Flow control: the buffer is full after one message; a blocking send times out naming the queue.
        await fake.send(FlowStopped("q", "flow_stop_size", 100, 120, "over the stop size"))

        def produce() -> fc.FlowControlTimeout:
            producer = conn.producer(routing_key="q")
            producer.send(b"x" * 100, timeout=5)
            with pytest.raises(fc.FlowControlled):
                producer.send(b"y", block=False)
            with pytest.raises(fc.FlowControlTimeout) as info:
                producer.send(b"y", timeout=0.3)
            assert producer.flow_state.destinations == ("q",)
            return info.value

        error = await trio.to_thread.run_sync(produce)
        assert error.destinations == ("q",)
        await trio.to_thread.run_sync(consumer.close)
        # The message the fake broker never completed is not lost silently: closing says so.
        with pytest.raises(fc.PublishFailures) as closing:
            await trio.to_thread.run_sync(conn.close)
        assert (closing.value.unconfirmed, closing.value.failed, closing.value.destinations) == (1, 0, ("q",))
    finally:
        await trio.to_thread.run_sync(conn.close)
    assert conn.is_closed


async def test_blocking_connect_failure_and_use_after_close(start_broker) -> None:
    broker = await start_broker(welcome=False)
    with pytest.raises(fc.HandshakeError):
        await trio.to_thread.run_sync(lambda: blocking.connect(broker.url, timeout=0.5))
    broker.welcome = True
    conn = await trio.to_thread.run_sync(lambda: blocking.connect(broker.url, timeout=5))
    await trio.to_thread.run_sync(conn.close)
    with pytest.raises(fc.ConnectionClosed):
        await trio.to_thread.run_sync(lambda: conn.declare_queue("q"))


async def test_blocking_negative_timeouts_are_0_and_nan_is_a_value_error_naming_the_wait(start_broker) -> None:
    broker = await start_broker()
    with pytest.raises(fc.HandshakeError):
        await fc.connect(broker.url, timeout=-1)
    with pytest.raises(ValueError, match="connect timeout"):
        await fc.connect(broker.url, timeout=math.nan)

    def work() -> None:
        # A tester's negative timeouts raised trio's ValueError ("`seconds` must be non-negative").
        with pytest.raises(fc.HandshakeError):
            blocking.connect(broker.url, timeout=-1)
        # NaN: blocking.connect raised HandshakeError ("did not start within nan s"), send_many waited 0 s,
        # close started closing and then raised from Thread.join, flow_events.get named no wait, a
        # consumer's close and a flush with nothing to wait for took it.
        with pytest.raises(ValueError, match="connect timeout"):
            blocking.connect(broker.url, timeout=math.nan)
        conn = blocking.connect(broker.url, timeout=5)
        with pytest.raises(ValueError, match="close timeout"):
            conn.close(math.nan)
        assert not conn.is_closed
        with conn:
            with conn.consumer("q") as consumer:
                with pytest.raises(fc.ReceiveTimeout):
                    consumer.receive(-1)
                assert consumer.receive_many(5, -1) == []
                with pytest.raises(ValueError, match="consumer close timeout"):
                    consumer.close(math.nan)  # (the cancel's errors are not raised: NaN was taken silently)
            producer = conn.producer(routing_key="q")
            with pytest.raises(ValueError, match="send timeout"):
                producer.send_many([b"x"], timeout=math.nan)
            assert producer.statistics().sent == 0
            with pytest.raises(ValueError, match="flush timeout"):
                producer.flush(math.nan)  # (nothing outstanding: NaN was taken silently)
            with producer.flow_events() as events:
                assert events.get(-1) is None
                with pytest.raises(ValueError, match="flow events get timeout"):
                    events.get(math.nan)

    await trio.to_thread.run_sync(work)


async def test_a_close_that_stops_waiting_says_what_the_close_still_waits_for(start_broker) -> None:
    broker = await start_broker(auto_complete=False)

    def work() -> None:
        conn = blocking.connect(broker.url, timeout=5, close_timeout=1)
        producer = conn.producer(routing_key="q")
        for body in (b"a", b"b", b"c"):
            producer.send(body, timeout=5)
        # A tester's close(timeout=0) said only "the connection thread did not end within 0 s"; the
        # messages not completed came out of a second close, which nothing said to call.
        with pytest.raises(fc.BrokerConnectionError, match="3 messages sent and not completed.*close\\(\\) again"):
            conn.close(timeout=0)
        with pytest.raises(fc.PublishFailures) as failures:
            conn.close()
        assert failures.value.unconfirmed == 3

    await trio.to_thread.run_sync(work)


async def test_a_process_that_exits_without_close_closes_its_connections(start_broker) -> None:
    broker = await start_broker(auto_complete=False)
    code = (
        "import sys; from flowbroker.client import blocking\n"
        "conn = blocking.connect(sys.argv[1], timeout=5, close_timeout=0.5)\n"
        "conn.producer(routing_key='q').send_many([b'm%d' % i for i in range(50)], timeout=5)\n"
    )  # and no close(): a tester's process lost what was queued, without a word
    with trio.fail_after(30):
        done = await trio.run_process([sys.executable, "-c", code, broker.url], capture_stderr=True, check=False)
    fake = await broker.connection()
    await fake.wait_for(lambda: fake.closed)
    assert len(fake.transfers) == 50 and fake.frames(Close) != []  # written, then closed as close() does
    assert b"50 messages sent and not completed" in done.stderr  # what close() raises, logged


async def test_the_blocking_connection_has_the_welcome_shortcuts_docs_name(start_broker) -> None:
    """client.md names conn.connection_id, conn.server_name and conn.max_message_size as shortcuts, and says
    the blocking API has the trio API's semantics: the blocking connection lacked the last two (a tester)."""
    broker = await start_broker()

    def work() -> tuple[int, str, int, Any]:
        with blocking.connect(broker.url, timeout=5) as conn:
            return conn.connection_id, conn.server_name, conn.max_message_size, conn.welcome

    connection_id, server_name, max_message_size, welcome = await trio.to_thread.run_sync(work)
    assert (connection_id, server_name, max_message_size) == (
        welcome.connection_id, welcome.server_name, welcome.max_message_size)
    assert max_message_size > 0 and server_name


async def test_a_receive_ended_by_another_threads_close_raises_consumer_closed_a_flowbroker_error(start_broker) -> None:
    """A blocking receive() waiting in one thread while another closes the connection got a bare
    trio.EndOfChannel with no text, which a caller catching fc.FlowbrokerError missed (a tester)."""
    broker = await start_broker()

    def both_sides() -> BaseException | None:
        caught: list[BaseException] = []
        with blocking.connect(broker.url, timeout=5) as conn:
            consumer = conn.consumer("q")

            def wait() -> None:
                try:
                    consumer.receive(timeout=None)
                except BaseException as exc:  # noqa: BLE001 - what it raised is the point
                    caught.append(exc)

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.5)
            conn.close()
            waiter.join(5)
        return caught[0] if caught else None

    error = await trio.to_thread.run_sync(both_sides)
    assert isinstance(error, fc.ConsumerClosed) and isinstance(error, fc.FlowbrokerError)
    assert isinstance(error, trio.EndOfChannel)  # (trio code that catches that still does)
    assert "consumer of 'q' has no more messages: its connection was closed by the application" in str(error)
