"""A pair of [server] sizes that do not fit each other is reported naming both, the rule and what to change
(a tester set max_frame_size = "1MiB" alone and was told `max_message_size = 4194304: must be an integer
in [1, 524288]`, a key he never set, with no word of max_frame_size)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowbroker.broker.config import ConfigError, load_config


def _error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "flowbroker.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_lowering_max_frame_size_alone_names_it_the_rule_and_the_fixes(tmp_path: Path) -> None:
    message = _error(tmp_path, '[server]\nmax_frame_size = "1MiB"\n')
    assert message == (
        "[server] max_frame_size = 1048576, max_message_size = 4194304 (its default): max_message_size must be "
        "<= max_frame_size / 2 = 524288 (a DELIVER of the largest message must fit in one frame): set "
        "max_message_size to 524288 or less, or max_frame_size to 8388608 or more")


def test_equal_frame_and_message_sizes_are_refused_naming_both(tmp_path: Path) -> None:
    message = _error(tmp_path, '[server]\nmax_frame_size = "4MiB"\nmax_message_size = "4MiB"\n')
    assert message.startswith("[server] max_frame_size = 4194304, max_message_size = 4194304 (its default): "
                              "max_message_size must be <= max_frame_size / 2 = 2097152")


def test_raising_max_frame_size_over_the_partial_frame_budget_names_both(tmp_path: Path) -> None:
    message = _error(tmp_path, '[server]\nmax_frame_size = "128MiB"\n')
    assert message == (
        "[server] max_frame_size = 134217728, max_partial_frame_bytes = 67108864 (its default): "
        "max_partial_frame_bytes must be >= max_frame_size (one whole frame must fit, or a frame of "
        "max_frame_size could never complete): set max_partial_frame_bytes to 134217728 or more, or "
        "max_frame_size to 67108864 or less")


def test_a_message_size_that_is_not_an_integer_is_still_refused_as_such(tmp_path: Path) -> None:
    assert _error(tmp_path, "[server]\nmax_message_size = 0\n").startswith(
        "[server] max_message_size = 0: must be an integer in [1, ")
