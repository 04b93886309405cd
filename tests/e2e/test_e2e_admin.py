"""The management HTTP API of a real broker on 127.0.0.1, driven over HTTP while real SDK producers
and consumers are connected: the credential, views, runtime thresholds, stop-all/start-all, policy."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import trio

import flowbroker.client as fb
from flowbroker.protocol import ErrorCode

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
    assert status == 200 and answer == {"queues": [], "next": None}
    status, answer, _ = await api(broker, "GET", "/api/nothing-here")
    assert status == 404 and answer["error"]["code"] == "not_found"
    status, answer, _ = await api(broker, "DELETE", "/api/queues")
    assert status == 405 and answer["error"]["code"] == "method_not_allowed"
    for index in ("/api", "/api/"):  # where the broker port's answer to HTTP points: a list, not a 404
        status, answer, _ = await api(broker, "GET", index)
        assert status == 200 and "GET /api/queues" in answer["endpoints"] and "PATCH /api/queues/{name}" in answer["endpoints"]
    status, answer, _ = await api(broker, "GET", "/api/", token=None)
    assert status == 401


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
            await wait_until(lambda: next(iter(broker.core.queues["orders"].subscriptions)).unsettled == 2)
            listing = await ok(broker, "GET", "/api/queues")
            assert [q["name"] for q in listing["queues"]] == ["audit", "orders"]
            orders = await ok(broker, "GET", "/api/queues/orders")
    assert orders == listing["queues"][1] | {"saturated_for_seconds": None}
    assert orders["depth"]["count"] == 7 and orders["depth"]["ready"] == 5
    assert orders["depth"]["bytes"] == broker.core.queues["orders"].size > 700
    assert orders["thresholds"] == {
        "flow_stop_count": 100, "flow_resume_count": 50, "flow_stop_size": 8 * MiB,
        "flow_resume_size": int(7 * MiB), "flow_stop_drain_time": 0.0, "flow_resume_drain_time": 0.0,
        "flow_stop_age": 0.0, "flow_resume_age": 0.0, "max_count": 0, "max_size": 10 * MiB, "overflow": "reject",
    }
    assert orders["drain"] == {"rate": 0.0, "oldest_ready_age": 0.0}  # no time threshold: not tracked
    assert orders["saturated"] is False and orders["held_transfers"] == 0
    assert orders["counters"]["enqueued"] == 7 and orders["counters"]["dequeued"] == 0
    [sub] = orders["subscriptions"]
    assert sub["client_name"] == "loader" and sub["prefetch"] == 2 and sub["unsettled"] == 2
    status, answer, _ = await api(broker, "GET", "/api/queues/nope")
    assert status == 404 and "'nope'" in answer["error"]["message"]


async def test_patch_takes_time_thresholds_in_seconds(broker: Any) -> None:
    async with await fb.connect(broker.url, client_name="feeder") as conn:
        await conn.declare_queue("t")
    q = await ok(broker, "PATCH", "/api/queues/t", {"flow_stop_drain_time": 0.5, "flow_stop_age": 2})
    t = q["thresholds"]
    assert (t["flow_stop_drain_time"], t["flow_resume_drain_time"], t["flow_stop_age"], t["flow_resume_age"]) == (
        0.5, 0.5, 2.0, 2.0)
    for bad in ({"flow_stop_age": "2s"}, {"flow_stop_drain_time": -1}, {"flow_resume_age": 3}):
        status, answer, _ = await api(broker, "PATCH", "/api/queues/t", bad)
        assert status == 400 and next(iter(bad)) in answer["error"]["message"], answer
    q = await ok(broker, "PATCH", "/api/queues/t", {"flow_stop_age": 1})  # alone: resume keeps its ratio
    assert (q["thresholds"]["flow_stop_age"], q["thresholds"]["flow_resume_age"]) == (1.0, 1.0)
    assert set(broker.core.timed_queues) == {"t"}


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
        assert q["saturated"] is True and q["thresholds"]["flow_resume_count"] == 2  # 3 * 900 // 1000: the ratio kept
        await producer.send(b"held", timeout=5)
        with pytest.raises(fb.FlowControlTimeout):
            await producer.flush(timeout=0.3)
        await wait_until(lambda: producer.flow_state.destinations == ("q",))
        assert (await ok(broker, "GET", "/api/queues/q"))["held_transfers"] == 1
        await conn.purge_queue("q")  # releases the held transfer: leaving the block would report it


async def test_bad_patches_name_the_field(broker: Any) -> None:
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("q")
    for body, field in (
        ({"flow_stop_count": -1}, "flow_stop_count"),
        ({"max_size": "big"}, "max_size"),
        ({"overflow": "explode"}, "overflow"),
        ({"flow_stop_size": 10, "bogus": 1}, "bogus"),
        ({"max_size": 2**70}, "max_size"),
        ({"max_count": 2**51}, "max_count"),
    ):
        status, answer, _ = await api(broker, "PATCH", "/api/queues/q", body)
        assert status == 400, answer
        assert answer["error"]["field"] == field and field in answer["error"]["message"]
    status, answer, _ = await api(broker, "PATCH", "/api/queues/q", raw=b"{not json")
    assert status == 400 and answer["error"]["code"] == "invalid_json"
    for deep in (b"[" * 30_000, b'{"a":' * 5_000):  # the decoder's recursion: a bad body, not a bug (500)
        status, answer, _ = await api(broker, "PATCH", "/api/queues/q", raw=deep)
        assert status == 400 and answer["error"]["code"] == "invalid_json", answer
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
        assert conn.sender_window.window == 1  # WELCOME: the provisional grant (one message) until it sends
        granted = (await ok(broker, "GET", "/api/policy"))["granted"]
        assert granted["total"] == 1 and granted["provisional"] == 1  # counted like any grant
        await conn.declare_queue("q")
        await send_one(conn)  # its first transfer registers it as a producer
        await wait_until(lambda: conn.sender_window.window == 50 * MiB)  # 5 % of the 1 GiB quota, clamped
        answer = await ok(broker, "PUT", "/api/policy", {"policy": "aggressive", "quota": 400 * MiB, "min_size": MiB})
        assert answer["policy"]["quota"] == 400 * MiB and answer["policy"]["min_size"] == MiB
        share = 20 * MiB - 10_000  # the 20 MiB pool but its reserve (one byte per connection slot)
        assert answer["pool"]["bytes"] == 20 * MiB and answer["pool"]["shareable"] == share
        assert answer["granted"]["connections"] == [{"connection": conn.connection_id, "client_name": "p1",
                                                     "buffer_size": share, "state": "producer",
                                                     "window": 50 * MiB}]  # its old limit, not yet used
        await wait_until(lambda: conn.sender_window.window == share)
        # p1 answers the shrink (BUFFER_LIMIT): its old 50 MiB limit is no longer promised, though it
        # sends nothing more (before BUFFER_LIMIT it stayed charged until p1 had spent it)
        await wait_until(lambda: broker.core.credit.window_of(conn.connection_id) == share)
        async with await fb.connect(broker.url, client_name="p2") as conn2:
            assert conn2.sender_window.window == 1
            await send_one(conn2)
            # the 20 MiB pool shared by two: p1, idle, answers its second shrink and p2 gets the rest
            await wait_until(lambda: conn2.sender_window.window == share // 2)
            await wait_until(lambda: conn.sender_window.window == share // 2)
            answer = await ok(broker, "GET", "/api/policy")
            assert answer["granted"]["total"] == 2 * (share // 2) and answer["granted"]["waiting"] == 0
            windows = {c["client_name"]: c["window"] for c in answer["granted"]["connections"]}
            assert windows == {"p1": share // 2, "p2": share // 2}
        answer = await ok(broker, "PUT", "/api/policy", {"policy": "static", "static_size": 3 * MiB})
        assert answer["granted"]["total"] == 3 * MiB
        await wait_until(lambda: conn.sender_window.window == 3 * MiB)
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

    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("listed")
    monkeypatch.setattr(views, "queue_view", broken)  # (a page's views are made in slices, after the handler)
    status, answer, _ = await api(broker, "GET", "/api/queues")
    assert status == 500 and answer["error"] == {"code": "internal_error", "message": "RuntimeError: view bug"}
    assert "GET /api/queues failed" in caplog.text
    monkeypatch.undo()
    assert [q["name"] for q in (await ok(broker, "GET", "/api/queues"))["queues"]] == ["listed"]
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("still-serving")


# -- issue 8: pages, bodies refused before they are read, names with "/", DELETE exchanges -----


async def test_lists_come_in_pages_that_follow_a_cursor(broker: Any) -> None:
    names = sorted([f"q{i:03d}" for i in range(250)] + ["q249/x"])
    for name in reversed(names):
        broker.core.declare_queue(name)
    first = await ok(broker, "GET", "/api/queues")
    assert [q["name"] for q in first["queues"]] == names[:100] and first["next"] == names[99]
    seen: list[str] = []
    cursor: str | None = None
    while True:
        query = "?limit=60" + ("" if cursor is None else "&after=" + urllib.parse.quote(cursor, safe=""))
        page = await ok(broker, "GET", "/api/queues" + query)
        assert len(page["queues"]) <= 60
        seen += [q["name"] for q in page["queues"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == sorted(names)
    page = await ok(broker, "GET", "/api/queues?limit=1000&after=q248")
    assert [q["name"] for q in page["queues"]] == ["q249", "q249/x"] and page["next"] is None

    async with await fb.connect(broker.url, client_name="a"), await fb.connect(broker.url, client_name="b"):
        ids = sorted(broker.core.sessions)
        page = await ok(broker, "GET", "/api/connections?limit=1")
        assert [c["id"] for c in page["connections"]] == ids[:1] and page["next"] == ids[0]
        page = await ok(broker, "GET", f"/api/connections?after={ids[0]}")
        assert [c["id"] for c in page["connections"]] == ids[1:] and page["next"] is None

    for query, field in (("limit=0", "limit"), ("limit=1001", "limit"), ("limit=x", "limit"),
                         ("limit=%C2%B2", "limit"), ("limt=5", "limt"), ("after=-1", "after"),
                         ("after=%C2%B2", "after")):
        path = "/api/connections?" if field == "after" else "/api/queues?"
        status, answer, _ = await api(broker, "GET", path + query)
        assert status == 400 and answer["error"]["field"] == field, (query, answer)


async def test_the_saturated_queues_come_in_pages_of_their_own(broker: Any) -> None:
    """`?saturated=true`: the console and `top` read one page of 1,000 queues by name, so 1,000 queues
    named before a saturated one hid it (a tester). The queues keep the set; it follows a clear and a
    delete."""
    for i in range(250):
        broker.core.declare_queue(f"q{i:03d}")
    hot = ["q010", "q120", "q249"]
    async with await fb.connect(broker.url) as conn:
        for name in hot:
            await ok(broker, "PATCH", f"/api/queues/{name}", {"flow_stop_count": 1})
            producer = conn.producer("", name)
            await producer.send(b"a")
            await producer.send(b"b")  # a depth of 2 over the stop count of 1: held
        await wait_until(lambda: all(broker.core.queues[name].saturated for name in hot))
        page = await ok(broker, "GET", "/api/queues?saturated=true")
        assert [q["name"] for q in page["queues"]] == hot and page["next"] is None
        assert all(q["saturated"] and q["held_transfers"] == 1 for q in page["queues"])
        page = await ok(broker, "GET", "/api/queues?saturated=true&limit=2")
        assert [q["name"] for q in page["queues"]] == hot[:2] and page["next"] == "q120"
        page = await ok(broker, "GET", "/api/queues?limit=2&saturated=true&after=q120")
        assert [q["name"] for q in page["queues"]] == ["q249"] and page["next"] is None
        assert (await ok(broker, "GET", "/api/broker"))["saturated_queues"] == 3
        page = await ok(broker, "GET", "/api/queues?saturated=false&limit=3")  # every queue, as without it
        assert [q["name"] for q in page["queues"]] == ["q000", "q001", "q002"]
        for value in ("yes", "1", "TRUE", ""):
            status, answer, _ = await api(broker, "GET", f"/api/queues?saturated={value}")
            assert status == 400 and answer["error"]["field"] == "saturated", (value, answer)

        await ok(broker, "POST", "/api/queues/q010/purge")  # cleared: leaves the set
        await ok(broker, "DELETE", "/api/queues/q120")  # deleted while saturated: leaves it too
        page = await ok(broker, "GET", "/api/queues?saturated=true")
        assert [q["name"] for q in page["queues"]] == ["q249"]
        assert (await ok(broker, "GET", "/api/broker"))["saturated_queues"] == 1
        await ok(broker, "POST", "/api/queues/q249/purge")
        assert (await ok(broker, "GET", "/api/queues?saturated=true")) == {"queues": [], "next": None}


async def test_a_queue_named_with_a_slash_is_reachable(broker: Any) -> None:
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("a/b")
        await conn.declare_queue("a")
    for path in ("/api/queues/a%2Fb", "/api/queues/a/b"):
        assert (await ok(broker, "GET", path))["name"] == "a/b"
    answer = await ok(broker, "PATCH", "/api/queues/a%2Fb", {"max_count": 9})
    assert answer["name"] == "a/b" and answer["thresholds"]["max_count"] == 9
    assert broker.core.queues["a"].thresholds.max_count == 0
    status, answer, _ = await api(broker, "GET", "/api/queues/a%2Fc")
    assert status == 404 and answer["error"]["message"] == "no queue named 'a/c'"


async def test_exchanges_are_listed_and_deleted(broker: Any) -> None:
    async with await fb.connect(broker.url) as conn:
        await conn.declare_queue("q")
        await conn.declare_exchange("ex/1", "fanout")
        await conn.bind("q", "ex/1")
        page = await ok(broker, "GET", "/api/exchanges")
        assert [e["name"] for e in page["exchanges"]] == ["amq.direct", "amq.fanout", "amq.topic", "ex/1"]
        assert page["exchanges"][3] == {"name": "ex/1", "kind": "fanout", "builtin": False, "binding_keys": 1}
        assert (await ok(broker, "DELETE", "/api/exchanges/ex%2F1")) == {"exchange": "ex/1", "bindings": 1}
        status, answer, _ = await api(broker, "DELETE", "/api/exchanges/ex%2F1")
        assert status == 404 and answer["error"]["message"] == "no exchange named 'ex/1'"
        status, answer, _ = await api(broker, "DELETE", "/api/exchanges/amq.topic")
        assert status == 400 and answer["error"]["code"] == "invalid_argument"
        with pytest.raises(fb.RequestError) as info:  # the SDK sees it gone at once
            await conn.bind("q", "ex/1")
        assert info.value.code is ErrorCode.NOT_FOUND
    assert "amq.topic" in broker.core.exchanges and (await ok(broker, "GET", "/api/broker"))["exchanges"] == 3


async def _http_response(stream: trio.SocketStream, wait_close: float = 2) -> tuple[int, dict[str, str], bytes, bool]:
    """Read one HTTP/1.1 response: (status, headers, body, whether the server closed within `wait_close` s)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = await stream.receive_some(65536)
        assert chunk
        body += chunk
    closed = False
    with trio.move_on_after(wait_close):
        closed = not await stream.receive_some(65536)
    return int(status_line.split()[1]), headers, body, closed


