"""Issue 10's first hour with the SDK, over a real broker on 127.0.0.1: no silent hangs, no silent losses.

- A consumer used without `async with` subscribes on first use (`receive`, `async for`, the blocking
  `receive`), within the call's deadline, instead of waiting for ever with messages in the queue.
- Leaving a producer's or a connection's block (trio or blocking) waits for the outstanding transfers and
  raises `PublishFailures` with what was refused or not completed; an exception of the block itself goes
  on untouched (the failures are logged).
- A message an exchange routes to no queue is counted on the producer (`stats.unroutable`) and, for a
  `mandatory` producer, is a refusal (`Unroutable`): the broker reports it with ERROR `UNROUTABLE` to a
  connection whose HELLO asked for it (capability "mandatory"), and to no other.
"""

from __future__ import annotations

import logging
import time

import pytest
import trio

import flowbroker.client as fc
from flowbroker.client import blocking
from flowbroker.client.producer import MAX_KEPT_ERRORS
from flowbroker.protocol import (
    CAPABILITY_MANDATORY,
    PROTOCOL_VERSION,
    Complete,
    Error,
    ErrorCode,
    Hello,
    Transfer,
    TransferEntry,
    Welcome,
    message_size,
)

from tests.e2e.test_e2e_faults import LIMIT, RawClient, wait_until


async def _fill(conn: fc.Connection, queue: str, count: int) -> None:
    await conn.declare_queue(queue)
    producer = conn.producer(routing_key=queue)
    for i in range(count):
        await producer.send(b"m%d" % i)
    await producer.flush(timeout=LIMIT)


async def _frames_until_complete(client: RawClient, transfer_id: int) -> list[Error]:
    """The ERROR frames the broker sends until it completes `transfer_id` (no other frame but COMPLETE)."""
    errors: list[Error] = []
    while True:
        frame = await client.next_frame()
        assert frame is not None, "the broker closed the connection"
        if isinstance(frame, Complete):
            if frame.cumulative_id >= transfer_id:
                return errors
        else:
            assert isinstance(frame, Error), frame
            errors.append(frame)


# -- no silent hangs ------------------------------------------------------------------------------


