"""`load_config` (broker/config.py) against docs/configuration.md, key by key.

The documented TOML block is the reference: every key in it parses to the value written there, every
default is the documented one, every key the code knows is documented, and every unknown key, value of
the wrong type or out of range is refused with a ConfigError whose message starts `[section] key = `.
Flags given to `flowbroker serve` override the file, and flags left out leave it alone. Size strings
and the bounds of the [server] timeouts have their own files (test_config_sizes.py,
test_config_server_bounds.py).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner

from flowbroker.broker.config import (
    AdminConfig,
    AuthConfig,
    TlsConfig,
    MetricsConfig,
    StorageConfig,
    UdpConfig,
    BrokerConfig,
    ConfigError,
    QueueDefaults,
    ServerConfig,
    default_quota,
    load_config,
    parse_size,
)
from flowbroker.policies.credit import CreditPolicy, CreditPolicyConfig

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
SECTIONS: dict[str, type[Any]] = {"server": ServerConfig, "queues": QueueDefaults, "admin": AdminConfig, "udp": UdpConfig,
                                   "metrics": MetricsConfig, "auth": AuthConfig, "tls": TlsConfig,
                                   "storage": StorageConfig}
CREDIT_KEYS = sorted(f.name for f in fields(CreditPolicyConfig) if f.init and f.name != "quota")
"""[credit] keys a file may set; `quota` is one too but is documented as following memory_quota."""


def documented() -> dict[str, dict[str, Any]]:
    """The one ```toml block of docs/configuration.md, parsed."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    (block,) = re.findall(r"^```toml\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    return tomllib.loads(block)


def section_values(config: BrokerConfig, section: str) -> dict[str, Any]:
    """What `config` holds for `section`, keyed as in the file (the credit policy as its string)."""
    if section == "credit":
        policy = config.credit_policy()
        return {key: str(getattr(policy, key)) if key == "policy" else getattr(policy, key) for key in CREDIT_KEYS}
    obj = getattr(config, section)
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flowbroker.toml"
    path.write_text(text)
    return path


# -- the documented file --------------------------------------------------------------------------


def test_the_documentation_lists_every_key_the_code_knows() -> None:
    doc = documented()
    assert sorted(doc) == ["admin", "auth", "credit", "metrics", "queues", "server", "storage", "tls", "udp"]
    for section, cls in SECTIONS.items():
        assert sorted(doc[section]) == sorted(f.name for f in fields(cls)), section
    assert sorted(doc["credit"]) == CREDIT_KEYS


def test_every_documented_key_parses_to_its_documented_value(tmp_path: Path) -> None:
    doc = documented()
    config = load_config(write(tmp_path, tomllib_dump(doc)))
    for section, values in doc.items():
        assert section_values(config, section) == values, section
    # [credit] quota is not in the file: it follows [server] memory_quota
    assert config.credit_policy().quota == doc["server"]["memory_quota"]


def test_the_defaults_are_the_documented_values() -> None:
    """Except memory_quota, which depends on the machine: a quarter of its memory (at least 64 MiB)."""
    doc = documented()
    config = load_config()
    for section, values in doc.items():
        expected = dict(values)
        if section == "server":
            expected["memory_quota"] = default_quota()
        assert section_values(config, section) == expected, section
    assert default_quota() >= 64 * MiB
    assert config.credit_policy().policy is CreditPolicy.AGGRESSIVE


def tomllib_dump(doc: dict[str, dict[str, Any]]) -> str:
    """Enough of a TOML writer for the documented block: tables of strings, bools, ints and floats."""
    lines = []
    for section, values in doc.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


# -- errors that name the key ---------------------------------------------------------------------


def every_key() -> list[tuple[str, str, Any]]:
    return [(section, key, value) for section, values in documented().items() for key, value in values.items()]


