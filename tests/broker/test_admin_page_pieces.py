"""A page of the admin API made in slices (broker/admin.py `_page_pieces`, in the broker's turn for heavy
answers) is the very JSON of the page made in one go, and an object gone while it is made is left out
(docs/management.md: pages are not a snapshot, none is listed twice and the order holds)."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from flowbroker.broker import admin, views
from tests.broker.coreharness import Harness, MiB


def _harness() -> Harness:
    h = Harness(credit={"policy": "static", "static_size": MiB})
    for name in ["b", "a", "ü-naïve", "c/d", 'quote"d', "z" * 250]:
        h.queue(name, flow_stop_count=3)
    h.producer("p").send("", "a", b"x" * 10)
    h.consumer("c")
    return h


def _bytes(page: views.Page[Any]) -> bytes:
    return b"".join(admin._page_pieces(page))


def test_the_pieces_are_the_json_of_the_whole_page() -> None:
    h = _harness()
    cases: list[tuple[views.Page[Any], dict[str, Any]]] = [
        (views.paged_queues(h.core, h.now), views.queues_page(h.core, h.now)),
        (views.paged_queues(h.core, h.now, "b", 2), views.queues_page(h.core, h.now, "b", 2)),
        (views.paged_queues(h.core, h.now, "\uffff"), {"queues": [], "next": None}),
        (views.paged_connections(h.core, h.now, limit=1), views.connections_page(h.core, h.now, limit=1)),
        (views.paged_exchanges(h.core), views.exchanges_page(h.core)),
    ]
    for page, whole in cases:
        assert _bytes(page) == JSONResponse(whole).body


def test_an_object_gone_while_its_page_is_made_is_left_out() -> None:
    h = _harness()
    page = views.paged_queues(h.core, h.now, limit=3)
    pieces = admin._page_pieces(page)
    made = [next(pieces), next(pieces)]  # the head and queue "a"
    h.core.delete_queue("b")  # meanwhile (between two slices)
    made += list(pieces)
    answer = json.loads(b"".join(made))
    assert [q["name"] for q in answer["queues"]] == ["a", "c/d"] and answer["next"] == "c/d"
