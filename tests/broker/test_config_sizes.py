"""Size strings ("2GiB") in the TOML file for every byte-valued key, as on the command line (issue 10.5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowbroker.broker.config import SIZE_KEYS, ConfigError, load_config, parse_size

MiB = 1024 * 1024


def test_every_byte_valued_key_takes_a_size_string(tmp_path: Path) -> None:
    path = tmp_path / "flowbroker.toml"
    path.write_text(
        '[server]\nmax_frame_size = "16MiB"\nmax_message_size = "4MiB"\nmax_partial_frame_bytes = "1GiB"\n'
        'memory_quota = "2GiB"\nmemory_watermark = "1536MiB"\n'
        '[queues]\nmax_size = "100MiB"\n'
        '[credit]\npolicy = "dynamic"\nquota = "1GiB"\nstatic_size = "10MiB"\nmin_size = "512KiB"\n'
        'max_size = "50MiB"\noverride_size = "0"\n'
        '[udp]\nterm_length = "4MiB"\nmin_receiver_window = "16KiB"\nmax_receiver_window = "2MiB"\n'
        '[storage]\nsegment_size = "8MiB"\ndisk_free_limit = "1GiB"\nquota = "10GiB"\n'
    )
    config = load_config(path)
    server = config.server
    assert (server.max_frame_size, server.max_message_size, server.max_partial_frame_bytes) == (16 * MiB, 4 * MiB, 1024 * MiB)
    assert (server.memory_quota, server.memory_watermark) == (2048 * MiB, 1536 * MiB)
    assert config.queues.max_size == 100 * MiB
    policy = config.credit_policy()
    assert (policy.quota, policy.static_size, policy.min_size, policy.max_size, policy.override_size) == (
        1024 * MiB, 10 * MiB, 512 * 1024, 50 * MiB, 0)
    udp = config.udp
    assert (udp.term_length, udp.min_receiver_window, udp.max_receiver_window) == (4 * MiB, 16 * 1024, 2 * MiB)
    storage = config.storage
    assert (storage.segment_size, storage.disk_free_limit, storage.quota) == (8 * MiB, 1024 * MiB, 10240 * MiB)
    assert {s: len(k) for s, k in SIZE_KEYS.items()} == {"server": 5, "queues": 1, "credit": 5, "udp": 3, "storage": 3}


def test_integers_still_work_and_a_bad_size_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "flowbroker.toml"
    path.write_text("[queues]\nmax_size = 1048576\n")
    assert load_config(path).queues.max_size == MiB
    for bad in ('"ten MiB"', '"infGiB"', '"-"'):
        path.write_text(f"[queues]\nmax_size = {bad}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value).startswith(f"[queues] max_size = {bad.replace(chr(34), chr(39))}: is not a size")
    path.write_text('[server]\nmax_frame_size = "1KiB"\n')  # a size string is range-checked like a number
    with pytest.raises(ConfigError, match=r"\[server\] max_frame_size = 1024: must be an integer in \[4096, "):
        load_config(path)


@pytest.mark.parametrize(("text", "size"), [("1048576", MiB), ("512KiB", 512 * 1024), ("10MiB", 10 * MiB),
                                            ("2GiB", 2048 * MiB), ("1.5g", 1536 * MiB), ("64k", 65536),
                                            ("1TiB", 1 << 40), (" 3 MB ", 3 * MiB)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size
