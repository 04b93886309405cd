"""The management API's JSON views, computed from a real BrokerCore driven in memory (no HTTP)."""

from __future__ import annotations

import json
from typing import Any

from tests.broker.coreharness import Harness, MiB
from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker import views
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.frames import Ok, Subscribe


def make(**credit: object) -> Harness:
    return Harness(credit={"policy": "static", "static_size": MiB, **credit})


def roundtrip(value: Any) -> Any:
    """Views must be plain JSON: a dumps/loads round trip changes nothing."""
    assert json.loads(json.dumps(value)) == value
    return value


def test_queue_view_reports_depth_thresholds_saturation_holds_and_counters() -> None:
    h = make()
    h.queue("orders", flow_stop_count=3, flow_resume_count=1, max_count=10, overflow="drop-head")
    p = h.producer("feeder")
    c = h.consumer("reader")
    sub = c.subscribe("orders", prefetch=1, buffer_size=4096)
    h.advance(1)
    for i in range(5):  # 1 delivered to the consumer, 4 ready; the 4th and 5th are over the stop count
        p.send("", "orders", b"m%d" % i)
    p.pump()
    c.pump()
    h.advance(2.5)
    view = roundtrip(views.queue_view(h.core.queues["orders"], h.now))
    size = message_size(b"m0")
    assert view["name"] == "orders" and view["durable"] is False
    assert view["depth"] == {"count": 5, "bytes": 5 * size, "ready": 4}
    assert view["thresholds"] == {
        "flow_stop_count": 3, "flow_resume_count": 1, "flow_stop_size": 80 * MiB, "flow_resume_size": int(70 * MiB),
        "flow_stop_drain_time": 0.0, "flow_resume_drain_time": 0.0, "flow_stop_age": 0.0, "flow_resume_age": 0.0,
        "max_count": 10, "max_size": 100 * MiB, "overflow": "drop-head",
    }
    assert view["saturated"] is True and view["saturated_for_seconds"] == 2.5
    assert view["stop_reason"] == {"threshold": "flow_stop_count", "limit": 3, "value": 4}
    assert view["held_transfers"] == 2
    assert view["flow_stopped_producers"] == [{"connection": p.session.conn_id, "client_name": "feeder"}]
    assert view["subscriptions"] == [{
        "connection": c.session.conn_id, "client_name": "reader", "subscription": sub, "queue": "orders",
        "prefetch": 1, "unsettled": 1, "delivered": 1, "buffer": {"size": 4096, "unacked": size},
    }]
    assert view["counters"] == {"enqueued": 5, "dequeued": 0, "rejected": 0, "dropped": 0,
                                "flow_stopped_count": 1, "held_total": 2}

    h.core.set_queue_thresholds("orders", {"flow_stop_count": 8, "flow_resume_count": 6})  # raised: clears at once
    view = views.queue_view(h.core.queues["orders"], h.now)
    assert view["saturated"] is False and view["saturated_for_seconds"] is None and view["stop_reason"] is None
    assert view["held_transfers"] == 0 and view["flow_stopped_producers"] == []
    assert view["thresholds"]["flow_stop_count"] == 8


def test_queues_page_is_sorted_by_name_and_pages_by_cursor() -> None:
    h = make()
    for name in ("b", "c", "a", "a/b", "d"):
        h.queue(name)
    page = roundtrip(views.queues_page(h.core, h.now))
    assert [q["name"] for q in page["queues"]] == ["a", "a/b", "b", "c", "d"] and page["next"] is None
    page = views.queues_page(h.core, h.now, limit=2)
    assert [q["name"] for q in page["queues"]] == ["a", "a/b"] and page["next"] == "a/b"
    page = views.queues_page(h.core, h.now, after="a/b", limit=2)
    assert [q["name"] for q in page["queues"]] == ["b", "c"] and page["next"] == "c"
    page = views.queues_page(h.core, h.now, after="c", limit=2)
    assert [q["name"] for q in page["queues"]] == ["d"] and page["next"] is None
    # a cursor need not name a queue that exists (it may have been deleted since)
    h.core.delete_queue("b")
    page = views.queues_page(h.core, h.now, after="b", limit=1)
    assert [q["name"] for q in page["queues"]] == ["c"] and page["next"] == "c"
    assert views.queues_page(h.core, h.now, after="zzz") == {"queues": [], "next": None}


