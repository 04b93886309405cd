"""[server] frame_timeout and max_partial_frame_bytes: defaults as documented, bad values named."""

from __future__ import annotations

import pytest

from flowbroker.broker.config import ConfigError, load_config

MiB = 1024 * 1024


def test_defaults_are_the_documented_ones() -> None:
    server = load_config().server
    assert server.frame_timeout == 30.0
    assert server.max_partial_frame_bytes == 64 * MiB


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"frame_timeout": 0}, "[server] frame_timeout = 0: must be a number > 0"),
        ({"max_partial_frame_bytes": 4 * MiB},
         "[server] max_partial_frame_bytes = 4194304: must be an integer in [8388608, "),
        ({"max_frame_size": 16 * MiB, "max_partial_frame_bytes": 8 * MiB}, "max_partial_frame_bytes = 8388608"),
    ],
)
def test_bad_values_are_refused_naming_the_key(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"server": values})
    assert message in str(info.value)
