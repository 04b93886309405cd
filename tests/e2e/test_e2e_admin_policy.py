"""PUT /api/policy's refusals over real HTTP on 127.0.0.1 (docs/management.md "GET /api/policy, PUT
/api/policy"): what is refused is named, and nothing it takes breaks /metrics."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
import trio

from tests.e2e.test_e2e_admin import TOKEN, api


@pytest.fixture
async def broker(start_flowbroker: Any) -> Any:
    return await start_flowbroker(admin={"token": TOKEN})


async def _metrics_status(broker: Any) -> int:
    def call() -> int:
        with urllib.request.urlopen(broker.admin_url + "/metrics", timeout=10) as resp:
            return int(resp.status)
    return await trio.to_thread.run_sync(call)


async def test_a_quota_past_the_bound_is_refused_and_metrics_still_answer(broker: Any) -> None:
    """{"quota": 2**1030} was answered 200, then every scrape 500 (OverflowError converting it to a float)
    until the quota was put back (a tester)."""
    before = (await api(broker, "GET", "/api/policy"))[1]["policy"]["quota"]
    status, answer, _ = await api(broker, "PUT", "/api/policy", raw=json.dumps({"quota": 2**1030}).encode())
    assert status == 400 and answer["error"]["field"] == "quota", answer
    assert "2^50" in answer["error"]["message"] and len(answer["error"]["message"]) < 200, answer
    assert (await api(broker, "GET", "/api/policy"))[1]["policy"]["quota"] == before
    assert await _metrics_status(broker) == 200
    status, answer, _ = await api(broker, "PUT", "/api/policy", {"quota": 2**50})
    assert status == 200 and answer["policy"]["quota"] == 2**50
    assert await _metrics_status(broker) == 200
