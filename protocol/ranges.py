"""Inclusive id ranges, for COMPLETE and SETTLE frames.

Completions and settlements arrive mostly in order with a few holes (a transfer held by a saturated
queue, a message requeued). Sending `(first, last)` ranges keeps those frames small whatever the
rate, and `IdSet` keeps "everything above the cumulative point" in memory proportional to the number
of holes, not the number of ids.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from flowbroker.protocol.frames import Range

__all__ = ["to_ranges", "IdSet"]


def to_ranges(ids: Iterable[int]) -> list[Range]:
    """Coalesce ids (>= 0, duplicates allowed) into sorted inclusive ranges: [1, 2, 3, 7, 5, 5] ->
    [(1, 3), (5, 5), (7, 7)]. The broker's COMPLETE and the SDK's SETTLE both build their ranges here."""
    seq = ids if isinstance(ids, list) else list(ids)
    if not seq:
        return []
    low, high = min(seq), max(seq)
    if high - low + 1 == len(seq) and len(set(seq)) == len(seq):
        # The common case without a Python loop: one run (settled in any order, no duplicates).
        return [(low, high)]
    out: list[Range] = []
    lo = hi = -2
    for i in sorted(seq):
        if i == hi + 1:
            hi = i
        elif i > hi:
            if lo >= 0:
                out.append((lo, hi))
            lo = hi = i
    if lo >= 0:
        out.append((lo, hi))
    return out


class IdSet:
    """A set of positive ids with a cumulative point: every id <= `cumulative` is in the set.

    Ids above it are kept as disjoint sorted ranges; adding the id just above the cumulative point
    absorbs any range that now touches it.
    """

    __slots__ = ("cumulative", "_los", "_his")

    def __init__(self, cumulative: int = 0):
        self.cumulative = cumulative
        self._los: list[int] = []
        self._his: list[int] = []

    def __contains__(self, i: int) -> bool:
        if i <= self.cumulative:
            return True
        k = bisect_left(self._his, i)
        return k < len(self._his) and self._los[k] <= i

    @property
    def holes(self) -> int:
        """Ranges kept above the cumulative point (memory in use, in ranges)."""
        return len(self._los)

    def add(self, i: int) -> None:
        if i <= self.cumulative:
            return
        los, his = self._los, self._his
        if i == self.cumulative + 1:
            self.cumulative = i
            if los and los[0] == i + 1:
                self.cumulative = his[0]
                del los[0], his[0]
            return
        k = bisect_left(his, i)
        if k < len(his) and los[k] <= i:
            return  # already present
        joins_left = k > 0 and his[k - 1] == i - 1
        joins_right = k < len(los) and los[k] == i + 1
        if joins_left and joins_right:
            his[k - 1] = his[k]
            del los[k], his[k]
        elif joins_left:
            his[k - 1] = i
        elif joins_right:
            los[k] = i
        else:
            los.insert(k, i)
            his.insert(k, i)

    def add_ranges(self, ranges: Iterable[Range]) -> None:
        for lo, hi in ranges:
            for i in range(lo, hi + 1):
                self.add(i)

    def ranges_above(self) -> list[Range]:
        return list(zip(self._los, self._his))
