"""What one queued message costs the broker in memory, beyond the bytes `message_size` charges for it.

Runs `BrokerCore` in memory (no sockets, as tests/broker/coreharness.py does): one producer session
sends N messages to one queue in TRANSFER frames of 100 entries, each frame encoded and then decoded
by `FrameDecoder`, so the broker keeps exactly the objects it keeps when the bytes come off a socket
(msgpack-decoded bodies, routing keys and header dicts). After every frame has been handled and
dropped, the memory still allocated is what the queued messages cost; divided by N it is the cost of
one message, and minus the bytes of body and header that `message_size` counts (its key and value
lengths, 8 for a number) it is the overhead `MESSAGE_OVERHEAD` and `HEADER_OVERHEAD` have to cover.

Three states of a queued message (a queue's byte watermarks count all three):

- `ready`: enqueued under the queue's watermarks, no consumer (a `Message` in the queue's deque);
- `held`: enqueued over the stop watermark, so it also holds its producer's completion (a
  `HeldTransfer` and an entry in the queue's held set);
- `unsettled`: delivered to a consumer and not yet settled (an entry in the session's unsettled map;
  the DELIVER frames are collected and dropped, as the connection's writer does).

Each case runs in a fresh interpreter, twice: under tracemalloc (the bytes Python asked for: exact,
without allocator rounding) and without it, reading the process's RSS growth (what the broker's host
sees: pymalloc's 16-byte size classes, malloc's chunk headers). Bodies are 16 B, 1 KiB and 64 KiB,
with no headers and with two (`content-type: application/json`, `attempt: 3`).

Measured (Python 3.11, x86-64), overhead beyond the counted bytes, traced / RSS: without headers,
about 270 / 220-290 bytes per ready message, 384-402 / 371-437 per unsettled one and 400-418 /
353-440 per held one, whatever the body size; the two headers add about 206 bytes (a dict and a
string value) beyond their 43 bytes of key and value. `MESSAGE_OVERHEAD` = 512 covers every case
without headers; with headers, `HEADER_OVERHEAD` (128 per header and once for the dict) covers the rest.

    python benchmarks/message_cost.py [--count N] [--states ready held unsettled]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tracemalloc
from typing import Any

import psutil

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.protocol.codec import FrameDecoder, encode_frame
from flowbroker.protocol.credit import HEADER_OVERHEAD, MESSAGE_OVERHEAD, message_size
from flowbroker.protocol.frames import Headers, Subscribe, Transfer, TransferEntry

KiB = 1024
MiB = 1024 * KiB
BATCH = 100
QUEUE = "cost"
BODY_SIZES = (16, KiB, 64 * KiB)
HEADERS: dict[str, Headers | None] = {
    "none": None,
    "two": {"content-type": "application/json", "attempt": 3},
}


def default_count(body_size: int) -> int:
    """Enough messages for a stable average, at most ~256 MiB of bodies."""
    return max(1000, min(50_000, 256 * MiB // body_size))


def measure(state: str, body_size: int, headers_name: str, count: int, use_tracemalloc: bool) -> dict[str, Any]:
    headers = HEADERS[headers_name]
    config = load_config(None, {
        "server": {"memory_quota": 1 << 30},
        "credit": {"policy": "none"},  # producers are not paced: the whole count goes in
        "queues": {"max_prefetch": 10_000_000},  # and, in `unsettled`, all of it is delivered
    })
    t = [0]
    core = BrokerCore(config, lambda: t[0])
    # Thresholds off (max_size 0 = unlimited, so no derived watermarks) or a stop of 1 byte (all held).
    arguments: dict[str, Any] = {"max_size": 0}
    if state == "held":
        arguments = {"max_size": 0, "flow_stop_size": 1}
    core.declare_queue(QUEUE, arguments)
    producer = core.open_session("producer", "anonymous", True, lambda: None)
    consumer = None
    if state == "unsettled":
        consumer = core.open_session("consumer", "anonymous", False, lambda: None)
        core.handle(consumer, Subscribe(1, 1, QUEUE, 0, 0))
        consumer.collect(t[0])
    body = bytes(range(256)) * (body_size // 256) + bytes(body_size % 256)
    size = message_size(body, headers)
    counted = len(body) + sum(  # the body and header bytes (lengths) message_size counts
        len(k) + (len(v) if isinstance(v, (str, bytes)) else 8) for k, v in (headers or {}).items()
    )
    wires = (count + BATCH - 1) // BATCH
    proc = psutil.Process()

    def send(first: int, n: int) -> None:
        wire = encode_frame(Transfer(first, [TransferEntry("", QUEUE, body, headers)] * n))
        decoder = FrameDecoder(16 * MiB)
        decoder.feed(wire)
        del wire
        frame = decoder.next_frame()
        assert frame is not None
        core.handle(producer, frame)
        del frame, decoder
        producer.collect(t[0])  # completions, flow-stopped: sent and forgotten
        if consumer is not None:
            consumer.collect(t[0])  # DELIVER frames: written to the socket and dropped

    # Warm up: one frame, so first-use allocations (caches, the deque's first blocks) are not counted.
    send(1, BATCH)
    first = BATCH + 1
    gc.collect()
    if use_tracemalloc:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
    else:
        before = proc.memory_info().rss
    for i in range(wires):
        n = min(BATCH, count - i * BATCH)
        send(first, n)
        first += n
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if use_tracemalloc else proc.memory_info().rss
    queue = core.queues[QUEUE]
    expected = count + BATCH
    assert queue.count == expected, (queue.count, expected)
    if state == "held":
        assert len(queue.held) == expected
    if state == "unsettled":
        assert consumer is not None and len(consumer.unsettled) == expected and not queue.store
    else:
        assert len(queue.store) == expected
    per_message = (after - before) / count
    return {"per_message": per_message, "counted": counted, "overhead": per_message - counted, "size": size}


def child(args: argparse.Namespace) -> None:
    result = measure(args.state, args.body, args.headers, args.count, args.mode == "tracemalloc")
    print(json.dumps(result))


def run_child(state: str, body: int, headers: str, count: int, mode: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", state, str(body), headers, str(count), mode],
        check=True, capture_output=True, text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=0, help="messages per case (default: by body size)")
    parser.add_argument("--states", nargs="*", default=["ready", "held", "unsettled"],
                        choices=["ready", "held", "unsettled"])
    parser.add_argument("--child", nargs=5, metavar=("STATE", "BODY", "HEADERS", "COUNT", "MODE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        state, body, headers, count, mode = args.child
        child(argparse.Namespace(state=state, body=int(body), headers=headers, count=int(count), mode=mode))
        return
    print(f"message_size charges body + header bytes + MESSAGE_OVERHEAD ({MESSAGE_OVERHEAD}) "
          f"+ HEADER_OVERHEAD ({HEADER_OVERHEAD}) per header and once for the headers' dict")
    print("overhead = memory per queued message - the body and header bytes message_size counts")
    print(f"{'state':<10} {'body':>7} {'headers':>7} {'count':>6} {'counted':>8} {'charged':>8} "
          f"{'traced/msg':>10} {'overhead':>8} {'rss/msg':>9} {'overhead':>8}")
    worst: dict[str, tuple[float, float, int]] = {}
    for state in args.states:
        for body in BODY_SIZES:
            for headers in HEADERS:
                count = args.count or default_count(body)
                traced = run_child(state, body, headers, count, "tracemalloc")
                rss = run_child(state, body, headers, count, "rss")
                print(f"{state:<10} {body:>7} {headers:>7} {count:>6} {traced['counted']:>8} {traced['size']:>8} "
                      f"{traced['per_message']:>10.1f} {traced['overhead']:>8.1f} "
                      f"{rss['per_message']:>9.1f} {rss['overhead']:>8.1f}", flush=True)
                key = f"{state}, {'two' if HEADERS[headers] else 'no'} headers"
                old = worst.get(key, (0.0, 0.0, 0))
                charged = traced["size"] - traced["counted"]  # what message_size adds beyond the lengths
                worst[key] = (max(old[0], traced["overhead"]), max(old[1], rss["overhead"]), charged)
    print()
    for key, (traced_max, rss_max, charged) in worst.items():
        verdict = "covered" if max(traced_max, rss_max) <= charged else "NOT covered"
        print(f"largest overhead, {key}: {traced_max:.0f} B traced, {rss_max:.0f} B RSS "
              f"({verdict} by the {charged} B charged beyond the counted bytes)")


if __name__ == "__main__":
    main()
