"""CPU the broker spends per message, without sockets or trio: bytes in, bytes out, in one process.

A producer session's TRANSFER frames (BATCH messages each) are decoded by the protocol state machine
and handled by the core, which routes them to a queue with one subscriber; that consumer session's
DELIVER frames and the producer's COMPLETE and BUFFER_ACK frames are collected and encoded, and the
consumer's SETTLE frames (one per batch, as the SDK sends them) are decoded and handled. What is
left out is what the end-to-end benchmark adds: system calls, the trio scheduler, other processes.

    python benchmarks/broker_core_cost.py [--messages 200000] [--batch 64] [--size 1024] [--permissions]

`--permissions`: the producer is a user with permissions (every message's write on its exchange is
checked, from the connection's cache), instead of the loopback user, who is not checked at all.
"""

from __future__ import annotations

import argparse
import time

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.protocol import Connection, Role
from flowbroker.protocol.frames import (
    PROTOCOL_VERSION,
    Deliver,
    DeclareQueue,
    Frame,
    Hello,
    Outcome,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    Welcome,
)


def run(messages: int, batch: int, size: int, permissions: bool = False) -> float:
    """Seconds of CPU for `messages` messages through the core; returns per-message microseconds."""
    config = load_config(None, {"server": {"memory_quota": 1 << 30}})
    clock = [0]
    core = BrokerCore(config, lambda: clock[0])
    producer = core.open_session("bench-producer", "anonymous", True, lambda: None)
    consumer = core.open_session("bench-consumer", "anonymous", True, lambda: None)
    if permissions:
        from flowbroker.broker.permissions import Access
        from flowbroker.broker.users import User
        from flowbroker.protocol.scram import StoredCredential

        producer.access = Access("bench", User("bench", StoredCredential.from_password("x", 1), (), ".*", ".*", ".*"))
    core.declare_queue("bench", None)
    # Each end speaks through a broker-side state machine fed by a client-side one, as on the wire.
    p_client, p_broker = Connection(Role.CLIENT), Connection(Role.BROKER)
    c_client, c_broker = Connection(Role.CLIENT), Connection(Role.BROKER)
    p_broker.build_transfers = False  # as the broker's server reads (BrokerServer's ConnectionHandler)
    for client, broker in ((p_client, p_broker), (c_client, c_broker)):
        broker.receive_data(client.send(Hello(PROTOCOL_VERSION, "bench", True, [])))
        broker.next_frame()
        client.receive_data(broker.send(_welcome()))
        client.next_frame()
    c_broker.receive_data(c_client.send(Subscribe(1, 1, "bench", 100_000, 0)))
    core.handle(consumer, c_broker.next_frame())  # type: ignore[arg-type]
    c_client.receive_data(b"".join(c_broker.send(f) for f in consumer.collect(0)))
    c_client.next_frame()
    body = bytes(size)
    # A flow-controlled connection holds a 1-byte grant until its first message registers it as a
    # producer (docs/policies.md): that message goes first, untimed, and its share follows.
    p_broker.receive_data(p_client.send(Transfer(1, [TransferEntry("", "bench", body, None, None, None)])))
    core.handle(producer, p_broker.next_frame())  # type: ignore[arg-type]
    b"".join([p_broker.send(f) for f in producer.collect(clock[0])])
    b"".join([c_broker.send(f) for f in consumer.collect(clock[0])])
    c_broker.receive_data(c_client.send(Settle(Outcome.ACK, [(1, 1)])))
    core.handle(consumer, c_broker.next_frame())  # type: ignore[arg-type]
    frames = []
    next_id = 2
    for _ in range(messages // batch):
        entries = [TransferEntry("", "bench", body, None, None, None)] * batch
        frames.append(p_client.send(Transfer(next_id, entries)))
        next_id += batch
    # What the consumer sends back: one SETTLE per batch, as the SDK does (prepared beforehand, so only
    # the broker's work is timed; its output is encoded but nobody decodes it).
    settles = [c_client.send(Settle(Outcome.ACK, [(first, first + batch - 1)])) for first in range(2, next_id, batch)]
    start = time.process_time()
    for data, settle in zip(frames, settles):
        p_broker.receive_data(data)
        while (frame := p_broker.next_frame()) is not None:
            core.handle(producer, frame)
        _encode(p_broker, producer.collect(clock[0]))
        _encode(c_broker, consumer.collect(clock[0]))
        c_broker.receive_data(settle)
        while (frame := c_broker.next_frame()) is not None:
            core.handle(consumer, frame)
        clock[0] += 1_000_000
    elapsed = time.process_time() - start
    queue = core.queues["bench"]
    assert queue.counters.dequeued == len(frames) * batch + 1 and queue.count == 0, "every message delivered and acked"
    return elapsed / (len(frames) * batch) * 1e6


def _encode(conn: Connection, frames: list[Frame]) -> bytes:
    """As the broker's server encodes what a session collected (BrokerServer._encode): its own
    DELIVER frames without re-checking their entries, every other frame checked."""
    return b"".join([conn.send(f, fields_checked=type(f) is Deliver) for f in frames])


def _welcome() -> Welcome:
    return Welcome(PROTOCOL_VERSION, 1, "bench", 8 << 20, 1 << 20, 60_000, 1 << 20, "anonymous")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=64, help="messages per TRANSFER frame")
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best is printed (least disturbed)")
    parser.add_argument("--permissions", action="store_true", help="the producer's permissions are checked")
    args = parser.parse_args()
    extra = (args.permissions,) if args.permissions else ()  # (so the script also runs on older trees)
    results = [run(args.messages, args.batch, args.size, *extra) for _ in range(args.repeat)]
    print(f"broker core, {args.size} B bodies, {args.batch} per TRANSFER: "
          f"{min(results):.2f} us CPU per message (runs: {', '.join(f'{r:.2f}' for r in results)}); "
          f"{1e6 / min(results):,.0f} msgs/s on one core")


if __name__ == "__main__":
    main()
