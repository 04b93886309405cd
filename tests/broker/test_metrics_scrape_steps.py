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
    """Each built scrape's text is held until its clients take it: clients that asked and never read kept a
    whole text each (a tester: twelve took a 128 MiB-quota broker to 298 MiB). At most SCRAPES_HELD; past
    that the oldest is let go and its client's answer ends unfinished, never a text cut short; the new
    request is answered (a 503 there let four slow readers keep every scrape from a well-behaved one, a
    tester). A text taken to its end, or dropped with its cut-off client, frees its place."""
    import gc

    m = _metrics(50, 5)
    route = metricshttp.metrics_route(m)
    endpoint = route.endpoint
    whole = b"".join([piece async for piece in (await endpoint(None)).body_iterator])
    kept = [await endpoint(None) for _ in range(metricshttp.SCRAPES_HELD)]
    assert all(answer.status_code == 200 for answer in kept)
    first = kept[0].body_iterator
    assert await first.__anext__()  # its client took a piece, and reads no more
    fifth = await endpoint(None)
    assert fifth.status_code == 200
    with pytest.raises(metricshttp.ScrapeLetGo, match="let go before its client took it all"):
        while True:
            await first.__anext__()  # the oldest was let go: its answer ends unfinished
    assert b"".join([piece async for piece in fifth.body_iterator]) == whole  # the new one whole
    assert b"".join([piece async for piece in kept[1].body_iterator]) == whole  # the others untouched
    del kept[2]  # a client cut off: the response is dropped, its text with it
    gc.collect()
    assert [piece async for piece in kept[-1].body_iterator]


async def test_requests_that_wait_for_a_scrape_share_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that came while a scrape was built wait for it, then share one scrape begun after they
    asked (each sees what happened before it asked; an attacker's parallel requests cost one build)."""
    m = _metrics(50, 5)
    endpoint = metricshttp.metrics_route(m).endpoint
    answers: list[Any] = []
    builds = 0
    steps = metricshttp._scrape_in_steps

    def counted(metrics: BrokerMetrics) -> Any:
        nonlocal builds
        builds += 1
        return steps(metrics)

    monkeypatch.setattr(metricshttp, "_scrape_in_steps", counted)
    monkeypatch.setattr(metricshttp, "SLICE_SECONDS", 0.0)  # a checkpoint after every step: the others ask meanwhile

    async def scrape() -> None:
        answers.append(await endpoint(None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scrape)
        for _ in range(3):
            await trio.sleep(0)  # the first scrape is being built
        assert builds == 1
        for _ in range(5):
            nursery.start_soon(scrape)
    texts = [b"".join([piece async for piece in answer.body_iterator]) for answer in answers]
    assert len(set(texts)) == 1 and texts[0]
    assert builds == 2  # the first request's, and one for the five that asked while it was built
