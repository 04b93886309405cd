"""Heavy admin answers take turns on the broker's thread (broker/httpturns.py): a page's views are made
and encoded in slices with the broker's connections served between them, and however many pages are
asked at once, one slice of theirs runs per pass of trio's scheduler. Built in one go, a page of 1,000
queues of 250-character names (917 KB, 20-40 ms of CPU) held every connection that long, and 20 clients
looping on it raised a bystander's median message latency from 0.7 ms to 110-650 ms (a tester).

Counted, not timed: a trio instrument counts the queue views made within one task step and within one
pass of the scheduler (a pass begins with its I/O poll), with the slice set to a single step."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import flowbroker.client as fb
from flowbroker.broker import views
from tests.e2e.test_e2e_admin import TOKEN, ok

QUEUES = 150


class _ViewsPerTurn(trio.abc.Instrument):
    """The most queue views made in one task step, and in one pass of the scheduler."""

    def __init__(self) -> None:
        self.made = 0
        self.in_step = self.in_pass = 0
        self.most_in_step = self.most_in_pass = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.in_step = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.most_in_step = max(self.most_in_step, self.in_step)

    def before_io_wait(self, timeout: float) -> None:
        self.most_in_pass = max(self.most_in_pass, self.in_pass)
        self.in_pass = 0

    def view_made(self) -> None:
        self.made += 1
        self.in_step += 1
        self.in_pass += 1


@pytest.fixture
async def counted(start_flowbroker: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    broker = await start_flowbroker(admin={"token": TOKEN}, server={"max_queues": QUEUES + 10})
    async with await fb.connect(broker.url) as conn:
        for i in range(QUEUES):
            await conn.declare_queue(f"q{i:04d}".ljust(250, "z"))
    try:  # a slice of one step: a turn makes one view
        from flowbroker.broker import httpturns
        monkeypatch.setattr(httpturns, "SLICE_SECONDS", 0.0)
    except ImportError:  # (before the turns: the page was made in one step, which the test finds)
        pass
    probe = _ViewsPerTurn()
    made = views.queue_view

    def counting(*args: Any, **kwargs: Any) -> Any:
        probe.view_made()
        return made(*args, **kwargs)

    monkeypatch.setattr(views, "queue_view", counting)
    trio.lowlevel.add_instrument(probe)
    try:
        yield broker, probe
    finally:
        trio.lowlevel.remove_instrument(probe)


async def test_a_page_is_made_a_slice_at_a_time_with_the_broker_served_between(counted: Any) -> None:
    broker, probe = counted
    page = await ok(broker, "GET", "/api/queues?limit=1000")
    assert len(page["queues"]) == QUEUES and page["next"] is None
    assert probe.made == QUEUES
    assert probe.most_in_step == 1, f"{probe.most_in_step} queue views made in one step of the broker's thread"


async def test_pages_asked_at_once_take_turns(counted: Any) -> None:
    """Eight pages at once: still one slice of them a pass, not one each."""
    broker, probe = counted
    pages: list[dict[str, Any]] = []

    async def one() -> None:
        pages.append(await ok(broker, "GET", "/api/queues?limit=1000"))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
    assert [len(p["queues"]) for p in pages] == [QUEUES] * 8 and probe.made == 8 * QUEUES
    assert probe.most_in_pass == 1, f"{probe.most_in_pass} queue views made in one pass of the scheduler"
