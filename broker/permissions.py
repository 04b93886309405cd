"""Permissions per user: RabbitMQ's configure / write / read, regular expressions over resource names.

Which operation needs which permission on which resource (RabbitMQ's table, docs/security.md):

| frame | needs |
|---|---|
| DECLARE_QUEUE, DELETE_QUEUE | configure on the queue |
| DECLARE_EXCHANGE, DELETE_EXCHANGE | configure on the exchange |
| BIND, UNBIND | write on the queue, read on the exchange |
| PURGE_QUEUE, SUBSCRIBE, SUBSCRIBE_UDP | read on the queue |
| TRANSFER (each message), REGISTER_PUBLICATION | write on the exchange |
| JOIN_GROUP | read on the exchange, configure on the group (its queue) |

The default exchange `""` is checked under RabbitMQ's name for it, `amq.default`. A pattern is searched
in the name (`re.search`, as RabbitMQ) with its `$` the end of the name (users.py `compile_pattern`, not
also before a final newline as Python's): `^orders$` is the queue `orders` only, `.*` anything, and `""`
or `^$` nothing.

Publishing is the hot path: a connection's decisions are cached per exchange name (`write_cache`, one
dict lookup per message), and the cache is dropped when the user's permissions change (`update`).
The cache holds at most MAX_CACHED names, so a client publishing to ever new names cannot grow it.
"""

from __future__ import annotations

from typing import Any

from flowbroker.broker.users import User
from flowbroker.protocol.frames import (
    Bind,
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

__all__ = ["Access", "Denied", "DEFAULT_EXCHANGE_NAME", "MAX_CACHED"]

DEFAULT_EXCHANGE_NAME = "amq.default"
MAX_CACHED = 1024
_KINDS = {"configure": 0, "write": 1, "read": 2}


class Denied:
    """A refusal: what the ERROR UNAUTHORIZED says, and the resource it names (its destination)."""

    __slots__ = ("text", "resource")

    def __init__(self, identity: str, permission: str, kind: str, name: str):
        shown = name or DEFAULT_EXCHANGE_NAME
        self.text = f"access refused: user {identity!r} has no {permission} permission on {kind} {shown!r}"
        self.resource = shown  # (the default exchange's refusals named "" as their destination, a tester)


class Access:
    """One connection's permissions: its user's patterns (None: a user deleted since it logged in, who
    may do nothing more) and the decisions cached for publishing."""

    def __init__(self, identity: str, user: User | None):
        self.identity = identity
        self.write_cache: dict[str, bool] = {}
        self.user = user

    def update(self, user: User | None) -> None:
        """The user's permissions changed (or the user was deleted): forget every cached decision."""
        self.user = user
        self.write_cache = {}

    def allowed(self, permission: str, name: str, is_exchange: bool = False) -> bool:
        user = self.user
        if user is None:
            return False
        pattern = user.patterns[_KINDS[permission]]
        if not pattern.pattern:
            return False
        subject = (name or DEFAULT_EXCHANGE_NAME) if is_exchange else name
        return pattern.search(subject) is not None

    def may_publish(self, exchange: str) -> bool:
        """Write on `exchange`, cached: called for every message whose exchange is not cached yet."""
        decision = self.allowed("write", exchange, True)
        cache = self.write_cache
        if len(cache) >= MAX_CACHED:
            cache.clear()
        cache[exchange] = decision
        return decision

    def denied_publish(self, exchange: str) -> Denied:
        return Denied(self.identity, "write", "exchange", exchange)

    def check_request(self, frame: Any) -> Denied | None:
        """Why this request is refused, or None. Requests not listed need no permission (CANCEL,
        CLOSE_PUBLICATION: they act on what this connection already holds)."""
        kind = type(frame)
        needs: tuple[tuple[str, str, str], ...]
        if kind is DeclareQueue or kind is DeleteQueue:
            needs = (("configure", "queue", frame.queue),)
        elif kind is DeclareExchange or kind is DeleteExchange:
            needs = (("configure", "exchange", frame.exchange),)
        elif kind is Bind or kind is Unbind:
            needs = (("write", "queue", frame.queue), ("read", "exchange", frame.exchange))
        elif kind is PurgeQueue or kind is Subscribe or kind is SubscribeUdp:
            needs = (("read", "queue", frame.queue),)
        elif kind is RegisterPublication:
            needs = (("write", "exchange", frame.exchange),)
        elif kind is JoinGroup:
            needs = (("read", "exchange", frame.exchange), ("configure", "queue", frame.group))
        else:
            return None
        for permission, resource, name in needs:
            if not self.allowed(permission, name, resource == "exchange"):
                return Denied(self.identity, permission, resource, name)
        return None

