"""broker/permissions.py: RabbitMQ's pattern semantics, the frame -> permission table, and the publish cache
(bounded, dropped when the user's permissions change)."""

from __future__ import annotations

import pytest

from flowbroker.broker.permissions import MAX_CACHED, Access
from flowbroker.broker.users import User
from flowbroker.protocol.frames import (
    Bind,
    Cancel,
    DeclareExchange,
    DeclareQueue,
    DeleteExchange,
    DeleteQueue,
    JoinGroup,
    PurgeQueue,
    RegisterPublication,
    Subscribe,
    SubscribeUdp,
    Unbind,
)
from flowbroker.protocol.scram import StoredCredential

CRED = StoredCredential.from_password("x", 1)


def access(configure: str = "^c", write: str = "^w", read: str = "^r") -> Access:
    return Access("u", User("u", CRED, (), configure, write, read))


@pytest.mark.parametrize("frame, allowed, denied", [
    (DeclareQueue(1, "c.q"), None, DeclareQueue(1, "q")),
    (DeclareQueue(1, "c.q", True), None, DeclareQueue(1, "q", True)),  # durable: the same configure permission
    (DeleteQueue(1, "c.q"), None, DeleteQueue(1, "x")),
    (DeclareExchange(1, "c.x", "topic"), None, DeclareExchange(1, "x", "topic")),
    (DeleteExchange(1, "c.x"), None, DeleteExchange(1, "x")),
    (Bind(1, "w.q", "r.x", "k"), None, Bind(1, "q", "r.x", "k")),
    (Unbind(1, "w.q", "r.x", "k"), None, Unbind(1, "w.q", "x", "k")),
    (PurgeQueue(1, "r.q"), None, PurgeQueue(1, "q")),
    (Subscribe(1, 1, "r.q", 0, 0), None, Subscribe(1, 1, "q", 0, 0)),
    (SubscribeUdp(1, 1, "r.q", 0, 0, 1000, 1), None, SubscribeUdp(1, 1, "q", 0, 0, 1000, 1)),
    (RegisterPublication(1, "w.x", "k", 1, 1000), None, RegisterPublication(1, "x", "k", 1, 1000)),
    (JoinGroup(1, 1, "r.x", "c.g", "", "", 0, 1, 1), None, JoinGroup(1, 1, "r.x", "g", "", "", 0, 1, 1)),
])
def test_each_request_is_allowed_and_refused_by_its_permission(frame: object, allowed: None, denied: object) -> None:
    a = access()
    assert a.check_request(frame) is allowed
    refusal = a.check_request(denied)
    assert refusal is not None and "access refused: user 'u' has no" in refusal.text


def test_requests_on_what_the_connection_holds_need_nothing() -> None:
    assert access("", "", "").check_request(Cancel(1, 1)) is None


def test_patterns_are_searched_and_empty_means_nothing_and_the_default_exchange_is_amq_default() -> None:
    a = access(configure="orders", write=r"^amq\.default$", read="")
    assert a.allowed("configure", "my-orders-queue")  # search, as RabbitMQ
    assert a.may_publish("") and not a.may_publish("amq.direct")
    assert not a.allowed("read", "anything")
    refusal = a.denied_publish("")
    assert refusal.text.endswith("on exchange 'amq.default'") and refusal.resource == "amq.default"


def test_the_publish_cache_is_bounded_and_dropped_when_permissions_change() -> None:
    a = access(write=".*")
    for i in range(MAX_CACHED * 3):
        assert a.may_publish(f"x{i}")
        assert len(a.write_cache) <= MAX_CACHED
    a.may_publish("kept")
    assert a.write_cache["kept"] is True
    a.update(User("u", CRED, (), "", "^nothing$", ""))
    assert a.write_cache == {} and not a.may_publish("kept")
    a.update(None)  # the user was deleted: nothing is allowed
    assert not a.may_publish("nothing") and a.check_request(DeclareQueue(1, "c")) is not None


def test_an_anchored_pattern_allows_the_name_only_not_the_name_and_a_newline() -> None:
    """security.md: "anchor it: `^orders$`". Python's `$` also matches before a final newline: a user with
    `^orders$` declared `orders\\n` (which alice had declared), read alice's message from it, published to
    an exchange `orders\\n` and deleted the queue (a tester)."""
    a = access(configure="^orders$", write="^orders$", read="^orders$")
    for permission in ("configure", "write", "read"):
        assert a.allowed(permission, "orders") and not a.allowed(permission, "orders\n")
    assert a.check_request(Subscribe(1, 1, "orders\n", 0, 0)) is not None
    assert a.check_request(DeleteQueue(1, "orders\n")) is not None
    assert not a.may_publish("orders\n") and a.may_publish("orders")


@pytest.mark.parametrize("pattern, allowed, denied", [
    (r"^a\$$", ["a$"], ["a$\n", "a"]),  # an escaped `$` is a character, the last one the end
    (r"^[$]$", ["$"], ["$\n"]),  # in a class too
    (r"^[]$]$", ["]", "$"], ["]\n"]),  # a `]` first in a class is a character: the class goes on
    (r"^[^]$]x$", ["ax"], ["$x", "ax\n"]),
    (r"^a\\$", ["a\\"], ["a\\\n"]),  # an escaped backslash, then the end
    (r"^(orders|bills)$", ["bills"], ["bills\n"]),
    (r"(?m)^a$", ["a"], ["a\n"]),  # the end of the name, even in multi-line mode
    ("orders", ["my-orders", "orders\n"], []),  # unanchored: searched, as before
])
def test_dollar_is_the_end_of_the_name_and_only_an_anchor_is_rewritten(
        pattern: str, allowed: list[str], denied: list[str]) -> None:
    a = access(read=pattern)
    assert [name for name in allowed + denied if a.allowed("read", name)] == allowed
