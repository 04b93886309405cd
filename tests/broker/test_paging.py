"""SortedKeyDict against a plain dict: every mutation keeps the sorted index, and paging from any
cursor walks every key once, in order. Chunks are made tiny so that splits and empty chunks happen."""

from __future__ import annotations

import copy
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker import paging
from flowbroker.broker.paging import SortedKeyDict

keys = st.text(alphabet="ab/c", max_size=4)
ops = st.lists(
    st.tuples(st.sampled_from(["set", "del", "pop", "pop-default", "setdefault", "popitem", "update", "clear"]),
              keys, st.integers()),
    max_size=120,
)


def pages(d: SortedKeyDict[str, int], after: str | None, limit: int) -> list[int]:
    out: list[int] = []
    while True:
        values, after = d.page(after, limit)
        assert len(values) <= limit
        out.extend(values)
        if after is None:
            return out


@given(ops, st.integers(1, 7), st.one_of(st.none(), keys))
def test_sorted_index_follows_every_mutation_and_pages_cover_it(
    operations: list[tuple[str, str, int]], limit: int, start: str | None
) -> None:
    with mock.patch.object(paging, "CHUNK", 3):
        d: SortedKeyDict[str, int] = SortedKeyDict()
        model: dict[str, int] = {}
        for op, key, value in operations:
            if op == "set":
                d[key] = value
                model[key] = value
            elif op == "del" and key in model:
                del d[key]
                del model[key]
            elif op == "pop" and key in model:
                assert d.pop(key) == model.pop(key)
            elif op == "pop-default":
                assert d.pop(key, -1) == model.pop(key, -1)
            elif op == "setdefault":
                assert d.setdefault(key, value) == model.setdefault(key, value)
            elif op == "popitem" and model:
                k, v = d.popitem()
                assert model.pop(k) == v
            elif op == "update":
                d.update({key: value, key + "x": value})
                model.update({key: value, key + "x": value})
            elif op == "clear" and value % 10 == 0:
                d.clear()
                model.clear()
            assert d == model and d.sorted_keys() == sorted(model)
        expected = [model[k] for k in sorted(model) if start is None or k > start]
        assert pages(d, start, limit) == expected
        clone = copy.deepcopy(d)
        clone["zzzz"] = 0
        assert d.sorted_keys() == sorted(model) and clone.sorted_keys() == sorted(model) + ["zzzz"]


def test_increasing_integer_keys_append() -> None:
    with mock.patch.object(paging, "CHUNK", 4):
        d: SortedKeyDict[int, str] = SortedKeyDict()
        for i in range(1, 101):
            d[i] = str(i)
        for i in range(1, 101, 3):
            d.pop(i, None)
        assert d.sorted_keys() == [i for i in range(1, 101) if i % 3 != 1]
        values, cursor = d.page(50, 5)
        assert values == ["51", "53", "54", "56", "57"] and cursor == 57
