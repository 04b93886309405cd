"""The blocking API's batch calls against a real broker: send_batch (each message its own headers and
routing key), receive_many (one thread hop for what is buffered) and ack_many."""

from __future__ import annotations

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
