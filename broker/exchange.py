"""Exchanges: where a transfer's routing key meets the queues bound to it.

Direct matches the key exactly, fanout ignores it, topic matches dot-separated words with `*`
(exactly one word) and `#` (zero or more words), as in AMQP. The default exchange is not an object
here: the router sends a message published to "" to the queue its routing key names.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from flowbroker.broker.topic import TopicBudget, TopicIndex
from flowbroker.protocol.limits import text_bytes_bound
from flowbroker.protocol.names import EXCHANGE_DIRECT, EXCHANGE_FANOUT, EXCHANGE_TOPIC

if TYPE_CHECKING:
    from flowbroker.broker.queue import Queue

__all__ = ["ExchangeKind", "Exchange", "RouteCache", "topic_matches"]


class ExchangeKind(enum.StrEnum):
    """DECLARE_EXCHANGE's kinds (their names are defined in ``protocol.names``)."""

    DIRECT = EXCHANGE_DIRECT
    FANOUT = EXCHANGE_FANOUT
    TOPIC = EXCHANGE_TOPIC


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching over dot-separated words: `*` is one word, `#` zero or more (one binding
    key; an exchange matches all of its keys at once with broker/topic.py's TopicIndex)."""
    index = TopicIndex()
    index.add(pattern)
    return bool(index.match(routing_key.split(".")))


class RouteCache:
    """What every exchange of a broker shares: routing results keyed by (exchange, routing key) in one
    bounded dict, and the number of bindings over all exchanges (bounded by `max_bindings`).

    One cache for the whole broker, not one per exchange: 10,000 exchanges with 10,000 cached keys each
    would hold gigabytes. A change of any binding empties it (bindings change rarely; routing is hot), and
    so does filling it: past MAX_ENTRIES results, or past MAX_BYTES of them (`entry_bytes`: a key of
    256 non-ASCII bytes matching 150 queues held 2.6 KB, and 65,536 of them took a broker to 1.8 times its
    memory bound, a tester)."""

    MAX_ENTRIES = 65_536
    MAX_BYTES = 16 << 20

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], list[Queue]] = {}
        self.bytes = 0  # what the entries hold, by `entry_bytes`
        self.bindings = 0
        self.topic_budget = TopicBudget()  # the topic exchanges' word masks, bounded together

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def entry_bytes(routing_key: str, queues: int) -> int:
    """A cached result's memory, from above: its dict slot, key tuple and list (about 200 bytes), a
    pointer a queue, and the routing key's string (4 bytes a character unless ASCII)."""
    return 200 + 8 * queues + 60 + text_bytes_bound(routing_key)


class Exchange:
    """Bindings of one exchange; `route()` caches its results in the broker's `RouteCache` until a
    binding changes."""

    def __init__(self, name: str, kind: ExchangeKind, cache: RouteCache | None = None):
        self.name = name
        self.kind = kind
        self.bindings: dict[str, dict[Queue, None]] = {}  # binding key -> queues (ordered set)
        self._cache = cache if cache is not None else RouteCache()
        # topic exchanges: every binding key in one matcher (broker/topic.py)
        self._topics = TopicIndex(self._cache.topic_budget)
        self.route_cost = 0  # topic matches' cost since the core last took it (BrokerCore.route)

    def bind(self, queue: Queue, key: str) -> bool:
        """Returns False if the binding already existed."""
        queues = self.bindings.get(key)
        if queues is not None and queue in queues:
            return False
        if self.kind is ExchangeKind.TOPIC:
            self._topics.add(key)  # first: it may refuse the key (TopicIndexFull), leaving nothing bound
        if queues is None:
            queues = self.bindings[key] = {}
        queues[queue] = None
        self._cache.bindings += 1
        self._cache.clear()
        return True

    def unbind(self, queue: Queue, key: str) -> bool:
        queues = self.bindings.get(key)
        if not queues or queue not in queues:
            return False
        if self._forget(queue, key):
            self._topics.remove(key)
        self._cache.clear()
        return True

    def _forget(self, queue: Queue, key: str) -> bool:
        """Remove the binding (it exists); True if `key` has no queue left (its topic key must go too)."""
        queues = self.bindings[key]
        del queues[queue]
        self._cache.bindings -= 1
        if queues:
            return False
        del self.bindings[key]
        return True

    def release(self) -> None:
        """The exchange is deleted: its topic matcher's word masks leave the broker's budget."""
        self._topics.release()

    def unbind_queue(self, queue: Queue) -> None:
        """Every binding of `queue` (it is deleted): the topic keys left with no queue leave the matcher
        together (TopicIndex.remove_many), not one by one."""
        emptied = [key for key in [k for k, qs in self.bindings.items() if queue in qs] if self._forget(queue, key)]
        if emptied and self.kind is ExchangeKind.TOPIC:
            self._topics.remove_many(emptied)
        self._cache.clear()

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
            bindings = self.bindings
            words = routing_key.split(".")
            result = list({q: None for key in self._topics.match(words) for q in bindings[key]})
            # What the match cost, in the copies of fan-out the core counts against a frame's slice
            # (core.FANOUT_BUDGET, about 2 us a copy): its operations are over every binding's states,
            # about 1.2 ms for a 127-word key at 99,000 bindings, and a frame of 1,024 such keys was routed
            # in one step, 1.1 s during which every connection waited (a tester).
            self.route_cost += len(words) * self._topics.states() // 65536
        owner = self._cache
        cost = entry_bytes(key[1], len(result))
        if len(cache) >= RouteCache.MAX_ENTRIES or owner.bytes + cost > RouteCache.MAX_BYTES:
            owner.clear()
        cache[key] = result
        owner.bytes += cost
        return result
