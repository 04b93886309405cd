"""The SDK producer's CPU per message alone: no broker process, no socket.

A real `flowbroker.client.Connection` runs over an in-memory trio stream; a scripted broker reads the
TRANSFER frames with a bare `msgpack.unpackb` (no validation: the same small cost before and after a change
to the SDK) and answers each with COMPLETE and BUFFER_ACK, so window and byte credit keep moving. The
application sends COUNT messages of 100 bytes (window 1000, a 1 MiB producer buffer) and flushes. What
is timed is the whole process: send, the ledger, the writer's TRANSFER frames (Connection.send validates
and encodes them), the reader's COMPLETE and BUFFER_ACK, and the scripted broker.

    python benchmarks/client_producer_cost.py [COUNT]

On a shared machine the CPU time varies by tens of percent from run to run. For a figure that does not,
count instructions: run it under `valgrind --tool=callgrind` with two counts (say 10,000 and 30,000) and
divide the difference of the totals by the difference of the counts (startup cancels out).
"""

from __future__ import annotations

import argparse
import struct
import time

import msgpack
import trio
import trio.testing

from flowbroker.client.connection import Connection
from flowbroker.protocol import PROTOCOL_VERSION, BufferAck, Complete, Hello, Role, Welcome, message_size
from flowbroker.protocol import Connection as ProtocolConnection

BODY = b"x" * 100
BUFFER = 1 << 20
LENGTH = struct.Struct(">I")


async def run(count: int) -> float:
    """CPU seconds per message for `count` messages."""
    client_end, broker_end = trio.testing.memory_stream_pair()
    client, broker = ProtocolConnection(Role.CLIENT), ProtocolConnection(Role.BROKER)
    broker.receive_data(client.send(Hello(PROTOCOL_VERSION, "bench", True, [], None)))
    broker.next_frame()
    welcome = Welcome(1, 1, "bench", 8 << 20, 1 << 20, 0, BUFFER, "bench")
    client.receive_data(broker.send(welcome))
    client.next_frame()
    size = message_size(BODY)

    async def scripted_broker() -> None:
        """Complete and acknowledge every TRANSFER as it arrives (one COMPLETE + BUFFER_ACK per read)."""
        buf = bytearray()
        acked = 0
        while True:
            buf += await broker_end.receive_some(1 << 20)
            pos = 0
            highest = 0
            while len(buf) - pos >= 4:
                (length,) = LENGTH.unpack_from(buf, pos)
                if len(buf) - pos - 4 < length:
                    break
                frame = msgpack.unpackb(memoryview(buf)[pos + 4 : pos + 4 + length])
                pos += 4 + length
                if frame[0] == 10:  # TRANSFER
                    highest = frame[1] + len(frame[2]) - 1
            del buf[:pos]
            if highest:
                freed = highest * size - acked
                acked = highest * size
                await broker_end.send_all(broker.send(Complete(highest, [])) + broker.send(BufferAck(0, freed, acked)))

    conn = Connection(client_end, client, welcome)
    async with conn, trio.open_nursery() as nursery:
        nursery.start_soon(scripted_broker)
        producer = conn.producer(routing_key="q", window=1000)
        cpu = time.process_time()
        for _ in range(count):
            await producer.send(BODY)
        await producer.flush(timeout=60)
        used = time.process_time() - cpu
        nursery.cancel_scope.cancel()
    return used / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", nargs="?", type=int, default=200_000, metavar="COUNT",
                        help="messages to send (default: 200,000)")
    count = parser.parse_args().count
    per_message = trio.run(run, count)
    print(f"SDK producer, {count:,} messages of {len(BODY)} B: CPU per message {per_message * 1e6:.2f} us")


if __name__ == "__main__":
    main()
