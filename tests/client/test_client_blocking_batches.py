"""The blocking API's batch calls against a real broker: send_batch (each message its own headers and
routing key), receive_many (one thread hop for what is buffered) and ack_many."""

from __future__ import annotations

import time

import trio

from flowbroker.client import blocking
from flowbroker.protocol import Headers


async def test_send_batch_receive_many_and_ack_many(start_flowbroker) -> None:
    broker = await start_flowbroker()

    def run() -> None:
        with blocking.connect(broker.url, timeout=5) as conn:
            conn.declare_queue("b")
            conn.declare_queue("c")
            with conn.producer(routing_key="b") as producer:
                batch: list[tuple[bytes, Headers | None, str | None]] = [(b"%d" % i, None, None) for i in range(500)]
                batch.append((b"other", {"h": "v"}, "c"))
                assert producer.send_batch(batch, timeout=5) == 501
            with conn.consumer("b", prefetch=1000) as consumer:
                got: list[blocking.BlockingMessage] = []
                while len(got) < 500:
                    taken = consumer.receive_many(1000, 5)
                    assert taken and len(taken) <= 1000 - len(got)
                    got += taken
                assert [m.body for m in got] == [b"%d" % i for i in range(500)]
                assert consumer.receive_many(10, 0.2) == []  # nothing more: an empty list, not an error
                consumer.ack_many(got)
            with conn.consumer("c") as other:
                [message] = other.receive_many(10, 5)
                assert (message.body, message.headers, message.routing_key) == (b"other", {"h": "v"}, "c")
                message.ack()
            with conn.consumer("b") as again:
                assert again.receive_many(10, 0.5) == []  # acknowledged: none came back on cancel

    await trio.to_thread.run_sync(run)
    assert broker.core.queues["b"].statistics().messages == 0


async def test_a_zero_timeout_polls_what_is_buffered_and_a_zero_limit_takes_nothing(start_flowbroker) -> None:
    """receive(0) hands out a message already buffered (it raised ReceiveTimeout however many were: the
    passed deadline cancelled even the buffered one's checkpoint), in trio and blocking alike; receive_many
    with a limit of 0 takes none (it took one)."""
    import flowbroker.client as fc

    broker = await start_flowbroker()
    async with await fc.connect(broker.url, timeout=5) as conn:
        await conn.declare_queue("z")
        async with conn.producer(routing_key="z") as producer:
            for i in range(6):
                await producer.send(b"%d" % i)
        async with conn.consumer("z", prefetch=10) as consumer:
            with trio.fail_after(5):
                while consumer.buffered < 6:
                    await trio.sleep(0.01)
            assert (await consumer.receive(0)).body == b"0"
            assert (await consumer.receive(timeout=-1)).body == b"1"
            await (await consumer.receive(0)).ack()

    def run() -> None:
        with blocking.connect(broker.url, timeout=5) as bconn:
            with bconn.consumer("z", prefetch=10) as bconsumer:
                assert bconsumer.receive_many(0, 5) == [] and bconsumer.receive_many(-1, 5) == []
                first = bconsumer.receive(5)  # subscribes and waits for the first delivery
                until = time.monotonic() + 5
                while bconsumer.statistics().buffered < 4 and time.monotonic() < until:
                    time.sleep(0.01)
                polled = [first] + [bconsumer.receive(0) for _ in range(4)]
                assert sorted(m.body for m in polled) == [b"0", b"1", b"3", b"4", b"5"]  # 0, 1 requeued by the close
                for m in polled:
                    m.ack()

    await trio.to_thread.run_sync(run)


async def test_the_blocking_connection_shows_what_the_trio_one_does(start_flowbroker) -> None:
    """docs/client.md: reconnecting, reconnects, connection_id and connection_errors on the blocking
    connection, and a flow-event watcher's dropped (each was an AttributeError)."""
    broker = await start_flowbroker()

    def run() -> None:
        with blocking.connect(broker.url, timeout=5) as conn:
            assert conn.connection_id == conn.welcome.connection_id
            assert conn.reconnecting is False and conn.reconnects == 0 and conn.connection_errors == []
            producer = conn.producer(routing_key="q")
            with producer.flow_events() as events:
                assert events.dropped == 0

    await trio.to_thread.run_sync(run)


async def test_ack_many_acks_every_message_it_can_and_says_how_many_it_could_not(start_flowbroker) -> None:
    """One message of five acked alone before: ack_many raised at it, having acked the two before and not
    the two after, and said nothing of which (a tester). Now the four others are acked, then AlreadySettled."""
    import pytest

    from flowbroker.client.errors import AlreadySettled

    broker = await start_flowbroker()

    def run() -> None:
        with blocking.connect(broker.url, timeout=5) as conn:
            conn.declare_queue("m")
            with conn.producer(routing_key="m") as producer:
                for i in range(5):
                    producer.send(b"%d" % i)
            with conn.consumer("m", prefetch=10) as consumer:
                got: list[blocking.BlockingMessage] = []
                while len(got) < 5:
                    got += consumer.receive_many(5, 5)
                got[2].ack()
                with pytest.raises(AlreadySettled, match="1 of the 5 messages were settled already.*the others are acked"):
                    consumer.ack_many(got)
                assert consumer.statistics().unsettled == 0
                with pytest.raises(AlreadySettled, match="5 of the 5 messages were settled already.*none was acked"):
                    consumer.ack_many(got)  # (it said "the others are acked" when there were none)

    await trio.to_thread.run_sync(run)
    assert broker.core.queues["m"].statistics().messages == 0


async def test_send_many_that_times_out_names_the_timeout_it_was_given(start_flowbroker) -> None:
    """`timeout` bounds the whole call, and its FlowControlTimeout said the time left for the message it
    stopped at ("after 0.999213 s" for timeout=1, a tester)."""
    import pytest

    import flowbroker.client as fc

    broker = await start_flowbroker()

    def run() -> None:
        with blocking.connect(broker.url, timeout=5) as conn:
            conn.declare_queue("stopped", flow_stop_count=1, flow_resume_count=1)
            producer = conn.producer(routing_key="stopped", window=3)
            with pytest.raises(fc.FlowControlTimeout) as info:
                producer.send_many([b"m%d" % i for i in range(10)], timeout=0.5)
            assert "send timed out after 0.5 s" in str(info.value) and info.value.timeout == 0.5
            assert info.value.destinations == ("stopped",)
            conn.delete_queue("stopped")  # its held messages complete (no PublishFailures at the close)
            producer.flush(timeout=5)

    await trio.to_thread.run_sync(run)
