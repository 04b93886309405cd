"""The management HTTP API of a real broker on 127.0.0.1, driven over HTTP while real SDK producers
and consumers are connected: the credential, views, runtime thresholds, stop-all/start-all, policy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import trio

import flowbroker.client as fb

MiB = 1024 * 1024
TOKEN = "test-admin-token-0123456789"


async def api(broker: Any, method: str, path: str, body: Any = None, *,
              token: str | None = TOKEN, raw: bytes | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One HTTP request with urllib in a worker thread; returns (status, JSON body, headers)."""

    def call() -> tuple[int, dict[str, Any], dict[str, str]]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(broker.admin_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read()), {k.lower(): v for k, v in exc.headers.items()}

    return await trio.to_thread.run_sync(call)


async def ok(broker: Any, method: str, path: str, body: Any = None) -> dict[str, Any]:
    status, answer, _ = await api(broker, method, path, body)
    assert status == 200, (status, answer)
    return answer


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


@pytest.fixture
async def broker(start_flowbroker: Any) -> Any:
    return await start_flowbroker(admin={"token": TOKEN})


async def test_every_request_needs_the_token(broker: Any) -> None:
    status, answer, headers = await api(broker, "GET", "/api/queues", token=None)
    assert status == 401 and answer["error"]["code"] == "unauthorized"
    assert headers["www-authenticate"].startswith("Bearer")
    status, answer, _ = await api(broker, "GET", "/api/queues", token="wrong-token-wrong-token")
    assert status == 403 and answer["error"]["code"] == "forbidden"
    status, answer, _ = await api(broker, "POST", "/api/producers/stop-all", token="x")
    assert status == 403 and not broker.core.producers_stopped  # refused before anything happened
    status, answer, _ = await api(broker, "GET", "/api/queues")
    assert status == 200 and answer == {"queues": []}
    status, answer, _ = await api(broker, "GET", "/api/nothing-here")
    assert status == 404 and answer["error"]["code"] == "not_found"
    status, answer, _ = await api(broker, "DELETE", "/api/queues")
    assert status == 405 and answer["error"]["code"] == "method_not_allowed"


async def test_generated_token_is_written_with_mode_0600(start_flowbroker: Any, tmp_path: Any) -> None:
    token_file = tmp_path / "sub" / "admin-token"
    broker = await start_flowbroker(admin={"token_file": str(token_file)})
    token = token_file.read_text().strip()
    assert token == broker.admin_token and len(token) >= 32
    assert token_file.stat().st_mode & 0o777 == 0o600
    status, _, _ = await api(broker, "GET", "/api/queues", token=token)
    assert status == 200
    status, _, _ = await api(broker, "GET", "/api/queues", token=TOKEN)
    assert status == 403


async def test_queues_list_and_show(broker: Any) -> None:
    async with await fb.connect(broker.url, client_name="loader") as conn:
        await conn.declare_queue("orders", flow_stop_count=100, flow_resume_count=50, max_size=10 * MiB)
        await conn.declare_queue("audit")
        producer = conn.producer(routing_key="orders")
        for i in range(7):
            await producer.send(b"x" * 100)
        await producer.flush(timeout=5)
        async with conn.consumer("orders", prefetch=2):
            await wait_until(lambda: broker.core.queues["orders"].subscriptions[0].unsettled == 2)
            listing = await ok(broker, "GET", "/api/queues")
            assert [q["name"] for q in listing["queues"]] == ["audit", "orders"]
            orders = await ok(broker, "GET", "/api/queues/orders")
    assert orders == listing["queues"][1] | {"saturated_for_seconds": None}
    assert orders["depth"]["count"] == 7 and orders["depth"]["ready"] == 5
    assert orders["depth"]["bytes"] == broker.core.queues["orders"].size > 700
    assert orders["thresholds"] == {
        "flow_stop_count": 100, "flow_resume_count": 50, "flow_stop_size": 8 * MiB,
        "flow_resume_size": int(7 * MiB), "max_count": 0, "max_size": 10 * MiB, "overflow": "reject",
    }
    assert orders["saturated"] is False and orders["held_transfers"] == 0
    assert orders["counters"]["enqueued"] == 7 and orders["counters"]["dequeued"] == 0
    [sub] = orders["subscriptions"]
    assert sub["client_name"] == "loader" and sub["prefetch"] == 2 and sub["unsettled"] == 2
    status, answer, _ = await api(broker, "GET", "/api/queues/nope")
    assert status == 404 and "'nope'" in answer["error"]["message"]


