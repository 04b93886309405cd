"""docs/operations.md explains every alert under the anchor its annotations link to, and links only to files
in the repository (and to its own headings)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors() -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", DOC.read_text(), re.MULTILINE)}


def test_every_alert_links_to_its_explanation() -> None:
    rules = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    alerts = re.findall(r"^      - alert: (\w+)$", rules, re.MULTILINE)
    linked = re.findall(r"docs/operations\.md#([\w-]+)", rules)
    assert len(linked) == len(alerts) == 17
    assert set(linked) <= _anchors(), set(linked) - _anchors()
    table = DOC.read_text().split("## Alerts", 1)[1]
    for alert in alerts:
        assert f"| [{alert}](#" in table or f"`{alert}`" in table, f"{alert} is not in the table of alerts"


def test_links_resolve_to_files_in_the_repository_and_headings() -> None:
    links = re.findall(r"\]\(([^)]+)\)", DOC.read_text())
    assert links
    for link in links:
        assert "://" not in link, f"{link}: link to files in the repository only"
        path, _, anchor = link.partition("#")
        if path:
            assert (DOC.parent / path).resolve().is_file(), f"{link}: no such file"
        elif anchor:
            assert anchor in _anchors(), f"#{anchor}: no such heading"
