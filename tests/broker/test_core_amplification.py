"""One small frame costs the broker time in proportion to its own size, never to state a client built up
(issue 8, items 2, 5 and 6), in memory through the core. The same attacks over real TCP, with a
well-behaved client beside them, are in tests/e2e/test_e2e_attacks.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from tests.broker.coreharness import Harness

from flowbroker.broker.subscription import Subscription
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Cancel, Complete, Deliver, Error, Headers, Outcome, Settle, Subscribe
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME, MAX_KEY_BYTES, MAX_RANGES_PER_FRAME


@contextmanager
def counting_credit_checks() -> Iterator[list[int]]:
    """Counts Subscription.has_credit() calls: the unit of work dispatch does per subscription."""
    calls = [0]
    original = Subscription.has_credit

    def counted(self: Subscription) -> bool:
        calls[0] += 1
        return original(self)

    Subscription.has_credit = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        Subscription.has_credit = original  # type: ignore[method-assign]


def test_settle_of_wide_ranges_over_tags_never_delivered_is_one_bisection_each() -> None:
    h = Harness()
    h.queue("q")
    c = h.consumer()
    c.subscribe("q", prefetch=5)
    p = h.producer()
    for i in range(20):
        p.send("", "q", b"m%d" % i)
    p.pump()
    c.pump()
    assert len(c.unsettled) == 5
    # 1,024 ranges, each 10,000 wide, none of them outstanding: tags far above what was delivered.
    ranges = [(10_000 * k + 100, 10_000 * (k + 1) + 99) for k in range(MAX_RANGES_PER_FRAME)]
    c.handle(Settle(Outcome.ACK, ranges))
    (error,) = [f for f in c.pump() if isinstance(f, Error)]
    assert error.code is ErrorCode.UNKNOWN_DELIVERY
    assert error.text.startswith(f"{10_000 * MAX_RANGES_PER_FRAME} delivery tag(s)")
    assert len(h.core.sessions[c.session.conn_id].unsettled) == 5  # nothing settled


def test_a_range_wider_than_what_is_outstanding_settles_those_and_reports_the_rest() -> None:
    """Item 6(e): SETTLE (1, 1000) with 3 outstanding settles the 3 and says 997 were not outstanding."""
    h = Harness()
    h.queue("q")
    c = h.consumer()
    c.subscribe("q", prefetch=3)
    p = h.producer()
    for i in range(5):
        p.send("", "q", b"m%d" % i)
    p.pump()
    c.pump()
    c.handle(Settle(Outcome.ACK, [(1, 1000)]))
    frames = c.pump()
    errors = [f for f in frames if isinstance(f, Error)]
    assert [e.code for e in errors] == [ErrorCode.UNKNOWN_DELIVERY] and errors[0].text.startswith("997 ")
    assert h.core.queues["q"].count == 2  # 3 acked, 2 left (and delivered now prefetch is free)
    assert len(c.bodies()) == 5


def test_subscription_id_zero_is_refused() -> None:
    """Item 6(d): 0 is the connection-level buffer's opaque in BUFFER_CONTROL/BUFFER_ACK."""
    h = Harness()
    h.queue("q")
    c = h.consumer()
    answer = c.request(lambda rid: Subscribe(rid, 0, "q", 0, 0))
    assert isinstance(answer, Error) and answer.code is ErrorCode.INVALID_ARGUMENT and "reserved" in answer.text


def test_subscriptions_per_connection_are_bounded() -> None:
    h = Harness(server={"max_subscriptions": 3})
    h.queue("q")
    c = h.consumer()
    for _ in range(3):
        c.subscribe("q")
    answer = c.request(lambda rid: Subscribe(rid, 99, "q", 0, 0))
    assert isinstance(answer, Error) and answer.code is ErrorCode.RESOURCE_EXHAUSTED


def test_subscriptions_in_the_broker_are_bounded_and_counted_back_as_they_end() -> None:
    """1,000 a connection on 10,000 connections was 3.6 GB of subscriptions (~0.4 KiB each, a tester):
    max_subscriptions_total bounds them all together. Cancels, closes and queue deletes give them back."""
    h = Harness(server={"max_subscriptions_total": 4})
    h.queue("q")
    h.queue("r")
    a, b = h.consumer("a"), h.consumer("b")
    a.subscribe("q")
    a.subscribe("r")
    first = b.subscribe("q")
    b.subscribe("r")
    answer = b.request(lambda rid: Subscribe(rid, 99, "q", 0, 0))
    assert isinstance(answer, Error) and answer.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "max_subscriptions_total 4" in answer.text
    assert h.core.memory.subscriptions == 4
    h.core.delete_queue("r")  # a's and b's subscriptions to r end with it
    assert h.core.memory.subscriptions == 2
    a.close()
    assert h.core.memory.subscriptions == 1
    assert b.ok(lambda rid: Cancel(rid, first)) == {"requeued": 0}
    assert h.core.memory.subscriptions == 0
    for _ in range(4):
        b.subscribe("q")
    assert h.core.memory.subscriptions == 4


