"""Exchanges: where a transfer's routing key meets the queues bound to it.

Direct matches the key exactly, fanout ignores it, topic matches dot-separated words with `*`
(exactly one word) and `#` (zero or more words), as in AMQP. The default exchange is not an object
here: the router sends a message published to "" to the queue its routing key names.
"""

from __future__ import annotations

import enum
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowbroker.broker.queue import Queue

__all__ = ["ExchangeKind", "Exchange", "topic_matches"]


class ExchangeKind(enum.StrEnum):
    DIRECT = "direct"
    FANOUT = "fanout"
    TOPIC = "topic"


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching over dot-separated words: `*` is one word, `#` zero or more."""
    return _match_words(tuple(pattern.split(".")), tuple(routing_key.split(".")))


@lru_cache(maxsize=65536)
def _match_words(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return _match_words(rest, words) or (bool(words) and _match_words(pattern, words[1:]))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _match_words(rest, words[1:])


class Exchange:
    """Bindings of one exchange; `route()` caches topic results until the bindings change."""

    _ROUTE_CACHE_SIZE = 10_000

    def __init__(self, name: str, kind: ExchangeKind):
        self.name = name
        self.kind = kind
        self.bindings: dict[str, dict[Queue, None]] = {}  # binding key -> queues (ordered set)
        self._cache: dict[str, list[Queue]] = {}

    def bind(self, queue: Queue, key: str) -> bool:
        """Returns False if the binding already existed."""
        queues = self.bindings.setdefault(key, {})
        if queue in queues:
            return False
        queues[queue] = None
        self._cache.clear()
        return True

    def unbind(self, queue: Queue, key: str) -> bool:
        queues = self.bindings.get(key)
        if not queues or queue not in queues:
            return False
        del queues[queue]
        if not queues:
            del self.bindings[key]
        self._cache.clear()
        return True

    def unbind_queue(self, queue: Queue) -> None:
        for key in [k for k, qs in self.bindings.items() if queue in qs]:
            self.unbind(queue, key)

    def route(self, routing_key: str) -> list[Queue]:
        cached = self._cache.get(routing_key)
        if cached is not None:
            return cached
        if self.kind is ExchangeKind.DIRECT:
            result = list(self.bindings.get(routing_key, ()))
        elif self.kind is ExchangeKind.FANOUT:
            result = list({q: None for qs in self.bindings.values() for q in qs})
        else:
            result = list(
                {q: None for key, qs in self.bindings.items() if topic_matches(key, routing_key) for q in qs}
            )
        if len(self._cache) >= self._ROUTE_CACHE_SIZE:
            self._cache.clear()
        self._cache[routing_key] = result
        return result
