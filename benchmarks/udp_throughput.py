"""The broker's UDP data path against its TCP path: a broker process, a producer process and a consumer process
on 127.0.0.1, flow control on, 1 KiB messages by default. One run prints, for each pairing:

  tcp-tcp   the SDK's TCP producer -> broker -> TCP consumer (as benchmarks/broker_throughput.py does it)
  udp-tcp   the SDK's UDP producer (conn.producer("", queue, transport="udp")) -> broker -> TCP consumer
  udp-udp   UDP producer -> broker -> UDP consumer (conn.consumer(queue, transport="udp"))

end-to-end msgs/s and MB/s (first send to last delivery), the CPU time per message of the producer, the
broker and the consumer process (steadier than msgs/s on a shared machine), p50/p99 publish-to-deliver latency (the producer
writes time.monotonic_ns() into the first 8 bytes of each body; CLOCK_MONOTONIC is shared by the processes
of one Linux machine), the broker's idle and peak RSS (psutil), and NAKs and retransmits: the SDK side's
from the producer's and consumer's statistics(), the broker's from its admin API (GET /api/broker) when
started with --admin and it reports them. Then:

  overload  the UDP producer unpaced, the consumer 10x slower than the udp-tcp rate just measured (or
            --overload-consumer-rate), for --overload-seconds (30): the broker's RSS every second.
  lossy     (--lossy) --lossy-messages (10^6) from a transport-level Aeron publication through a lossy relay
            (tests/e2e/udprelay.py: 5 % loss, 1 % duplication, 1 % reordering both ways) to the broker
            and a TCP consumer that counts every sequence number: exactly once, in order. The
            publication registers with REGISTER_PUBLICATION naming the relay's port as its source
            (the SDK registers its own socket's port, so the relay could not stand in for it).

The broker runs as `flowbroker serve --port P --udp-endpoint 127.0.0.1:U --no-admin` (a fresh one per
pairing and round). Whatever cannot be measured (a broker or SDK without the UDP transport, a counter the
broker does not report) is printed as such, and the run goes on.

    python benchmarks/udp_throughput.py [--messages N] [--rounds R] [--only tcp-tcp,udp-tcp,udp-udp,overload]
                                        [--overload-seconds S] [--lossy] [--admin] [--broker-config FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import multiprocessing as mp
import queue
import random
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import trio

import flowbroker.client as fb
from broker_throughput import QUEUE, STAMP, MiB, _queue_count, percentile_ms
from procs import cpu_seconds, free_port, rss, stop_broker, wait_listening

SEQ = struct.Struct("<Q")
PAIRINGS = {"tcp-tcp": ("tcp", "tcp"), "udp-tcp": ("udp", "tcp"), "udp-udp": ("udp", "udp")}
COUNTER_WORDS = ("nak", "retransmit")


class Unsupported(Exception):
    """The SDK or the broker lacks what a scenario needs: reported as "not measured", not as a failure."""


# -- the broker process -------------------------------------------------------------------------


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.udp_port = free_udp_port()
        self.url = f"flowbroker://127.0.0.1:{self.port}"
        self.admin_port = free_port() if args.admin else None
        admin = ["--admin-port", str(self.admin_port)] if self.admin_port else ["--no-admin"]
        exe = Path(sys.executable).with_name("flowbroker")
        self.proc = wait_listening(subprocess.Popen(
            [str(exe), "serve", "--port", str(self.port), "--udp-endpoint", f"127.0.0.1:{self.udp_port}", *admin,
             "--memory-quota", args.quota, *(["--config", args.broker_config] if args.broker_config else [])],
            stderr=subprocess.DEVNULL), self.port)

    def rss(self) -> int:
        return rss(self.proc.pid)

    def counters(self) -> str:
        """The broker's NAK/retransmit counters from its admin API, or why there are none."""
        if self.admin_port is None:
            return "not measured (the broker runs with --no-admin; --admin asks its admin API)"
        try:
            from flowbroker.broker.adminclient import AdminClient
            client = AdminClient(f"http://127.0.0.1:{self.admin_port}", None)
            found = _find_counters(client.request("GET", "/api/broker"))
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return f"not measured (admin API: {type(exc).__name__}: {exc})"
        return _format(found) if found else "not measured (GET /api/broker reports no NAK or retransmit counter)"

    def stop(self) -> None:
        stop_broker(self.proc)


