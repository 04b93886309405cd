"""Held messages share the strings that many of them carry, rather than keep one decoded copy each: the
memory bound charges a message its body, headers and MESSAGE_OVERHEAD, not its names (docs/architecture.md).

Testers measured what one copy a message cost: a 255-emoji idempotent producer id took a 64 MiB-watermark
broker to 1.9 times its bound; a queue named with 64 emoji cost 350 bytes a message more than one named "q"."""

from __future__ import annotations

from tests.broker.coreharness import Harness


def make() -> Harness:
    return Harness(credit={"policy": "static", "static_size": 1 << 20})


def test_the_messages_of_one_idempotent_producer_share_its_id() -> None:
    h = make()
    h.queue("q")
    p = h.producer()
    p.register()
    pid = "\U0001f600" * 255
    for first in range(0, 300, 100):
        for n in range(first, first + 100):  # each message's id a copy of its own, as decoded
            p.send_many([("", "q", b"m", None)], producer_id=(pid + "x")[:-1], sequences=[n])
        p.pump()
    held = list(h.core.queues["q"].store)
    assert len(held) == 300 and held[0].producer_id is not None and held[0].producer_id.endswith(pid)
    assert len({id(m.producer_id) for m in held}) == 1


def test_messages_to_a_queue_by_name_share_its_name_on_every_path() -> None:
    """The run path (`route`'s common frame: plain messages to one queue) kept each message's decoded key."""
    h = make()
    name = "\U0001f600" * 64
    h.queue(name)
    p = h.producer()
    p.register()
    def decoded() -> str:  # a copy of its own, as msgpack decodes each message's key
        return (name + "x")[:-1]

    p.send_many([("", decoded(), b"m", None) for _ in range(100)])  # the run path
    p.send_many([("", decoded(), b"m", {"h": "v"}) for _ in range(10)])  # the per-message path
    p.pump()
    queue = h.core.queues[name]
    held = list(queue.store)
    assert len(held) == 110 and all(m.routing_key is queue.name for m in held)


def test_messages_through_an_exchange_share_its_name_and_one_copy_of_each_routing_key() -> None:
    h = make()
    p = h.producer()
    exchange, key = "\U0001f600" * 245 + "ex", "\U0001f601" * 64
    p.declare_exchange(exchange, "direct")
    h.queue("q")
    p.bind("q", exchange, key)
    p.register()
    p.send_many([((exchange + "x")[:-1], (key + "x")[:-1], b"m", None) for _ in range(50)])  # decoded copies
    p.pump()
    held = list(h.core.queues["q"].store)
    assert len(held) == 50 and all(m.exchange is h.core.exchanges[exchange].name for m in held)
    assert len({id(m.routing_key) for m in held}) == 1
