"""A Ctrl-C that lands before `publish` or `consume` handles it (while they import or connect) gets their
documented exit status and line, not click's bare "Aborted!" and 1 (a tester: `consume` exited 1,
`publish` said no counts). Driven here by the first thing both call raising KeyboardInterrupt."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from flowbroker.broker import cli


def _interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("args, code, line", [
    (["consume", "q"], 0, ""),
    (["publish", "-k", "q", "m"], 1, "Error: interrupted (Ctrl-C) before anything was sent"),
])
def test_an_early_ctrl_c_exits_as_documented(monkeypatch: pytest.MonkeyPatch, args: list[str], code: int,
                                            line: str) -> None:
    monkeypatch.setattr(cli, "_broker_auth", _interrupt)
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == code, result.output
    assert "Aborted!" not in result.output
    assert line in result.output
