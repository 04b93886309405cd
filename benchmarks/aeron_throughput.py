"""Throughput of the Aeron-compatible transport, Python publication -> Python subscription over loopback.

Not a test: run it and read the numbers.

    .venv/bin/python benchmarks/aeron_throughput.py [--seconds 10] [--lossy-messages 1000000]

1. For 32 B and 1 KiB messages: a publication process and a subscription process exchange messages for
   ``--seconds`` over 127.0.0.1 (several frames per datagram, up to the channel's MTU); prints msgs/s, MB/s,
   NAKs and retransmits, and checks every message arrived once and in order.
2. The ceiling for Python on this machine: a tight ``sendto`` loop of datagrams of the message size.
3. ``--lossy-messages`` messages through 5 % loss + 1 % duplication + 1 % reordering (the seeded fake
   network from the tests, simulated time), delivered exactly once and in order; prints the wall time.

The duty-cycle loops here are plain synchronous loops over ``udp.open_udp`` endpoints: the same sans-IO
objects the trio drivers run, without a scheduler in the way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import struct
import sys
import time
from pathlib import Path

from flowbroker.transport.channel import parse_channel
from flowbroker.transport.publication import OfferResult, Publication
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig
from flowbroker.transport.udp import open_udp

STREAM_ID = 10
SESSION_ID = 4321
SEQ = struct.Struct("<Q")


def channel_uri(port: int) -> str:
    # A large MTU packs many frames per datagram (Aeron's way to throughput); the window and socket
    # buffers are sized to hold several of them.
    return (
        f"aeron:udp?endpoint=127.0.0.1:{port}|mtu=32768|term-length=16m|rcv-wnd=2m"
        f"|so-rcvbuf=4m|so-sndbuf=4m"
    )


def subscriber(port_queue: mp.Queue, result_queue: mp.Queue, seconds: float) -> None:  # type: ignore[type-arg]
    endpoint = open_udp(("127.0.0.1", 0), so_rcvbuf=4 << 20, so_sndbuf=4 << 20)
    port_queue.put(endpoint.local_address[1])
    uri = parse_channel(channel_uri(endpoint.local_address[1]))
    channel = ReceiveChannel(STREAM_ID, ReceiverConfig.from_channel(uri, receiver_id=77))
    sub = channel.add_subscription(0)
    state = {"next": 0, "bad": 0, "bytes": 0}

    def handler(message: memoryview | bytes) -> None:
        seq = SEQ.unpack_from(message, 0)[0]
        if seq != state["next"]:
            state["bad"] += 1
        state["next"] = seq + 1
        state["bytes"] += len(message)

    started: float | None = None
    last = 0.0
    stop_at = time.monotonic() + seconds + 30
    try_receive = endpoint.try_receive
    on_datagram = channel.on_datagram
    while time.monotonic() < stop_at:
        now = time.monotonic_ns()
        for _ in range(64):
            got = try_receive()
            if got is None:
                break
            on_datagram(got[0], got[1], now)
        if sub.poll(handler, 1 << 16):
            last = time.monotonic()
            if started is None:
                started = last
        for datagram, address in channel.do_work(time.monotonic_ns()):
            endpoint.send(datagram, address)  # type: ignore[arg-type]
        if started is not None and not channel.images:
            break  # end of stream: the publication closed and the image drained
    elapsed = last - started if started is not None else 0.0
    naks = sum(i.naks_sent for i in channel.images.values())
    result_queue.put((state["next"], state["bad"], state["bytes"], elapsed, naks, dict(channel.dispositions)))


def publisher(port: int, size: int, seconds: float, result_queue: mp.Queue) -> None:  # type: ignore[type-arg]
    endpoint = open_udp(("127.0.0.1", 0), so_rcvbuf=4 << 20, so_sndbuf=4 << 20)
    uri = parse_channel(channel_uri(port))
    pub = Publication.from_channel(
        uri, STREAM_ID, SESSION_ID, time.monotonic_ns(), destination=("127.0.0.1", port),
        max_messages_per_send=8,
    )
    payload = bytearray(size)
    seq = 0
    deadline = None
    offer = pub.offer
    pack = SEQ.pack_into
    while True:
        now = time.monotonic_ns()
        if deadline is None and pub.is_connected:
            deadline = time.monotonic() + seconds
        if deadline is not None and not pub.is_closed:
            if time.monotonic() >= deadline:
                pub.close(now)
            else:
                for _ in range(256):
                    pack(payload, 0, seq)
                    result = offer(payload)
                    if result > 0:
                        seq += 1
                    elif result != OfferResult.ADMIN_ACTION:
                        break
        for datagram, address in pub.do_work(now):
            endpoint.send(datagram, address)  # type: ignore[arg-type]
        for _ in range(16):
            got = endpoint.try_receive()
            if got is None:
                break
            pub.on_datagram(got[0], got[1], now)
        if pub.is_closed and pub.sender_position >= pub.position and pub.counters.heartbeats_sent:
            break
    s = pub.counters
    result_queue.put((seq, s.retransmits_sent, s.naks_received, endpoint.counters.send_drops))


def run_pair(size: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("fork")
    port_queue: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    sub_results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    pub_results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    sub_proc = ctx.Process(target=subscriber, args=(port_queue, sub_results, seconds))
    sub_proc.start()
    port = port_queue.get(timeout=10)
    pub_proc = ctx.Process(target=publisher, args=(port, size, seconds, pub_results))
    pub_proc.start()
    sent, retransmits, naks_received, send_drops = pub_results.get(timeout=seconds + 60)
    received, bad, nbytes, elapsed, naks, dispositions = sub_results.get(timeout=seconds + 60)
    pub_proc.join(10)
    sub_proc.join(10)
    return {
        "size": size, "sent": sent, "received": received, "out_of_order": bad, "seconds": elapsed,
        "msgs_per_s": received / elapsed, "mb_per_s": nbytes / elapsed / 1e6, "naks": naks,
        "naks_received": naks_received, "retransmits": retransmits, "send_drops": send_drops,
    }


def sendto_ceiling(size: int, seconds: float) -> tuple[float, float]:
    """Datagrams/s and MB/s of a tight non-blocking sendto loop to a loopback port nobody reads."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.setblocking(False)
    address = sink.getsockname()
    data = bytes(size)
    count = 0
    sendto = sender.sendto
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(1000):
            try:
                sendto(data, address)
            except BlockingIOError:
                continue
            count += 1
    sender.close()
    sink.close()
    return count / seconds, count * size / seconds / 1e6