def test_connections_page_by_id() -> None:
    h = make()
    sessions = [h.producer(f"p{i}").session for i in range(5)]
    h.core.close_session(sessions[2])
    page = roundtrip(views.connections_page(h.core, h.now, limit=2))
    ids = [s.conn_id for s in sessions]
    assert [c["id"] for c in page["connections"]] == ids[:2] and page["next"] == ids[1]
    page = views.connections_page(h.core, h.now, after=ids[1], limit=2)
    assert [c["id"] for c in page["connections"]] == [ids[3], ids[4]] and page["next"] is None


def test_exchanges_page_and_delete_exchange() -> None:
    h = make()
    h.queue("q")
    p = h.producer()
    p.declare_exchange("fan", "fanout")
    p.bind("q", "fan", "x")
    p.bind("q", "fan", "y")
    page = roundtrip(views.exchanges_page(h.core))
    assert page == {"next": None, "exchanges": [
        {"name": "amq.direct", "kind": "direct", "builtin": True, "binding_keys": 0},
        {"name": "amq.fanout", "kind": "fanout", "builtin": True, "binding_keys": 0},
        {"name": "amq.topic", "kind": "topic", "builtin": True, "binding_keys": 0},
        {"name": "fan", "kind": "fanout", "builtin": False, "binding_keys": 2},
    ]}
    assert views.exchanges_page(h.core, after="amq.fanout", limit=1)["next"] == "amq.topic"
    assert h.core.delete_exchange("fan") == 2
    assert [e["name"] for e in views.exchanges_page(h.core)["exchanges"]] == ["amq.direct", "amq.fanout", "amq.topic"]


def test_connection_roles() -> None:
    h = make()
    h.queue("q")
    idle = h.producer("idle")
    producer = h.producer("p")
    producer.send("", "q")
    consumer = h.consumer("c")
    consumer.subscribe("q")
    both = h.producer("both")
    both.send("", "q")
    assert isinstance(both.request(lambda rid: Subscribe(rid, 7, "q", 0, 0)), Ok)
    roles = {c["client_name"]: c["role"] for c in views.connections_page(h.core, h.now)["connections"]}
    assert roles == {"idle": "idle", "p": "producer", "c": "consumer", "both": "both"}
    assert views.connection_role(idle.session) == "idle"


def test_connection_view_producer_credit_and_flow_state() -> None:
    h = make()
    h.queue("q", flow_stop_count=1, flow_resume_count=1)
    p = h.producer("feeder")
    h.advance(10)
    p.send("", "q", b"a")  # count 1: not over the stop threshold, completed
    h.advance(1)
    p.send("", "q", b"b")  # count 2 > 1: saturated, held, flow-stopped at t = 11 s
    h.advance(4)
    size = message_size(b"a")
    page = views.connections_page(h.core, h.now, lambda _conn_id: "127.0.0.1:4242")["connections"]
    view = roundtrip(next(c for c in page if c["id"] == p.session.conn_id))
    assert view["id"] == p.session.conn_id and view["client_name"] == "feeder" and view["peer"] == "127.0.0.1:4242"
    assert view["identity"] == "anonymous" and view["role"] == "producer" and view["flow_control"] is True
    assert view["producer"] == {
        "buffer_size": MiB, "received_bytes": 2 * size, "acknowledged_bytes": 0, "unacked_bytes": 2 * size,
        "completed_bytes": size, "transfers": 2, "transfers_held": 1, "transfers_held_total": 1, "transfers_parked": 0,
        "transfers_duplicate": 0, "credit_state": "producer", "paced_on": None, "paced_total": 0,
        "messages_dropped": 0,
    }
    assert view["flow"] == {
        "stopped": True, "stopped_for_seconds": 4.0, "blocking_queues": ["q"], "admin_stopped": False, "memory_stopped": False,
        "destinations": [{"destination": "q", "stopped_for_seconds": 4.0, "reason": "queue",
                          "threshold": "flow_stop_count", "limit": 1, "value": 2}],
        "destinations_total": 1,
    }
    assert view["consumer"] == {"buffer": {"size": 0, "unacked": 0}, "subscriptions": [], "subscriptions_total": 0,
                                "unsettled": 0}

    p.session.poll_credit(h.now + 10**10)  # the timer re-advertises: the completed bytes are acknowledged
    p.pump()
    view = views.connection_view(p.session, h.now)
    assert view["producer"]["acknowledged_bytes"] == size and view["producer"]["unacked_bytes"] == size
    assert view["peer"] is None