class StallWatch:
    """Samples the bystander's progress; `worst` is its longest time without a message through."""

    def __init__(self, b: Any):
        self.b = b
        self.worst = 0.0

    async def run(self) -> None:
        last, since = len(self.b.received), trio.current_time()
        while True:
            await trio.sleep(0.005)
            now = trio.current_time()
            if len(self.b.received) != last:
                last, since = len(self.b.received), now
            self.worst = max(self.worst, now - since)


async def test_oversized_bodies_are_refused_before_they_are_read(broker: Any) -> None:
    from tests.e2e.test_e2e_faults import bystander

    head = (f"PATCH /api/queues/q HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\n")
    broker.core.declare_queue("q")
    async with bystander(broker) as calm, trio.open_nursery() as nursery:
        watch = StallWatch(calm)
        nursery.start_soon(watch.run)
        with trio.fail_after(10):
            # 1 GiB announced and none of it sent: refused at once (before, the API read it all first)
            stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
            await stream.send_all((head + "Content-Length: 1073741824\r\n\r\n").encode())
            status, headers, body, closed = await _http_response(stream)
            assert status == 413 and json.loads(body)["error"]["code"] == "too_large"
            assert headers["connection"] == "close" and closed
            await stream.aclose()
            # chunked, no length: cut off past 64 KiB, while the client is still sending
            stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
            await stream.send_all((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
            for _ in range(5):
                await stream.send_all(b"4000\r\n" + b" " * 0x4000 + b"\r\n")  # 16 KiB chunks, never the last
            status, headers, body, closed = await _http_response(stream)
            assert status == 413 and closed
            await stream.aclose()
            # a chunked body under the limit is read as before
            stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
            patch = json.dumps({"max_count": 7}).encode()
            await stream.send_all((head + "Transfer-Encoding: chunked\r\n\r\n").encode()
                                  + b"%x\r\n%s\r\n0\r\n\r\n" % (len(patch), patch))
            status, headers, body, _ = await _http_response(stream, wait_close=0)
            assert status == 200 and json.loads(body)["thresholds"]["max_count"] == 7
            await stream.aclose()
        nursery.cancel_scope.cancel()
    assert watch.worst < 0.5, f"the bystander stalled {watch.worst:.3f} s"


async def test_a_client_that_leaves_mid_body_is_not_logged_as_a_bug(
        broker: Any, caplog: pytest.LogCaptureFixture) -> None:
    broker.core.declare_queue("q")
    stream = await trio.open_tcp_stream("127.0.0.1", broker.server.admin_port)
    await stream.send_all((f"PATCH /api/queues/q HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                           "Content-Length: 100\r\n\r\n{\"max_count\"").encode())
    await trio.sleep(0.2)  # the endpoint is reading the body now
    await stream.aclose()
    await trio.sleep(0.5)
    assert "failed" not in caplog.text and "Traceback" not in caplog.text
    assert broker.core.queues["q"].thresholds.max_count == 0
    assert (await ok(broker, "GET", "/api/queues/q"))["name"] == "q"


async def test_delete_and_purge_a_queue(broker: Any) -> None:
    """DELETE /api/queues/NAME and POST /api/queues/NAME/purge do what DELETE_QUEUE and PURGE_QUEUE do;
    a queue whose name holds "/" (or "/purge") is reached too, and an unknown one is a 404."""
    async with await fb.connect(broker.url) as conn:
        for name in ("jobs", "a/purge"):
            await conn.declare_queue(name)
            producer = conn.producer(routing_key=name)
            for i in range(3):
                await producer.send(b"m%d" % i, timeout=5)
            await producer.flush(timeout=5)
    assert await ok(broker, "POST", "/api/queues/jobs/purge") == {"queue": "jobs", "purged": 3}
    assert (await ok(broker, "GET", "/api/queues/jobs"))["depth"]["count"] == 0
    assert await ok(broker, "POST", "/api/queues/a%2Fpurge/purge") == {"queue": "a/purge", "purged": 3}
    assert await ok(broker, "DELETE", "/api/queues/jobs") == {"queue": "jobs", "deleted": 0}
    assert await ok(broker, "DELETE", "/api/queues/a/purge") == {"queue": "a/purge", "deleted": 0}
    assert broker.core.queues == {}
    for method, path in (("DELETE", "/api/queues/jobs"), ("POST", "/api/queues/jobs/purge")):
        status, answer, _ = await api(broker, method, path)
        assert status == 404 and answer["error"]["code"] == "not_found" and "jobs" in answer["error"]["message"]


async def test_a_refusal_naming_an_exchange_names_no_field(broker: Any) -> None:
    status, answer, _ = await api(broker, "DELETE", "/api/exchanges/amq.direct")
    assert status == 400 and "amq.direct" in answer["error"]["message"] and "field" not in answer["error"], answer


async def test_a_client_that_never_reads_its_metrics_answer_is_cut_off_and_cannot_hold_the_shutdown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """hypercorn writes an answer in a shielded scope with no deadline: a client that asked for /metrics (no
    token needed) and never read kept the whole answer in memory and the broker from exiting at SIGTERM for
    as long as it stayed connected (a tester: 97 s). The kernel now cuts it off (TCP_USER_TIMEOUT)."""
    import socket

    from flowbroker.broker import admin
    from tests.serving import serving

    monkeypatch.setattr(admin, "HTTP_STALL_SECONDS", 1.0)
    attacker = socket.socket()
    attacker.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        with trio.fail_after(20):
            async with serving(admin={"enabled": True, "port": 0}) as server:
                for i in range(3000):  # an answer of megabytes: more than the sockets' buffers hold
                    server.core.declare_queue(f"queue-{i:05d}-" + "x" * 40)
                assert server.admin is not None and server.admin.port is not None
                attacker.connect(("127.0.0.1", server.admin.port))
                attacker.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
                await trio.sleep(2.5)  # the answer stalls: the kernel cuts it after HTTP_STALL_SECONDS
                began = trio.current_time()
            took = trio.current_time() - began
        assert took < admin.HTTP_DRAIN_SECONDS + 3, took
        attacker.setblocking(False)
        with pytest.raises(OSError):  # reset by the broker's side
            while attacker.recv(1 << 20):
                pass
    finally:
        attacker.close()


async def test_an_operator_closes_a_connection_and_its_client_is_told_why(broker: Any) -> None:
    """A client holding what others wait for (a credit window it will not give back, a queue it stalls)
    could be ended by nothing but its idle timeout, which a client answering NOOPs never reaches (a
    tester): DELETE /api/connections/ID ends it with ERROR + CLOSE CONNECTION_FORCED within a second."""
    async with await fb.connect(broker.url, client_name="hog") as hog, await fb.connect(broker.url) as calm:
        await calm.declare_queue("q")
        async with calm.producer(routing_key="q") as producer:
            await producer.send(b"before")
        conn_id = hog.welcome.connection_id
        assert (await ok(broker, "DELETE", f"/api/connections/{conn_id}?reason=holds%20the%20pool")) == {
            "connection": conn_id, "closed": True}
        await wait_until(lambda: hog.is_closed, 3.0)
        assert isinstance(hog.close_error, fb.ConnectionClosed) and hog.close_error.code is ErrorCode.CONNECTION_FORCED
        assert "closed by an operator: holds the pool" in str(hog.close_error)
        status, answer, _ = await api(broker, "DELETE", f"/api/connections/{conn_id}")
        assert status == 404 and answer["error"]["message"] == f"no connection {conn_id}"
        async with calm.consumer("q") as consumer:  # the others carry on
            assert (await consumer.receive(timeout=5)).body == b"before"


async def test_numbers_of_thousands_of_digits_are_a_400_or_404_in_plain_words(broker: Any) -> None:
    """Over 4,300 digits Python's int() raises: ?limit= and ?after= were 500 internal_error, DELETE
    /api/connections/<5000 digits> a text/plain 500 with a traceback, and a PATCH body's number a 400
    advising sys.set_int_max_str_digits() (a tester); then told a number of digits was not an integer, and a
    parameter given twice was used once, silently (another)."""
    huge = "9" * 5000
    for path, field in ((f"/api/queues?limit={huge}", "limit"), (f"/api/connections?limit={huge}", "limit"),
                        (f"/api/connections?after={huge}", "after")):
        status, answer, _ = await api(broker, "GET", path)
        assert status == 400 and answer["error"]["field"] == field, (path, status, answer)
    status, answer, _ = await api(broker, "DELETE", f"/api/connections/{huge}")
    assert status == 404 and answer["error"]["code"] == "not_found" and len(answer["error"]["message"]) < 200
    assert "no connection id has more than 20 digits" in answer["error"]["message"]  # not "is an integer"
    status, answer, _ = await api(broker, "GET", f"/api/connections?after={huge}")
    assert "at most 20 digits" in answer["error"]["message"]
    for path in ("/api/connections?limit=10&limit=20", "/api/queues?after=a&after=b"):  # one was used silently
        status, answer, _ = await api(broker, "GET", path)
        assert status == 400 and "given more than once" in answer["error"]["message"], (path, answer)
    for path, says in (("/api/connections/1?reason=a&reason=b", "given more than once"),
                       ("/api/connections/1?bogus=1", "unknown parameter 'bogus'")):
        status, answer, _ = await api(broker, "DELETE", path)
        assert status == 400 and says in answer["error"]["message"], (path, answer)
    status, answer, _ = await api(broker, "DELETE", "/api/connections/abc")
    assert status == 404 and answer["error"]["code"] == "not_found"
    broker.server.core.declare_queue("q")
    status, answer, _ = await api(broker, "PATCH", "/api/queues/q", raw=b'{"flow_stop_count": ' + huge.encode() + b"}")
    assert status == 400 and "4,300 digits" in answer["error"]["message"]
    assert "set_int_max_str_digits" not in answer["error"]["message"]


async def test_put_policy_type_errors_name_the_type_each_key_takes(broker: Any) -> None:
    """{"policy": ["x"]} and {"quota": true} were both told "must be a number (the policy: a string)" (a tester)."""
    status, answer, _ = await api(broker, "PUT", "/api/policy", {"policy": ["x"]})
    assert status == 400 and answer["error"]["field"] == "policy"
    assert answer["error"]["message"].startswith("policy must be a string: none, static, dynamic or aggressive")
    for value in (True, "64MiB", [1]):
        status, answer, _ = await api(broker, "PUT", "/api/policy", {"quota": value})
        assert status == 400 and answer["error"]["field"] == "quota"
        assert "quota must be an integer number of bytes" in answer["error"]["message"], answer
    status, answer, _ = await api(broker, "PUT", "/api/policy", {"dynamic_percent": "10"})
    assert status == 400 and answer["error"]["message"] == "dynamic_percent must be a number, a percent"
