"""Deliveries the broker never wrote to a consumer's socket come back unflagged when that connection closes:
only what the client may have read is marked redelivered. A consumer that never reads, prefetch 10,000 of
2 KB messages: what the sockets hold was written (flagged), the rest waited in the broker (not flagged).
Before, all that were delivered came back flagged, and `flowbroker consume -n N` left messages flagged though nothing
had seen them (a tester)."""

from __future__ import annotations

import fcntl
import termios

import trio

import flowbroker.client as fc
from flowbroker.broker.outbox import MAX_DELIVERY_BYTES_WAITING
from flowbroker.protocol import Subscribe
from flowbroker.protocol.credit import message_size

from tests.e2e.test_e2e_faults import RawClient

BODY = b"." * 2000


async def test_deliveries_never_written_to_a_closed_connection_come_back_unflagged(start_flowbroker) -> None:
    broker = await start_flowbroker()
    total, prefetch = 20_000, 10_000
    with trio.fail_after(60):
        async with await fc.connect(broker.url) as conn:
            await conn.declare_queue("q")
            async with conn.producer("", "q") as producer:
                for i in range(total):
                    await producer.send(b"%06d" % i + BODY)
            queue = broker.core.queues["q"]
            raw = await RawClient.connect(broker.port, flow_control=False)
            await raw.send(Subscribe(1, 1, "q", prefetch, 0))
            delivered, seen_at = 0, trio.current_time()
            while trio.current_time() - seen_at < 0.5:  # until deliveries stop: the sockets and the outbox full
                if total - len(queue.store) != delivered:
                    delivered, seen_at = total - len(queue.store), trio.current_time()
                await trio.sleep(0.01)
            await raw.stream.aclose()
            while len(queue.store) < total:  # all ready again
                await trio.sleep(0.01)
            got: list[tuple[bytes, bool]] = []
            async with conn.consumer("q", prefetch=1000) as consumer:
                while len(got) < total:
                    msg = await consumer.receive(timeout=10)
                    got.append((msg.body[:6], msg.redelivered))
                    await msg.ack()
    assert sorted(body for body, _ in got) == [b"%06d" % i for i in range(total)]
    flagged = sum(1 for _, redelivered in got if redelivered)
    assert 0 < flagged < delivered <= prefetch, (flagged, delivered)  # (all of them flagged before)


async def test_a_consumer_that_never_reads_pins_at_most_two_outboxes_of_deliveries(start_flowbroker) -> None:
    # What the broker holds for a connection that never reads: its outbox (MAX_DELIVERY_BYTES_WAITING and
    # one message) and what its writer took from it last (as much again): architecture.md's 2 x 8 MiB. The
    # writer collected again while a previous collect's rest was still unwritten, and each collect lets the
    # subscriptions refill the outbox: three outboxes' worth (a tester). Measured as the deliveries that
    # left the queue less what the two sockets' kernel buffers hold.
    broker = await start_flowbroker()
    body = b"." * 65_000
    total = 800  # 52 MB: under the queue's 80 MiB stop
    with trio.fail_after(60):
        async with await fc.connect(broker.url) as conn:
            await conn.declare_queue("q")
            async with conn.producer("", "q") as producer:
                for i in range(total):
                    await producer.send(body)
            queue = broker.core.queues["q"]
            raw = await RawClient.connect(broker.port, flow_control=False)
            await raw.send(Subscribe(1, 1, "q", 10_000, 0))
            delivered, seen_at = 0, trio.current_time()
            while trio.current_time() - seen_at < 0.5:  # until deliveries stop
                if total - len(queue.store) != delivered:
                    delivered, seen_at = total - len(queue.store), trio.current_time()
                await trio.sleep(0.01)
            assert raw.welcome is not None
            handler = broker.server.connections[raw.welcome.connection_id]
            in_kernel = (fcntl.ioctl(raw.stream.socket.fileno(), termios.FIONREAD, b"\0" * 4)
                         + fcntl.ioctl(handler.io.socket.fileno(), termios.TIOCOUTQ, b"\0" * 4))
            kernel_bytes = int.from_bytes(in_kernel[:4], "little") + int.from_bytes(in_kernel[4:], "little")
            held = delivered - kernel_bytes // len(body)  # the messages only the broker holds
            await raw.stream.aclose()
    size = message_size(body)
    assert held * size <= 2 * (MAX_DELIVERY_BYTES_WAITING + size), (held, delivered, kernel_bytes)