def test_admin_stop_shows_as_flow_state_since_the_stop_and_held_counts_each_transfer_once() -> None:
    h = make()
    h.queue("a", flow_stop_count=1)
    h.queue("b", flow_stop_count=1)
    p = h.producer("fan")
    p.declare_exchange("fan", "fanout")
    p.bind("a", "fan")
    p.bind("b", "fan")
    h.advance(5)
    p.send("fan", "", b"1")
    p.send("fan", "", b"2")  # held by both saturated queues: one transfer
    assert views.held_by_connection(h.core) == {p.session.conn_id: 1}
    h.advance(100)
    h.core.stop_all_producers()
    h.advance(3)
    p.send("fan", "", b"3")  # held by both queues and by the admin stop: still one transfer
    assert views.held_by_connection(h.core) == {p.session.conn_id: 2}
    [view] = views.connections_page(h.core, h.now, lambda cid: f"peer-{cid}")["connections"]
    assert view["peer"] == f"peer-{p.session.conn_id}" and view["producer"]["transfers_held"] == 2
    flow = view["flow"]
    assert flow["admin_stopped"] is True and flow["blocking_queues"] == ["a", "b"]
    [admin] = [d for d in flow["destinations"] if d["destination"] == "*"]
    assert admin == {"destination": "*", "stopped_for_seconds": 3.0, "reason": "admin", "threshold": "admin",
                     "limit": 0, "value": 0}
    assert flow["stopped_for_seconds"] == 103.0  # the queues stopped it first
    h.core.start_all_producers()
    assert views.held_by_connection(h.core) == {p.session.conn_id: 2}  # the queues still hold both
    h.core.get_queue("a").purge()
    h.core.get_queue("b").purge()
    assert views.held_by_connection(h.core) == {}
    [view] = views.connections_page(h.core, h.now)["connections"]
    assert view["flow"]["stopped"] is False and view["producer"]["transfers_held"] == 0


def test_connection_view_consumer_buffers() -> None:
    h = make()
    h.queue("q")
    p = h.producer()
    for i in range(3):
        p.send("", "q", b"x" * 100)
    c = h.consumer("reader")
    c.set_buffer(0, 10_000)
    sub = c.subscribe("q", prefetch=2, buffer_size=5000)
    c.pump()
    view = views.connection_view(c.session, h.now)
    size = message_size(b"x" * 100)
    assert view["role"] == "consumer"
    assert view["consumer"]["buffer"] == {"size": 10_000, "unacked": 2 * size}
    assert view["consumer"]["subscriptions"] == [{
        "connection": c.session.conn_id, "client_name": "reader", "subscription": sub, "queue": "q", "prefetch": 2,
        "unsettled": 2, "delivered": 2, "buffer": {"size": 5000, "unacked": 2 * size},
    }]
    assert view["consumer"]["unsettled"] == 2
    c.buffer_ack(0)
    c.buffer_ack(sub)
    assert views.connection_view(c.session, h.now)["consumer"]["buffer"]["unacked"] == 0


