"""The broker core's CPU per message with many producer connections: `broker_core_cost.py`'s loop (bytes in,
bytes out, no sockets, no trio) with --producers sessions taking turns, one TRANSFER frame of --batch messages
each per turn (each producer's share 4 MiB), into one queue with one consumer that settles every frame's messages as the SDK does. Beside
the one-producer figure, it shows what the core spends per producer connection per frame: credit accounting,
COMPLETE and BUFFER_ACK frames, the pool's shares (issue 16 item 2). Run it under callgrind for a figure
that does not move with the machine's load:

    python benchmarks/many_producers_core_cost.py [--messages 200000] [--producers 10] [--batch 64]
    valgrind --tool=callgrind --callgrind-out-file=/tmp/mp-N.out python benchmarks/many_producers_core_cost.py \\
        --messages N --producers 10 --repeat 1     # N = 20000 and 40000: (Ir@40k - Ir@20k) / 20000
"""

from __future__ import annotations

import argparse
import time

from broker_core_cost import _welcome
from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.protocol import Connection, Role
from flowbroker.protocol.frames import PROTOCOL_VERSION, Hello, Outcome, Settle, Subscribe, Transfer, TransferEntry


def run(messages: int, producers: int, batch: int, size: int) -> float:
    """Per-message microseconds of CPU for `messages` messages from `producers` connections."""
    # Every producer's share fits the pool from its first message on (5 % of 1 GiB over up to 12 producers of
    # 4 MiB), whatever the count: no shrink waits for an answer that this loop, having no client, never sends.
    config = load_config(None, {"server": {"memory_quota": 1 << 30},
                                "credit": {"min_size": 2 << 20, "max_size": 4 << 20}})
    clock = [0]
    core = BrokerCore(config, lambda: clock[0])
    core.declare_queue("bench", None)
    consumer = core.open_session("bench-consumer", "anonymous", True, lambda: None)
    c_client, c_broker = Connection(Role.CLIENT), Connection(Role.BROKER)
    sessions = [core.open_session(f"bench-producer-{i}", "anonymous", True, lambda: None) for i in range(producers)]
    pairs = [(Connection(Role.CLIENT), Connection(Role.BROKER)) for _ in range(producers)]
    for client, broker in [(c_client, c_broker), *pairs]:
        broker.receive_data(client.send(Hello(PROTOCOL_VERSION, "bench", True, [])))
        broker.next_frame()
        client.receive_data(broker.send(_welcome()))
        client.next_frame()
    c_broker.receive_data(c_client.send(Subscribe(1, 1, "bench", 100_000, 0)))
    core.handle(consumer, c_broker.next_frame())  # type: ignore[arg-type]
    b"".join(c_broker.send(f) for f in consumer.collect(0))
    body = bytes(size)
    tag = 0
    # Each connection's first message registers it as a producer (its 1-byte grant becomes a share): untimed.
    for session, (client, broker) in zip(sessions, pairs, strict=True):
        broker.receive_data(client.send(Transfer(1, [TransferEntry("", "bench", body, None, None, None)])))
        core.handle(session, broker.next_frame())  # type: ignore[arg-type]
        b"".join([broker.send(f) for f in session.collect(clock[0])])
    b"".join([c_broker.send(f) for f in consumer.collect(clock[0])])
    tag += producers
    c_broker.receive_data(c_client.send(Settle(Outcome.ACK, [(1, tag)])))
    core.handle(consumer, c_broker.next_frame())  # type: ignore[arg-type]
    turns = messages // (batch * producers)
    frames: list[bytes] = []
    settles: list[bytes] = []
    next_id = 2
    for _ in range(turns):
        for client, _broker in pairs:
            frames.append(client.send(Transfer(next_id, [TransferEntry("", "bench", body, None, None, None)] * batch)))
            settles.append(c_client.send(Settle(Outcome.ACK, [(tag + 1, tag + batch)])))
            tag += batch
        next_id += batch
    order = [(sessions[i % producers], pairs[i % producers][1]) for i in range(len(frames))]
    start = time.process_time()
    for (session, broker), data, settle in zip(order, frames, settles, strict=True):
        broker.receive_data(data)
        while (frame := broker.next_frame()) is not None:
            core.handle(session, frame)
        b"".join([broker.send(f) for f in session.collect(clock[0])])
        b"".join([c_broker.send(f) for f in consumer.collect(clock[0])])
        c_broker.receive_data(settle)
        while (frame := c_broker.next_frame()) is not None:
            core.handle(consumer, frame)
        clock[0] += 1_000_000 // producers
    elapsed = time.process_time() - start
    queue = core.queues["bench"]
    sent = len(frames) * batch
    assert queue.counters.dequeued == sent + producers and queue.count == 0, "every message delivered and acked"
    return elapsed / sent * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--producers", type=int, default=10, help="producer connections taking turns")
    parser.add_argument("--batch", type=int, default=64, help="messages per TRANSFER frame")
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best is printed (least disturbed)")
    args = parser.parse_args()
    results = [run(args.messages, args.producers, args.batch, args.size) for _ in range(args.repeat)]
    print(f"broker core, {args.producers} producer(s), {args.size} B bodies, {args.batch} per TRANSFER: "
          f"{min(results):.2f} us CPU per message (runs: {', '.join(f'{r:.2f}' for r in results)})")


if __name__ == "__main__":
    main()