def wrong_type(value: Any) -> Any:
    """A value of another TOML type than the documented one."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, (int, float)):
        return "many"
    return 5


@pytest.mark.parametrize(("section", "key", "value"), every_key(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(section: str, key: str, value: Any) -> None:
    bad = wrong_type(value)
    with pytest.raises(ConfigError) as info:
        load_config(None, {section: {key: bad}})
    shown = "'***'" if key == "token" else repr(str(bad) if key == "policy" else bad)  # the token is a secret
    assert str(info.value).startswith(f"[{section}] {key} = {shown}: "), str(info.value)


@pytest.mark.parametrize("section", ["server", "queues", "credit", "admin", "udp", "metrics", "auth", "tls"])
def test_an_unknown_key_is_refused_naming_it_and_the_known_ones(section: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {section: {"max_sise": 1}})
    message = str(info.value)
    assert message.startswith(f"[{section}] max_sise = 1: unknown key; known: ")
    for key in documented()[section]:
        assert key in message


def test_an_unknown_section_or_a_section_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^\[sever\]: unknown section; known: admin, auth, credit, metrics, queues, server, storage, tls, udp$"):
        load_config(write(tmp_path, "[sever]\nport = 1\n"))
    for section in ("server", "queues", "admin", "credit"):
        with pytest.raises(ConfigError, match=rf"^\[{section}\] \* = 3: must be a table$"):
            load_config(write(tmp_path, f"{section} = 3\n"))


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("server", {"port": 65536}, "[server] port = 65536: must be an integer in [0, 65535]"),
        ("server", {"port": True}, "[server] port = True: must be an integer in [0, 65535]"),
        ("server", {"max_message_size": 5 * MiB}, "[server] max_frame_size = 8388608 (its default), "
         "max_message_size = 5242880: max_message_size must be <= max_frame_size / 2 = 4194304"),
        ("server", {"idle_timeout": -1.0}, "[server] idle_timeout = -1.0: must be a number of seconds in [0.001, 100000000]"),
        ("server", {"memory_quota": MiB - 1}, "[server] memory_quota = 1048575: must be an integer in [1048576, "),
        ("server", {"memory_resume_percent": 0}, "[server] memory_resume_percent = 0: must be an integer in [1, 100]"),
        ("server", {"max_exchanges": 3}, "[server] max_exchanges = 3: must be an integer in [4, "),
        ("server", {"host": " "}, "[server] host = ' ': must be a non-empty host name or address"),
        ("queues", {"flow_stop_percent": 120}, "[queues] flow_stop_percent = 120: must be a number in [0, 100]"),
        ("queues", {"flow_stop_percent": 50, "flow_resume_percent": 60},
         "[queues] flow_resume_percent = 60: must be <= flow_stop_percent"),
        ("queues", {"overflow": "drop-tail"}, "[queues] overflow = 'drop-tail': unknown overflow policy"),
        ("queues", {"max_prefetch": 0}, "[queues] max_prefetch = 0: must be an integer in [1, "),
        ("credit", {"policy": "greedy"}, "[credit] policy = 'greedy': unknown policy; known: none, static, dynamic, aggressive"),
        ("credit", {"min_size": 2 * MiB, "max_size": MiB}, "[credit] min_size = 2097152: must be <= max_size=1048576"),
        ("credit", {"static_size": 0}, "[credit] static_size = 0: "),
        ("credit", {"aggressive_percent": 101}, "[credit] aggressive_percent = 101: "),
        # as PUT /api/policy refuses it: started, the broker refused every client naming no key (a tester)
        ("credit", {"quota": 19}, "[credit] quota = 19: the aggressive policy's pool of 0 bytes cannot hold a single "
         "connection (one byte each, at most half the pool): raise the quota"),
        ("admin", {"port": -1}, "[admin] port = -1: must be an integer in [0, 65535]"),
        ("admin", {"port": 5680}, "[admin] port = 5680: the same port as [server] port, on the same host"),
        ("admin", {"port": 5680, "host": "localhost"}, "[admin] port = 5680: the same port as [server] port"),
        ("metrics", {"endpoint": "127.0.0.1:5681"}, "[metrics] endpoint = '127.0.0.1:5681': the same port as [admin] port"),
        ("admin", {"token": "short"}, "[admin] token = '***': must be at least 16 printable ASCII characters"),
        ("admin", {"token": "sixteen chars with spaces"}, "[admin] token = '***': "),
        ("admin", {"token_file": ""}, "[admin] token_file = '': must be a non-empty path"),
        ("metrics", {"endpoint": "9419"}, "[metrics] endpoint = '9419': must be host:port with a port in [0, 65535]"),
        ("metrics", {"endpoint": "127.0.0.1:99999"}, "[metrics] endpoint = '127.0.0.1:99999': must be host:port"),
        ("metrics", {"max_producer_series": -1}, "[metrics] max_producer_series = -1: must be an integer in [0, "),
        ("tls", {"enabled": True}, "[tls] cert_file = '': must name a PEM file when [tls] enabled = true"),
        ("tls", {"verify_client": "required"}, "[tls] ca_file = '': must name the CA's PEM file"),
        ("tls", {"verify_client": "maybe"}, "[tls] verify_client = 'maybe': must be one of none, optional, required"),
        ("auth", {"plain": "sometimes"}, "[auth] plain = 'sometimes': must be one of never, tls-or-loopback, always"),
        ("auth", {"failed_login_delay": 61}, "[auth] failed_login_delay = 61: must be a number in [0, 60]"),
        ("auth", {"loopback_user": "a\nb"}, "[auth] loopback_user = 'a\\nb': must be a user name"),
        ("udp", {"loopback_mtu": 65536}, "[udp] loopback_mtu = 65536: must be an integer in [64, 65504]"),
        ("udp", {"loopback_mtu": 8200}, "[udp] loopback_mtu = 8200: must be a multiple of 32"),
        ("storage", {"quota": MiB}, "[storage] quota = 1048576: must be 0 (no quota) or at least 2 x segment_size "
         "(2 x 67108864)"),
        ("storage", {"quota": 4 * MiB - 1, "segment_size": 2 * MiB},
         "[storage] quota = 4194303: must be 0 (no quota) or at least 2 x segment_size (2 x 2097152)"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_the_key(section: str, values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {section: values})
    assert str(info.value).startswith(message), str(info.value)
    assert info.value.section == section


def test_the_tls_port_on_the_plain_port_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Its listen error said "Address already in use (another broker running?)" (a tester)."""
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    with pytest.raises(ConfigError) as info:
        load_config(None, {"server": {"port": 6000}, "tls": {"enabled": True, "port": 6000, "cert_file": str(pem),
                                                             "key_file": str(pem)}})
    assert str(info.value).startswith("[tls] port = 6000: the same port as [server] port"), str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, {"server": {"port": 6000}, "admin": {"port": 6001},
                           "tls": {"enabled": True, "port": 6001, "cert_file": str(pem), "key_file": str(pem)}})
    assert str(info.value).startswith("[admin] port = 6001: the same port as [tls] port"), str(info.value)
    load_config(None, {"server": {"port": 6000}, "admin": {"port": 6000, "host": "127.0.0.2"}})  # another address


