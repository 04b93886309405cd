"""`flowbroker consume -n N` takes exactly N, whatever --prefetch and the broker's max_prefetch (testers,
session 35): with -n 12000 and the broker's max_prefetch of 10,000 it acknowledged nothing before the
10,001st, which never came, and waited for ever; with a prefetch of 2,000 and more, the broker handled the
final acknowledgements' refill before the CANCEL, and the rest of the queue came back flagged redelivered."""

from __future__ import annotations

import json

import trio

import flowbroker.client as fc

from tests.e2e.daemon import FLOWBROKER


async def _consume(url: str, *args: str) -> list[dict[str, object]]:
    done = await trio.run_process([FLOWBROKER, "consume", "--url", url, "--json", *args], capture_stdout=True,
                                  capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return [json.loads(line) for line in done.stdout.decode().splitlines()]


async def test_consume_n_takes_exactly_n_under_a_lower_max_prefetch(start_flowbroker) -> None:
    broker = await start_flowbroker(queues={"max_prefetch": 300})
    total = 3000
    async with await fc.connect(broker.url) as conn:
        await conn.declare_queue("q")
        async with conn.producer("", "q") as producer:
            for i in range(total):
                await producer.send(b"m%05d" % i)
    with trio.fail_after(60):
        first = await _consume(broker.url, "-n", "1200", "--prefetch", "5000", "q")
        rest = await _consume(broker.url, "-n", str(total - 1200), "--prefetch", "5000", "q")
    got = [(m["body"], m["redelivered"]) for m in first + rest]
    assert got == [("m%05d" % i, False) for i in range(total)]
    assert len(broker.core.queues["q"].store) == 0