def test_policy_view_reports_settings_pool_and_every_grant() -> None:
    h = Harness(credit={"policy": "aggressive"})  # quota 1 GiB: a 5 % pool of 51.2 MiB
    pool = (1 << 30) * 5 // 100
    view = roundtrip(views.policy_view(h.core))
    assert view["policy"] == {
        "quota": 1 << 30, "policy": "aggressive", "static_size": 10 * MiB, "min_size": 10 * MiB, "max_size": 50 * MiB,
        "dynamic_percent": 1.0, "dynamic_threshold_percent": 10.0, "aggressive_percent": 5.0, "override_size": 0,
    }
    assert view["pool"] == {"bytes": pool, "reserve": 10_000, "shareable": pool - 10_000, "share": 50 * MiB,
                            "floor": 4 * MiB + 512}
    assert view["granted"] == {"total": 0, "producers": 0, "provisional": 0, "waiting": 0, "connections": []}
    assert view["producers_stopped"] is False and view["committed"] == view["promised_outstanding"] == 0
    p1, p2 = h.producer("p1"), h.producer("p2")
    h.consumer("not paced")  # flow_control off: not granted a buffer
    c = h.consumer("only consumes", flow_control=True)  # provisional buffer, never registered
    view = views.policy_view(h.core)
    assert view["granted"]["total"] == 3 and view["granted"]["provisional"] == 3  # one byte each, counted
    assert view["promised_outstanding"] == 3
    p1.register()
    p2.register()  # a first transfer registers a connection as a producer
    view = roundtrip(views.policy_view(h.core))
    half = (pool - 10_000) // 2
    # p1 was granted 50 MiB alone and may still send up to that until acknowledgements overtake it:
    # the 1.2 MB left is less than one maximum message, so p2 waits for a share
    assert view["granted"]["connections"] == [
        {"connection": p1.session.conn_id, "client_name": "p1", "buffer_size": half, "state": "producer",
         "window": 50 * MiB},
        {"connection": p2.session.conn_id, "client_name": "p2", "buffer_size": 1, "state": "waiting", "window": 1},
        {"connection": c.session.conn_id, "client_name": "only consumes", "buffer_size": 1,
         "state": "provisional", "window": 1},
    ]
    assert view["granted"]["total"] <= view["committed"] <= pool and view["granted"]["waiting"] == 1
    h.core.set_credit_policy(policy="static", static_size=3 * MiB)
    h.core.stop_all_producers()
    view = views.policy_view(h.core)
    assert view["policy"]["policy"] == "static" and view["policy"]["static_size"] == 3 * MiB
    assert view["pool"]["bytes"] == 1 << 30
    assert view["granted"]["total"] == 6 * MiB + 1 and view["producers_stopped"] is True


def test_broker_view() -> None:
    h = make()
    h.queue("q")
    h.producer()
    view = roundtrip(views.broker_view(h.core, port=5680, admin_port=5681))
    assert view == {"name": "flowbroker", "port": 5680, "admin_port": 5681, "connections": 1, "queues": 1, "saturated_queues": 0,
                    "exchanges": 3, "subscriptions": 0, "producers_stopped": False,
                    "credit_policy": "static", "unroutable": 0, "udp": None, "journal": None,
                    "idempotence": {"producer_ids": 0, "max_producer_ids": 10_000, "max_producer_ids_per_user": 5_000,
                                    "producer_id_ttl": 3600.0,
                                    "accepted": 0, "duplicates": 0, "gaps": 0, "refused": 0, "evicted": 0}}


