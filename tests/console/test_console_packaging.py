"""The console's files ship in the package: an installed (not editable) flowbroker serves the same
console. pyproject.toml's explicit `packages` list is the trap (a folder left out of it is silently
missing from the wheel, as broker/udp/ once was), so this checks it against the source tree."""

from __future__ import annotations

import fnmatch
import tomllib
from importlib import resources
from pathlib import Path

from flowbroker.broker.console import STATIC_FILES

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict[str, object]:
    config: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return config


def test_every_source_package_is_in_the_wheel() -> None:
    config = _setuptools()
    packages = config["packages"]
    package_dir = config["package-dir"]
    assert isinstance(packages, list) and isinstance(package_dir, dict)
    found = set()
    for name, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]))
    assert found - set(packages) == set()


def test_every_console_file_is_package_data() -> None:
    config = _setuptools()
    data, packages = config["package-data"], config["packages"]
    assert isinstance(data, dict) and isinstance(packages, list)
    # The folder is listed as a package of its own (setuptools warns about a data folder Python could
    # import that `packages` leaves out), its files as that package's data.
    assert "flowbroker.broker.static.console" in packages
    globs = data["flowbroker.broker.static.console"]
    folder = resources.files("flowbroker.broker").joinpath("static", "console")
    for name in STATIC_FILES:
        assert folder.joinpath(name).is_file(), name
        assert any(fnmatch.fnmatch(name, g) for g in globs), name
    assert folder.joinpath("uPlot.LICENSE").is_file()  # MIT: the licence travels with the copy
    assert "v1.6.32" in folder.joinpath("uPlot.iife.min.js").read_text()[:80]  # the version README.md names
