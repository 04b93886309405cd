"""Broker configuration: embedded defaults, an optional TOML file, command-line overrides.

Every key is documented in docs/configuration.md and in `flowbroker serve --help`. Unknown keys
and bad values are errors that name the key (`[queues] flow_stop_percent = 120: must be in
[0, 100]`), because a typo that silently falls back to a default is the worst kind of config bug.
"""

from __future__ import annotations

import ipaddress

import os
import socket
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from flowbroker.policies.credit import CreditPolicy, CreditPolicyConfig, PolicyConfigError, reserve_for
from flowbroker.policies.overflow import OverflowPolicy, ThresholdDefaults
from flowbroker.protocol.names import OVERFLOW_REJECT

__all__ = [
    "ConfigError",
    "ServerConfig",
    "QueueDefaults",
    "AdminConfig",
    "UdpConfig",
    "MetricsConfig",
    "AuthConfig",
    "TlsConfig",
    "StorageConfig",
    "BrokerConfig",
    "load_config",
    "default_quota",
    "parse_size",
    "SIZE_KEYS",
]

MiB = 1024 * 1024

SIZE_KEYS = {
    "server": ("max_frame_size", "max_message_size", "max_partial_frame_bytes", "memory_quota", "memory_watermark"),
    "queues": ("max_size",),
    "credit": ("quota", "static_size", "min_size", "max_size", "override_size"),
    "udp": ("term_length", "min_receiver_window", "max_receiver_window"),
    "storage": ("segment_size", "disk_free_limit", "quota"),
}
"""The byte-valued keys: in the TOML file as on the command line, each takes an integer or a size
string such as "2GiB" (parse_size)."""


def parse_size(value: str) -> int:
    """A size: plain bytes ("1048576") or a number with a binary suffix: KiB, MiB, GiB, TiB (1024-based;
    K/KB, M/MB, G/GB, T/TB mean the same), case-insensitive, e.g. "512KiB", "1.5GiB". ValueError if not."""
    text = value.strip().upper().removesuffix("B")
    if text.endswith("I"):  # KiB, MiB, ...: the "i" only after a unit letter ("5i" and "100iB" are no sizes)
        text = text[:-1]
        if not text.endswith(("K", "M", "G", "T")):
            raise ValueError(f"{value!r} is not a size")
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if text.endswith(suffix):
            try:
                return int(float(text[:-1]) * factor)
            except OverflowError:  # "infGiB"
                raise ValueError(f"{value!r} is not a size") from None
    return int(text)


class ConfigError(ValueError):
    """A configuration value is wrong; the message names `[section] key` and the value."""

    def __init__(self, section: str, key: str, value: object, reason: str, *, where: str | None = None):
        # `where` instead of "[section] key = value" for what is not a key's value (the file, a section)
        super().__init__(f"{where if where is not None else f'[{section}] {key} = {value!r}'}: {reason}")
        self.section = section
        self.key = key
        self.value = value