async def test_raising_a_threshold_releases_a_blocked_producer_and_lowering_stops_it(broker: Any) -> None:
    async with await fb.connect(broker.url, client_name="feeder") as conn:
        await conn.declare_queue("q", flow_stop_count=2, flow_resume_count=1)
        producer = conn.producer(routing_key="q", window=3)
        for i in range(5):  # the 3rd saturates the queue: 3 transfers held fill the window
            await producer.send(b"m%d" % i, timeout=5)
        with pytest.raises(fb.FlowControlTimeout) as blocked:
            await producer.send(b"blocked", timeout=0.3)
        assert "q" in blocked.value.destinations

        q = await ok(broker, "GET", "/api/queues/q")
        assert q["saturated"] is True and q["held_transfers"] == 3
        assert q["stop_reason"] == {"threshold": "flow_stop_count", "limit": 2, "value": 3}
        assert q["flow_stopped_producers"] == [{"connection": conn.connection_id, "client_name": "feeder"}]
        connections = (await ok(broker, "GET", "/api/connections"))["connections"]
        [me] = [c for c in connections if c["id"] == conn.connection_id]
        assert me["role"] == "producer" and me["client_name"] == "feeder" and me["flow_control"] is True
        assert me["peer"].startswith("127.0.0.1:")
        assert me["flow"]["stopped"] is True and me["flow"]["blocking_queues"] == ["q"]
        assert me["flow"]["stopped_for_seconds"] >= 0.3
        assert me["flow"]["destinations"][0]["threshold"] == "flow_stop_count"
        assert me["producer"]["transfers_held"] == 3 and me["producer"]["buffer_size"] > 0
        assert me["producer"]["unacked_bytes"] > 0  # held transfers have not given their credit back

        q = await ok(broker, "PATCH", "/api/queues/q", {"flow_stop_count": 1000, "flow_resume_count": 900})
        assert q["saturated"] is False and q["held_transfers"] == 0
        assert q["thresholds"]["flow_stop_count"] == 1000
        await producer.flush(timeout=5)  # every held transfer completed
        await wait_until(lambda: not producer.flow_state.is_stopped)
        await producer.send(b"free again", timeout=5)
        await producer.flush(timeout=5)

        q = await ok(broker, "PATCH", "/api/queues/q", {"flow_stop_count": 3})
        assert q["saturated"] is True and q["thresholds"]["flow_resume_count"] == 3
        await producer.send(b"held", timeout=5)
        with pytest.raises(fb.FlowControlTimeout):
            await producer.flush(timeout=0.3)
        await wait_until(lambda: producer.flow_state.destinations == ("q",))
        assert (await ok(broker, "GET", "/api/queues/q"))["held_transfers"] == 1


async def test_bad_patches_name_the_field(broker: Any) -> None:
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("q")
    for body, field in (
        ({"flow_stop_count": -1}, "flow_stop_count"),
        ({"max_size": "big"}, "max_size"),
        ({"overflow": "explode"}, "overflow"),
        ({"flow_stop_size": 10, "bogus": 1}, "bogus"),
    ):
        status, answer, _ = await api(broker, "PATCH", "/api/queues/q", body)
        assert status == 400, answer
        assert answer["error"]["field"] == field and field in answer["error"]["message"]
    status, answer, _ = await api(broker, "PATCH", "/api/queues/q", raw=b"{not json")
    assert status == 400 and answer["error"]["code"] == "invalid_json"
    status, answer, _ = await api(broker, "PATCH", "/api/queues/missing", {"flow_stop_count": 1})
    assert status == 404 and "'missing'" in answer["error"]["message"]
    assert broker.core.queues["q"].thresholds.flow_stop_count == 0  # nothing was applied


async def test_stop_all_holds_sends_and_start_all_releases(broker: Any) -> None:
    async with await fb.connect(broker.url, client_name="p") as conn:
        await conn.declare_queue("q")
        producer = conn.producer(routing_key="q", window=2)
        await producer.send(b"before", timeout=5)
        await producer.flush(timeout=5)
        answer = await ok(broker, "POST", "/api/producers/stop-all")
        assert answer == {"producers_stopped": True, "connections": [conn.connection_id]}
        await wait_until(lambda: producer.flow_state.destinations == ("*",))
        await producer.send(b"a", timeout=5)
        await producer.send(b"b", timeout=5)
        with pytest.raises(fb.FlowControlTimeout) as blocked:
            await producer.send(b"c", timeout=0.3)
        assert "*" in blocked.value.destinations
        [me] = (await ok(broker, "GET", "/api/connections"))["connections"]
        assert me["flow"]["admin_stopped"] is True and me["flow"]["blocking_queues"] == []
        assert me["producer"]["transfers_held"] == 2
        assert (await ok(broker, "GET", "/api/policy"))["producers_stopped"] is True

        answer = await ok(broker, "POST", "/api/producers/start-all")
        assert answer["producers_stopped"] is False
        await producer.flush(timeout=5)
        await producer.send(b"c", timeout=5)
        await producer.flush(timeout=5)
        assert broker.core.queues["q"].count == 4


async def send_one(conn: Any) -> None:
    producer = conn.producer(routing_key="q")
    await producer.send(b"first", timeout=5)
    await producer.flush(timeout=5)


