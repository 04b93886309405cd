"""CPU the broker spends per message, without sockets or trio: bytes in, bytes out, in one process.

Producer sessions' TRANSFER frames (BATCH messages each) are decoded by the protocol state machine
and handled by the core, which routes them to a queue with one subscriber; that consumer session's
DELIVER frames and the producers' COMPLETE and BUFFER_ACK frames are collected and encoded, and the
consumer's SETTLE frames (one per batch, as the SDK sends them) are decoded and handled. What is
left out is what the end-to-end benchmark adds: system calls, the trio scheduler, other processes.

    python benchmarks/broker_core_cost.py [--messages 200000] [--batch 64] [--size 1024] [--permissions]
                                          [--producers 1] [--saturated]

`--saturated`: the queue spends half its time at its stop watermark, as one whose consumer falls behind
does: it is declared with flow_stop_count 4 frames and flow_resume_count 2 frames, and its consumer settles
in bursts, every 8 frames all it has but the newest frame, so the frames that arrive while it is saturated
are held (the `HeldTransfer` path) and released together when the burst takes it under resume.
`--permissions`: the producer is a user with permissions (every message's write on its exchange is
checked, from the connection's cache), instead of the loopback user, who is not checked at all.
`--producers N`: N producer connections take turns, one frame each per turn (each one's share 2-4 MiB),
to show what the core spends per producer connection per frame: credit accounting, COMPLETE and
BUFFER_ACK frames, the pool's shares (issue 16 item 2). For a figure that does not move with the
machine's load, run it under callgrind at two sizes:

    valgrind --tool=callgrind --callgrind-out-file=/tmp/core-N.out python benchmarks/broker_core_cost.py \\
        --messages N --repeat 1 [--producers 10]      # N = 20000 and 40000: (Ir@40k - Ir@20k) / 20000
"""

from __future__ import annotations

import argparse
import time

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.session import Session
from flowbroker.protocol import Connection, Role
from flowbroker.protocol.frames import (
    PROTOCOL_VERSION,
    Deliver,
    Frame,
    Hello,
    Outcome,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    Welcome,
)


SETTLE_BURST = 8  # --saturated: frames between the consumer's settlements


