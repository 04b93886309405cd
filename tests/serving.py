"""An in-process broker on an ephemeral port for one `async with` block, for tests that restart it (the
`start_flowbroker` fixture's broker lives as long as the test's nursery)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from flowbroker.broker.config import load_config
from flowbroker.broker.server import BrokerServer


@asynccontextmanager
async def serving(**sections: dict[str, Any]) -> AsyncIterator[BrokerServer]:
    """Serve a broker (port 0, a 1 GiB quota, no admin API, no UDP path, each section's keys over these) until the
    block ends; `server.port` is where it listens."""
    overrides: dict[str, dict[str, Any]] = {
        "server": {"port": 0, "memory_quota": 1 << 30}, "admin": {"enabled": False}, "udp": {"enabled": False}}
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    server = BrokerServer(load_config(None, overrides))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        yield server
        server.shutdown()


def url(server: BrokerServer) -> str:
    return f"flowbroker://127.0.0.1:{server.port}"
