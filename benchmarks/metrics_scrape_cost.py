"""What one `GET /metrics` costs the broker, by the number of queues and producers: the collector and
`generate_latest` over a `BrokerCore` in this process (no sockets: the HTTP part is hypercorn's and does not
grow with the broker), CPU time per scrape and the size of the text. The cost should grow in proportion
to what is scraped (queues, producer series), never faster.

    python benchmarks/metrics_scrape_cost.py [--queues 1000,10000,50000] [--producers 100] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

from prometheus_client import generate_latest

from flowbroker.broker.config import load_config
from flowbroker.broker.core import BrokerCore
from flowbroker.broker.metrics import broker_registry
from flowbroker.protocol.frames import Transfer, TransferEntry


def build(queues: int, producers: int) -> BrokerCore:
    """A core with `queues` queues (one message each) and `producers` connections that have sent one."""
    config = load_config(None, {"server": {"memory_quota": 1 << 30, "max_queues": max(queues, 1)}})
    clock = [0]
    core = BrokerCore(config, lambda: clock[0])
    for i in range(queues):
        core.declare_queue(f"queue-{i:06d}")
    for i in range(producers):
        session = core.open_session(f"producer-{i}", "anonymous", True, lambda: None)
        core.handle(session, Transfer(1, [TransferEntry("", f"queue-{i % max(queues, 1):06d}", b"x" * 64, None)]))
    return core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", default="1000,10000,50000", help="comma-separated queue counts")
    parser.add_argument("--producers", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'queues':>8} {'producers':>9} {'bytes':>12} {'CPU ms/scrape':>14} {'us/queue':>9}")
    for queues in (int(q) for q in args.queues.split(",")):
        core = build(queues, args.producers)
        registry = broker_registry(core)
        size = len(generate_latest(registry))  # warm up
        best = float("inf")
        for _ in range(args.repeat):
            started = time.process_time()
            generate_latest(registry)
            best = min(best, time.process_time() - started)
        per_queue = f"{best / queues * 1e6:.1f}" if queues else "-"  # no queues: nothing to divide by
        print(f"{queues:>8,} {args.producers:>9,} {size:>12,} {best * 1e3:>14.1f} {per_queue:>9}")


if __name__ == "__main__":
    main()
