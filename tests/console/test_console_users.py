"""Admin API users (issue 15.4): HTTP Basic for users with the administrator tag (anything) or the monitoring
tag (reads only), the console's login with a user and password (a monitoring session is read only), and
the token still working beside them."""

from __future__ import annotations

import base64
import http.client
import threading
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from flowbroker.broker.users import User, write_users
from flowbroker.protocol.scram import StoredCredential
from flowbroker.broker.console import CSRF_HEADER
from tests.console.test_console_auth import TOKEN, login, request


DELAY = 0.2


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
async def broker(start_flowbroker: Any, tmp_path: Path) -> Any:
    users = tmp_path / "users.json"
    write_users(users, {
        "root": User("root", StoredCredential.from_password("r00t", 4096), ("administrator",)),
        "watch": User("watch", StoredCredential.from_password("w4tch", 4096), ("monitoring",)),
        "app": User("app", StoredCredential.from_password("app", 4096)),
    })
    broker = await start_flowbroker(admin={"token": TOKEN}, auth={"users_file": str(users), "failed_login_delay": DELAY})
    broker.core.declare_queue("q")
    return broker


async def test_an_administrator_may_read_and_change(broker: Any) -> None:
    assert (await request(broker, "GET", "/api/queues", headers=basic("root", "r00t"))).status == 200
    purge = await request(broker, "POST", "/api/queues/q/purge", headers=basic("root", "r00t"))
    assert purge.status == 200, purge.text


async def test_monitoring_may_read_but_not_change(broker: Any) -> None:
    assert (await request(broker, "GET", "/api/connections", headers=basic("watch", "w4tch"))).status == 200
    refused = await request(broker, "POST", "/api/queues/q/purge", headers=basic("watch", "w4tch"))
    assert refused.status == 403 and refused.json()["error"]["code"] == "read_only"
    assert "monitoring tag" in refused.json()["error"]["message"]


@pytest.mark.parametrize("user, password", [("root", "wrong"), ("app", "app"), ("nobody", "x"), ("", "")])
async def test_a_wrong_password_or_a_user_without_an_admin_tag_is_refused_slowly(
        broker: Any, user: str, password: str) -> None:
    began = trio.current_time()
    answer = await request(broker, "GET", "/api/queues", headers=basic(user, password))
    assert answer.status == 403 and answer.json()["error"]["code"] == "forbidden"
    assert trio.current_time() - began >= DELAY and "x-flowbroker-login-failed" not in answer.headers


async def test_a_slow_basic_password_check_holds_no_other_request(broker: Any,
                                                                   stalled_password_checks: threading.Event) -> None:
    """HTTP Basic checks the password with PBKDF2 at the user's iterations: checked on the event loop, a
    guesser's wrong passwords for a user with 10^6 iterations paused every client up to 3 s (a tester).
    The check stands in here for a slow one, blocking its thread up to 5 s, while the token's request
    goes on."""
    began = trio.current_time()  # (the broker runs in this process: a blocked loop holds this task too)
    async with trio.open_nursery() as nursery:
        async def guess() -> None:
            assert (await request(broker, "GET", "/api/queues", headers=basic("root", "guess"))).status == 403

        nursery.start_soon(guess)
        await trio.sleep(0.2)  # its check is running now
        answer = await request(broker, "GET", "/api/queues", headers={"Authorization": f"Bearer {TOKEN}"})
        took = trio.current_time() - began
        stalled_password_checks.set()
    assert answer.status == 200 and took < 2.5, f"the token's request waited {took:.1f} s"


