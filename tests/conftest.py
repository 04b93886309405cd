"""Shared fixtures: a real flowbroker serving on 127.0.0.1 inside the test's nursery."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from flowbroker.broker.config import load_config
from flowbroker.broker.server import BrokerServer


class RunningBroker:
    """A BrokerServer on an ephemeral port; `url` for clients, `core` for assertions and admin calls."""

    def __init__(self, server: BrokerServer, port: int):
        self.server = server
        self.core = server.core
        self.port = port
        self.url = f"flowbroker://127.0.0.1:{port}"


@pytest.fixture
def start_flowbroker(nursery: trio.Nursery) -> Callable[..., Awaitable[RunningBroker]]:
    """`broker = await start_flowbroker(server={...}, queues={...}, credit={...})`."""

    async def start(**sections: dict[str, Any]) -> RunningBroker:
        overrides: dict[str, dict[str, Any]] = {"server": {"port": 0, "memory_quota": 1 << 30}}
        for name, values in sections.items():
            overrides.setdefault(name, {}).update(values)
        server = BrokerServer(load_config(None, overrides))
        port = await nursery.start(server.serve)
        return RunningBroker(server, port)

    return start
