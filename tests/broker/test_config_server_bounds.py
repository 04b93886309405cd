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
        ({"frame_timeout": 0}, "[server] frame_timeout = 0: must be a number of seconds in [0.001, 100000000]"),
        ({"idle_timeout": float("inf")}, "[server] idle_timeout = inf: must be a number of seconds in"),
        ({"stuck_timeout": float("nan")}, "[server] stuck_timeout = nan: must be a number of seconds in"),
        ({"producer_id_ttl": 1e20}, "[server] producer_id_ttl = 1e+20: must be a number of seconds in"),
        ({"handshake_timeout": 0.0001}, "[server] handshake_timeout = 0.0001: must be a number of seconds in"),
        ({"max_partial_frame_bytes": 4 * MiB},
         "[server] max_frame_size = 8388608 (its default), max_partial_frame_bytes = 4194304: "
         "max_partial_frame_bytes must be >= max_frame_size"),
        ({"max_frame_size": 16 * MiB, "max_partial_frame_bytes": 8 * MiB}, "max_partial_frame_bytes = 8388608"),
    ],
)
def test_bad_values_are_refused_naming_the_key(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"server": values})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"server = 5\n", "[server] * = 5: must be a table"),
        (b"credit = [1, 2]\n", "[credit] * = [1, 2]: must be a table"),
        (b"port = 5680\n[server]\n", "port = 5680: a key outside any section"),
        (b'[server]\nname = "caf\xe9"\n', "not UTF-8, as TOML must be: byte 0xe9 at offset"),
    ],
)
def test_a_file_of_the_wrong_shape_is_refused_naming_what_is_wrong(tmp_path, text: bytes, message: str) -> None:
    path = tmp_path / "broker.toml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, {"server": {"port": 0}})  # as serve passes its flags: over the file's sections
    assert message in str(info.value)