def _find_counters(obj: Any, prefix: str = "") -> dict[str, int]:
    """Every integer under a key naming NAKs or retransmits, in a statistics() snapshot or a JSON answer."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    found: dict[str, int] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            name = f"{prefix}{key}"
            if isinstance(value, int) and not isinstance(value, bool):
                if any(word in str(key).lower() for word in COUNTER_WORDS):
                    found[name] = value
            else:
                found.update(_find_counters(value, name + "."))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found.update(_find_counters(value, f"{prefix}{i}."))
    return found


def _format(counters: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counters.items())) or "none reported"


# -- the SDK's UDP transport, through its contract ------------------------------------------------


def open_producer(conn: fb.Connection, transport: str, window: int) -> Any:
    if transport == "tcp":
        return conn.producer(routing_key=QUEUE, window=window)
    try:
        return cast(Any, conn).producer("", QUEUE, transport="udp")
    except TypeError as exc:
        raise Unsupported(f"this SDK has no UDP producer: conn.producer(..., transport='udp') -> {exc}") from None


def open_consumer(conn: fb.Connection, transport: str, prefetch: int) -> Any:
    if transport == "tcp":
        return conn.consumer(QUEUE, prefetch=prefetch)
    try:
        return cast(Any, conn).consumer(QUEUE, transport="udp", prefetch=prefetch)
    except TypeError as exc:
        raise Unsupported(f"this SDK has no UDP consumer: conn.consumer(..., transport='udp') -> {exc}") from None


def preload(transport: str) -> None:
    """Import the SDK's UDP modules before a worker's CPU clock starts. The SDK imports them on first use
    (about 56 ms of CPU once, `python -X importtime`), which over 100,000 messages read as 0.5 us each of
    the UDP consumer's CPU per message and none of the TCP one's."""
    if transport == "udp":
        try:
            for module in ("flowbroker.client.udpconsumer", "flowbroker.client.udpproducer"):
                importlib.import_module(module)
        except ImportError:  # an SDK without them: open_consumer / open_producer say so
            pass


def _statistics(obj: Any) -> dict[str, int]:
    try:
        return _find_counters(obj.statistics())
    except Exception:  # noqa: BLE001 - a statistics() we cannot read is reported as none
        return {}


def _wire_counters(producer: Any) -> dict[str, int]:
    """A UDP producer's data datagrams sent and status messages received (how many messages each
    datagram carried, how many SMs the broker sent for them); empty for a TCP producer or an SDK without."""
    counters = getattr(getattr(producer, "publication", None), "counters", None)
    if counters is None:
        return {}
    return {name: int(getattr(counters, name, 0)) for name in ("data_datagrams_sent", "status_messages_received")}


def _contained(run: Any, out: Any) -> None:
    """Run a worker's trio main; put its result, or what stopped it as one line, on `out`."""
    try:
        out.put(trio.run(run))
    except Unsupported as exc:
        out.put({"error": str(exc)})
    except BaseException as exc:  # noqa: BLE001 - a worker reports, the parent prints
        out.put({"error": f"{type(exc).__name__}: {exc}"})


# -- worker processes ---------------------------------------------------------------------------


def producer_main(url: str, transport: str, count: int, size: int, seconds: float, window: int, out: Any) -> None:
    """Send `count` messages (or until `seconds` pass) as fast as credit allows, then flush."""

    preload(transport)

    async def run() -> dict[str, Any]:
        pad = b"x" * (size - STAMP.size - SEQ.size)
        sent = 0
        async with await fb.connect(url, client_name=f"bench-{transport}-producer") as conn:
            producer = open_producer(conn, transport, window)
            cpu = time.process_time()
            start = time.monotonic()
            end = start + seconds
            while sent < count and time.monotonic() < end:
                await producer.send(STAMP.pack(time.monotonic_ns()) + SEQ.pack(sent) + pad, timeout=60)
                sent += 1
            if seconds == float("inf"):
                await producer.flush(timeout=120)
            counters = _statistics(producer)
            wire = _wire_counters(producer)
        return {"sent": sent, "start": start, "end": time.monotonic(), "counters": counters,
                "cpu": time.process_time() - cpu, "wire": wire}

    _contained(run, out)