def test_blocked_subscriptions_cost_enqueue_nothing() -> None:
    """20,000 blocked subscriptions made every enqueue walk them all (1,000 messages took 2.6 s): a
    subscription without credit leaves the queue's rotation until its credit returns."""
    h = Harness(server={"max_subscriptions": 100_000})
    h.queue("q")
    attacker = h.consumer("attacker")
    for _ in range(2_000):
        attacker.subscribe("q", prefetch=1)
    p = h.producer()
    for i in range(2_000):  # one message each: now every attacker subscription is at its prefetch
        p.send("", "q", b"a%d" % i)
    p.pump()
    attacker.pump()
    with counting_credit_checks() as calls:
        for i in range(1_000):
            p.send("", "q", b"b%d" % i)
        p.pump()
    assert calls[0] <= 2 * 1_000, calls[0]  # not 1,000 x 2,000
    assert h.core.queues["q"].count == 3_000
    # Credit returns: a settle puts that subscription back in the rotation and it gets the next message.
    first = min(attacker.unsettled)
    attacker.ack([first])
    attacker.pump()
    assert len(attacker.deliveries) == 2_001


def test_a_shared_connection_buffer_is_shared_between_a_slow_and_a_fast_subscription() -> None:
    """Item 6(b): freed connection-buffer space went to the first subscription every time, so a slow
    subscription starved a fast one (0 of 3,000 delivered in 4 s)."""
    h = Harness()
    h.queue("slow")
    h.queue("fast")
    c = h.consumer()
    c.set_buffer(0, 20_000)
    slow = c.subscribe("slow")
    fast = c.subscribe("fast")
    p = h.producer()
    for i in range(300):
        p.send("", "slow", b"s" * 1000)
        p.send("", "fast", b"f" * 1000)
    p.pump()
    c.pump()
    for _ in range(20):  # the application handles (and acks buffer space for) what it got
        c.ack()
        c.buffer_ack(0)
        c.pump()
    slow_n, fast_n = len(c.bodies(slow)), len(c.bodies(fast))
    assert fast_n >= slow_n // 2 and slow_n >= fast_n // 2, (slow_n, fast_n)


def test_completions_and_deliveries_are_split_at_the_per_frame_limits() -> None:
    h = Harness(queues={"max_prefetch": 10 * MAX_ENTRIES_PER_FRAME})
    h.queue("q")
    c = h.consumer()
    c.subscribe("q")
    p = h.producer()
    p.register()  # its first message makes it a producer: its share follows (until then, one message)
    n = 3 * MAX_ENTRIES_PER_FRAME
    for start in range(0, n, 256):
        p.send_many([("", "q", b"", None)] * 256)
    frames = c.pump() + c.pump()  # (a collect takes at most MAX_DELIVERIES_WAITING, 2,048)
    delivers = [f for f in frames if isinstance(f, Deliver)]
    assert all(len(f.entries) <= MAX_ENTRIES_PER_FRAME for f in delivers)
    assert sum(len(f.entries) for f in delivers) == n
    completes = [f for f in p.pump() if isinstance(f, Complete)]
    assert all(len(f.ranges) <= MAX_RANGES_PER_FRAME for f in completes)


