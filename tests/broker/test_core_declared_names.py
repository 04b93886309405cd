"""The names a DECLARE_QUEUE or DECLARE_EXCHANGE may give (docs/protocol.md, docs/security.md): no control
character (U+0000-U+001F, U+007F), refused INVALID_ARGUMENT naming the rule; printable names of any script
are names as before."""

from __future__ import annotations

import pytest

from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import DeclareExchange, DeclareQueue, Error, Ok

from tests.broker.coreharness import Harness


@pytest.mark.parametrize("name", ["orders\n", "a\x00b", "\x1b[31mred", "tab\there", "del\x7f"])
def test_a_queue_or_exchange_name_with_a_control_character_is_refused_naming_the_rule(name: str) -> None:
    """`orders\\n` passed a permission `^orders$`, and nothing checked names for control characters: a user
    declared `orders\\n` beside alice's `orders` and read her messages from it (a tester)."""
    h = Harness()
    client = h.producer()
    answers = [client.request(lambda rid: DeclareQueue(rid, name)),
               client.request(lambda rid: DeclareQueue(rid, name, True)),
               client.request(lambda rid: DeclareExchange(rid, name, "fanout"))]
    for kind, answer in zip(("queue", "queue", "exchange"), answers):
        assert isinstance(answer, Error) and answer.code == ErrorCode.INVALID_ARGUMENT, answer
        assert answer.text == f"{kind} name {name!r} must not contain control characters (U+0000-U+001F, U+007F)"
        assert answer.destination == name
    assert name not in h.core.queues and name not in h.core.exchanges


def test_printable_names_of_any_script_are_declared() -> None:
    h = Harness()
    client = h.producer()
    name = "\u00e9v\u00e9nements \u2168 \u6ce8\u6587"
    assert isinstance(client.request(lambda rid: DeclareQueue(rid, name)), Ok)
    assert isinstance(client.request(lambda rid: DeclareExchange(rid, name, "topic")), Ok)
    assert name in h.core.queues and name in h.core.exchanges