def consumer_main(url: str, transport: str, count: int, per_second: float, sample_every: int, out: Any) -> None:
    """Receive `count` messages, checking each sequence number arrives once and in order; `per_second`
    > 0 paces the consumer."""
    preload(transport)

    async def run() -> dict[str, Any]:
        latencies: list[int] = []
        received = duplicates = out_of_order = 0
        expected = 0
        first = time.monotonic()
        cpu = time.process_time()
        async with await fb.connect(url, client_name=f"bench-{transport}-consumer") as conn:
            async with open_consumer(conn, transport, 2000) as consumer:
                async for msg in consumer:
                    body = msg.body
                    if received % sample_every == 0:
                        latencies.append(time.monotonic_ns() - STAMP.unpack_from(body)[0])
                    seq = SEQ.unpack_from(body, STAMP.size)[0]
                    if seq < expected:
                        duplicates += 1
                    elif seq > expected:
                        out_of_order += 1
                    expected = max(expected, seq + 1)
                    received += 1
                    await msg.ack()
                    if per_second:
                        delay = first + received / per_second - time.monotonic()
                        if delay > 0:
                            await trio.sleep(delay)
                    if received >= count:
                        break
                counters = _statistics(consumer)
        return {"received": received, "last": time.monotonic(), "latencies": latencies, "duplicates": duplicates,
                "out_of_order": out_of_order, "counters": counters, "cpu": time.process_time() - cpu}

    _contained(run, out)


# -- orchestration --------------------------------------------------------------------------------


class Pair:
    """A consumer process and a producer process against `broker`; `wait()` samples the broker's RSS."""

    def __init__(self, broker: Broker, producer_args: tuple[Any, ...], consumer_args: tuple[Any, ...],
                 producer_target: Any = producer_main) -> None:
        ctx = mp.get_context("spawn")
        self.broker = broker
        self.pq: Any = ctx.Queue()
        self.cq: Any = ctx.Queue()
        self.consumer = ctx.Process(target=consumer_main, args=(*consumer_args, self.cq))
        self.consumer.start()
        time.sleep(1.5)  # subscribed before the first message
        self.producer = ctx.Process(target=producer_target, args=(*producer_args, self.pq))
        self.producer.start()
        self.p: dict[str, Any] | None = None
        self.c: dict[str, Any] | None = None
        self.peak = 0

    def poll(self) -> str | None:
        """Collect what has arrived; the error that ends the pairing, if any."""
        self.peak = max(self.peak, self.broker.rss())
        for name, q in (("producer", self.pq), ("consumer", self.cq)):
            if (self.p if name == "producer" else self.c) is not None:
                continue
            try:
                got = q.get(timeout=0.05)
            except queue.Empty:
                proc = self.producer if name == "producer" else self.consumer
                if not proc.is_alive():
                    return f"the {name} process died (exit code {proc.exitcode})"
                continue
            if "error" in got:
                return f"{name}: {got['error']}"
            if name == "producer":
                self.p = got
            else:
                self.c = got
        return None

    def wait(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while self.c is None or self.p is None:
            error = self.poll()
            if error is not None:
                return error
            if time.monotonic() > deadline:
                return f"timed out after {timeout:.0f} s"
        return None

    def end(self) -> None:
        for proc in (self.producer, self.consumer):
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)


