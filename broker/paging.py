"""A dict that keeps its keys sorted beside it, so the admin API pages through queues, connections
and exchanges at a cost proportional to the page, not to how many there are (issue 8, item 2).

`GET /api/queues` used to sort every name and render every queue per request: over 100,000 queues,
seconds of a blocked event loop and ~48 MB per answer. `SortedKeyDict` is the core's `queues`,
`sessions` and `exchanges`: reads are plain dict reads (the hot path is unchanged), and every
mutation also updates `SortedKeys`, so `page(after, limit)` is two bisects and a slice.

`SortedKeys` is a list of sorted chunks of at most CHUNK keys (the layout of the `sortedcontainers`
package, in a few lines): an insert or a delete moves at most CHUNK keys and the chunk index, never
all the keys, so a DECLARE_QUEUE costs microseconds at a million queues as at ten (one flat list
took 28 us per insert at its front with 100,000 keys, growing with the count).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar, overload

__all__ = ["SortedKeyDict", "SortedKeys", "CHUNK"]

CHUNK = 512
"""Most keys in one chunk; a full one is split in two halves."""


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Ordered)  # a queue or exchange name, a connection id
V = TypeVar("V")
T = TypeVar("T")


class SortedKeys(Generic[K]):
    """Distinct keys in order. `add` and `remove` cost O(log n + CHUNK); `after(key, n)` O(log n + n).
    The caller (SortedKeyDict) guarantees a key is added only when absent and removed only when present."""

    __slots__ = ("_chunks", "_maxes", "_len")

    def __init__(self, keys: Iterable[K] = ()) -> None:
        ordered = sorted(keys)
        self._chunks: list[list[K]] = [ordered[i:i + CHUNK] for i in range(0, len(ordered), CHUNK)]
        self._maxes: list[K] = [chunk[-1] for chunk in self._chunks]
        self._len = len(ordered)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        for chunk in self._chunks:
            yield from chunk

    def add(self, key: K) -> None:
        chunks, maxes = self._chunks, self._maxes
        self._len += 1
        if not chunks:
            chunks.append([key])
            maxes.append(key)
            return
        i = bisect_left(maxes, key)
        if i == len(chunks):  # beyond every key: the last chunk (increasing ids land here)
            i -= 1
            chunks[i].append(key)
            maxes[i] = key
        else:
            insort(chunks[i], key)
        chunk = chunks[i]
        if len(chunk) > CHUNK:
            half = len(chunk) // 2
            chunks.insert(i + 1, chunk[half:])
            del chunk[half:]
            maxes.insert(i, chunk[-1])

    def remove(self, key: K) -> None:
        chunks, maxes = self._chunks, self._maxes
        i = bisect_left(maxes, key)
        chunk = chunks[i]
        del chunk[bisect_left(chunk, key)]
        self._len -= 1
        if not chunk:
            del chunks[i]
            del maxes[i]
        else:
            maxes[i] = chunk[-1]

    def after(self, key: K | None, count: int) -> tuple[list[K], bool]:
        """Up to `count` keys greater than `key` (the first ones when None), and whether more follow."""
        chunks = self._chunks
        if key is None:
            i, j = 0, 0
        else:
            i = bisect_right(self._maxes, key)
            j = bisect_right(chunks[i], key) if i < len(chunks) else 0
        out: list[K] = []
        while i < len(chunks) and len(out) < count:
            chunk = chunks[i]
            taken = chunk[j:j + count - len(out)]
            out.extend(taken)
            j += len(taken)
            if j >= len(chunk):
                i, j = i + 1, 0
        return out, i < len(chunks)  # chunk i, when there is one, still has keys from j on

    def clear(self) -> None:
        self._chunks.clear()
        self._maxes.clear()
        self._len = 0


class SortedKeyDict(dict[K, V]):
    """A dict whose keys are also kept sorted, for `page()`. Every mutating dict method keeps both."""

    __slots__ = ("_sorted",)

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        super().__init__(items)
        self._sorted: SortedKeys[K] = SortedKeys(dict.keys(self))

    def page(self, after: K | None, limit: int) -> tuple[list[V], K | None]:
        """Up to `limit` values whose keys come after `after` (from the first when None), in key
        order, and the key to pass as `after` for the next page (None when this page is the last)."""
        keys, more = self._sorted.after(after, limit)
        return [self[k] for k in keys], (keys[-1] if more and keys else None)

    def sorted_keys(self) -> list[K]:
        """The keys in order (for tests)."""
        return list(self._sorted)

    def _forget(self, key: K) -> None:
        self._sorted.remove(key)

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self:
            self._sorted.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        self._forget(key)

    @overload
    def pop(self, key: K, /) -> V: ...
    @overload
    def pop(self, key: K, default: V, /) -> V: ...
    @overload
    def pop(self, key: K, default: T, /) -> V | T: ...

    def pop(self, key: K, *default: Any) -> Any:
        if key in self:
            value = super().pop(key)
            self._forget(key)
            return value
        return super().pop(key, *default)

    def popitem(self) -> tuple[K, V]:
        key, value = super().popitem()
        self._forget(key)
        return key, value

    def setdefault(self, key: K, default: V) -> V:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> SortedKeyDict[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        super().clear()
        self._sorted.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        """copy, deepcopy and pickle rebuild through __init__, so the copy gets its own sorted list."""
        return (type(self), (dict(self),))