async def test_iterating_a_consumer_never_entered_subscribes_and_gets_the_messages(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await _fill(conn, "first-use", 3)
        consumer = conn.consumer("first-use")  # no `async with`
        got = []
        with trio.fail_after(LIMIT):
            async for msg in consumer:
                got.append(msg.body)
                await msg.ack()
                if len(got) == 3:
                    break
        assert got == [b"m0", b"m1", b"m2"]
        session = broker.core.sessions[conn.connection_id]
        assert list(session.subscriptions) == [consumer.subscription_id]
        await consumer.aclose()
        assert session.subscriptions == {}  # closing cancels what first use subscribed
        assert broker.core.queues["first-use"].count == 0


async def test_receive_on_a_consumer_never_entered_subscribes_within_its_deadline(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await _fill(conn, "first-receive", 2)
        consumer = conn.consumer("first-receive", prefetch=10)
        first = await consumer.receive(timeout=3)
        second = await consumer.receive(timeout=3)
        assert (first.body, second.body) == (b"m0", b"m1")
        assert consumer.prefetch_in_force == 10
        await first.ack()
        await second.ack()
        with pytest.raises(fc.ReceiveTimeout):
            await consumer.receive(timeout=0.2)
        # `async with` on a consumer already subscribed by first use is fine, and closes it.
        async with consumer:
            pass
        with pytest.raises(trio.EndOfChannel):
            await consumer.receive(timeout=1)


async def test_polling_a_consumer_never_entered_with_receive_0_subscribes_and_gets_the_messages(
        start_flowbroker) -> None:
    """receive(0) polls; on a consumer never entered its passed deadline cancelled subscribe() before the
    SUBSCRIBE went out, so a poll loop got nothing for ever (a tester: 59 polls, no message)."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await _fill(conn, "polled", 3)
        consumer = conn.consumer("polled")
        got: list[bytes] = []
        with trio.fail_after(5):
            while len(got) < 3:
                try:
                    msg = await consumer.receive(0)
                except fc.ReceiveTimeout:
                    await trio.sleep(0.02)
                    continue
                got.append(msg.body)
                await msg.ack()
        assert got == [b"m0", b"m1", b"m2"]
        await consumer.aclose()

    def poll_blocking() -> list[bytes]:
        with blocking.connect(broker.url, timeout=LIMIT) as bconn:
            bconn.declare_queue("polled-blocking")
            producer = bconn.producer(routing_key="polled-blocking")
            producer.send(b"a", timeout=LIMIT)
            producer.send(b"b", timeout=LIMIT)
            producer.flush(timeout=LIMIT)
            bconsumer = bconn.consumer("polled-blocking")
            bodies: list[bytes] = []
            for _ in range(250):  # 5 s at most
                for m in bconsumer.receive_many(10, 0):
                    bodies.append(m.body)
                    m.ack()
                if len(bodies) == 2:
                    break
                time.sleep(0.02)
            bconsumer.close()
            return bodies

    assert await trio.to_thread.run_sync(poll_blocking) == [b"a", b"b"]


async def test_first_use_of_a_consumer_of_a_missing_queue_raises_not_found(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        consumer = conn.consumer("nowhere")
        with pytest.raises(fc.RequestError) as info:
            await consumer.receive(timeout=3)
        assert info.value.code is ErrorCode.NOT_FOUND
        with pytest.raises(fc.RequestError):
            async for _ in consumer:
                pass
        # Once the queue exists, the same consumer subscribes on its next use.
        await _fill(conn, "nowhere", 1)
        assert (await consumer.receive(timeout=3)).body == b"m0"
        await consumer.aclose()


async def test_blocking_receive_on_a_consumer_never_entered_gets_the_message(start_flowbroker) -> None:
    broker = await start_flowbroker()

    def work() -> tuple[bytes, fc.ConsumerStats]:
        with blocking.connect(broker.url, timeout=LIMIT) as conn:
            conn.declare_queue("blocking-first-use")
            producer = conn.producer(routing_key="blocking-first-use")
            producer.send(b"hello", timeout=LIMIT)
            producer.flush(timeout=LIMIT)
            assert conn.welcome.connection_id == conn.connection.connection_id and conn.close_error is None
            assert conn.producer_buffer_size > 1 and conn.consumer_buffer_size == 0
            consumer = conn.consumer("blocking-first-use")
            msg = consumer.receive(timeout=3)
            msg.ack()
            stats = consumer.stats
            consumer.close()
            return msg.body, stats

    body, stats = await trio.to_thread.run_sync(work)
    assert body == b"hello"
    assert (stats.received, stats.unsettled, stats.buffered) == (1, 0, 0)


async def test_polling_a_closed_consumer_with_receive_0_raises_consumer_closed(start_flowbroker) -> None:
    """A passed deadline cancelled the closed consumer's answer too: receive(0) and receive(-1) raised
    ReceiveTimeout, so a polling loop catching it never learned that its consumer was closed (a tester)."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("closed-poll")
        async with conn.consumer("closed-poll") as consumer:
            pass
        for timeout in (0, -1, 0.001):
            with pytest.raises(fc.ConsumerClosed):
                await consumer.receive(timeout)
        other = conn.consumer("closed-poll")
        await other.subscribe()
    for timeout in (0, -1):
        with pytest.raises(fc.ConsumerClosed):
            await other.receive(timeout)  # its connection was closed by the application

    def work() -> list[str]:
        with blocking.connect(broker.url, timeout=LIMIT) as bconn:
            consumer = bconn.consumer("closed-poll")
            consumer.receive_many(1, 0.1)
            consumer.close()
            raised = []
            for timeout in (0, 0.5):
                try:
                    consumer.receive(timeout)
                except Exception as error:  # noqa: BLE001 (the kind is what is checked)
                    raised.append(type(error).__name__)
            return raised

    assert await trio.to_thread.run_sync(work) == ["ConsumerClosed", "ConsumerClosed"]


# -- no silent losses: refusals at the end of a block ------------------------------------------


async def test_leaving_the_connection_block_raises_refusals_nobody_flushed(start_flowbroker) -> None:
    broker = await start_flowbroker()
    with pytest.raises(fc.PublishFailures) as info:
        async with await fc.connect(broker.url, timeout=LIMIT) as conn:
            producer = conn.producer(routing_key="no-such-queue")
            for i in range(3):
                await producer.send(b"%d" % i)
    failures = info.value
    assert (failures.failed, failures.unconfirmed) == (3, 0)
    assert [type(e) for e in failures.errors] == [fc.NotFound] * 3
    assert {e.destination for e in failures.errors} == {"no-such-queue"}
    assert failures.first is failures.errors[0] and "3 messages refused" in str(failures)
    assert producer.stats.failed == 3 and producer.stats.outstanding == 0


async def test_leaving_a_producer_block_raises_its_refusals_and_the_connection_does_not_repeat_them(
    start_flowbroker,
) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("there")
        with pytest.raises(fc.PublishFailures) as info:
            async with conn.producer(routing_key="there") as producer:
                await producer.send(b"1")
                await producer.send(b"2", routing_key="not-there")
                await producer.send(b"3")
        assert (info.value.failed, info.value.unconfirmed) == (1, 0)
        assert [(type(e), e.destination) for e in info.value.errors] == [(fc.NotFound, "not-there")]
        assert broker.core.queues["there"].count == 2
        # Flushed refusals are reported once: a producer block with nothing new ends quietly.
        async with conn.producer(routing_key="there") as quiet:
            await quiet.send(b"x", routing_key="missing")
            with pytest.raises(fc.NotFound):
                await quiet.flush(timeout=LIMIT)
    # and the connection block found nothing more to report


async def test_a_producer_keeps_a_bounded_number_of_refusals_and_counts_the_rest(start_flowbroker) -> None:
    broker = await start_flowbroker()
    count = MAX_KEPT_ERRORS + 50
    with pytest.raises(fc.PublishFailures) as info:
        async with await fc.connect(broker.url, timeout=LIMIT, flow_control=False) as conn:
            producer = conn.producer(routing_key="no-such-queue", window=count)
            for i in range(count):
                await producer.send(b"%d" % i)
    assert info.value.failed == count and len(info.value.errors) == MAX_KEPT_ERRORS
    assert [e.transfer_id for e in info.value.errors] == list(range(1, MAX_KEPT_ERRORS + 1))  # the oldest


async def test_an_exception_of_the_block_is_not_masked_and_the_failures_are_logged(
    start_flowbroker, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start_flowbroker()
    caplog.set_level(logging.WARNING, logger="flowbroker.client")
    with pytest.raises(KeyError, match="the application's own error"):
        async with await fc.connect(broker.url, timeout=LIMIT) as conn:
            producer = conn.producer(routing_key="no-such-queue")
            await producer.send(b"x")
            await producer.send(b"y")
            await trio.sleep(0.2)
            raise KeyError("the application's own error")
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1 and "2 messages refused" in logged[0] and "KeyError" in logged[0]


async def test_transfers_held_by_stop_all_are_reported_unconfirmed_not_lost(start_flowbroker) -> None:
    """A transfer held past the close timeout is reported as not completed (outcome unknown to the
    client): here it was enqueued, and is delivered once producers are started again."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as setup:
        await setup.declare_queue("held")
    broker.core.stop_all_producers()
    with pytest.raises(fc.PublishFailures) as info:
        async with await fc.connect(broker.url, timeout=LIMIT, close_timeout=0.3) as conn:
            producer = conn.producer(routing_key="held")
            await producer.send(b"kept")
    assert (info.value.failed, info.value.unconfirmed, info.value.destinations) == (0, 1, ("*",))
    assert "may still be enqueued" in str(info.value) and "flow-stopped: * (all producers" in str(info.value)
    broker.core.start_all_producers()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        msg = await conn.consumer("held").receive(timeout=3)
        assert msg.body == b"kept"
        await msg.ack()


async def test_blocking_blocks_raise_failures_and_do_not_mask_the_blocks_own_error(start_flowbroker) -> None:
    broker = await start_flowbroker()

    def producer_block() -> fc.PublishFailures:
        with blocking.connect(broker.url, timeout=LIMIT) as conn:
            with pytest.raises(fc.PublishFailures) as info:
                with conn.producer(routing_key="no-such-queue") as producer:
                    producer.send(b"x", timeout=LIMIT)
            return info.value

    def connection_block() -> fc.PublishFailures:
        with pytest.raises(fc.PublishFailures) as info:
            with blocking.connect(broker.url, timeout=LIMIT) as conn:
                conn.producer(routing_key="no-such-queue").send_many([b"a", b"b"], timeout=LIMIT)
        return info.value

    def raising_block() -> None:
        with blocking.connect(broker.url, timeout=LIMIT) as conn:
            conn.producer(routing_key="no-such-queue").send(b"a", timeout=LIMIT)
            raise ValueError("mine")

    assert (await trio.to_thread.run_sync(producer_block)).failed == 1
    assert (await trio.to_thread.run_sync(connection_block)).failed == 2
    with pytest.raises(ValueError, match="mine"):
        await trio.to_thread.run_sync(raising_block)


# -- unroutable: counted, and refused for mandatory producers ----------------------------------


async def test_unroutable_messages_are_counted_and_refused_only_for_mandatory_producers(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_exchange("events", "topic")
        await conn.declare_queue("orders")
        await conn.bind("orders", "events", "order.*")
        plain = conn.producer("events", "audit.login")
        for _ in range(3):
            await plain.send(b"nobody listens")
        await plain.send(b"routed", routing_key="order.created")
        await plain.flush(timeout=LIMIT)  # counted, not a failure
        assert (plain.stats.unroutable, plain.stats.failed, plain.stats.completed) == (3, 0, 4)

        async with conn.producer("events", "audit.login", mandatory=True) as strict:
            await strict.send(b"lost?")
            await strict.send(b"routed", routing_key="order.paid")
            with pytest.raises(fc.Unroutable) as info:
                await strict.flush(timeout=LIMIT)
        error = info.value
        assert (error.code, error.destination, error.transfer_id) == (ErrorCode.UNROUTABLE, "events", 5)
        assert isinstance(error, fc.PublishError) and "audit.login" in str(error)
        assert (strict.stats.unroutable, strict.stats.failed) == (1, 1)
        assert broker.core.unroutable == 4
        assert broker.core.queues["orders"].count == 2

    with pytest.raises(fc.PublishFailures) as closing:
        async with await fc.connect(broker.url, timeout=LIMIT) as conn:
            await conn.producer("amq.fanout", mandatory=True).send(b"no queue is bound")
    assert [type(e) for e in closing.value.errors] == [fc.Unroutable]


async def test_the_broker_reports_unroutable_only_to_connections_that_asked(start_flowbroker) -> None:
    broker = await start_flowbroker()
    entry = TransferEntry("amq.topic", "nobody.binds.this", b"x", None)
    # Without the capability (protocol version 1 as before): completed silently.
    # (Without flow control, so that two messages need no credit.)
    legacy = await RawClient.connect(broker.port, flow_control=False)
    await legacy.send(Transfer(1, [entry]))
    assert await _frames_until_complete(legacy, 1) == []
    # With it: ERROR UNROUTABLE naming the transfer and the exchange, then the transfer completes.
    asking = RawClient(await trio.open_tcp_stream("127.0.0.1", broker.port))
    await asking.send(Hello(PROTOCOL_VERSION, "asks", False, [CAPABILITY_MANDATORY, "not-a-capability"]))
    assert isinstance(await asking.next_frame(), Welcome)
    await asking.send(Transfer(1, [entry, entry]))
    errors = await _frames_until_complete(asking, 2)
    assert [(e.code, e.ref_id, e.destination) for e in errors] == [
        (ErrorCode.UNROUTABLE, 1, "amq.topic"),
        (ErrorCode.UNROUTABLE, 2, "amq.topic"),
    ]
    assert broker.core.unroutable == 3
    # Neither connection was harmed, and an SDK client beside them works.
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await _fill(conn, "beside", 1)
    for raw in (legacy, asking):
        await raw.stream.aclose()


# -- the counters the docs name ---------------------------------------------------------------


async def test_consumer_stats_count_the_credit_it_grants(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        assert conn.producer_buffer_size == conn.sender_window.window
        await _fill(conn, "counted", 4)
        assert conn.producer_buffer_size > 1  # a producer now: its share of the pool
        await conn.set_buffer_size(1 << 20)
        assert conn.consumer_buffer_size == 1 << 20
        async with conn.consumer("counted", prefetch=10, buffer_size=1 << 16) as consumer:
            await wait_until(lambda: consumer.stats.received == 4)
            stats = consumer.stats
            assert (stats.unsettled, stats.buffered, stats.prefetch_in_force, stats.buffer_size) == (4, 4, 10, 1 << 16)
            size = message_size(b"m0")
            assert stats.received_bytes == 4 * size and stats.processed_bytes == 0
            for _ in range(4):
                await (await consumer.receive(timeout=LIMIT)).ack()
            await consumer.set_buffer_size(1 << 16)  # acknowledges what is processed at once
            stats = consumer.stats
            assert (stats.unsettled, stats.buffered) == (0, 0)
            assert stats.processed_bytes == stats.acked_bytes == 4 * size


async def test_a_malformed_request_raises_request_error_and_the_connection_stays_open(start_flowbroker) -> None:
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        with pytest.raises(fc.RequestError, match="queue") as info:
            await conn.declare_queue("q" * 256)
        assert info.value.code is ErrorCode.MALFORMED_FRAME
        await conn.declare_queue("kept")  # the same connection goes on
        async with conn.producer("", "kept") as producer:
            await producer.send(b"after")
        async with conn.consumer("kept") as consumer:
            assert (await consumer.receive(timeout=LIMIT)).body == b"after"


async def test_a_passed_deadline_is_no_wait_a_nan_timeout_a_value_error_and_a_request_timeout_no_broker_fault(
        start_flowbroker) -> None:
    """A negative timeout (`deadline - now` once the deadline passed) waits not at all, as 0 does (trio's
    own ValueError leaked from send); NaN is a ValueError naming the wait."""
    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        await conn.declare_queue("t")
        producer = conn.producer(routing_key="t", window=1)
        await producer.send(b"x")
        with pytest.raises(fc.FlowControlTimeout):
            await producer.send(b"y", timeout=-1)  # it would have to wait: the window is full
        with pytest.raises(ValueError, match="send timeout must be a number of seconds"):
            await producer.send(b"y", timeout=float("nan"))
        with pytest.raises(ValueError, match="flush timeout must be a number of seconds"):
            await producer.flush(timeout=float("nan"))
        with pytest.raises(ValueError, match="receive timeout must be a number of seconds"):
            await conn.consumer("t").receive(float("nan"))
        with pytest.raises(ValueError, match="request timeout must be a number of seconds"):
            await conn.declare_queue("u", timeout=float("nan"))
        # A passed deadline waits for nothing, but an answer already in (the broker here is in-process and
        # may answer while the request is written) is taken: a few tries see the timeout (one CI run's
        # single try got its answer)
        late: fc.RequestTimeout | None = None
        for i in range(50):
            try:
                await conn.declare_queue(f"v{i}", timeout=-1 if i % 2 else 0)
            except fc.RequestTimeout as exc:
                late = exc
                break
        assert late is not None
        assert late.code is ErrorCode.IDLE_TIMEOUT and "INTERNAL_ERROR" not in str(late)
        assert str(late).startswith("the broker did not answer request")
        await producer.flush(timeout=LIMIT)
