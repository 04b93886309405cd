"""DELETE_EXCHANGE in the core: the exchange and its bindings go, its queues and their messages stay."""

from __future__ import annotations

from tests.broker.coreharness import Harness

from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import DeleteExchange, Error, Ok


def test_delete_exchange_removes_its_bindings_and_keeps_its_queues() -> None:
    h = Harness()
    h.queue("a")
    h.queue("b")
    p = h.producer("p")
    assert isinstance(p.declare_exchange("fan", "fanout"), Ok)
    p.bind("a", "fan")
    p.bind("b", "fan", "x")
    p.bind("a", "amq.direct", "k")
    tid = p.send("fan", "", b"before")
    p.pump()
    assert p.is_complete(tid) and h.core.get_queue("a").count == 1 and h.core.get_queue("b").count == 1

    assert p.ok(lambda rid: DeleteExchange(rid, "fan")) == {"exchange": "fan", "bindings": 2}
    assert "fan" not in h.core.exchanges
    tid = p.send("fan", "", b"after")
    p.pump()
    [error] = p.errors_for(tid)
    assert error.code is ErrorCode.NOT_FOUND and error.destination == "fan"
    assert p.is_complete(tid)  # refused, and completed so the producer's credit flows
    # The queues keep their messages and their other bindings.
    assert h.core.get_queue("a").count == 1 and h.core.get_queue("b").count == 1
    p.send("amq.direct", "k", b"direct")
    assert h.core.get_queue("a").count == 2
    # The name is free again, for any kind.
    assert isinstance(p.declare_exchange("fan", "topic"), Ok)


def test_built_in_and_unknown_exchanges_are_refused_and_the_connection_carries_on() -> None:
    h = Harness()
    p = h.producer("p")
    for name in ("amq.direct", "amq.fanout", "amq.topic", ""):
        answer = p.request(lambda rid, name=name: DeleteExchange(rid, name))
        assert isinstance(answer, Error) and answer.code is ErrorCode.INVALID_ARGUMENT, name
        assert "built-in" in answer.text
    answer = p.request(lambda rid: DeleteExchange(rid, "nope"))
    assert isinstance(answer, Error) and answer.code is ErrorCode.NOT_FOUND and answer.destination == "nope"
    assert sorted(h.core.exchanges) == ["amq.direct", "amq.fanout", "amq.topic"]
    assert isinstance(p.declare_exchange("ex", "direct"), Ok)  # still served
