"""Redeclaring a queue (DECLARE_QUEUE, docs/protocol.md): an answer OK must never leave the client
believing something false of the queue. Asking a memory-only queue for `durable=True` is refused
(ALREADY_EXISTS), as is a declaration with arguments whose durability differs; a bare declare (no
arguments, not durable: what `flowbroker publish`, the Spark writer and multicast groups send to make
sure the queue exists) takes the queue as it is."""

from __future__ import annotations

from typing import Any

from flowbroker.protocol.frames import DeclareQueue, Error, Ok
from flowbroker.protocol.errors import ErrorCode

from tests.broker.coreharness import Harness, Producer


def declare(client: Producer, name: str, durable: bool, **arguments: Any) -> Ok | Error:
    return client.request(lambda rid: DeclareQueue(rid, name, durable, arguments or None))


def refused(answer: Ok | Error) -> str:
    assert isinstance(answer, Error) and answer.code == ErrorCode.ALREADY_EXISTS, answer
    return answer.text


def test_a_memory_only_queue_redeclared_durable_is_refused_and_stays_as_it_was() -> None:
    h = Harness()
    client = h.producer()
    assert isinstance(declare(client, "q", False), Ok)
    text = refused(declare(client, "q", True))
    assert "memory-only" in text and "delete it" in text and "durable=True" in text
    refused(declare(client, "q", True, flow_stop_count=10))
    assert not h.core.queues["q"].durable


def test_a_durable_queue_declared_with_arguments_but_not_durable_is_refused() -> None:
    h = Harness()
    client = h.producer()
    assert isinstance(declare(client, "d", True, flow_stop_count=10), Ok)
    text = refused(declare(client, "d", False, flow_stop_count=10))
    assert "durable" in text and "durable=True" in text
    assert h.core.queues["d"].durable


def test_a_bare_declare_takes_a_durable_queue_as_it_is() -> None:
    """`flowbroker publish -k d` and the Spark writer declare with the wire's defaults before sending:
    a queue made durable beforehand must stay usable by them."""
    h = Harness()
    client = h.producer()
    assert isinstance(declare(client, "d", True, flow_stop_count=10), Ok)
    assert isinstance(declare(client, "d", False), Ok)
    assert h.core.declare_queue("d") is h.core.queues["d"]  # the core's own declare (multicast groups)
    assert h.core.queues["d"].durable


def test_a_redeclare_of_the_same_durability_is_idempotent() -> None:
    h = Harness()
    client = h.producer()
    for durable in (False, True):
        name = f"q{durable}"
        assert isinstance(declare(client, name, durable, flow_stop_count=10), Ok)
        assert isinstance(declare(client, name, durable, flow_stop_count=10), Ok)
        assert isinstance(declare(client, name, durable), Ok)
        assert h.core.queues[name].durable is durable
    refused(declare(client, "qTrue", True, flow_stop_count=20))  # other arguments: refused as before


def test_a_redeclare_with_other_arguments_names_each_that_differs() -> None:
    """client.md: ALREADY_EXISTS "saying what differs" (it said only "other arguments")."""
    h = Harness()
    client = h.producer()
    assert isinstance(declare(client, "rq", False, max_count=10, flow_stop_count=8), Ok)
    text = refused(declare(client, "rq", False, max_count=20, flow_stop_count=8, overflow="drop-head"))
    assert "max_count 10 (declared 20)" in text and "overflow 'reject' (declared 'drop-head')" in text
    assert "flow_stop_count" not in text  # the same as declared: not named
    assert "flowbroker queue set" in text


def test_with_storage_off_a_durable_declare_is_a_memory_only_queue_and_says_so() -> None:
    """configuration.md: `[storage] enabled = false` keeps every queue in memory, durable=True ignored. The OK
    said "durable": true of a queue a restart empties (a tester); it says false now, and so does the queue."""
    h = Harness(storage={"enabled": False})
    client = h.producer()
    answer = declare(client, "dd", True)
    assert isinstance(answer, Ok) and answer.result["durable"] is False
    assert not h.core.queues["dd"].durable
    again = declare(client, "dd", True, flow_stop_count=10)  # ignored on a redeclare too, not refused
    assert isinstance(again, Error) and "flow_stop_count" in again.text  # (only the arguments differ)
