"""A console session follows its user in the users file: the user deleted or stripped of its admin tags
ends the session (401), demoted to monitoring makes it read only, as HTTP Basic already did (a tester:
a deleted administrator's session still got 200 for POST /api/producers/start-all)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowbroker.broker.console import CSRF_HEADER
from flowbroker.broker.users import User, write_users
from flowbroker.protocol.scram import StoredCredential
from tests.console.test_console_auth import TOKEN, request

CREDENTIAL = StoredCredential.from_password("3ve", 4096)


def eve(*tags: str) -> dict[str, User]:
    return {"eve": User("eve", CREDENTIAL, tags)}


@pytest.fixture
async def broker(start_flowbroker: Any, tmp_path: Path) -> Any:
    write_users(tmp_path / "users.json", eve("administrator"))
    broker = await start_flowbroker(admin={"token": TOKEN},
                                    auth={"users_file": str(tmp_path / "users.json"), "failed_login_delay": 0.1})
    broker.core.declare_queue("q")
    return broker


async def _session(broker: Any) -> dict[str, str]:
    answer = await request(broker, "POST", "/login", json.dumps({"username": "eve", "password": "3ve"}).encode(),
                           {"Content-Type": "application/json"})
    assert answer.status == 200 and answer.json()["read_only"] is False, answer.text
    return {"Cookie": answer.cookies[0].split(";")[0], CSRF_HEADER: answer.json()["csrf"]}


async def test_a_session_of_a_user_demoted_to_monitoring_is_read_only_at_once(broker: Any, tmp_path: Path) -> None:
    headers = await _session(broker)
    assert (await request(broker, "POST", "/api/producers/start-all", headers=headers)).status == 200
    write_users(tmp_path / "users.json", eve("monitoring"))
    refused = await request(broker, "POST", "/api/producers/start-all", headers=headers)
    assert refused.status == 403 and refused.json()["error"]["code"] == "read_only", refused.text
    assert (await request(broker, "GET", "/api/queues", headers=headers)).status == 200
    assert (await request(broker, "GET", "/session", headers=headers)).json()["read_only"] is True
    write_users(tmp_path / "users.json", eve("administrator"))  # promoted again: its rights come back
    assert (await request(broker, "POST", "/api/queues/q/purge", headers=headers)).status == 200


@pytest.mark.parametrize("users", [{}, eve()], ids=["deleted", "no admin tag"])
async def test_a_session_of_a_deleted_user_ends(broker: Any, tmp_path: Path, users: dict[str, User]) -> None:
    headers = await _session(broker)
    write_users(tmp_path / "users.json", users)
    refused = await request(broker, "POST", "/api/producers/start-all", headers=headers)
    assert refused.status == 401 and refused.json()["error"]["code"] == "unauthorized", refused.text
    write_users(tmp_path / "users.json", eve("administrator"))  # the name back: the session stays ended
    assert (await request(broker, "GET", "/api/queues", headers=headers)).status == 401
    assert (await request(broker, "GET", "/session", headers=headers)).status == 401


@pytest.mark.parametrize("change", ["passwd", "delete and add again"])
async def test_a_session_ends_when_its_users_password_changes(broker: Any, tmp_path: Path, change: str) -> None:
    """A session survived `flowbroker user passwd eve`, and `user delete eve` + `user add eve` with no
    request between: an administrator changing a leaked password did not end the attacker's console
    session (a tester). The session is tied to the credential it logged in with."""
    headers = await _session(broker)
    assert (await request(broker, "POST", "/api/producers/start-all", headers=headers)).status == 200
    if change == "delete and add again":
        write_users(tmp_path / "users.json", {})
    new = StoredCredential.from_password("n3w", 4096)
    write_users(tmp_path / "users.json", {"eve": User("eve", new, ("administrator",))})
    refused = await request(broker, "POST", "/api/producers/start-all", headers=headers)
    assert refused.status == 401 and refused.json()["error"]["code"] == "unauthorized", refused.text
