"""The latency floor for flowbroker's paced scenario on this machine: producer -> relay -> consumer as three
trio processes on 127.0.0.1, no broker logic at all (the relay forwards bytes). Compare its p50/p99 with
`broker_throughput.py paced`: the difference is what flowbroker's task hops and processing add.

    python benchmarks/latency_floor.py [--rate 5000] [--count 50000]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import struct
import time
from typing import Any

import trio

from procs import free_port
STAMP = struct.Struct("<Q")
SIZE = 1024


def relay(pin: int, pout: int) -> None:
    async def main() -> None:
        out_stream: trio.SocketStream | None = None
        ready = trio.Event()
        async def on_consumer(stream: trio.SocketStream) -> None:
            nonlocal out_stream
            out_stream = stream; ready.set(); await trio.sleep_forever()
        async def on_producer(stream: trio.SocketStream) -> None:
            await ready.wait()
            assert out_stream is not None  # set before ready
            while True:
                data = await stream.receive_some(65536)
                if not data: return
                await out_stream.send_all(data)
        async with trio.open_nursery() as n:
            n.start_soon(trio.serve_tcp, on_consumer, pout)
            n.start_soon(trio.serve_tcp, on_producer, pin)
    trio.run(main)


def consumer(pout: int, count: int, q: Any) -> None:
    async def main() -> None:
        s = await trio.open_tcp_stream("127.0.0.1", pout)
        buf = b""; lat: list[int] = []
        while len(lat) < count:
            buf += await s.receive_some(65536)
            while len(buf) >= SIZE:
                lat.append(time.monotonic_ns() - STAMP.unpack_from(buf)[0]); buf = buf[SIZE:]
        lat.sort(); q.put((lat[len(lat)//2], lat[int(len(lat)*0.99)]))
    trio.run(main)


def producer(pin: int, count: int, rate: float) -> None:
    async def main() -> None:
        s = await trio.open_tcp_stream("127.0.0.1", pin)
        start = time.monotonic()
        for i in range(count):
            d = start + i / rate - time.monotonic()
            if d > 0: await trio.sleep(d)
            await s.send_all(STAMP.pack(time.monotonic_ns()) + b"x" * (SIZE - 8))
    trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=5000.0)
    parser.add_argument("--count", type=int, default=50_000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    pin, pout = free_port(), free_port()
    r = ctx.Process(target=relay, args=(pin, pout))
    r.start()
    time.sleep(1)
    c = ctx.Process(target=consumer, args=(pout, args.count, q))
    c.start()
    time.sleep(0.5)
    p = ctx.Process(target=producer, args=(pin, args.count, args.rate))
    p.start()
    p50, p99 = q.get(timeout=120)
    print(f"bare trio relay, 3 processes, {args.rate:,.0f} msgs/s of {SIZE} B: p50 {p50 / 1e6:.3f} ms, p99 {p99 / 1e6:.3f} ms")
    p.join()
    c.join()
    r.terminate()  # the relay serves forever; it is our own child process
    r.join()


if __name__ == "__main__":
    main()