def default_quota() -> int:
    """A quarter of physical memory: the broker's memory budget when none is configured."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 4096 * MiB
    return max(64 * MiB, total // 4)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 5680
    name: str = "flowbroker"
    max_frame_size: int = 8 * MiB
    max_message_size: int = 4 * MiB
    idle_timeout: float = 60.0
    handshake_timeout: float = 10.0
    frame_timeout: float = 30.0
    max_partial_frame_bytes: int = 64 * MiB
    max_connections: int = 10_000
    max_subscriptions: int = 1_000
    max_subscriptions_total: int = 100_000
    max_queues: int = 100_000
    max_exchanges: int = 10_000
    max_bindings: int = 100_000
    stuck_timeout: float = 720.0
    disconnect_when_stuck: bool = False
    memory_quota: int = field(default_factory=default_quota)
    memory_watermark: int = 0  # bytes of messages held that raise the memory alarm; 0 = memory_quota
    memory_resume_percent: int = 90  # the alarm clears under this percentage of the watermark
    max_producer_ids: int = 10_000  # idempotent producer ids tracked at once (broker/idempotence.py)
    max_producer_ids_per_user: int = 5_000  # of them, held by one authenticated user at once
    producer_id_ttl: float = 3600.0  # seconds an idle producer id is kept at least after its last message

    def _pair(self, key: str) -> str:
        """`[server] max_frame_size = N, key = M`, saying which of the two is the default: an error of a
        pair names both, as the one the user set may be either (a tester set max_frame_size alone and was
        told max_message_size, which he never set, was out of range)."""
        def shown(name: str) -> str:
            value = getattr(self, name)
            return f"{name} = {value}" + (" (its default)" if value == getattr(ServerConfig, name) else "")
        return f"[server] {shown('max_frame_size')}, {shown(key)}"

    def _sizes_fit(self) -> None:
        """max_message_size <= max_frame_size / 2, so a DELIVER of the largest message fits in a frame."""
        half = self.max_frame_size // 2
        if self.max_message_size > half:
            raise ConfigError(
                "server", "max_message_size", self.max_message_size,
                f"max_message_size must be <= max_frame_size / 2 = {half} (a DELIVER of the largest message must "
                f"fit in one frame): set max_message_size to {half} or less, or max_frame_size to "
                f"{2 * self.max_message_size} or more", where=self._pair("max_message_size"))

    def _partial_fits(self) -> None:
        """max_partial_frame_bytes >= max_frame_size, or a frame of max_frame_size could never complete."""
        if self.max_partial_frame_bytes < self.max_frame_size:
            raise ConfigError(
                "server", "max_partial_frame_bytes", self.max_partial_frame_bytes,
                f"max_partial_frame_bytes must be >= max_frame_size (one whole frame must fit, or a frame of "
                f"max_frame_size could never complete): set max_partial_frame_bytes to {self.max_frame_size} or "
                f"more, or max_frame_size to {self.max_partial_frame_bytes} or less",
                where=self._pair("max_partial_frame_bytes"))

    def validate(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError("server", "host", self.host, "must be a non-empty host name or address")
        _int_range("server", "port", self.port, 0, 65535)
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError("server", "name", self.name, "must be a non-empty string")
        _int_range("server", "max_frame_size", self.max_frame_size, 4096, 1 << 30)
        _int_range("server", "max_message_size", self.max_message_size, 1, 1 << 29)
        self._sizes_fit()
        _seconds("server", "idle_timeout", self.idle_timeout)
        _seconds("server", "handshake_timeout", self.handshake_timeout)
        _seconds("server", "frame_timeout", self.frame_timeout)
        _int_range("server", "max_partial_frame_bytes", self.max_partial_frame_bytes, 4096, 1 << 40)
        self._partial_fits()
        _int_range("server", "max_connections", self.max_connections, 1, 1_000_000)
        _int_range("server", "max_subscriptions", self.max_subscriptions, 1, 1_000_000)
        _int_range("server", "max_subscriptions_total", self.max_subscriptions_total, 1, 10_000_000)
        _int_range("server", "max_queues", self.max_queues, 1, 10_000_000)
        _int_range("server", "max_exchanges", self.max_exchanges, 4, 10_000_000)
        _int_range("server", "max_bindings", self.max_bindings, 1, 10_000_000)
        _seconds("server", "stuck_timeout", self.stuck_timeout)
        if not isinstance(self.disconnect_when_stuck, bool):  # "false" would be truthy
            raise ConfigError("server", "disconnect_when_stuck", self.disconnect_when_stuck, "must be true or false")
        _int_range("server", "memory_quota", self.memory_quota, MiB, 1 << 50)
        _int_range("server", "memory_watermark", self.memory_watermark, 0, 1 << 50)
        _int_range("server", "memory_resume_percent", self.memory_resume_percent, 1, 100)
        _int_range("server", "max_producer_ids", self.max_producer_ids, 1, 10_000_000)
        _int_range("server", "max_producer_ids_per_user", self.max_producer_ids_per_user, 1, 10_000_000)
        _seconds("server", "producer_id_ttl", self.producer_id_ttl)


@dataclass(frozen=True)
class QueueDefaults:
    """Defaults for queues that do not declare their own thresholds (Qpid's broker-wide defaults)."""

    max_size: int = 100 * MiB
    flow_stop_percent: float = 80.0
    flow_resume_percent: float = 70.0
    overflow: str = OVERFLOW_REJECT
    max_prefetch: int = 10_000
    pace_producers: bool = False
    """Hold back the completions and credit of a producer that routed to a queue holding more ready
    messages than twice its consumers' combined prefetch until that queue is down to the prefetch
    (docs/policies.md, "Pacing"): the backlog, and the latency it costs, stay small without stopping anyone."""

    def validate(self) -> None:
        _int_range("queues", "max_size", self.max_size, 0, 1 << 50)
        if not isinstance(self.pace_producers, bool):  # "false" would be truthy
            raise ConfigError("queues", "pace_producers", self.pace_producers, "must be true or false")
        for key in ("flow_stop_percent", "flow_resume_percent"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
                raise ConfigError("queues", key, value, "must be a number in [0, 100]")
        if self.flow_resume_percent > self.flow_stop_percent:
            raise ConfigError("queues", "flow_resume_percent", self.flow_resume_percent, "must be <= flow_stop_percent")
        try:
            OverflowPolicy.parse(self.overflow)
        except PolicyConfigError as exc:
            raise ConfigError("queues", "overflow", self.overflow, exc.reason) from None
        _int_range("queues", "max_prefetch", self.max_prefetch, 1, 10_000_000)

    def thresholds(self) -> ThresholdDefaults:
        return ThresholdDefaults(self.max_size, self.flow_stop_percent, self.flow_resume_percent)


DEFAULT_TOKEN_FILE = "~/.flowbroker/admin-token-{port}"
"""Where a generated admin token goes: one file per admin port, so two brokers on one host never
overwrite each other's token, and the CLI finds the file from the port of the URL it is given."""
MIN_TOKEN_LENGTH = 16


def token_file_for(token_file: str, port: int) -> Path:
    """`token_file` with `{port}` replaced by the admin port (the bound one, when configured as 0)."""
    return Path(token_file.replace("{port}", str(port))).expanduser()


def valid_token(token: str) -> bool:
    """A token the API accepts: at least MIN_TOKEN_LENGTH printable ASCII characters, no spaces."""
    return (len(token) >= MIN_TOKEN_LENGTH and token.isascii() and token.isprintable()
            and not any(c.isspace() for c in token))


@dataclass(frozen=True)
class AdminConfig:
    """The management HTTP API (docs/management.md). Every request needs `Authorization: Bearer
    <token>`; with no token configured the broker generates one at start and writes it to
    `token_file` (mode 0600, `{port}` replaced by the admin port), where the CLI finds it; a valid
    token already in that file is reused, so a broker restarted keeps its CLI's credential."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 5681
    token: str = ""
    token_file: str = DEFAULT_TOKEN_FILE
    max_connections: int = 64
    """HTTP connections served at once; a socket accepted beyond them is answered 503 and closed, so the
    port costs bounded memory and descriptors whatever its clients send (broker/httpserve.py)."""

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("admin", "enabled", self.enabled, "must be true or false")
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError("admin", "host", self.host, "must be a non-empty host name or address")
        _int_range("admin", "port", self.port, 0, 65535)
        _int_range("admin", "max_connections", self.max_connections, 1, 10_000)
        if not isinstance(self.token, str):
            raise ConfigError("admin", "token", "***", "must be a string")
        if self.token and not valid_token(self.token):
            # The value itself is a secret: never echo it in the error.
            raise ConfigError(
                "admin", "token", "***",
                f"must be at least {MIN_TOKEN_LENGTH} printable ASCII characters without spaces "
                "(or empty to generate one at start)",
            )
        if not isinstance(self.token_file, str) or not self.token_file.strip():
            raise ConfigError("admin", "token_file", self.token_file, "must be a non-empty path")

    def token_path(self, port: int) -> Path:
        """The token file of a broker whose admin API listens on `port`."""
        return token_file_for(self.token_file, port)


CONGESTION_CONTROLS = ("static", "cubic")


@dataclass(frozen=True)
class UdpConfig:
    """The Aeron data path (docs/transport.md, "The broker's UDP data path"): one UDP endpoint for the
    publications producers register over TCP and the broker's publications to UDP consumers.

    The window an image advertises is its producer's credit grant, clamped to [min_receiver_window,
    max_receiver_window] and never above the congestion window; 0 while the producer waits for a share
    of the pool. Publications and images hold three terms each (allocated lazily by the OS), so
    `term_length` x 3 x (max_publications + max_subscriptions) bounds what the data path can hold."""

    enabled: bool = True
    endpoint: str = "127.0.0.1:5682"
    term_length: int = 2 * MiB
    mtu: int = 8192
    loopback_mtu: int = 65504
    min_receiver_window: int = 8192
    max_receiver_window: int = MiB
    congestion_control: str = "static"
    max_publications: int = 64
    max_publications_per_connection: int = 8
    max_subscriptions: int = 64
    max_groups: int = 8
    max_group_members: int = 64
    group_receiver_timeout: float = 5.0
    multicast_interface: str = ""

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("udp", "enabled", self.enabled, "must be true or false")
        try:
            self.address()
        except ValueError as exc:
            raise ConfigError("udp", "endpoint", self.endpoint, str(exc)) from None
        tl = self.term_length
        if isinstance(tl, bool) or not isinstance(tl, int) or tl < 64 * 1024 or tl > 1 << 30 or tl & (tl - 1):
            raise ConfigError("udp", "term_length", tl, "must be a power of two in [64KiB, 1GiB]")
        _int_range("udp", "mtu", self.mtu, 64, 65504)
        if self.mtu % 32 or self.mtu > tl // 8:
            raise ConfigError("udp", "mtu", self.mtu, "must be a multiple of 32 and at most term_length / 8")
        _int_range("udp", "loopback_mtu", self.loopback_mtu, 64, 65504)
        if self.loopback_mtu % 32:
            raise ConfigError("udp", "loopback_mtu", self.loopback_mtu, "must be a multiple of 32")
        if (isinstance(self.max_receiver_window, int) and not isinstance(self.max_receiver_window, bool)
                and self.mtu <= tl // 2 < self.max_receiver_window):
            # (a term_length lowered alone named this key, which the user never set, a tester)
            raise ConfigError("udp", "max_receiver_window", self.max_receiver_window,
                              f"must be at most term_length / 2 ({tl // 2} with term_length = {tl}): lower "
                              "max_receiver_window together with term_length")
        _int_range("udp", "max_receiver_window", self.max_receiver_window, self.mtu, tl // 2)
        if (isinstance(self.min_receiver_window, int) and not isinstance(self.min_receiver_window, bool)
                and self.min_receiver_window < self.mtu <= self.max_receiver_window):
            # (an mtu raised alone named this key, which the user never set, a tester)
            raise ConfigError("udp", "min_receiver_window", self.min_receiver_window,
                              f"must be at least mtu ({self.mtu}): a window must hold one datagram; raise "
                              "min_receiver_window together with mtu")
        _int_range("udp", "min_receiver_window", self.min_receiver_window, self.mtu, self.max_receiver_window)
        if self.congestion_control not in CONGESTION_CONTROLS:
            raise ConfigError("udp", "congestion_control", self.congestion_control,
                              f"must be one of {', '.join(CONGESTION_CONTROLS)}")
        _int_range("udp", "max_publications", self.max_publications, 0, 65536)
        _int_range("udp", "max_publications_per_connection", self.max_publications_per_connection, 0, 65536)
        _int_range("udp", "max_subscriptions", self.max_subscriptions, 0, 65536)
        _int_range("udp", "max_groups", self.max_groups, 0, 1024)
        _int_range("udp", "max_group_members", self.max_group_members, 1, 1024)
        _seconds("udp", "group_receiver_timeout", self.group_receiver_timeout)
        if not isinstance(self.multicast_interface, str):
            raise ConfigError("udp", "multicast_interface", self.multicast_interface,
                              "must be a string: a local IPv4 address, or \"\" for the kernel's choice")
        if self.multicast_interface:
            try:
                ipaddress.IPv4Address(self.multicast_interface)
            except ValueError:
                raise ConfigError("udp", "multicast_interface", self.multicast_interface,
                                  "must be a local IPv4 address, or \"\" for the kernel's choice") from None

    def address(self) -> tuple[str, int]:
        """`endpoint` as (host, port); ValueError naming what is wrong."""
        return parse_endpoint(self.endpoint, "127.0.0.1:5682")

    def publication_mtu(self, host: str) -> int:
        """The mtu a producer's publication registered from `host` sends with: `loopback_mtu` from a
        loopback address (no IP fragments there, and each datagram costs both ends a system call and a
        pass of the data path, so fewer, bigger ones cost less per message), at most term_length / 8 and
        max_receiver_window; `mtu` from anywhere else."""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            return self.mtu
        return min(self.loopback_mtu, self.term_length // 8, self.max_receiver_window & ~31)


def parse_endpoint(endpoint: object, example: str) -> tuple[str, int]:
    """A `host:port` (IPv6 in brackets) as (host, port); ValueError naming what is wrong."""
    if not isinstance(endpoint, str):
        raise ValueError("must be a string host:port")
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"must be host:port with a port in [0, 65535], e.g. {example}")
    return host, int(port)


@dataclass(frozen=True)
class MetricsConfig:
    """`GET /metrics` for Prometheus (docs/metrics.md). Served on the admin port unless `endpoint` gives
    it a listener of its own; without the admin token unless `require_token` (as RabbitMQ's
    Prometheus plugin: scrapers rarely hold credentials, and the figures change nothing). Producers
    get series of their own, but only the first `max_producer_series` (by connection id), so a
    scrape stays bounded however many connect."""

    enabled: bool = True
    endpoint: str = ""
    require_token: bool = False
    max_producer_series: int = 100
    max_connections: int = 16
    """HTTP connections served at once on the port of its own (with `endpoint`), as [admin] max_connections."""

    def validate(self) -> None:
        for key in ("enabled", "require_token"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError("metrics", key, getattr(self, key), "must be true or false")
        if not isinstance(self.endpoint, str):
            raise ConfigError("metrics", "endpoint", self.endpoint, "must be a string: \"\" or host:port")
        if self.endpoint:
            try:
                self.address()
            except ValueError as exc:
                raise ConfigError("metrics", "endpoint", self.endpoint,
                                  f"{exc} (or \"\" to serve /metrics on the admin port)") from None
        _int_range("metrics", "max_producer_series", self.max_producer_series, 0, 100_000)
        _int_range("metrics", "max_connections", self.max_connections, 1, 10_000)

    def address(self) -> tuple[str, int]:
        """`endpoint` as (host, port); only when it is not "" (ValueError naming what is wrong)."""
        return parse_endpoint(self.endpoint, "127.0.0.1:9419")


PLAIN_MODES = ("never", "tls-or-loopback", "always")
DEFAULT_USERS_FILE = "~/.flowbroker/users.json"


@dataclass(frozen=True)
class AuthConfig:
    """Who may connect (docs/security.md). Users and their SCRAM-SHA-256 credentials live in
    `users_file` (the CLI's `flowbroker user add/set/passwd/delete` change it), re-read when it changes. A connection
    from a loopback address that sends no credentials is `loopback_user` (RabbitMQ's `guest`, which
    cannot log in from elsewhere): the zero-set-up experience on one host; "" turns it off."""

    loopback_user: str = "guest"
    users_file: str = DEFAULT_USERS_FILE
    plain: str = "tls-or-loopback"
    failed_login_delay: float = 1.0
    failed_login_max_delay: float = 30.0  # the per-source throttle's longest spacing (broker/auth.py)

    def validate(self) -> None:
        if not isinstance(self.loopback_user, str) or not self.loopback_user.isprintable() or len(self.loopback_user) > 255:
            raise ConfigError("auth", "loopback_user", self.loopback_user,
                              "must be a user name (printable, at most 255 characters), or \"\" for none")
        if not isinstance(self.users_file, str) or not self.users_file.strip():
            raise ConfigError("auth", "users_file", self.users_file, "must be a non-empty path")
        if self.plain not in PLAIN_MODES:
            raise ConfigError("auth", "plain", self.plain, f"must be one of {', '.join(PLAIN_MODES)}")
        if isinstance(self.failed_login_delay, bool) or not isinstance(self.failed_login_delay, (int, float)) \
                or not 0 <= self.failed_login_delay <= 60:
            raise ConfigError("auth", "failed_login_delay", self.failed_login_delay, "must be a number in [0, 60]")
        if isinstance(self.failed_login_max_delay, bool) or not isinstance(self.failed_login_max_delay, (int, float)) \
                or not self.failed_login_delay <= self.failed_login_max_delay <= 600:
            raise ConfigError("auth", "failed_login_max_delay", self.failed_login_max_delay,
                              "must be a number in [failed_login_delay, 600]")

    def users_path(self) -> Path:
        return Path(self.users_file).expanduser()


VERIFY_CLIENT = ("none", "optional", "required")


@dataclass(frozen=True)
class TlsConfig:
    """TLS on a client port of its own (`port`, on [server] host), beside the plain one (docs/security.md).
    `verify_client` asks for a client certificate signed by `ca_file`; a verified certificate's subject
    common name is the connection's identity when HELLO carries no credentials (mutual TLS)."""

    enabled: bool = False
    port: int = 5671
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    verify_client: str = "none"

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("tls", "enabled", self.enabled, "must be true or false")
        _int_range("tls", "port", self.port, 0, 65535)
        for key in ("cert_file", "key_file", "ca_file"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError("tls", key, getattr(self, key), "must be a path (a string)")
        if self.verify_client not in VERIFY_CLIENT:
            raise ConfigError("tls", "verify_client", self.verify_client, f"must be one of {', '.join(VERIFY_CLIENT)}")
        if self.enabled:
            for key in ("cert_file", "key_file"):
                if not getattr(self, key):
                    raise ConfigError("tls", key, "", "must name a PEM file when [tls] enabled = true")
        if self.verify_client != "none" and not self.ca_file:
            raise ConfigError("tls", "ca_file", "", f"must name the CA's PEM file when verify_client = "
                              f"{self.verify_client!r}")
FSYNC_POLICIES = ("always", "never")


def default_data_dir() -> Path:
    """The user's state directory (XDG: $XDG_STATE_HOME, else ~/.local/state), then flowbroker."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "flowbroker"


QUOTA_SEGMENTS = 2
"""`[storage] quota` is 0 or at least this many segments. Compaction deletes whole segments, never the
one being written, which holds up to `segment_size` bytes plus its last record even when every message is
settled; the quota must stay above that, or the disk alarm it raises could never clear. One more segment
leaves room for the snapshot a new segment opens with and for the records a settlement appends."""


@dataclass(frozen=True)
class StorageConfig:
    """The journal of durable queues (docs/storage.md). `fsync = "always"`: a transfer to a durable queue
    completes after the group commit that wrote it was fsynced (survives a power cut); `"never"`: after
    the write reached the kernel (survives the broker's own crash, kill -9 included, not the machine's).
    Producers of durable queues are held while free space under `data_dir` is under `disk_free_limit` or
    the journal holds more than `quota` bytes (0: no quota; else at least QUOTA_SEGMENTS segments)."""

    enabled: bool = True
    data_dir: str = ""
    fsync: str = "always"
    segment_size: int = 64 * MiB
    disk_free_limit: int = 128 * MiB
    quota: int = 0

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("storage", "enabled", self.enabled, "must be true or false")
        if not isinstance(self.data_dir, str):
            raise ConfigError("storage", "data_dir", self.data_dir, "must be a path (or \"\" for the default)")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError("storage", "fsync", self.fsync, f"must be one of {', '.join(FSYNC_POLICIES)}")
        _int_range("storage", "segment_size", self.segment_size, 64 * 1024, 1 << 40)
        _int_range("storage", "disk_free_limit", self.disk_free_limit, 0, 1 << 50)
        _int_range("storage", "quota", self.quota, 0, 1 << 50)
        if 0 < self.quota < QUOTA_SEGMENTS * self.segment_size:
            raise ConfigError("storage", "quota", self.quota,
                              f"must be 0 (no quota) or at least {QUOTA_SEGMENTS} x segment_size "
                              f"({QUOTA_SEGMENTS} x {self.segment_size}): the segment being written is never "
                              "deleted, so under a smaller quota the disk alarm may never clear")

    def journal_dir(self) -> Path:
        """Where the journal's segments are: `<data_dir>/journal`."""
        base = Path(self.data_dir).expanduser() if self.data_dir else default_data_dir()
        return base / "journal"


@dataclass(frozen=True)
class BrokerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    queues: QueueDefaults = field(default_factory=QueueDefaults)
    credit: dict[str, Any] = field(default_factory=dict)  # [credit] table, see credit_policy()
    admin: AdminConfig = field(default_factory=AdminConfig)
    udp: UdpConfig = field(default_factory=UdpConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def credit_policy(self) -> CreditPolicyConfig:
        """The producer credit policy; its quota defaults to the broker's memory quota."""
        settings = {"quota": self.server.memory_quota, **self.credit}
        try:
            return CreditPolicyConfig.from_mapping(settings)
        except PolicyConfigError as exc:
            raise ConfigError("credit", exc.key, exc.value, exc.reason) from None

    def validate(self) -> BrokerConfig:
        self.server.validate()
        self.queues.validate()
        policy = self.credit_policy()
        if policy.policy is not CreditPolicy.NONE and reserve_for(policy.pool_bytes, self.server.max_connections) < 1:
            # as PUT /api/policy refuses it: a broker started with it refused every client, consumers too,
            # naming neither key nor remedy (a tester, [credit] quota = 1)
            raise ConfigError("credit", "quota", policy.quota,
                              f"the {policy.policy.value} policy's pool of {policy.pool_bytes} bytes cannot hold a "
                              "single connection (one byte each, at most half the pool): raise the quota")
        self.admin.validate()
        self.udp.validate()
        self.metrics.validate()
        self.auth.validate()
        self.tls.validate()
        self.storage.validate()
        self._check_ports_apart()
        return self

    def _check_ports_apart(self) -> None:
        """The broker's own TCP listeners on one port: the second one's listen error said "another broker
        running?", pointing the operator the wrong way (testers: [tls] port = [server] port, then [tls] =
        [admin], the metrics endpoint on either, the admin host "localhost" beside 127.0.0.1)."""
        listeners: list[tuple[str, str, str, int]] = [("server", "port", self.server.host, self.server.port)]
        if self.tls.enabled:
            listeners.append(("tls", "port", self.server.host, self.tls.port))
        if self.admin.enabled:
            listeners.append(("admin", "port", self.admin.host, self.admin.port))
        if self.metrics.enabled and self.metrics.endpoint:
            host, port = self.metrics.address()
            listeners.append(("metrics", "endpoint", host, port))
        for i, (section, key, host, port) in enumerate(listeners):
            for other_section, other_key, other_host, other_port in listeners[:i]:
                if port and port == other_port and _same_host(host, other_host):
                    value: object = self.metrics.endpoint if section == "metrics" else port
                    raise ConfigError(section, key, value,
                                      f"the same port as [{other_section}] {other_key}, on the same host: each of the "
                                      "broker's ports needs its own (or 0 for any free one)")


_WILDCARDS = ("0.0.0.0", "::", "")
_LOCALHOST = frozenset({"127.0.0.1", "::1"})  # what "localhost" binds (every address it resolves to)


def _addresses(host: str) -> frozenset[str] | None:
    """The addresses a listener on `host` takes, in one spelling (None: every address, a wildcard):
    case and brackets aside, "localhost" is its two loopback addresses, an IPv4-mapped IPv6 address is
    its IPv4 one, and any other name is itself (names are not resolved)."""
    host = host.strip().strip("[]").lower()
    if host in _WILDCARDS:
        return None
    if host == "localhost":
        return _LOCALHOST
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:  # IPv4's shorthands, which the listeners' getaddrinfo takes ("127.1", "0"; a tester)
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return frozenset({host})
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return None if address.is_unspecified else frozenset({str(address)})


def _same_host(a: str, b: str) -> bool:
    """Whether listening on `a` and on `b` with one port would clash: a wildcard takes every address;
    otherwise they clash when they share one (127.0.0.1 and ::1 do not: a tester's [admin] host = "::1"
    beside [server] 127.0.0.1 on one port binds on Linux; "LOCALHOST" and "::ffff:127.0.0.1" are
    127.0.0.1's)."""
    first, second = _addresses(a), _addresses(b)
    return first is None or second is None or bool(first & second)


def _int_range(section: str, key: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(section, key, value, f"must be an integer in [{low}, {high}]")


MIN_SECONDS = 0.001
MAX_SECONDS = 100_000_000  # about three years: beyond it (or inf, nan) deadlines overflow the clocks they meet


def _seconds(section: str, key: str, value: object) -> None:
    """A duration in seconds: TOML and click both take inf and nan, which no timer can use."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_SECONDS <= value <= MAX_SECONDS:
        raise ConfigError(section, key, value, f"must be a number of seconds in [{MIN_SECONDS}, {MAX_SECONDS}]")


def _section(cls: type[Any], name: str, table: object) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(name, "*", table, "must be a table")
    known = {f.name for f in fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(name, key, table[key], f"unknown key; known: {', '.join(sorted(known))}")
    return cls(**table)


def _parse_sizes(data: dict[str, Any]) -> None:
    """Replace every size string of a byte-valued key ("2GiB") by its number of bytes, in place."""
    for section, keys in SIZE_KEYS.items():
        table = data.get(section)
        if not isinstance(table, dict):
            continue
        for key in keys:
            value = table.get(key)
            if isinstance(value, str):
                try:
                    table[key] = parse_size(value)
                except ValueError:
                    raise ConfigError(section, key, value, "is not a size (examples: 1048576, 512KiB, 10MiB, 2GiB)") from None


_SECTIONS: dict[str, Any] = {
    "server": ServerConfig, "queues": QueueDefaults, "admin": AdminConfig, "udp": UdpConfig,
    "metrics": MetricsConfig, "auth": AuthConfig, "tls": TlsConfig, "storage": StorageConfig,
}
"""The sections `_section` builds (all but [credit], checked by its policy)."""


def load_config(path: Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> BrokerConfig:
    """Embedded defaults, then the TOML file if given, then overrides (from the command line)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("file", str(path), None, f"not valid TOML: {exc}", where=str(path)) from None
        except UnicodeDecodeError as exc:
            raise ConfigError("file", str(path), None, f"not UTF-8, as TOML must be: byte {exc.object[exc.start]:#04x} "
                              f"at offset {exc.start}", where=str(path)) from None
        except OSError as exc:
            raise ConfigError("file", str(path), None, f"cannot be read: {exc.strerror}", where=str(path)) from None
    for section in data:
        if section not in _SECTIONS and section != "credit":
            if not isinstance(data[section], dict):  # `port = 5680` above every [section]
                raise ConfigError(section, "*", None, "a key outside any section: every key belongs under a "
                                  "[section] (docs/configuration.md)", where=f"{section} = {data[section]!r}")
            raise ConfigError(section, "*", None, "unknown section; known: admin, auth, credit, metrics, queues, "
                                                  "server, storage, tls, udp", where=f"[{section}]")
        if not isinstance(data[section], dict):
            raise ConfigError(section, "*", data[section], "must be a table")
    # A key of the file a flag overrides is still checked, section by section: an out-of-range value in
    # the file stops the broker whatever flags are given (`port = 70000` beside --port started it, a tester).
    replaced = {section for section, values in (overrides or {}).items()
                if section in _SECTIONS and any(v is not None and k in data.get(section, {}) for k, v in values.items())}
    if replaced:
        as_filed = {section: dict(data[section]) for section in replaced}
        _parse_sizes(as_filed)
        for section in replaced:
            _section(_SECTIONS[section], section, as_filed[section]).validate()
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    _parse_sizes(data)
    server = _section(ServerConfig, "server", data.get("server", {}))
    queues = _section(QueueDefaults, "queues", data.get("queues", {}))
    admin = _section(AdminConfig, "admin", data.get("admin", {}))
    udp = _section(UdpConfig, "udp", data.get("udp", {}))
    metrics = _section(MetricsConfig, "metrics", data.get("metrics", {}))
    auth = _section(AuthConfig, "auth", data.get("auth", {}))
    tls = _section(TlsConfig, "tls", data.get("tls", {}))
    storage = _section(StorageConfig, "storage", data.get("storage", {}))
    credit = data.get("credit", {})
    if not isinstance(credit, dict):
        raise ConfigError("credit", "*", credit, "must be a table")
    if "policy" in credit:
        credit = {**credit, "policy": str(credit["policy"])}
    return BrokerConfig(server, queues, dict(credit), admin, udp, metrics, auth, tls, storage).validate()