async def test_policy_set_pushes_new_buffers_to_connected_producers(broker: Any) -> None:
    before = await ok(broker, "GET", "/api/policy")
    assert before["policy"]["policy"] == "aggressive"
    assert before["granted"] == {"total": 0, "producers": 0, "provisional": 0, "waiting": 0, "connections": []}
    async with await fb.connect(broker.url, client_name="p1") as conn:
        assert conn.credit.max_bytes == 1  # WELCOME: the provisional grant (one message) until it sends
        granted = (await ok(broker, "GET", "/api/policy"))["granted"]
        assert granted["total"] == 1 and granted["provisional"] == 1  # counted like any grant
        await conn.declare_queue("q")
        await send_one(conn)  # its first transfer registers it as a producer
        await wait_until(lambda: conn.credit.max_bytes == 50 * MiB)  # 5 % of the 1 GiB quota, clamped
        answer = await ok(broker, "PUT", "/api/policy", {"policy": "aggressive", "quota": 400 * MiB, "min_size": MiB})
        assert answer["policy"]["quota"] == 400 * MiB and answer["policy"]["min_size"] == MiB
        share = 20 * MiB - 10_000  # the 20 MiB pool but its reserve (one byte per connection slot)
        assert answer["pool"]["bytes"] == 20 * MiB and answer["pool"]["shareable"] == share
        assert answer["granted"]["connections"] == [{"connection": conn.connection_id, "client_name": "p1",
                                                     "buffer_size": share, "state": "producer",
                                                     "window": 50 * MiB}]  # its old limit, not yet used
        await wait_until(lambda: conn.credit.max_bytes == share)
        async with await fb.connect(broker.url, client_name="p2") as conn2:
            assert conn2.credit.max_bytes == 1
            await send_one(conn2)
            # p1 may still send up to its old 50 MiB limit: nothing is left for p2, which waits
            answer = await ok(broker, "GET", "/api/policy")
            assert answer["granted"]["waiting"] == 1 and answer["granted"]["total"] <= 20 * MiB
            producer = conn.producer(routing_key="q")
            for _ in range(60):  # p1 spends its old limit: acknowledgements overtake it
                await producer.send(b"z" * MiB, timeout=5)
            await producer.flush(timeout=5)
            await wait_until(lambda: conn2.credit.max_bytes == share // 2)  # the 20 MiB pool shared by two
            await wait_until(lambda: conn.credit.max_bytes == share // 2)
            answer = await ok(broker, "GET", "/api/policy")
            assert answer["granted"]["total"] == 2 * (share // 2) and answer["granted"]["waiting"] == 0
        answer = await ok(broker, "PUT", "/api/policy", {"policy": "static", "static_size": 3 * MiB})
        assert answer["granted"]["total"] == 3 * MiB
        await wait_until(lambda: conn.credit.max_bytes == 3 * MiB)
    for body, field in (({"policy": "greedy"}, "policy"), ({"min_size": 0}, "min_size"), ({"nope": 1}, "nope"),
                        ({"quota": True}, "quota")):
        status, answer, _ = await api(broker, "PUT", "/api/policy", body)
        assert status == 400 and answer["error"]["field"] == field, answer
    assert (await ok(broker, "GET", "/api/policy"))["policy"]["policy"] == "static"  # unchanged by the failures


async def test_connections_show_consumers_and_roles(broker: Any) -> None:
    async with await fb.connect(broker.url, client_name="idle") as idle, \
            await fb.connect(broker.url, client_name="both", flow_control=True) as both:
        await both.declare_queue("q")
        producer = both.producer(routing_key="q")
        for _ in range(3):
            await producer.send(b"y" * 1000)
        await producer.flush(timeout=5)
        async with both.consumer("q", prefetch=10, buffer_size=64 * 1024):
            await wait_until(lambda: len(broker.core.sessions[both.connection_id].unsettled) == 3)
            connections = {c["client_name"]: c for c in (await ok(broker, "GET", "/api/connections"))["connections"]}
    assert connections["idle"]["role"] == "idle" and connections["idle"]["id"] == idle.connection_id
    me = connections["both"]
    assert me["role"] == "both" and me["consumer"]["unsettled"] == 3
    [sub] = me["consumer"]["subscriptions"]
    assert sub["queue"] == "q" and sub["buffer"]["size"] == 64 * 1024 and sub["buffer"]["unacked"] > 3000
    assert me["producer"]["transfers"] == 3 and me["flow"]["stopped"] is False


async def test_a_failing_endpoint_answers_500_and_the_broker_carries_on(
        broker: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from flowbroker.broker import views

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("view bug")

    monkeypatch.setattr(views, "queues_view", broken)
    status, answer, _ = await api(broker, "GET", "/api/queues")
    assert status == 500 and answer["error"] == {"code": "internal_error", "message": "RuntimeError: view bug"}
    assert "GET /api/queues failed" in caplog.text
    monkeypatch.undo()
    assert (await ok(broker, "GET", "/api/queues")) == {"queues": []}
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("still-serving")
