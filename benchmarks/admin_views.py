"""What one `GET /api/queues` costs the broker when it has many queues (issue 8, item 2).

A broker with its admin API runs in this process; QUEUES queues are declared straight on its core
(as DECLARE_QUEUE would), then a thread asks the API over HTTP on 127.0.0.1 for the first page of
queues (`GET /api/queues`, the default limit) and then for all of them, page by page as
`flowbroker queues` does, following `next`. Printed: the time of each, the bytes of the answers,
and how much the process's peak RSS grew (the broker's answer and the client's copy of it both count,
so it is an upper bound on what the broker held).

Before paging, the first request answered every queue at once, so the "first page" line is the whole
listing: its time and bytes grew with the number of queues.

    python benchmarks/admin_views.py [--queues 100000]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import urllib.parse
import urllib.request
from typing import Any

import trio

from flowbroker.broker.config import load_config
from flowbroker.broker.server import BrokerServer

TOKEN = "benchmark-admin-token-0123456789"


def _get(url: str) -> tuple[dict[str, Any], int]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        raw = resp.read()
    return json.loads(raw), len(raw)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(admin_url: str) -> None:
    rss0 = _peak_rss_mb()
    t0 = time.perf_counter()
    answer, size = _get(admin_url + "/api/queues")
    first = time.perf_counter() - t0
    print(f"first page:  {len(answer['queues']):>7} queues  {first * 1000:8.1f} ms  {size / 1e6:7.3f} MB"
          f"  peak RSS +{_peak_rss_mb() - rss0:.1f} MB")
    t0 = time.perf_counter()
    total, pages, size_all, slowest = 0, 0, 0, 0.0
    cursor: str | None = None
    while True:
        query = "" if cursor is None else "?after=" + urllib.parse.quote(cursor, safe="")
        t1 = time.perf_counter()
        answer, size = _get(admin_url + "/api/queues" + query)
        slowest = max(slowest, time.perf_counter() - t1)
        total += len(answer["queues"])
        pages += 1
        size_all += size
        cursor = answer.get("next")
        if cursor is None:
            break
    elapsed = time.perf_counter() - t0
    print(f"all pages:   {total:>7} queues  {elapsed * 1000:8.1f} ms  {size_all / 1e6:7.3f} MB"
          f"  in {pages} request(s), slowest {slowest * 1000:.1f} ms  peak RSS +{_peak_rss_mb() - rss0:.1f} MB")


async def main(queues: int) -> None:
    config = load_config(None, {"server": {"port": 0, "memory_quota": 1 << 30},
                                "admin": {"host": "127.0.0.1", "port": 0, "token": TOKEN},
                                "udp": {"enabled": False}})
    server = BrokerServer(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        t0 = time.perf_counter()
        for i in range(queues):
            server.core.declare_queue(f"q{(i * 7919) % queues:07d}")  # not in sorted order
        print(f"declared {queues} queues in {time.perf_counter() - t0:.2f} s")
        await trio.to_thread.run_sync(measure, f"http://127.0.0.1:{server.admin_port}")
        server.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", type=int, default=100_000)
    args = parser.parse_args()
    trio.run(main, args.queues)
