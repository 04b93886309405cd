"""The SDK producer's CPU per message against a real broker process, over UDP or TCP: the producer side
of issue 11 item 7 (a UDP producer should cost no more than a TCP one).

A broker process is started (`flowbroker serve`, as benchmarks/udp_throughput.py starts it); this process
connects, sends 200 messages to warm up and flushes, then sends COUNT messages of 1 KiB to a queue nobody
consumes (so nothing but the broker's window paces it), flushes, and prints the CPU time of this process
per message (process_time: user and system, so the system calls a datagram or a write costs count).
Run under `valgrind --tool=callgrind` at two counts and take the difference of the totals divided by the
difference of the counts for instructions per message (only this process is traced; the broker runs at
full speed beside it):

    python benchmarks/udp_producer_cost.py [--count 50000] [--transport udp|tcp]
"""

from __future__ import annotations

import argparse
import time

import trio

import flowbroker.client as fc
from udp_throughput import Broker

BODY = b"x" * 1024


async def run(url: str, transport: str, count: int) -> float:
    async with await fc.connect(url, client_name=f"cost-{transport}-producer") as conn:
        await conn.declare_queue("cost")
        producer = conn.producer("", "cost", transport="udp") if transport == "udp" else conn.producer(routing_key="cost")
        async with producer:
            for _ in range(200):
                await producer.send(BODY)
            await producer.flush()
            start = time.process_time()
            for _ in range(count):
                await producer.send(BODY, timeout=60)
            await producer.flush(timeout=60)
            return (time.process_time() - start) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--transport", choices=("udp", "tcp"), default="udp")
    args = parser.parse_args()
    broker = Broker(argparse.Namespace(admin=False, quota="400MiB", broker_config=None))
    try:
        per_message = trio.run(run, broker.url, args.transport, args.count)
    finally:
        broker.stop()
    print(f"SDK {args.transport.upper()} producer, {args.count:,} x {len(BODY)} B, nobody consuming: "
          f"{per_message:.2f} us CPU per message (this process)")


if __name__ == "__main__":
    main()