def test_an_admin_token_is_never_echoed(tmp_path: Path) -> None:
    secret = "hunter2 is not enough"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, f'[admin]\ntoken = "{secret}"\n'))
    assert secret not in str(info.value) and info.value.value == "***"
    token = "0123456789abcdef"
    assert load_config(None, {"admin": {"token": token}}).admin.token == token


def test_a_file_that_is_not_toml_or_cannot_be_read_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not valid TOML: "):
        load_config(path)
    missing = tmp_path / "nowhere.toml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(missing))}: cannot be read: "):
        load_config(missing)


# -- precedence: defaults, then the file, then overrides (flags) ----------------------------------


def test_overrides_win_over_the_file_and_none_leaves_the_file_alone(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nport = 7000\nidle_timeout = 5.0\nhost = "0.0.0.0"\n[credit]\npolicy = "static"\n')
    config = load_config(path, {"server": {"port": 7001, "idle_timeout": None}, "credit": {"policy": None}})
    assert (config.server.port, config.server.idle_timeout, config.server.host) == (7001, 5.0, "0.0.0.0")
    assert config.credit_policy().policy is CreditPolicy.STATIC
    assert config.server.name == "flowbroker"  # in neither: the default
    # an override is validated like a file value, and a size string from it is parsed too
    assert load_config(path, {"server": {"memory_quota": "2GiB"}}).server.memory_quota == 2048 * MiB
    with pytest.raises(ConfigError, match=r"^\[server\] port = 70000: "):
        load_config(path, {"server": {"port": 70000}})


def test_serve_flags_override_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`flowbroker serve --config F --flag ...` with trio.run replaced, so nothing listens: the flags
    given win over the file, the flags left out leave the file's values (env vars play no part)."""
    from flowbroker.broker.cli import main

    seen: list[BrokerConfig] = []

    def fake_run(_serve: Any, config: BrokerConfig, *args: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(trio, "run", fake_run)
    path = write(
        tmp_path,
        '[server]\nhost = "127.0.0.2"\nport = 7000\nidle_timeout = 5.0\nmemory_quota = "512MiB"\n'
        '[credit]\npolicy = "static"\n[admin]\nport = 7001\nenabled = false\n',
    )
    runner = CliRunner()
    result = runner.invoke(main, ["serve", "--config", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        main,
        ["serve", "--config", str(path), "--port", "7100", "--memory-quota", "1GiB", "--credit-policy", "dynamic",
         "--admin", "--admin-port", "7101", "--metrics-endpoint", "127.0.0.1:9419", "--no-metrics",
         "--pace-producers"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    from_file, flagged = seen
    assert (from_file.server.port, from_file.server.memory_quota, from_file.admin.enabled) == (7000, 512 * MiB, False)
    assert from_file.credit_policy().policy is CreditPolicy.STATIC
    assert (flagged.server.port, flagged.server.memory_quota, flagged.admin.port, flagged.admin.enabled) == (
        7100, 1024 * MiB, 7101, True)
    assert flagged.credit_policy().policy is CreditPolicy.DYNAMIC
    assert (flagged.metrics.endpoint, flagged.metrics.enabled) == ("127.0.0.1:9419", False)
    assert (from_file.metrics.endpoint, from_file.metrics.enabled) == ("", True)
    assert (flagged.server.host, flagged.server.idle_timeout) == ("127.0.0.2", 5.0)  # not flagged: the file's
    assert (from_file.queues.pace_producers, flagged.queues.pace_producers) == (False, True)


def test_serve_reports_a_configuration_error_naming_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowbroker.broker.cli import main

    monkeypatch.setattr(trio, "run", lambda *args: pytest.fail("must not start"))
    path = write(tmp_path, "[queues]\nflow_stop_percent = 120\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(path)])
    assert result.exit_code == 1
    assert "configuration error: [queues] flow_stop_percent = 120: must be a number in [0, 100]" in result.output


def test_a_quota_of_two_segments_or_none_is_accepted() -> None:
    """The smallest quota the disk alarm can always clear under (docs/storage.md, "The disk as flow control")."""
    assert load_config(None, {"storage": {"quota": 2 * 64 * MiB}}).storage.quota == 128 * MiB
    assert load_config(None, {"storage": {"quota": 0, "segment_size": 1 << 40}}).storage.quota == 0


def test_a_term_length_lowered_alone_says_max_receiver_window_must_follow_it() -> None:
    """`term_length = 262144` alone was refused as "max_receiver_window = 1048576: must be an integer in
    [8192, 131072]", a key the user never set, without saying why (a tester)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, {"udp": {"term_length": 262144}})
    text = str(info.value)
    assert "max_receiver_window" in text and "term_length / 2 (131072 with term_length = 262144)" in text
    assert "together with term_length" in text
    load_config(None, {"udp": {"term_length": 262144, "max_receiver_window": 131072}})  # as configuration.md says


def test_an_mtu_raised_alone_or_a_credit_max_size_lowered_alone_says_which_key_must_follow_it() -> None:
    """`[udp] mtu = 16384` alone was refused as "min_receiver_window = 8192: must be an integer in [16384,
    ...]", and `[credit] max_size = "4MiB"` as "min_size = 10485760: must be <= max_size": keys at their
    defaults the user never set, without saying so (a tester)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, {"udp": {"mtu": 16384}})
    assert "min_receiver_window" in str(info.value) and "together with mtu" in str(info.value)
    load_config(None, {"udp": {"mtu": 16384, "min_receiver_window": 16384}})
    with pytest.raises(ConfigError) as info:
        load_config(None, {"credit": {"max_size": "4MiB"}})
    assert "min_size" in str(info.value) and "raise max_size or lower min_size" in str(info.value)


@pytest.mark.parametrize("text", ["5i", "100IB", "i", "KB5"])
def test_a_size_with_a_stray_i_is_no_size(text: str) -> None:
    """"5i" and "100IB" loaded as 5 and 100 bytes (a tester)."""
    with pytest.raises(ValueError):
        parse_size(text)
    assert parse_size("5KiB") == parse_size("5kib") == parse_size("5K") == 5120 and parse_size("7B") == 7


def test_an_out_of_range_value_in_the_file_stops_the_broker_even_when_a_flag_overrides_it(tmp_path: Path) -> None:
    """configuration.md: out-of-range values stop the broker. `port = 70000` beside --port, or
    `idle_timeout = -1` beside --idle-timeout, started it (a tester)."""
    config = tmp_path / "flowbroker.toml"
    config.write_text("[server]\nport = 70000\n")
    with pytest.raises(ConfigError, match=r"\[server\] port = 70000: must be an integer in \[0, 65535\]"):
        load_config(config, {"server": {"port": 6140}})
    config.write_text("[server]\nidle_timeout = -1\n")
    with pytest.raises(ConfigError, match="idle_timeout"):
        load_config(config, {"server": {"idle_timeout": 5.0}})
    config.write_text("[server]\nport = 6000\n")
    assert load_config(config, {"server": {"port": 6140}}).server.port == 6140  # a good value: the flag wins


@pytest.mark.parametrize("host", ["LOCALHOST", "::ffff:127.0.0.1", "[::FFFF:127.0.0.1]", " 127.0.0.1 ", "0.0.0.0", "::",
                                  "::ffff:0.0.0.0", "127.1", "0", "2130706433"])
def test_any_spelling_of_the_clients_address_on_the_client_port_is_refused(host: str) -> None:
    """"LOCALHOST" and "::ffff:127.0.0.1" beside [server] host 127.0.0.1 on its port got the listen error's
    "another broker running?" (a tester): compared as addresses, case aside."""
    with pytest.raises(ConfigError) as info:
        load_config(None, {"server": {"port": 6000, "host": "127.0.0.1"}, "admin": {"port": 6000, "host": host}})
    assert str(info.value).startswith("[admin] port = 6000: the same port as [server] port"), str(info.value)


@pytest.mark.parametrize(("server", "admin"), [("127.0.0.1", "::1"), ("::1", "127.0.0.2"), ("127.0.0.1", "[::1]"),
                                               ("10.0.0.1", "127.0.0.1")])
def test_two_addresses_that_share_nothing_may_share_a_port(server: str, admin: str) -> None:
    """[admin] host = "::1" beside [server] 127.0.0.1 on one port was refused as the same host, though
    Linux binds both (a tester)."""
    config = load_config(None, {"server": {"port": 6000, "host": server}, "admin": {"port": 6000, "host": admin}})
    assert config.admin.port == config.server.port == 6000