def test_lists_inside_one_object_show_their_first_entries_and_a_total() -> None:
    h = make()
    n = views.NESTED_LIMIT + 5
    for i in range(n):
        h.queue(f"q{i:02d}", flow_stop_count=1, flow_resume_count=1)
    c = h.consumer("many")
    for i in range(n):
        c.subscribe("q00")
    p = h.producer("stopped-everywhere")
    for i in range(n):
        p.send("", f"q{i:02d}")
        p.send("", f"q{i:02d}")  # over the stop threshold: flow-stopped by every queue
    h.advance(1)
    q = views.queue_view(h.core.get_queue("q00"), h.now)
    assert len(q["subscriptions"]) == views.NESTED_LIMIT and q["subscriptions_total"] == n
    assert len(q["flow_stopped_producers"]) == 1 and q["flow_stopped_producers_total"] == 1
    [consumer] = [v for v in views.connections_page(h.core, h.now)["connections"] if v["client_name"] == "many"]
    assert len(consumer["consumer"]["subscriptions"]) == views.NESTED_LIMIT
    assert consumer["consumer"]["subscriptions_total"] == n
    flow = views.connection_view(p.session, h.now)["flow"]
    assert len(flow["destinations"]) == views.NESTED_LIMIT and flow["destinations_total"] == n
    assert flow["blocking_queues"] == [f"q{i:02d}" for i in range(views.NESTED_LIMIT)]
    assert flow["stopped_for_seconds"] == 1.0


@given(st.lists(st.sampled_from(["send-a", "send-fan", "stop-all", "start-all", "purge-a", "purge-b",
                                 "delete-b", "raise-a", "lower-a"]), max_size=40))
def test_held_transfers_per_connection_agree_with_a_walk_over_every_queue(ops: list[str]) -> None:
    """`transfers_held` reads a counter kept by HeldTransfer; it must always equal the walk it replaced."""
    h = make()
    h.queue("a", flow_stop_count=1, flow_resume_count=1)
    h.queue("b", flow_stop_count=1, flow_resume_count=1)
    p = h.producer("p", window=10_000)
    p.declare_exchange("fan", "fanout")
    p.bind("a", "fan")
    p.bind("b", "fan")
    for op in ops:
        if op == "send-a":
            p.send("", "a", force=True)
        elif op == "send-fan":
            p.send("fan", "", force=True)
        elif op == "stop-all":
            h.core.stop_all_producers()
        elif op == "start-all":
            h.core.start_all_producers()
        elif op in ("purge-a", "purge-b") and op[-1] in h.core.queues:
            h.core.get_queue(op[-1]).purge()
        elif op == "delete-b" and "b" in h.core.queues:
            h.core.delete_queue("b")
        elif op == "raise-a":
            h.core.set_queue_thresholds("a", {"flow_stop_count": 1000})
        elif op == "lower-a":
            h.core.set_queue_thresholds("a", {"flow_stop_count": 1})
        p.pump()
        assert p.session.transfers_held_now == views.held_by_connection(h.core).get(p.session.conn_id, 0)


def test_a_producer_without_flow_control_shows_no_unacked_bytes() -> None:
    """It is acknowledged nothing, so received minus acknowledged was every byte it ever sent: 2.2 GiB
    for a broker holding 20 MiB in `flowbroker connections` (a tester)."""
    h = Harness()
    h.queue("q")
    p = h.producer("legacy", flow_control=False)
    for _ in range(5):
        p.send("", "q", b"x" * 1000)
    p.pump()
    view = views.connection_view(p.session, h.now)
    assert view["producer"]["received_bytes"] > 5000 and view["producer"]["unacked_bytes"] == 0


def test_a_subscription_without_a_byte_buffer_shows_no_unacked_bytes_as_its_metric() -> None:
    """It acknowledges nothing, so the bytes delivered to it only grew in the view (buffer size 0,
    unacked in megabytes) while flowbroker_queue_consumer_unacknowledged_bytes counted 0 (session 33's note)."""
    h = Harness()
    h.queue("q")
    p = h.producer("p")
    for _ in range(5):
        p.send("", "q", b"x" * 1000)
    c = h.consumer("c")
    c.subscribe("q", prefetch=0, buffer_size=0)
    c.pump()
    (sub,) = views.queue_view(h.core.queues["q"], h.now)["subscriptions"]
    assert sub["delivered"] == 5 and sub["buffer"] == {"size": 0, "unacked": 0}
    assert views.connection_view(c.session, h.now)["consumer"]["subscriptions"][0]["buffer"]["unacked"] == 0
