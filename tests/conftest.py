"""Shared fixtures: a real flowbroker serving on 127.0.0.1 inside the test's nursery."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import trio
from hypothesis import settings

from flowbroker.broker.config import load_config
from flowbroker.protocol.scram import StoredCredential
from flowbroker.broker.server import BrokerServer

# No per-example deadline: hypothesis's default of 200 ms is a timing assertion, and on a busy 2-core
# machine an example that runs 255 ms failed a property that held (timing figures come from
# benchmarks/). A test that sets its own deadline in @settings still has it.
settings.register_profile("flowbroker", deadline=None)
settings.load_profile("flowbroker")


@pytest.fixture(autouse=True, scope="session")
def _state_dir_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Brokers the tests start (in process or as subprocesses, which inherit the environment) keep
    their journal ([storage] data_dir's default, $XDG_STATE_HOME/flowbroker) in a temporary directory,
    never in the user's state directory."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = before


@pytest.fixture(autouse=True)
def _state_dir_per_test(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """And each test its own: a durable queue one test declares (a doc example's, say) must not come
    back, recovered from the journal, in the brokers of the tests after it."""
    state = tmp_path / "xdg-state"
    state.mkdir(exist_ok=True)
    monkeypatch.setenv("XDG_STATE_HOME", str(state))


class RunningBroker:
    """A BrokerServer on an ephemeral port; `url` for clients, `core` for assertions and admin calls.
    With `admin={...}` given to start_flowbroker, `admin_url` and `admin_token` reach its HTTP API."""

    def __init__(self, server: BrokerServer, port: int):
        self.server = server
        self.core = server.core
        self.port = port
        self.url = f"flowbroker://127.0.0.1:{port}"
        self.tls_port = server.tls_port  # the TLS client port (None unless tls={"enabled": True, ...})
        self.admin_url = f"http://127.0.0.1:{server.admin_port}" if server.admin_port is not None else None
        self.admin_token = server.admin.token if server.admin is not None else None
        self.udp_port = server.udp_port  # the UDP data path's port (None with udp={"enabled": False})
        # GET /metrics: on the admin port, or on [metrics] endpoint's own (None when not served)
        self.metrics_url = (f"http://127.0.0.1:{server.metrics_port}/metrics" if server.metrics_port is not None
                            else None)


@pytest.fixture
def start_flowbroker(nursery: trio.Nursery) -> Callable[..., Awaitable[RunningBroker]]:
    """`broker = await start_flowbroker(server={...}, queues={...}, credit={...})`. The admin API is
    off unless an `admin={...}` section is given (then it listens on 127.0.0.1, port 0); the UDP data path
    is on, on an ephemeral port (`broker.udp_port`). Brokers of one test share the test's data directory
    ([storage] data_dir's default), one at a time as two processes would (docs/storage.md: one broker per
    data directory): a broker started while an earlier one still holds it gets a directory of its own."""
    started: list[BrokerServer] = []

    async def start(**sections: dict[str, Any]) -> RunningBroker:
        overrides: dict[str, dict[str, Any]] = {
            "server": {"port": 0, "memory_quota": 1 << 30},
            "admin": {"enabled": "admin" in sections, "host": "127.0.0.1", "port": 0},
            "udp": {"endpoint": "127.0.0.1:0"},  # the UDP data path on an ephemeral port too
        }
        for name, values in sections.items():
            overrides.setdefault(name, {}).update(values)
        holding = [s for s in started if s.journal is not None and s.journal.lock_fd >= 0]
        if holding and "data_dir" not in overrides.get("storage", {}):
            state = Path(os.environ["XDG_STATE_HOME"])
            overrides.setdefault("storage", {})["data_dir"] = str(state / f"flowbroker-{len(started) + 1}")
        server = BrokerServer(load_config(None, overrides))
        started.append(server)
        port = await nursery.start(server.serve)
        return RunningBroker(server, port)

    return start


@pytest.fixture
def stalled_password_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every stored credential's password check blocks its thread until the event is set (5 s at most):
    a stand-in for PBKDF2 at many iterations (broker/passwords.py runs it off the event loop)."""
    release = threading.Event()
    check = StoredCredential.check_password

    def stalling(self: StoredCredential, password: str) -> bool:
        release.wait(5)
        return check(self, password)

    monkeypatch.setattr(StoredCredential, "check_password", stalling)
    yield release
    release.set()
