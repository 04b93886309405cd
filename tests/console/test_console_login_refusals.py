"""What the admin port answers, and logs, when a user's login is refused: the console's login and HTTP
Basic alike (docs/security.md)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from flowbroker.broker.auth import FORGET_AFTER
from flowbroker.broker.users import User, write_users
from flowbroker.protocol.scram import StoredCredential
from tests.console.test_console_auth import TOKEN, request


@pytest.fixture
async def broker(start_flowbroker: Any, tmp_path: Path) -> Any:
    write_users(tmp_path / "users.json", {"root": User("root", StoredCredential.from_password("r00t", 4096),
                                                       ("administrator",))})
    return await start_flowbroker(admin={"token": TOKEN}, auth={
        "users_file": str(tmp_path / "users.json"), "failed_login_delay": 5.0, "failed_login_max_delay": 10.0})


def _throttle_loopback(broker: Any) -> None:
    """127.0.0.1 failed once and has two attempts waiting: its next turn is 20 s away, past the 10 s maximum."""
    throttle, now = broker.core.login_throttle, broker.core.clock_ns()
    throttle.failed("127.0.0.1", now)
    assert throttle.admit("127.0.0.1", now) is not None and throttle.admit("127.0.0.1", now) is not None


async def test_a_login_refused_unlooked_says_when_to_come_back_on_the_console_as_with_basic(broker: Any) -> None:
    """The console's 429 had no Retry-After, HTTP Basic's had one (a tester)."""
    _throttle_loopback(broker)
    answers: dict[str, Any] = {}
    started = trio.current_time()

    async def console() -> None:
        answers["console"] = await request(broker, "POST", "/login", json.dumps(
            {"username": "root", "password": "r00t"}).encode(), {"Content-Type": "application/json"})

    async def basic() -> None:
        answers["basic"] = await request(broker, "GET", "/api/queues", headers={
            "Authorization": "Basic " + base64.b64encode(b"root:r00t").decode()})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(console)
        nursery.start_soon(basic)
    # after failed_login_delay, as any refused login (security.md; the 429 came at once, a tester)
    assert trio.current_time() - started >= 5.0
    for answer in answers.values():
        assert answer.status == 429 and answer.json()["error"]["code"] == "too_many_failed_logins", answer.text
        assert answer.headers["retry-after"] == "10"  # [auth] failed_login_max_delay



async def test_a_basic_login_waiting_its_turn_goes_when_the_failure_is_forgotten(
        autojump_clock: trio.testing.MockClock, start_flowbroker: Any, tmp_path: Path) -> None:
    """HTTP Basic pollers behind an address with one typo were answered 429 too_many_failed_logins for 40 s,
    their logins always in flight keeping the failure remembered (a tester). In virtual time: the request
    whose turn is 16 s away is let in when the failure is forgotten, at 10 s, as on the data port."""
    autojump_clock.autojump_threshold = 0.05  # virtual time jumps only while the real sockets are quiet
    write_users(tmp_path / "users.json", {"root": User("root", StoredCredential.from_password("r00t", 4096),
                                                       ("administrator",))})
    broker = await start_flowbroker(admin={"token": TOKEN}, auth={
        "users_file": str(tmp_path / "users.json"), "failed_login_delay": 1.0, "failed_login_max_delay": 30.0})
    throttle, clock_ns = broker.core.login_throttle, broker.core.clock_ns
    failed_ns = clock_ns()
    throttle.failed("127.0.0.1", failed_ns)  # the typo; four logins in flight: turns at 1, 2, 4 and 8 s
    assert [throttle.admit("127.0.0.1", failed_ns) for _ in range(4)] == [t * 10**9 for t in (1, 2, 4, 8)]
    basic = await request(broker, "GET", "/api/queues", headers={
        "Authorization": "Basic " + base64.b64encode(b"root:r00t").decode()})
    assert basic.status == 200, basic.text
    waited_ns = clock_ns() - failed_ns
    assert FORGET_AFTER * 10**9 <= waited_ns < 16 * 10**9, waited_ns  # before: at its turn, 16 s
    assert len(throttle) == 0  # forgotten, those four still in flight


@pytest.mark.parametrize("user, password, reason", [
    ("root", "wrong", "wrong password"), ("nobody", "x", "unknown user"), ("app", "app", "no admin tag")])
async def test_a_refused_login_is_logged_with_the_peer_address_and_the_reason(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        user: str, password: str, reason: str) -> None:
    """Each line says where the attempt came from and why it failed, as the data port's lines do (a
    tester: the admin port's said only the user); the answer still does not say which."""
    write_users(tmp_path / "users.json", {
        "root": User("root", StoredCredential.from_password("r00t", 4096), ("administrator",)),
        "app": User("app", StoredCredential.from_password("app", 4096))})
    broker = await start_flowbroker(admin={"token": TOKEN}, auth={
        "users_file": str(tmp_path / "users.json"), "failed_login_delay": 0.01, "failed_login_max_delay": 0.01})
    console = await request(broker, "POST", "/login", json.dumps({"username": user, "password": password}).encode(),
                            {"Content-Type": "application/json"})
    basic = await request(broker, "GET", "/api/queues",
                          headers={"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()})
    token = await request(broker, "POST", "/login", json.dumps({"token": "not-the-token"}).encode(),
                          {"Content-Type": "application/json"})
    assert console.status == basic.status == token.status == 403
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("flowbroker.broker.") and "refused" in r.getMessage()]
    assert any(line.startswith("console: login from 127.0.0.1:") and f"for user {user}: " in line and reason in line
               for line in lines), lines
    assert any(line.startswith("admin API: HTTP Basic from 127.0.0.1:") and f"for user {user}: " in line
               and reason in line for line in lines), lines
    assert any(line.startswith("console: login from 127.0.0.1:") and "wrong admin token" in line for line in lines), lines


async def test_a_wrong_bearer_token_is_logged_once_per_interval_with_the_peer_and_the_path(
        broker: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong token on /api/* was answered 403 and logged nowhere (session 33's note): someone guessing
    went unseen. A flood of them writes one line per 10 s, which counts the rest."""
    import logging

    from flowbroker.broker import admin
    from flowbroker.broker.accept import RateLimitedLog

    monkeypatch.setattr(admin, "_LOG_WRONG_TOKEN", RateLimitedLog(admin.LOGGER, logging.WARNING))  # fresh
    for _ in range(5):
        answer = await request(broker, "DELETE", "/api/queues/orders",
                               headers={"Authorization": "Bearer not-the-token-at-all"})
        assert answer.status == 403 and answer.json()["error"]["message"] == "the admin token is wrong"
    lines = [r.getMessage() for r in caplog.records if "wrong admin token" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("admin API: DELETE /api/queues/orders from 127.0.0.1:"), lines
