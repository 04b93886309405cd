"""deploy/grafana/flowbroker.json is a Grafana dashboard as Grafana exports it: a Prometheus data source variable
that every query uses, a row per concern, panels laid out on the 24-column grid without overlapping. (Grafana is
not installable here; tests/deploy/test_real_prometheus.py runs every expression against a real Prometheus.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "flowbroker.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROWS = ["Overview", "Queues vs watermarks", "Producers: flow state and credit", "Consumers", "UDP transport"]


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _rows(dashboard: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], [])
        else:
            assert current is not None, f"panel {panel['title']!r} before the first row"
            current.append(panel)
    return rows


def test_the_export_shape_and_the_datasource_variable() -> None:
    dashboard = load()
    assert dashboard["id"] is None and dashboard["uid"] == "flowbroker" and dashboard["title"] == "flowbroker"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "queue"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]
            assert 'instance=~"$instance"' in target["expr"], f"{panel['title']}: not filtered by $instance"


def test_a_row_per_concern_in_order() -> None:
    dashboard = load()
    assert list(_rows(dashboard)) == ROWS
    assert all(_rows(dashboard).values())


def test_queue_depth_is_drawn_against_its_watermarks_per_queue() -> None:
    panels = _rows(load())["Queues vs watermarks"]
    for unit, depth in (("messages", "flowbroker_queue_messages"), ("bytes", "flowbroker_queue_bytes")):
        [panel] = [p for p in panels if p["title"] == f"$queue: {unit} vs watermarks"]
        assert panel["repeat"] == "queue"
        legends = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
        assert legends["depth"].startswith(depth + "{")
        assert legends["flow_stop"].startswith(f"flowbroker_queue_flow_stop_{unit}{{")
        assert legends["flow_resume"].startswith(f"flowbroker_queue_flow_resume_{unit}{{")
        assert legends["max"].startswith(f"flowbroker_queue_max_{unit}{{")
        styled = {o["matcher"]["options"] for o in panel["fieldConfig"]["overrides"]}
        assert {"flow_stop", "flow_resume", "max"} <= styled  # drawn as lines, not as more series


def test_panels_sit_on_the_grid_without_overlapping() -> None:
    dashboard = load()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
