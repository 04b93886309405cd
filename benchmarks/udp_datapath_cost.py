"""CPU per message of the UDP data path end to end, without sockets or trio: one process, datagrams by hand.

A producer's transport `Publication` offers 1 KiB messages (the SDK's bare PUBLISH envelope); its
datagrams go into the broker's `DataPath` (ingress: image, route, queue), whose UDP subscription
publishes the deliveries back out (egress); a consumer's `ReceiveChannel` takes them, polls and decodes
each DELIVER_BATCH envelope (the consumer's connection asks for capability "deliver-batch", as the SDK's
does; `--no-batches`: one DELIVER envelope per message, as for a client that does not), holds and
releases its term bytes as the SDK's UDP consumer does, and settles each batch with one SETTLE frame
over "TCP" (core.handle). Status messages go back both ways. What is
left out is what the end-to-end benchmark (benchmarks/udp_throughput.py) adds: system calls, the trio
scheduler, other processes. For instruction counts under callgrind, run it at two sizes and take the
difference (docs/performance.md):

    python benchmarks/udp_datapath_cost.py [--messages 40000] [--size 1024] [--repeat 3] [--part all]
                                           [--no-batches]

The producer offers PUBLISH_BATCH payloads of as many bodies as fit one datagram, as the SDK's UDP producer
does against a broker that offers them (`--no-publish-batch`: one bare PUBLISH per message, as against an
older broker, or as an Aeron client publishing plain messages).

`--part transport`: only the transport (Publication -> ReceiveChannel, no broker), the floor the
term append, datagram scan, rebuild and read cost together.

`--part ingress`: the producer -> broker half only (the UDP producer's side of issue 11 item 7): the
`Publication`'s datagrams into the broker's `DataPath`, routed to a queue whose subscriber is a TCP
consumer session (its DELIVER frames collected and encoded, one SETTLE per batch, as in
benchmarks/broker_core_cost.py). Set beside `broker_core_cost.py` (a TCP producer into the same core) it
says what a message costs the broker arriving over UDP rather than TCP; the CPU of the producer's
`offer`/`do_work` and of the broker's side are printed apart.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.session import Session
from flowbroker.broker.udp.datapath import DataPath
from flowbroker.protocol.capabilities import CAPABILITY_DELIVER_BATCH
from flowbroker.protocol.envelope import (
    DELIVER_BATCH,
    array_head_length,
    bin_length,
    decode_delivery,
    decode_delivery_batch,
    encode_publish,
    encode_publish_batch,
)
from flowbroker.protocol import Connection, Role
from flowbroker.protocol.frames import (
    PROTOCOL_VERSION,
    Hello,
    Ok,
    Outcome,
    RegisterPublication,
    Settle,
    Subscribe,
    SubscribeUdp,
    Welcome,
)
from flowbroker.transport.positions import frame_space
from flowbroker.transport.publication import Publication, PublicationConfig
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig

ENDPOINT = ("127.0.0.1", 5682)
PRODUCER = ("127.0.0.1", 40001)
CONSUMER = ("127.0.0.1", 40002)
STEP_NS = 100_000  # the clock moves 0.1 ms per round


def _ok(core: BrokerCore, session: Any, frame: Any) -> dict[str, Any]:
    core.handle(session, frame)
    for answer in session.collect(0):
        if isinstance(answer, Ok):
            return dict(answer.result)
    raise AssertionError(f"no OK for {frame}")


def run_transport(messages: int, size: int) -> float:
    """Publication -> ReceiveChannel only: per-message microseconds."""
    term_length, mtu = 2 << 20, 8192
    pub = Publication(PublicationConfig(7, 1001, term_length=term_length, mtu=mtu, max_messages_per_send=1024,
                                        publication_window=256 * 1024), 0, destination=ENDPOINT)
    channel = ReceiveChannel(1001, ReceiverConfig(receiver_id=3, receiver_window=1 << 20, session_id=7,
                                                  so_rcvbuf=1 << 20))
    sub = channel.add_subscription(0)
    payload = encode_publish(bytes(size))
    received = [0]

    def take(message: memoryview | bytes) -> None:
        received[0] += 1

    now = 0
    start = time.process_time()
    sent = 0
    while received[0] < messages:
        now += STEP_NS
        while sent < messages and pub.offer(payload) > 0:
            sent += 1
        for datagram, _ in pub.do_work(now):
            channel.on_datagram(datagram, PRODUCER, now)
        back = channel.do_work(now)
        while sub.poll(take, 256):
            pass
        for datagram, _ in back + channel.do_work(now):
            pub.on_datagram(datagram, ENDPOINT, now)
    elapsed = time.process_time() - start
    return elapsed / messages * 1e6


def _broker_with_publication(batches: bool = False) -> tuple[list[int], BrokerCore, DataPath, Session, Session,
                                                             Publication]:
    """A broker core with its UDP data path and a queue "bench", a producer session that registered a
    publication to it (the producer's `Publication`, as the SDK makes it from the answer), and a consumer
    session (asking for DELIVER_BATCH with `batches`); the clock is the list's one value, in nanoseconds."""
    config = load_config(None, {"server": {"memory_quota": 1 << 30}})
    clock = [0]
    core = BrokerCore(config, lambda: clock[0])
    datapath = DataPath(config.udp, core, ENDPOINT, lambda: None, seed=1)
    core.udp = datapath
    core.declare_queue("bench", None)
    owner = core.open_session("bench-producer", "anonymous", True, lambda: None)
    owner.peer_host = PRODUCER[0]
    consumer = core.open_session("bench-consumer", "anonymous", True, lambda: None,
                                 capabilities=[CAPABILITY_DELIVER_BATCH] if batches else [])
    consumer.peer_host = CONSUMER[0]
    answer = _ok(core, owner, RegisterPublication(1 << 32, "", "bench", 1001, PRODUCER[1]))
    pub = Publication(PublicationConfig(answer["session_id"], 1001, term_length=answer["term_length"],
                                        mtu=answer["mtu"], max_messages_per_send=1024,
                                        publication_window=min(256 * 1024, answer["term_length"] // 2)),
                      0, destination=ENDPOINT)
    return clock, core, datapath, owner, consumer, pub


def _payload(pub: Publication, size: int, publish_batch: bool) -> tuple[bytes, int]:
    """What the producer offers at a time and how many messages it carries: a datagram's worth of bodies
    as one PUBLISH_BATCH, or one bare PUBLISH."""
    if not publish_batch:
        return encode_publish(bytes(size)), 1
    per_batch = max(1, (pub.mtu - 32 - 1 - array_head_length(1024)) // bin_length(size))
    return encode_publish_batch([bytes(size)] * min(per_batch, 1024)), min(per_batch, 1024)


def run(messages: int, size: int, batches: bool = True, publish_batch: bool = True) -> float:
    """Producer publication -> broker data path -> consumer channel: per-message microseconds."""
    clock, core, datapath, owner, consumer, pub = _broker_with_publication(batches)
    window = 1 << 20
    sub_answer = _ok(core, consumer, SubscribeUdp(1 << 32, 1, "bench", 2000, window, CONSUMER[1], 1002))
    channel = ReceiveChannel(1002, ReceiverConfig(receiver_id=9, receiver_window=window,
                                                  session_id=sub_answer["session_id"], so_rcvbuf=1 << 20))
    sub = channel.add_subscription(0)
    sub_id = sub.subscription_id
    payload, carried = _payload(pub, size, publish_batch)
    messages = max(messages // carried, 1) * carried  # whole batches
    tags: list[int] = []
    held = [0]
    received = [0]

    def take(message: memoryview | bytes) -> None:
        image = channel_image[0]
        space = frame_space(len(message), image.mtu)
        image.hold(sub_id, space)
        held[0] += space
        if message[0] == DELIVER_BATCH:
            entries = decode_delivery_batch(message)
            tags.extend(e[0] for e in entries)
            received[0] += len(entries)
            return
        entry = decode_delivery(message)
        tags.append(entry.delivery_tag)
        received[0] += 1

    channel_image: list[Any] = [None]
    sent = 0
    start = time.process_time()
    while received[0] < messages:
        clock[0] += STEP_NS
        now = clock[0]
        while sent < messages and pub.offer(payload) > 0:
            sent += carried
        for datagram, _ in pub.do_work(now):
            datapath.on_datagram(datagram, PRODUCER, now)
        for datagram, address in datapath.do_work(now):
            if address == CONSUMER:
                channel.on_datagram(datagram, ENDPOINT, now)
            else:
                pub.on_datagram(datagram, ENDPOINT, now)
        back = channel.do_work(now)
        if channel_image[0] is None:
            channel_image[0] = next(iter(channel.images.values()), None)
        while channel_image[0] is not None and sub.poll(take, 256):
            pass
        if tags:  # processed: release the bytes, settle the batch over "TCP"
            channel_image[0].release(sub_id, held[0])
            held[0] = 0
            channel_image[0].report_now()
            core.handle(consumer, Settle(Outcome.ACK, [(tags[0], tags[-1])]))
            tags.clear()
        consumer.collect(now)
        owner.collect(now)
        for datagram, _ in back + channel.do_work(now):
            datapath.on_datagram(datagram, CONSUMER, now)
    elapsed = time.process_time() - start
    queue = core.queues["bench"]
    assert queue.counters.dequeued == messages and queue.count == 0, "every message delivered and acked"
    return elapsed / messages * 1e6


def run_ingress(messages: int, size: int, split: list[float] | None = None, publish_batch: bool = True) -> float:
    """Producer publication -> broker data path -> queue -> TCP consumer session: per-message microseconds
    of the whole; ``split`` gets the producer's and the broker's shares (microseconds per message)."""
    clock, core, datapath, owner, consumer, pub = _broker_with_publication()
    # The consumer speaks through a broker-side protocol state machine, as on the wire.
    c_client, c_broker = Connection(Role.CLIENT), Connection(Role.BROKER)
    c_broker.receive_data(c_client.send(Hello(PROTOCOL_VERSION, "bench", True, [])))
    c_broker.next_frame()
    c_client.receive_data(c_broker.send(Welcome(PROTOCOL_VERSION, 1, "bench", 8 << 20, 1 << 20, 60_000, 1 << 20,
                                                "anonymous")))
    c_client.next_frame()
    c_broker.receive_data(c_client.send(Subscribe(1, 1, "bench", 100_000, 0)))
    core.handle(consumer, c_broker.next_frame())  # type: ignore[arg-type]
    b"".join(c_broker.send(f) for f in consumer.collect(0))
    payload, carried = _payload(pub, size, publish_batch)
    messages = max(messages // carried, 1) * carried  # whole batches
    sent = 0
    settled = 0
    producer_cpu = 0.0
    start = time.process_time()
    while settled < messages:
        clock[0] += STEP_NS
        now = clock[0]
        t0 = time.process_time()
        while sent < messages and pub.offer(payload) > 0:
            sent += carried
        datagrams = pub.do_work(now)
        producer_cpu += time.process_time() - t0
        for datagram, _ in datagrams:
            datapath.on_datagram(datagram, PRODUCER, now)
        back = datapath.do_work(now)
        owner.collect(now)
        delivered = settled
        for frame in consumer.collect(now):
            c_broker.send(frame)
            entries = getattr(frame, "entries", None)
            if entries:
                delivered = entries[-1][0]  # the broker's DELIVER entries are plain tuples (delivery_tag first)
        if delivered > settled:  # one SETTLE per collect, as the SDK sends them
            core.handle(consumer, Settle(Outcome.ACK, [(settled + 1, delivered)]))
            settled = delivered
        back += datapath.do_work(now)
        t0 = time.process_time()
        for datagram, _ in back:
            pub.on_datagram(datagram, ENDPOINT, now)
        producer_cpu += time.process_time() - t0
    elapsed = time.process_time() - start
    queue = core.queues["bench"]
    assert queue.counters.dequeued == messages and queue.count == 0, "every message delivered and acked"
    if split is not None:
        split[:] = [producer_cpu / messages * 1e6, (elapsed - producer_cpu) / messages * 1e6]
    return elapsed / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best is printed (least disturbed)")
    parser.add_argument("--part", choices=("all", "transport", "ingress"), default="all")
    parser.add_argument("--no-publish-batch", action="store_true",
                        help="the producer offers one bare PUBLISH per message, not PUBLISH_BATCHes")
    parser.add_argument("--no-batches", action="store_true",
                        help="the consumer does not ask for DELIVER_BATCH: one DELIVER envelope per message")
    args = parser.parse_args()
    if args.part == "ingress":
        splits: list[list[float]] = []
        results = []
        for _ in range(args.repeat):
            split: list[float] = []
            results.append(run_ingress(args.messages, args.size, split, not args.no_publish_batch))
            splits.append(split)
        best = min(range(len(results)), key=results.__getitem__)
        print(f"UDP data path (producer -> broker -> TCP consumer session), {args.size} B bodies: "
              f"{results[best]:.2f} us CPU per message (runs: {', '.join(f'{r:.2f}' for r in results)}); "
              f"of the best run, producer {splits[best][0]:.2f} us, broker {splits[best][1]:.2f} us")
        return
    if args.part == "all":
        results = [run(args.messages, args.size, not args.no_batches, not args.no_publish_batch)
                   for _ in range(args.repeat)]
        what = (f"producer -> broker -> UDP consumer, {'one PUBLISH each' if args.no_publish_batch else 'PUBLISH_BATCH'}"
                f", {'one DELIVER each' if args.no_batches else 'DELIVER_BATCH'}")
    else:
        results = [run_transport(args.messages, args.size) for _ in range(args.repeat)]
        what = "transport only"
    print(f"UDP data path ({what}), {args.size} B bodies: {min(results):.2f} us CPU per message "
          f"(runs: {', '.join(f'{r:.2f}' for r in results)}); {1e6 / min(results):,.0f} msgs/s on one core")


if __name__ == "__main__":
    main()
