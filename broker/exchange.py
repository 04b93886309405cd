"""Exchanges: where a transfer's routing key meets the queues bound to it.

Direct matches the key exactly, fanout ignores it, topic matches dot-separated words with `*`
(exactly one word) and `#` (zero or more words), as in AMQP. The default exchange is not an object
here: the router sends a message published to "" to the queue its routing key names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowbroker.broker.queue import Queue

__all__ = ["ExchangeKind", "Exchange", "RouteCache", "topic_matches"]


class ExchangeKind(enum.StrEnum):
    DIRECT = "direct"
    FANOUT = "fanout"
    TOPIC = "topic"


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching over dot-separated words: `*` is one word, `#` zero or more.

    Iterative, in time proportional to words x pattern words and memory proportional to the pattern:
    the set of pattern positions the words read so far can have reached, advanced one word at a time
    (a `#` both stays and lets the next position be reached without a word). A recursive matcher let
    a routing key of 5,000 words raise RecursionError inside the broker; keys are also bounded at
    MAX_KEY_BYTES (protocol/limits.py), so a match costs at most ~129 x 129 steps.
    """
    return _matcher(pattern)(routing_key.split("."))


def _matcher(pattern: str) -> Callable[[list[str]], bool]:
    words = pattern.split(".")
    if "#" not in words and "*" not in words:
        return lambda key: key == words
    m = len(words)
    hashes = [w == "#" for w in words]

    def close(reached: list[bool]) -> list[bool]:
        """Let every `#` that is reached match zero words."""
        for i in range(m):
            if reached[i] and hashes[i]:
                reached[i + 1] = True
        return reached

    def match(key: list[str]) -> bool:
        reached = close([True] + [False] * m)
        for word in key:
            after = [False] * (m + 1)
            for i in range(m):
                if reached[i]:
                    head = words[i]
                    if head == "#":
                        after[i] = True
                    elif head == "*" or head == word:
                        after[i + 1] = True
            reached = close(after)
            if not any(reached):
                return False
        return reached[m]

    return match


class RouteCache:
    """What every exchange of a broker shares: routing results keyed by (exchange, routing key) in one
    bounded dict, and the number of bindings over all exchanges (bounded by `max_bindings`).

    One cache for the whole broker, not one per exchange: 10,000 exchanges with 10,000 cached keys each
    would hold gigabytes. A change of any binding empties it (bindings change rarely; routing is hot)."""

    MAX_ENTRIES = 65_536

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], list[Queue]] = {}
        self.bindings = 0

    def clear(self) -> None:
        self.entries.clear()


class Exchange:
    """Bindings of one exchange; `route()` caches its results in the broker's `RouteCache` until a
    binding changes."""

    def __init__(self, name: str, kind: ExchangeKind, cache: RouteCache | None = None):
        self.name = name
        self.kind = kind
        self.bindings: dict[str, dict[Queue, None]] = {}  # binding key -> queues (ordered set)
        self._matchers: dict[str, Callable[[list[str]], bool]] = {}  # topic binding key -> compiled matcher
        self._cache = cache if cache is not None else RouteCache()

    def bind(self, queue: Queue, key: str) -> bool:
        """Returns False if the binding already existed."""
        queues = self.bindings.setdefault(key, {})
        if queue in queues:
            return False
        queues[queue] = None
        self._cache.bindings += 1
        if self.kind is ExchangeKind.TOPIC and key not in self._matchers:
            self._matchers[key] = _matcher(key)
        self._cache.clear()
        return True

    def unbind(self, queue: Queue, key: str) -> bool:
        queues = self.bindings.get(key)
        if not queues or queue not in queues:
            return False
        del queues[queue]
        self._cache.bindings -= 1
        if not queues:
            del self.bindings[key]
            self._matchers.pop(key, None)
        self._cache.clear()
        return True

    def unbind_queue(self, queue: Queue) -> None:
        for key in [k for k, qs in self.bindings.items() if queue in qs]:
            self.unbind(queue, key)

    def route(self, routing_key: str) -> list[Queue]:
        kind = self.kind
        if kind is ExchangeKind.DIRECT:  # a dict lookup already: nothing to cache
            queues = self.bindings.get(routing_key)
            return list(queues) if queues else []
        key = (self.name, routing_key if kind is ExchangeKind.TOPIC else "")
        cache = self._cache.entries
        cached = cache.get(key)
        if cached is not None:
            return cached
        if kind is ExchangeKind.FANOUT:
            result = list({q: None for qs in self.bindings.values() for q in qs})
        else:
            words = routing_key.split(".")
            matchers = self._matchers
            result = list({q: None for key, qs in self.bindings.items() if matchers[key](words) for q in qs})
        if len(cache) >= RouteCache.MAX_ENTRIES:
            cache.clear()
        cache[key] = result
        return result