def run(messages: int, batch: int, size: int, permissions: bool = False, producers: int = 1,
        saturated: bool = False) -> float:
    """Seconds of CPU for `messages` messages through the core; returns per-message microseconds."""
    settings: dict[str, dict[str, int]] = {"server": {"memory_quota": 1 << 30}}
    if producers > 1:
        # Every producer's share fits the pool from its first message on (5 % of 1 GiB over up to 12 producers
        # of 4 MiB): no shrink waits for an answer that this loop, having no client, never sends.
        settings["credit"] = {"min_size": 2 << 20, "max_size": 4 << 20}
    config = load_config(None, settings)
    clock = [0]
    core = BrokerCore(config, lambda: clock[0])
    sessions = [core.open_session(f"bench-producer-{i}", "anonymous", True, lambda: None) for i in range(producers)]
    consumer = core.open_session("bench-consumer", "anonymous", True, lambda: None)
    if permissions:
        from flowbroker.broker.permissions import Access
        from flowbroker.broker.users import User
        from flowbroker.protocol.scram import StoredCredential

        user = User("bench", StoredCredential.from_password("x", 1), (), ".*", ".*", ".*")
        for session in sessions:
            session.access = Access("bench", user)
    core.declare_queue("bench", {"flow_stop_count": 4 * batch, "flow_resume_count": 2 * batch} if saturated else None)
    # Each end speaks through a broker-side state machine fed by a client-side one, as on the wire.
    pairs = [(Connection(Role.CLIENT), Connection(Role.BROKER)) for _ in range(producers)]
    c_client, c_broker = Connection(Role.CLIENT), Connection(Role.BROKER)
    for _client, broker in pairs:
        broker.build_transfers = False  # as the broker's server reads (BrokerServer's ConnectionHandler)
    for client, broker in [*pairs, (c_client, c_broker)]:
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
    for session, (client, broker) in zip(sessions, pairs, strict=True):
        broker.receive_data(client.send(Transfer(1, [TransferEntry("", "bench", body, None, None, None)])))
        core.handle(session, broker.next_frame())  # type: ignore[arg-type]
        b"".join([broker.send(f) for f in session.collect(clock[0])])
    b"".join([c_broker.send(f) for f in consumer.collect(clock[0])])
    c_broker.receive_data(c_client.send(Settle(Outcome.ACK, [(1, producers)])))
    core.handle(consumer, c_broker.next_frame())  # type: ignore[arg-type]
    # The producers take turns, a frame each; what the consumer sends back is one SETTLE per frame, as the
    # SDK does (all prepared beforehand, so only the broker's work is timed; its output is encoded but
    # nobody decodes it).
    frames: list[bytes] = []
    tags: list[int] = []  # the last delivery tag of each frame's messages
    tag, next_id = producers, 2
    for _ in range(messages // (batch * producers)):
        for client, _broker in pairs:
            frames.append(client.send(Transfer(next_id, [TransferEntry("", "bench", body, None, None, None)] * batch)))
            tag += batch
            tags.append(tag)
        next_id += batch
    order = [(sessions[i % producers], pairs[i % producers][1]) for i in range(len(frames))]
    settles: list[bytes] = []  # after each frame (b"": none)
    settled = producers
    for i, last in enumerate(tags):
        if saturated and (i % SETTLE_BURST != SETTLE_BURST - 1 or i == 0):
            settles.append(b"")
            continue
        upto = tags[i - 1] if saturated else last  # a burst leaves the newest frame unsettled
        settles.append(c_client.send(Settle(Outcome.ACK, [(settled + 1, upto)])))
        settled = upto
    last_settle = c_client.send(Settle(Outcome.ACK, [(settled + 1, tags[-1])])) if settled < tags[-1] else b""
    start = time.process_time()
    for (session, broker), data, settle in zip(order, frames, settles, strict=True):
        broker.receive_data(data)
        while (frame := broker.next_frame()) is not None:
            core.handle(session, frame)
        _encode(broker, session.collect(clock[0]))
        _encode(c_broker, consumer.collect(clock[0]))
        _settle(c_broker, core, consumer, settle)
        clock[0] += 1_000_000 // producers
    _settle(c_broker, core, consumer, last_settle)
    elapsed = time.process_time() - start
    queue = core.queues["bench"]
    sent = len(frames) * batch
    assert not saturated or queue.counters.held_total >= sent // 4, "a quarter of the messages held at least"
    assert queue.counters.dequeued == sent + producers and queue.count == 0, "every message delivered and acked"
    return elapsed / sent * 1e6


def _settle(conn: Connection, core: BrokerCore, consumer: Session, data: bytes) -> None:
    """The consumer's SETTLE bytes through its broker-side connection into the core (none: nothing)."""
    if data:
        conn.receive_data(data)
        while (frame := conn.next_frame()) is not None:
            core.handle(consumer, frame)


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
    parser.add_argument("--permissions", action="store_true", help="the producers' permissions are checked")
    parser.add_argument("--producers", type=int, default=1, help="producer connections taking turns")
    parser.add_argument("--saturated", action="store_true", help="the queue saturates and clears once a frame")
    args = parser.parse_args()
    results = [run(args.messages, args.batch, args.size, args.permissions, args.producers, args.saturated)
               for _ in range(args.repeat)]
    print(f"broker core, {args.producers} producer(s), {args.size} B bodies, {args.batch} per TRANSFER"
          f"{', saturated' if args.saturated else ''}: "
          f"{min(results):.2f} us CPU per message (runs: {', '.join(f'{r:.2f}' for r in results)}); "
          f"{1e6 / min(results):,.0f} msgs/s on one core")


if __name__ == "__main__":
    main()