async def test_the_token_still_works(broker: Any) -> None:
    answer = await request(broker, "GET", "/api/queues", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status == 200


async def test_the_console_logs_in_a_user_and_a_monitoring_session_is_read_only(broker: Any) -> None:
    for user, password, read_only in (("root", "r00t", False), ("watch", "w4tch", True)):
        answer = await request(broker, "POST", "/login", json.dumps({"username": user, "password": password}).encode(),
                               {"Content-Type": "application/json"})
        assert answer.status == 200 and answer.json()["read_only"] is read_only
        pair = answer.cookies[0].split(";")[0]
        csrf = answer.json()["csrf"]
        headers = {"Cookie": pair, CSRF_HEADER: csrf}
        assert (await request(broker, "GET", "/api/queues", headers=headers)).status == 200
        purge = await request(broker, "POST", "/api/queues/q/purge", headers=headers)
        assert purge.status == (403 if read_only else 200), purge.text
        # a monitoring session may still log out (docs/console.md: Log out ends the session on the broker)
        refused = await request(broker, "POST", "/logout", headers={"Cookie": pair})  # still needs the CSRF header
        assert refused.status == 403 and refused.json()["error"]["code"] == "csrf"
        out = await request(broker, "POST", "/logout", headers=headers)
        assert out.status == 200, out.text
        assert (await request(broker, "GET", "/api/queues", headers=headers)).status == 401
    began = trio.current_time()
    refused = await request(broker, "POST", "/login", json.dumps({"username": "root", "password": "no"}).encode(),
                            {"Content-Type": "application/json"})
    assert refused.status == 403 and trio.current_time() - began >= DELAY
    await login(broker)  # the token, as before


async def test_basic_and_the_console_look_a_unicode_name_up_in_its_saslprep_form(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`Ⅸ` is `IX` and `jose` + U+0301 is `josé` on the admin port as on the data port (docs/security.md):
    both were refused 403 over HTTP Basic and the console's login, each refusal counted against the
    address, while they logged in over SCRAM and PLAIN (a tester). A name SASLprep refuses is a refused
    login, its reason logged."""
    users = tmp_path / "users.json"
    password = "pw-\u00fc\u00f1\u00ed x"
    write_users(users, {
        "IX": User("IX", StoredCredential.from_password(password, 4096), ("administrator",)),
        "jos\u00e9": User("jos\u00e9", StoredCredential.from_password(password, 4096), ("monitoring",)),
    })
    broker = await start_flowbroker(admin={"token": TOKEN}, auth={"users_file": str(users), "failed_login_delay": DELAY})
    broker.core.declare_queue("q")
    nine, decomposed = "\u2168", "jose\u0301"
    purge = await request(broker, "POST", "/api/queues/q/purge", headers=basic(nine, password))
    assert purge.status == 200, purge.text
    answer = await request(broker, "GET", "/api/queues", headers=basic(decomposed, password))
    assert answer.status == 200, answer.text
    for name, read_only in ((nine, False), (decomposed, True)):
        login = await request(broker, "POST", "/login", json.dumps({"username": name, "password": password}).encode(),
                              {"Content-Type": "application/json"})
        assert login.status == 200 and login.json()["read_only"] is read_only, login.text
    throttle = broker.core.login_throttle
    assert throttle.failures("127.0.0.1", broker.core.clock_ns()) == 0
    refused = await request(broker, "GET", "/api/queues", headers=basic("I\u0007X", password))
    assert refused.status == 403 and refused.json()["error"]["code"] == "forbidden"
    assert any("U+0007" in r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert throttle.failures("127.0.0.1", broker.core.clock_ns()) == 1


async def _basic_from(broker: Any, source: str, user: str, password: str) -> int:
    """A GET /api/queues with HTTP Basic from the local address `source` (127.0.0.x); its status."""
    port = int(broker.admin_url.rsplit(":", 1)[1])

    def call() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20, source_address=(source, 0))
        try:
            conn.request("GET", "/api/queues", headers=basic(user, password))
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    return await trio.to_thread.run_sync(call)


async def test_an_address_guessing_admin_passwords_in_parallel_is_throttled_and_nobody_else_is(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Many wrong passwords sent at once from one address (HTTP Basic, then the console's login) are
    looked at one at a time, the rest refused unlooked (429); an administrator on another address is not
    made to wait. The throttle is the data port's (broker/auth.py LoginThrottle)."""
    import logging

    from flowbroker.broker import admin
    from flowbroker.broker.accept import RateLimitedLog

    # the log's once-per-10-s is the process's: another test's refusal a moment before would hide this one's
    monkeypatch.setattr(admin, "_LOG_UNLOOKED", RateLimitedLog(admin.LOGGER, logging.WARNING))
    users = tmp_path / "users.json"
    write_users(users, {"root": User("root", StoredCredential.from_password("r00t", 4096), ("administrator",))})
    broker = await start_flowbroker(admin={"token": TOKEN}, auth={
        "users_file": str(users), "failed_login_delay": 0.1, "failed_login_max_delay": 1.0})
    throttle = broker.core.login_throttle
    assert await _basic_from(broker, "127.0.0.1", "root", "wrong-0") == 403  # the first failure
    statuses: list[int] = []

    async def guess(i: int) -> None:
        statuses.append(await _basic_from(broker, "127.0.0.1", "root", f"wrong-{i}"))

    async with trio.open_nursery() as nursery:
        for i in range(12):
            nursery.start_soon(guess, i + 1)
        await trio.sleep(0.05)
        assert await _basic_from(broker, "127.0.0.2", "root", "r00t") == 200  # during the guessing
    # spaced 0.1, 0.2, 0.4 ... s apart: a few are looked at within the 1 s maximum, the rest refused unlooked
    assert sorted(set(statuses)) == [403, 429] and throttle.refused == statuses.count(429), statuses
    unlooked = [r for r in caplog.records if "refused unlooked" in r.getMessage()]
    assert statuses.count(429) > 1 and len(unlooked) == 1  # logged once per 10 s, not once a refusal
    # another address has no failures, so the throttle gives it no wait (admit returns 0 for it)
    assert throttle.failures("127.0.0.2", broker.core.clock_ns()) == 0
    login = await request(broker, "POST", "/login", json.dumps({"username": "root", "password": "no"}).encode(),
                          {"Content-Type": "application/json"})
    assert login.status in (403, 429)  # the console's login shares the address's throttle
    assert throttle.failures("127.0.0.1", broker.core.clock_ns()) >= 2
