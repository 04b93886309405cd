"""The SDK consumer's CPU per message alone: no broker process, no socket.

A real `flowbroker.client.Connection` runs over an in-memory trio stream; a scripted broker answers
SUBSCRIBE and writes DELIVER frames (100-byte bodies, 200 per frame) that were encoded before timing
starts. The application iterates and acks every message. What is timed is the consumer's process: its
reader (decode, hand-off), the iteration, settling and the writer's SETTLE frames.

    python benchmarks/client_consumer_cost.py [COUNT]

On a shared machine the CPU time varies by tens of percent from run to run. For a figure that does not,
count instructions: run it under `valgrind --tool=callgrind` with two counts (say 10,000 and 30,000) and
divide the difference of the totals by the difference of the counts (startup cancels out).
"""

from __future__ import annotations

import argparse
import time

import trio
import trio.testing

from flowbroker.client.connection import Connection
from flowbroker.protocol import PROTOCOL_VERSION, Deliver, DeliveryEntry, Hello, Ok, Role, Subscribe, Welcome
from flowbroker.protocol import Connection as ProtocolConnection

BODY = b"x" * 100
PER_FRAME = 200
FRAMES_PER_WRITE = 10


async def run(count: int) -> float:
    """CPU seconds per message for `count` messages."""
    client_end, broker_end = trio.testing.memory_stream_pair()
    client, broker = ProtocolConnection(Role.CLIENT), ProtocolConnection(Role.BROKER)
    broker.receive_data(client.send(Hello(PROTOCOL_VERSION, "bench", True, [], None)))
    broker.next_frame()
    welcome = Welcome(1, 1, "bench", 8 << 20, 1 << 20, 0, 0, "bench")
    client.receive_data(broker.send(welcome))
    client.next_frame()
    frames = [
        broker.send(Deliver(1, [DeliveryEntry(tag, "", "q", BODY, None, False) for tag in range(first, min(count, first + PER_FRAME - 1) + 1)]))
        for first in range(1, count + 1, PER_FRAME)
    ]
    writes = [b"".join(frames[i : i + FRAMES_PER_WRITE]) for i in range(0, len(frames), FRAMES_PER_WRITE)]

    async def scripted_broker(nursery: trio.Nursery) -> None:
        """Answer SUBSCRIBE (prefetch in force: every message), then write every DELIVER; read the rest."""
        while True:
            broker.receive_data(bytes(await broker_end.receive_some(65536)))
            while (frame := broker.next_frame()) is not None:
                if isinstance(frame, Subscribe):
                    await broker_end.send_all(broker.send(Ok(frame.request_id, {"queue": "q", "prefetch": count})))
                    nursery.start_soon(deliver)

    async def deliver() -> None:
        for data in writes:
            await broker_end.send_all(data)

    conn = Connection(client_end, client, welcome)
    async with conn, trio.open_nursery() as nursery:
        nursery.start_soon(scripted_broker, nursery)
        async with conn.consumer("q", prefetch=0) as consumer:
            received = 0
            cpu = time.process_time()
            async for msg in consumer:
                await msg.ack()
                received += 1
                if received == count:
                    break
            used = time.process_time() - cpu
        nursery.cancel_scope.cancel()
    return used / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", nargs="?", type=int, default=200_000, metavar="COUNT",
                        help="messages to receive and ack (default: 200,000)")
    count = parser.parse_args().count
    per_message = trio.run(run, count)
    print(f"SDK consumer, {count:,} messages of {len(BODY)} B: CPU per message {per_message * 1e6:.2f} us")


if __name__ == "__main__":
    main()
