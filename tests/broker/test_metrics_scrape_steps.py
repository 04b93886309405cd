"""GET /metrics built on the broker's thread in small steps (broker/metricshttp.py): the same bytes as the
collector in one go, with a checkpoint between steps and no worker thread. The worker thread held the
interpreter's lock while it rendered: scrapes of 11,000 queues stalled a tester's data connections by
134-765 ms."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from prometheus_client.registry import Collector

from flowbroker.broker import metricshttp
from flowbroker.broker.metrics import BrokerCollector, BrokerMetrics, Families
from tests.broker.coreharness import Harness, MiB


class _Process(Collector):
    """A process collector whose figures do not move between two scrapes."""

    def collect(self) -> Any:
        return iter(())


def _metrics(queues: int, producers: int) -> BrokerMetrics:
    h = Harness(credit={"policy": "static", "static_size": MiB}, server={"max_queues": max(queues, 1)})
    for i in range(queues):
        h.queue(f"q-{i:05d}", flow_stop_count=3 + i % 5)
    for i in range(producers):
        h.producer(f"producer-{i}").send("", f"q-{i % max(queues, 1):05d}" if queues else "nowhere", b"x" * 10)
    collector = BrokerCollector(h.core, max_producer_series=producers)
    return BrokerMetrics(collector, _Process(), None)  # type: ignore[arg-type]  # (the registry is not used)


@pytest.mark.parametrize("queues, producers", [(0, 0), (1, 1), (20, 3), (21, 3), (457, 30)])
def test_the_text_in_steps_is_the_text_in_one_go(monkeypatch: pytest.MonkeyPatch, queues: int, producers: int) -> None:
    monkeypatch.setattr(metricshttp, "SAMPLE_STEP", 7)  # the producers' families in several parts too
    m = _metrics(queues, producers)
    whole = metricshttp._render(m.collector.scrape().read_all(), m.process)
    assert b"".join(metricshttp._scrape_in_steps(m)) == whole
    assert whole.count(b"# HELP flowbroker_queue_messages ") == 1 and whole.count(b'flowbroker_queue_messages{') == queues
    assert whole.count(b"flowbroker_producer_granted_bytes{") == producers


async def test_a_scrape_checkpoints_between_steps_and_uses_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _metrics(457, 30)
    expected = metricshttp._render(m.collector.scrape().read_all(), m.process)

    async def no_thread(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a worker thread rendering holds the interpreter's lock: the broker's thread waits")

    checkpoints = 0
    real_checkpoint = trio.lowlevel.checkpoint

    async def counted() -> None:
        nonlocal checkpoints
        checkpoints += 1
        await real_checkpoint()

    monkeypatch.setattr(metricshttp, "SLICE_SECONDS", 0.0)  # a checkpoint after every step
    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    monkeypatch.setattr(trio.lowlevel, "checkpoint", counted)
    answer = await metricshttp.metrics_route(m).endpoint(None)
    assert checkpoints >= 457 // metricshttp.QUEUE_TEXT_STEP  # at least one per step of queues
    # streamed piece by piece, not joined into a second copy of the text (a tester: +474 MiB a scrape)
    assert answer.status_code == 200 and b"".join([piece async for piece in answer.body_iterator]) == expected


async def test_scrapes_held_for_clients_that_do_not_read_are_bounded() -> None:
    """Each built scrape's text is held until its client takes it: clients that asked and never read kept a
    whole text each (a tester: twelve took a 128 MiB-quota broker to 298 MiB). At most SCRAPES_HELD; past
    that 503 Retry-After; a text taken to its end, or dropped with its cut-off client, frees its place."""
    import gc

    m = _metrics(50, 5)
    endpoint = metricshttp.metrics_route(m).endpoint
    kept = [await endpoint(None) for _ in range(metricshttp.SCRAPES_HELD)]
    assert all(answer.status_code == 200 for answer in kept)
    refused = await endpoint(None)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert b"".join([piece async for piece in kept[0].body_iterator])  # taken to its end: its place is free
    assert (await endpoint(None)).status_code == 200  # (dropped at once: its place is free again)
    gc.collect()
    assert (await endpoint(None)).status_code == 200
    del kept[1]  # a client cut off: the response is dropped
    kept.append(await endpoint(None))
    assert kept[-1].status_code == 200
