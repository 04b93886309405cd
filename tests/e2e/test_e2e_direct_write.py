"""The broker writes what a chunk of frames made due at once, and leaves the rest to the writer task.

broker/server.py flushes every woken connection with one non-blocking write at the end of each reader
chunk; what the kernel does not take waits in `_unsent` for that connection's writer. These tests
make the kernel refuse (a consumer that stops reading, with a small receive buffer) and check that
every frame still arrives whole and in order, and that other connections are not held up meanwhile.
"""

from __future__ import annotations

import socket

import trio

import flowbroker.client as fc
from flowbroker.protocol import PROTOCOL_VERSION, Deliver, DeliveryEntry, Hello, Outcome, Settle, Subscribe, Welcome

from tests.e2e.test_e2e_faults import LIMIT, RawClient, wait_until

BODY = 4096
COUNT = 3000  # 12 MiB of bodies: far beyond what loopback socket buffers hold


async def stalled_consumer(port: int, queue: str, prefetch: int) -> RawClient:
    """A subscribed raw consumer with a 16 KiB receive buffer that reads nothing until asked."""
    async with await fc.connect(f"flowbroker://127.0.0.1:{port}") as conn:
        await conn.declare_queue(queue)
    raw = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
    raw.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    await raw.send(Hello(PROTOCOL_VERSION, "stalled-consumer", True, []))
    welcome = await raw.next_frame()
    assert isinstance(welcome, Welcome), welcome
    raw.welcome = welcome
    await raw.send(Subscribe(1, 1, queue, prefetch, 0))
    return raw


async def test_deliveries_the_kernel_refused_arrive_whole_and_in_order(start_flowbroker) -> None:
    broker = await start_flowbroker()
    raw = await stalled_consumer(broker.port, "q", COUNT)
    assert raw.welcome is not None
    handler = broker.server.connections[raw.welcome.connection_id]
    async with await fc.connect(f"flowbroker://127.0.0.1:{broker.port}") as conn:
        producer = conn.producer(routing_key="q", window=COUNT)
        for i in range(COUNT):
            await producer.send(i.to_bytes(4, "big") + bytes(BODY - 4))
        await producer.flush(timeout=LIMIT)  # completions came back while the consumer read nothing
        # The kernel took only part of the deliveries: the rest waits for this connection's writer.
        await wait_until(lambda: bool(handler._unsent) or handler._writing)

        # Meanwhile the broker goes on serving other connections.
        await conn.declare_queue("other")
        other = conn.producer(routing_key="other")
        await other.send(b"not held up")
        async with conn.consumer("other") as consumer:
            with trio.fail_after(LIMIT):
                msg = await consumer.receive()
            assert msg.body == b"not held up"
            await msg.ack()

    entries: list[DeliveryEntry] = []
    with trio.fail_after(LIMIT * 4):
        while len(entries) < COUNT:
            frame = await raw.next_frame()
            assert frame is not None, "closed while deliveries were outstanding"
            if isinstance(frame, Deliver):
                entries.extend(frame.entries)
    assert [int.from_bytes(e.body[:4], "big") for e in entries] == list(range(COUNT))
    assert [e.delivery_tag for e in entries] == list(range(1, COUNT + 1))
    await raw.send(Settle(Outcome.ACK, [(1, COUNT)]))
    await wait_until(lambda: broker.core.queues["q"].count == 0)
    await raw.aclose()


async def test_a_connection_ended_while_its_writer_is_stuck_loses_no_message(start_flowbroker) -> None:
    """Closed mid-frame (the writer was inside send_all), the broker closes without writing more, and
    every delivery it had sent goes back to the queue for the next consumer."""
    broker = await start_flowbroker()
    raw = await stalled_consumer(broker.port, "q", COUNT)
    assert raw.welcome is not None
    conn_id = raw.welcome.connection_id
    handler = broker.server.connections[conn_id]
    url = f"flowbroker://127.0.0.1:{broker.port}"
    async with await fc.connect(url) as conn:
        producer = conn.producer(routing_key="q", window=COUNT)
        for i in range(COUNT):
            await producer.send(i.to_bytes(4, "big") + bytes(BODY - 4))
        await producer.flush(timeout=LIMIT)
    await wait_until(lambda: handler._writing)
    await raw.aclose()  # the consumer goes away with the broker's writer blocked on it
    await wait_until(lambda: conn_id not in broker.core.sessions)
    async with await fc.connect(url) as conn:
        got = []
        async with conn.consumer("q", prefetch=500) as consumer:
            with trio.fail_after(LIMIT * 4):
                async for msg in consumer:
                    got.append(int.from_bytes(msg.body[:4], "big"))
                    await msg.ack()
                    if len(got) == COUNT:
                        break
    assert got == list(range(COUNT))  # requeued in their original order


async def test_a_frame_the_state_machine_refuses_ends_only_its_own_connection(start_flowbroker) -> None:
    """A broker bug that queues a frame the protocol forbids (here a HELLO, which only clients send)
    closes that connection; the reader that found it while flushing, and everyone else, carry on."""
    broker = await start_flowbroker()
    url = f"flowbroker://127.0.0.1:{broker.port}"
    async with await fc.connect(url) as victim, await fc.connect(url) as bystander:
        await bystander.declare_queue("q")
        producer = bystander.producer(routing_key="q")
        async with bystander.consumer("q") as consumer:
            broker.core.sessions[victim.connection_id].send(Hello(PROTOCOL_VERSION, "bug", True, []))
            # The victim's writer finds it (or a reader flushing after the bystander's next frame).
            await producer.send(b"after the bug")
            with trio.fail_after(LIMIT):
                msg = await consumer.receive()
            assert msg.body == b"after the bug"
            await msg.ack()
            await wait_until(lambda: victim.is_closed)
            assert victim.connection_id not in broker.core.sessions
        await producer.flush(timeout=LIMIT)