def scenario_pairing(args: argparse.Namespace, name: str, round_no: int) -> float | None:
    """One pairing, one round; returns msgs/s, or None if it could not be measured."""
    sending, receiving = PAIRINGS[name]
    label = f"{name} round {round_no}: {sending.upper()} producer -> broker -> {receiving.upper()} consumer, " \
            f"{args.messages:,} x {args.size} B"
    print(f"\n== {label} ==", flush=True)
    broker = Broker(args)
    pair: Pair | None = None
    try:
        trio.run(_queue_count, broker.url)
        idle = broker.rss()
        broker_cpu = cpu_seconds(broker.proc.pid)
        pair = Pair(broker, (broker.url, sending, args.messages, args.size, float("inf"), args.window),
                    (broker.url, receiving, args.messages, 0.0, 10))
        error = pair.wait(args.timeout)
        broker_cpu = cpu_seconds(broker.proc.pid) - broker_cpu
        if error is not None:
            print(f"not measured: {error}")
            return None
        p, c = pair.p, pair.c
        assert p is not None and c is not None
        elapsed = c["last"] - p["start"]
        rate = float(c["received"] / elapsed)
        print(f"{c['received']:,} of {p['sent']:,} delivered in {elapsed:.2f} s: {rate:,.0f} msgs/s, "
              f"{c['received'] * args.size / elapsed / 1e6:.1f} MB/s end to end "
              f"(duplicates {c['duplicates']}, out of order {c['out_of_order']})")
        lat = c["latencies"]
        print(f"publish->deliver latency over {len(lat):,} samples: p50 {percentile_ms(lat, 0.5):.3f} ms, "
              f"p99 {percentile_ms(lat, 0.99):.3f} ms")
        print(f"broker RSS: idle {idle / MiB:.1f} MiB, peak {max(pair.peak, idle) / MiB:.1f} MiB")
        # CPU per message of each process: what a shared machine's load does not change as it does msgs/s.
        n = max(c["received"], 1)
        print(f"CPU per message: producer {p.get('cpu', 0) / n * 1e6:.1f} us, broker {broker_cpu / n * 1e6:.1f} us, "
              f"consumer {c.get('cpu', 0) / n * 1e6:.1f} us")
        wire = p.get("wire") or {}
        if wire.get("data_datagrams_sent"):
            print(f"producer datagrams: {wire['data_datagrams_sent']:,} ({p['sent'] / wire['data_datagrams_sent']:.2f} "
                  f"messages each), status messages from the broker: {wire.get('status_messages_received', 0):,}")
        if "udp" in name:
            print(f"NAKs/retransmits: producer {_format(p['counters']) if sending == 'udp' else '(TCP)'}; "
                  f"consumer {_format(c['counters']) if receiving == 'udp' else '(TCP)'}; broker {broker.counters()}")
        return rate
    finally:
        if pair is not None:
            pair.end()
        broker.stop()


def scenario_overload(args: argparse.Namespace, udp_rate: float | None) -> None:
    slow = args.overload_consumer_rate or (udp_rate / 10 if udp_rate else 5000.0)
    print(f"\n== overload: UDP producer unpaced, TCP consumer at {slow:,.0f} msgs/s, {args.overload_seconds:.0f} s ==")
    broker = Broker(args)
    pair: Pair | None = None
    try:
        trio.run(_queue_count, broker.url)
        time.sleep(0.5)
        idle = broker.rss()
        stop_size = 80 * MiB  # the broker's default flow_stop_size
        print(f"broker idle RSS {idle / MiB:.1f} MiB; target: idle + stop size + 32 MiB = "
              f"{(idle + stop_size + 32 * MiB) / MiB:.1f} MiB")
        pair = Pair(broker, (broker.url, "udp", 10**12, args.size, args.overload_seconds, args.window),
                    (broker.url, "tcp", 10**12, slow, 100))
        started = time.monotonic()
        next_print = started + 1.0
        peak = idle
        while pair.p is None:
            error = pair.poll()
            if error is not None:
                print(f"not measured: {error}")
                return
            if time.monotonic() >= next_print:
                next_print += 1.0
                now_rss = broker.rss()
                peak = max(peak, now_rss)
                depth = trio.run(_queue_count, broker.url)
                print(f"t={time.monotonic() - started:5.1f}s  broker RSS {now_rss / MiB:7.1f} MiB "
                      f"(+{(now_rss - idle) / MiB:6.1f})  queue depth {depth:,} messages")
            if time.monotonic() > started + args.overload_seconds + args.timeout:
                print("not measured: the producer did not stop")
                return
        p = pair.p
        print(f"producer sent {p['sent']:,} messages ({p['sent'] / (p['end'] - p['start']):,.0f} msgs/s, paced by "
              f"credit); NAKs/retransmits: producer {_format(p['counters'])}; broker {broker.counters()}")
        peak = max(peak, pair.peak)
        verdict = "within" if peak - idle <= stop_size + 32 * MiB else "OVER"
        print(f"peak RSS {peak / MiB:.1f} MiB = idle + {(peak - idle) / MiB:.1f} MiB: {verdict} the target")
    finally:
        if pair is not None:
            pair.end()
        broker.stop()


