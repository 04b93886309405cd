"""One process of tests/e2e/test_e2e_multicast.py's multi-process run, inside its network namespace, against a
`flowbroker serve` there (default ports):

    python multicast_process.py setup
    python multicast_process.py member <fc> <group address:port> <delay seconds> <count> <window>
    python multicast_process.py produce <count> <body bytes>

`member` prints "joined" once JOIN_GROUP was answered, then one JSON line: each message's body and, per
message, the CLOCK_MONOTONIC time (shared by every process of the host) after it was received (delay 0) or
processed (delay > 0: taken after its handler and its ack, before the status message saying so can leave).
`produce` prints one JSON line: the flow events its connection saw.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import trio

import flowbroker.client as fc
from flowbroker.client.errors import HandshakeError

URL = "flowbroker://127.0.0.1:5680"
STOP, RESUME = 60, 20


async def connect() -> fc.Connection:
    deadline = trio.current_time() + 20
    while True:
        try:
            return await fc.connect(URL)
        except (OSError, HandshakeError):  # the broker is not listening yet
            if trio.current_time() > deadline:
                raise
            await trio.sleep(0.05)


async def setup() -> None:
    async with await connect() as conn:
        await conn.declare_exchange("fan", "fanout")
        await conn.declare_queue("g", flow_stop_count=STOP, flow_resume_count=RESUME)


async def member(fc_mode: str, group: str, delay: float, count: int, window: int) -> None:
    bodies: list[str] = []
    times: list[int] = []
    async with await connect() as conn:
        async with conn.consumer(exchange="fan", transport="udp", group="g", multicast=group, fc=fc_mode,
                                 buffer_size=window) as consumer:
            print("joined", flush=True)
            with trio.fail_after(120):
                async for msg in consumer:
                    if delay:
                        await trio.sleep(delay)
                    bodies.append(msg.body.decode())
                    await msg.ack()
                    times.append(time.monotonic_ns())
                    if len(bodies) == count:
                        break
    print(json.dumps({"bodies": bodies, "times": times}), flush=True)


async def produce(count: int, size: int) -> None:
    events: list[Any] = []
    async with await connect() as conn:

        async def watch() -> None:
            async for event in conn.flow_events():
                events.append([event.kind, event.destination])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with conn.producer("fan", "") as producer:
                for i in range(count):
                    await producer.send(b"%05d" % i + b"b" * (size - 5), timeout=60)
            nursery.cancel_scope.cancel()
    print(json.dumps({"events": events}), flush=True)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "setup":
        trio.run(setup)
    elif what == "member":
        trio.run(member, sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    elif what == "produce":
        trio.run(produce, int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {what!r}")
