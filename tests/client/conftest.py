"""Fixtures for the client SDK tests: a fake broker on 127.0.0.1 started in the test's nursery."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from tests.client.fakebroker import FakeBroker


@pytest.fixture
def start_broker(nursery: trio.Nursery) -> Callable[..., Awaitable[FakeBroker]]:
    """`broker = await start_broker(buffer_size=..., ...)`: a FakeBroker serving on an ephemeral port."""

    async def start(**options: Any) -> FakeBroker:
        broker = FakeBroker(**options)
        await nursery.start(broker.serve)
        return broker

    return start


@pytest.fixture
def io_clock() -> trio.testing.MockClock:
    """A mock clock that jumps ahead only after 100 ms of real idleness (20 ms proved flaky on a loaded
    2-core machine), so that bytes in flight on a real
    127.0.0.1 socket arrive before virtual time skips to the next deadline (threshold 0 would fire
    timeouts while a reply is still in the kernel)."""
    return trio.testing.MockClock(autojump_threshold=0.1)