def lossy(messages: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.transport
    from tests.transport.fakenet import FakeNetwork, pump  # noqa: PLC0415

    from flowbroker.transport.publication import PublicationConfig  # noqa: PLC0415

    pub_addr, sub_addr = ("10.0.0.1", 1), ("10.0.0.2", 2)
    net = FakeNetwork(42, loss=0.05, duplicate=0.01, reorder=0.01, jitter_ns=20_000)
    config = PublicationConfig(session_id=1, stream_id=STREAM_ID, term_length=1 << 20, mtu=8192,
                               initial_term_id=2**31 - 5, max_messages_per_send=8)
    pub = Publication(config, 0, destination=sub_addr)
    channel = ReceiveChannel(STREAM_ID, ReceiverConfig(receiver_id=9, receiver_window=256 * 1024,
                                                       so_rcvbuf=1 << 20))
    sub = channel.add_subscription(0)
    state = {"next": 0, "bad": 0}

    def handler(message: memoryview | bytes) -> None:
        seq = SEQ.unpack_from(message, 0)[0]
        if seq != state["next"]:
            state["bad"] += 1
        state["next"] = seq + 1

    payload = bytearray(32)
    sent = 0
    now = 0
    started = time.monotonic()
    while state["next"] < messages and now < 3600 * 10**9:
        while sent < messages:
            SEQ.pack_into(payload, 0, sent)
            result = pub.offer(payload)
            if result == OfferResult.ADMIN_ACTION:
                continue
            if result < 0:
                break
            sent += 1
        pump(net, {pub_addr: pub, sub_addr: channel}, now)
        sub.poll(handler, 1 << 16)
        now += 100_000
    wall = time.monotonic() - started
    image = next(iter(channel.images.values()))
    print(f"lossy: {state['next']:,} of {messages:,} messages delivered, {state['bad']} out of order/duplicate, "
          f"{wall:.1f} s wall ({now / 1e9:.2f} s simulated); network dropped {net.stats.dropped:,}, "
          f"duplicated {net.stats.duplicated:,}, reordered {net.stats.reordered:,}; "
          f"NAKs {image.naks_sent:,}, retransmits {pub.counters.retransmits_sent:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--ceiling-seconds", type=float, default=3.0)
    parser.add_argument("--lossy-messages", type=int, default=1_000_000)
    parser.add_argument("--sizes", type=int, nargs="*", default=[32, 1024])
    args = parser.parse_args()
    for size in args.sizes:
        r = run_pair(size, args.seconds)
        ceiling_dps, ceiling_mbs = sendto_ceiling(size, args.ceiling_seconds)
        ok = r["received"] == r["sent"] and r["out_of_order"] == 0
        print(
            f"{size:>5} B: {r['msgs_per_s']:>10,.0f} msgs/s {r['mb_per_s']:>7.1f} MB/s  "
            f"({r['received']:,} of {r['sent']:,} in {r['seconds']:.1f} s, exactly once in order: {ok})  "
            f"NAKs {r['naks']:.0f}, retransmits {r['retransmits']:.0f}, send drops {r['send_drops']:.0f} | "
            f"sendto ceiling {ceiling_dps:,.0f} datagrams/s {ceiling_mbs:.1f} MB/s -> "
            f"{100 * r['mb_per_s'] / ceiling_mbs:.0f} % of ceiling"
        )
    if args.lossy_messages:
        lossy(args.lossy_messages)


if __name__ == "__main__":
    main()