# -- lossy: an Aeron publication through tests/e2e/udprelay.py ---------------------------------------


def lossy_producer_main(url: str, udp_port: int, count: int, size: int, seed: int, loss: float, out: Any) -> None:
    """Register a publication whose source is a lossy relay's port, publish `count` envelopes through the
    relay, then keep the publication and the relay running (retransmits) until the parent ends us; the
    relay's and the publication's counters go to `out` each second."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from flowbroker.protocol.envelope import encode_publish
    from flowbroker.protocol.frames import RegisterPublication
    from flowbroker.transport.publication import Publication, PublicationConfig
    from flowbroker.transport.udp import PublicationDriver, now_ns, open_udp
    from tests.e2e.udprelay import Impairment, LossyRelay

    async def run() -> dict[str, Any]:
        impairment = Impairment(loss, loss / 5, loss / 5)
        relay = LossyRelay(("127.0.0.1", udp_port), seed=seed, to_server=impairment, to_client=impairment)
        endpoint = open_udp(("127.0.0.1", 0), so_rcvbuf=4 << 20, so_sndbuf=4 << 20)
        async with await fb.connect(url, client_name="bench-lossy-producer") as conn, relay, endpoint:
            try:
                answer = await conn._request(
                    lambda rid: RegisterPublication(rid, "", QUEUE, 1001, relay.server_port), 10)
            except Exception as exc:
                raise Unsupported(f"REGISTER_PUBLICATION failed: {type(exc).__name__}: {exc}") from None
            config = PublicationConfig(session_id=int(answer["session_id"]), stream_id=int(answer["stream_id"]),
                                       term_length=int(answer["term_length"]), mtu=int(answer["mtu"]),
                                       initial_term_id=random.Random(seed).randrange(-(2**31), 2**31))
            publication = Publication(config, now_ns(), destination=relay.client_address)
            driver = PublicationDriver(publication, endpoint)
            pad = b"x" * (size - STAMP.size - SEQ.size)
            start = time.monotonic()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay.run)
                nursery.start_soon(driver.run)
                for seq in range(count):
                    payload = encode_publish(STAMP.pack(time.monotonic_ns()) + SEQ.pack(seq) + pad)
                    position = await driver.publish(payload, deadline=trio.current_time() + 60)
                    if position < 0:
                        raise RuntimeError(f"publish {seq} failed: {position}")
                out.put({"sent": count, "start": start, "end": time.monotonic()})
                while True:  # retransmits until the parent has seen every message and ends this process
                    await trio.sleep(1.0)
                    stats = publication.statistics()
                    out.put({"relay": {k: dataclasses.asdict(v) for k, v in relay.counters.items()},
                             "naks_received": stats.naks_received, "retransmits_sent": stats.retransmits_sent})
        return {}

    _contained(run, out)


def scenario_lossy(args: argparse.Namespace) -> None:
    count = args.lossy_messages
    print(f"\n== lossy: {count:,} x {args.size} B, Aeron publication -> relay ({args.loss:.0%} loss, "
          f"{args.loss / 5:.0%} duplication, {args.loss / 5:.0%} reordering both ways) -> broker -> TCP consumer ==")
    broker = Broker(args)
    pair: Pair | None = None
    try:
        trio.run(_queue_count, broker.url)
        pair = Pair(broker, (broker.url, broker.udp_port, count, args.size, 7, args.loss),
                    (broker.url, "tcp", count, 0.0, 100), producer_target=lossy_producer_main)
        deadline = time.monotonic() + args.timeout
        last: dict[str, Any] = {}
        while pair.c is None:
            error = pair.poll()  # the producer's first report ("sent") becomes pair.p, its later ones counters
            if pair.p is not None:
                try:
                    last = pair.pq.get_nowait()
                except queue.Empty:
                    pass
            if error is not None:
                print(f"not measured: {error}")
                return
            if time.monotonic() > deadline:
                print(f"not measured: timed out after {args.timeout:.0f} s")
                return
        c = pair.c
        if pair.p is None:  # the consumer's result came first: the producer reports "sent" after its last
            try:            # publish, and the last message can be delivered within the same poll
                got = pair.pq.get(timeout=10)
                if "error" not in got:
                    pair.p = got
            except queue.Empty:
                pass
        if pair.p is None:
            print("not measured: the producer did not report its start")
            return
        p = pair.p
        try:
            last = pair.pq.get(timeout=2)
        except queue.Empty:
            pass
        elapsed = c["last"] - p["start"]
        exact = c["received"] == count and c["duplicates"] == 0 and c["out_of_order"] == 0
        print(f"{c['received']:,} of {count:,} delivered in {elapsed:.2f} s ({c['received'] / elapsed:,.0f} msgs/s); "
              f"duplicates {c['duplicates']}, out of order {c['out_of_order']}: "
              f"{'exactly once, in order' if exact else 'NOT exactly once'}")
        lat = c["latencies"]
        print(f"latency p50 {percentile_ms(lat, 0.5):.3f} ms, p99 {percentile_ms(lat, 0.99):.3f} ms; "
              f"broker peak RSS {pair.peak / MiB:.1f} MiB")
        if "relay" in last:
            print(f"publication: NAKs received {last['naks_received']:,}, "
                  f"retransmits sent {last['retransmits_sent']:,}")
            for direction, counters in last["relay"].items():
                print(f"relay {direction}: " + ", ".join(f"{k} {v:,}" for k, v in counters.items()))
        else:
            print("relay and publication counters: not received")
        print(f"broker NAKs/retransmits: {broker.counters()}")
    finally:
        if pair is not None:
            pair.end()
        broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000, help="messages per pairing and round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of each pairing")
    parser.add_argument("--only", default="tcp-tcp,udp-tcp,udp-udp,overload",
                        help="comma-separated: tcp-tcp, udp-tcp, udp-udp, overload")
    parser.add_argument("--size", type=int, default=1024, help="message body size in bytes (at least 16)")
    parser.add_argument("--window", type=int, default=1000, help="the TCP producer's window (the SDK's default)")
    parser.add_argument("--quota", default="200MiB", help="broker memory quota (sizes producer credit)")
    parser.add_argument("--overload-seconds", type=float, default=30.0)
    parser.add_argument("--overload-consumer-rate", type=float, default=0.0,
                        help="the slow consumer's msgs/s (default: a tenth of the udp-tcp rate measured)")
    parser.add_argument("--lossy", action="store_true", help="also run the lossy scenario")
    parser.add_argument("--lossy-messages", type=int, default=1_000_000)
    parser.add_argument("--loss", type=float, default=0.05,
                        help="lossy: loss; duplication and reordering are 1/5 of it")
    parser.add_argument("--admin", action="store_true",
                        help="start the broker with its admin API (instead of --no-admin) to read its UDP counters")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a pairing may take")
    parser.add_argument("--broker-config", default=None,
                        help="a TOML file for the broker (--config), e.g. [udp] mtu = 65504 for bigger datagrams")
    args = parser.parse_args()
    if args.size < STAMP.size + SEQ.size:
        parser.error(f"--size must be at least {STAMP.size + SEQ.size}")
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = only - {*PAIRINGS, "overload"}
    if unknown:
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}")
    rates: dict[str, list[float]] = {}
    for round_no in range(1, args.rounds + 1):
        for name in PAIRINGS:
            if name in only:
                rate = scenario_pairing(args, name, round_no)
                if rate is not None:
                    rates.setdefault(name, []).append(rate)
    if args.rounds > 1 and rates:
        print("\n== summary (msgs/s, each round) ==")
        for name, values in rates.items():
            print(f"{name}: " + ", ".join(f"{v:,.0f}" for v in values))
    if "overload" in only:
        udp = rates.get("udp-tcp")
        scenario_overload(args, max(udp) if udp else None)
    if args.lossy:
        scenario_lossy(args)


if __name__ == "__main__":
    main()