@pytest.mark.parametrize("where", ["routing key", "binding key"])
def test_keys_over_the_limit_are_refused_with_key_too_long(where: str) -> None:
    h = Harness()
    h.queue("q")
    p = h.producer()
    assert p.declare_exchange("t", "topic").__class__.__name__ == "Ok"
    long_key = ".".join(["w"] * 5_000)  # 9,999 bytes: the key that stopped the broker
    if where == "routing key":
        ok = p.send("t", "w." * (MAX_KEY_BYTES // 2 - 1) + "w")  # 255 bytes
        tid = p.send("t", long_key)
        p.pump()
        assert p.errors_for(ok) == []
        (e,) = p.errors_for(tid)
        assert e.code is ErrorCode.KEY_TOO_LONG and "9999 bytes" in e.text
        assert p.is_complete(tid)  # refused, and completed so credit flows
    else:
        answer = p.bind("q", "t", long_key)
        assert isinstance(answer, Error) and answer.code is ErrorCode.KEY_TOO_LONG
        answer = p.unbind("q", "t", long_key)  # UNBIND too (limits.py: binding keys of BIND and UNBIND)
        assert isinstance(answer, Error) and answer.code is ErrorCode.KEY_TOO_LONG


def test_a_message_whose_headers_fill_the_frame_is_refused_at_publish() -> None:
    """Item 5: a TRANSFER exactly max_frame_size became a DELIVER 2 bytes over it, killing every consumer
    of the queue forever. The whole message is checked against max_message_size at publish."""
    h = Harness(server={"max_frame_size": 64 * 1024, "max_message_size": 32 * 1024})
    h.queue("q")
    c = h.consumer()
    c.subscribe("q")
    p = h.producer()
    headers: Headers = {f"h{i}": "v" * 1000 for i in range(40)}  # 40 KB of headers on a 1-byte body
    tid = p.send("", "q", b"x", headers)
    p.pump()
    (e,) = p.errors_for(tid)
    assert e.code is ErrorCode.MESSAGE_TOO_LARGE and "max_message_size 32768" in e.text
    assert h.core.queues["q"].count == 0 and c.pump() == []


def test_queues_exchanges_and_bindings_are_bounded() -> None:
    h = Harness(server={"max_queues": 2, "max_exchanges": 4, "max_bindings": 2})
    p = h.producer()
    assert p.declare_queue("a").__class__.__name__ == "Ok" and p.declare_queue("b").__class__.__name__ == "Ok"
    refused = p.declare_queue("c")
    assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED and "max_queues" in refused.text
    assert p.declare_queue("a").__class__.__name__ == "Ok"  # redeclaring is not a new queue
    assert p.declare_exchange("x", "topic").__class__.__name__ == "Ok"  # three built in + this one
    refused = p.declare_exchange("y", "topic")
    assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
    assert p.bind("a", "x", "k.#").__class__.__name__ == "Ok"
    assert p.bind("b", "x", "k.#").__class__.__name__ == "Ok"
    refused = p.bind("a", "x", "other")
    assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED and "max_bindings" in refused.text
    assert p.unbind("a", "x", "k.#").__class__.__name__ == "Ok"  # a binding freed is one more allowed
    assert p.bind("a", "x", "other").__class__.__name__ == "Ok"


def test_the_route_cache_is_one_bounded_dict_for_the_whole_broker() -> None:
    h = Harness()
    h.queue("q")
    p = h.producer()
    for i in range(20):
        assert p.declare_exchange(f"t{i}", "topic").__class__.__name__ == "Ok"
        assert p.bind("q", f"t{i}", "#").__class__.__name__ == "Ok"
    p.register()
    n = 0
    for i in range(20):
        for start in range(0, 3_400, 200):  # 68,000 distinct (exchange, key) pairs in all
            p.send_many([(f"t{i}", f"key.{k}", b"", None) for k in range(start, start + 200)])
            p.pump()
            n += 200
    assert h.core.queues["q"].count == n
    assert len(h.core.routes.entries) <= h.core.routes.MAX_ENTRIES


def test_the_route_cache_is_bounded_by_the_bytes_of_its_results_too() -> None:
    """65,536 results of 150 queues each, under keys of 256 non-ASCII bytes, took a broker to 1.8 times
    its memory bound (a tester): the cache is emptied past RouteCache.MAX_BYTES as well."""
    from flowbroker.broker.exchange import entry_bytes

    h = Harness(queues={"overflow": "drop-head"})
    p = h.producer()
    assert p.declare_exchange("t", "topic").__class__.__name__ == "Ok"
    for i in range(150):
        h.queue(f"q{i}", max_count=1, flow_stop_count=0, flow_stop_size=0)
        assert p.bind(f"q{i}", "t", "#").__class__.__name__ == "Ok"
    p.register()
    routes = h.core.routes
    key_tail = "a" * 240 + "\U0001f600"
    most = 0
    for start in range(0, 12_000, 100):
        p.send_many([("t", f"{k:06d}.{key_tail}", b"", None) for k in range(start, start + 100)])
        p.pump()
        most = max(most, routes.bytes)
        assert routes.bytes == sum(entry_bytes(k, len(v)) for (_, k), v in routes.entries.items())
    assert 0 < most <= routes.MAX_BYTES
    assert len(routes.entries) < 12_000  # emptied on the way: 12,000 such results hold over MAX_BYTES
