"""Aeron channel URIs: ``aeron:udp?endpoint=host:port|control=host:port|mtu=1408|...``.

Parsed once into a frozen ``ChannelUri`` that carries the driver defaults (aeron-wire.md section 3) so the
publication, image and socket code read plain fields. Parameters are separated by ``|`` as in Aeron. A bad
URI raises ``ChannelUriError`` naming the parameter at fault; unknown parameters are rejected too (a typo
such as ``endpont`` would otherwise silently fall back to a default).

Addressing modes (the protocol spec's "Aeron over UDP"):

* **unicast**: ``endpoint`` is the subscription's address; the publication sends data there and gets SMs and
  NAKs back at its own (possibly ephemeral) source address.
* **multicast**: ``endpoint`` is an odd IPv4 group address (or IPv6 multicast); data goes to it, control
  (SMs, NAKs) to the next address up (``224.10.9.7`` -> ``224.10.9.8``), same port. ``interface`` picks
  the local interface, ``ttl`` the hop limit.
* **multi-destination-cast**: the publication has ``control`` (its control address) and
  ``control-mode=manual`` (destinations added by the application) or ``dynamic`` (subscriptions, whose URIs
  carry the same ``control``, announce themselves with SETUP-eliciting SMs).

``aeron:ipc`` is rejected: this transport has no shared-memory media; in-process delivery is the broker's job.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from flowbroker.transport.errors import ChannelUriError
from flowbroker.transport.flow_control import parse_duration_ns, parse_flow_control_param
from flowbroker.transport.frames import FRAME_ALIGNMENT, MAX_MTU, MIN_MTU
from flowbroker.transport.positions import (
    TERM_MAX_LENGTH,
    TERM_MIN_LENGTH,
    is_valid_term_length,
    term_count,
)

__all__ = [
    "AERON_PREFIX",
    "DEFAULT_LINGER_NS",
    "DEFAULT_MAX_RESEND",
    "DEFAULT_MTU",
    "DEFAULT_NAK_DELAY_NS",
    "DEFAULT_RECEIVER_WINDOW",
    "DEFAULT_SO_RCVBUF",
    "DEFAULT_TERM_LENGTH",
    "DEFAULT_TTL",
    "MAX_RESEND_LIMIT",
    "ChannelUri",
    "CongestionControlName",
    "ControlMode",
    "Endpoint",
    "InterfaceSpec",
    "parse_aeron_size",
    "parse_channel",
]

AERON_PREFIX: Final = "aeron:"
DEFAULT_MTU: Final = 1408
DEFAULT_TERM_LENGTH: Final = 16 * 1024 * 1024
DEFAULT_RECEIVER_WINDOW: Final = 128 * 1024
DEFAULT_SO_RCVBUF: Final = 128 * 1024
DEFAULT_TTL: Final = 0
DEFAULT_LINGER_NS: Final = 5_000_000_000
DEFAULT_NAK_DELAY_NS: Final = 100_000
DEFAULT_MAX_RESEND: Final = 16
MAX_RESEND_LIMIT: Final = 256

_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_SIZE: Final = re.compile(r"^(\d+)([kKmMgG]?)$")
_SIZE_UNITS: Final = {"": 1, "k": 1024, "m": 1024 * 1024, "g": 1024 * 1024 * 1024}
_HOST_PORT: Final = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]/]+)):(?P<port>\d+)$")
_HOSTNAME: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9\-]{0,62}))*\.?$")


class ControlMode(enum.Enum):
    MANUAL = "manual"
    DYNAMIC = "dynamic"


class CongestionControlName(enum.Enum):
    STATIC = "static"
    CUBIC = "cubic"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A host (IP literal or name, unresolved) and UDP port."""

    host: str
    port: int

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The address if ``host`` is an IP literal, else None (a name to resolve at bind time)."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    @property
    def is_multicast(self) -> bool:
        ip = self.ip
        return ip is not None and ip.is_multicast

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class InterfaceSpec:
    """``interface=addr[:port][/prefix]``: the local address to bind or send multicast from."""

    host: str
    port: int | None = None
    prefix_length: int | None = None

    def __str__(self) -> str:
        text = f"[{self.host}]" if ":" in self.host and self.port is not None else self.host
        if self.port is not None:
            text += f":{self.port}"
        if self.prefix_length is not None:
            text += f"/{self.prefix_length}"
        return text


@dataclass(frozen=True, slots=True)
class ChannelUri:
    """A parsed ``aeron:udp`` channel with defaults filled in (``params`` keeps what was written)."""

    endpoint: Endpoint | None = None
    control: Endpoint | None = None
    control_mode: ControlMode | None = None
    interface: InterfaceSpec | None = None
    ttl: int = DEFAULT_TTL
    mtu: int = DEFAULT_MTU
    term_length: int = DEFAULT_TERM_LENGTH
    session_id: int | None = None
    rcv_wnd: int | None = None
    fc: str | None = None
    cc: CongestionControlName = CongestionControlName.STATIC
    gtag: int | None = None
    init_term_id: int | None = None
    term_id: int | None = None
    term_offset: int | None = None
    so_rcvbuf: int = DEFAULT_SO_RCVBUF
    so_sndbuf: int = 0
    linger_ns: int = DEFAULT_LINGER_NS
    nak_delay_ns: int = DEFAULT_NAK_DELAY_NS
    max_resend: int = DEFAULT_MAX_RESEND
    pub_wnd: int | None = None
    reliable: bool = True
    eos: bool = True
    tether: bool = True
    rejoin: bool = True
    sparse: bool = True
    alias: str | None = None
    params: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    # ------------------------------------------------------------------ addressing

    @property
    def is_multicast(self) -> bool:
        return self.endpoint is not None and self.endpoint.is_multicast

    @property
    def is_multi_destination(self) -> bool:
        """Multi-destination-cast: a control-mode was given (a publication that manages destinations)."""
        return self.control_mode is not None

    @property
    def is_unicast(self) -> bool:
        return not self.is_multicast and not self.is_multi_destination

    @property
    def has_explicit_control(self) -> bool:
        return self.control is not None

    @property
    def data_endpoint(self) -> Endpoint | None:
        """Where data frames go (publication) / arrive (subscription)."""
        return self.endpoint

    @property
    def control_endpoint(self) -> Endpoint | None:
        """Where SMs and NAKs go: the next-even group for multicast, else the explicit ``control``."""
        if self.is_multicast and self.endpoint is not None:
            ip = self.endpoint.ip
            assert ip is not None
            return Endpoint(str(ip + 1), self.endpoint.port)
        return self.control

    # ------------------------------------------------------------------ derived settings

    @property
    def receiver_window(self) -> int:
        """Static-window receiver window: ``min(rcv-wnd or 128 KiB, term_length / 2)``."""
        return min(self.rcv_wnd or DEFAULT_RECEIVER_WINDOW, self.term_length // 2)

    @property
    def publication_window(self) -> int:
        """How far a publication may run ahead of its sender: ``pub-wnd`` or term_length / 2."""
        return min(self.pub_wnd or self.term_length // 2, self.term_length // 2)

    @property
    def has_initial_position(self) -> bool:
        return self.init_term_id is not None

    def __str__(self) -> str:
        return "aeron:udp?" + "|".join(f"{k}={v}" for k, v in self.params)


# ---------------------------------------------------------------------------------------------- parsing


def parse_aeron_size(text: str) -> int:
    """Aeron's size syntax in a channel URI: digits with an optional k/m/g (binary) suffix, nothing else.

    Not the broker's ``parse_size`` (``flowbroker.broker.config``, which also takes "1.5GiB", KiB/MiB/TiB
    and a B suffix) on purpose: a channel URI must mean the same to the real Aeron driver
    (``SystemUtil.parseSize``), so what Aeron would refuse is refused here too, and a URI that works
    against our transport works against theirs."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a size (<int>[k|m|g])")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def _parse_endpoint(text: str, allow_port_zero: bool = True) -> Endpoint:
    match = _HOST_PORT.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not host:port (IPv6 as [addr]:port)")
    port = int(match.group("port"))
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    v6 = match.group("v6")
    if v6 is not None:
        try:
            return Endpoint(str(ipaddress.IPv6Address(v6)), port)
        except ValueError:
            raise ValueError(f"{v6!r} is not an IPv6 address") from None
    host = match.group("host")
    if re.fullmatch(r"[\d.]+", host):
        try:
            return Endpoint(str(ipaddress.IPv4Address(host)), port)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address") from None
    if not _HOSTNAME.match(host):
        raise ValueError(f"{host!r} is not a host name")
    return Endpoint(host, port)


def _parse_interface(text: str) -> InterfaceSpec:
    base, slash, prefix_text = text.partition("/")
    prefix: int | None = None
    if slash:
        if not prefix_text.isdigit():
            raise ValueError(f"prefix {prefix_text!r} is not a number")
        prefix = int(prefix_text)
    if _HOST_PORT.match(base):
        ep = _parse_endpoint(base)
        host, port = ep.host, ep.port
    else:
        host, port = base.strip("[]"), None
        if not host:
            raise ValueError("missing address")
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
        if not _HOSTNAME.match(host):
            raise ValueError(f"{host!r} is not an address or host name") from None
    if prefix is not None:
        max_prefix = 128 if isinstance(ip, ipaddress.IPv6Address) else 32
        if prefix > max_prefix:
            raise ValueError(f"prefix /{prefix} is longer than {max_prefix}")
    return InterfaceSpec(str(ip) if ip is not None else host, port, prefix)


def _parse_int(text: str, low: int, high: int) -> int:
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if not low <= value <= high:
        raise ValueError(f"{value} is out of range [{low}, {high}]")
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    raise ValueError(f"{text!r} is not true or false")


_KNOWN: Final = frozenset({
    "endpoint", "control", "control-mode", "interface", "ttl", "mtu", "term-length", "session-id",
    "rcv-wnd", "fc", "cc", "gtag", "init-term-id", "term-id", "term-offset", "so-rcvbuf", "so-sndbuf",
    "linger", "nak-delay", "max-resend", "pub-wnd", "reliable", "eos", "tether", "rejoin", "sparse", "alias",
})


def parse_channel(uri: str) -> ChannelUri:
    """Parse an ``aeron:udp?...`` channel; raise ChannelUriError naming the bad part."""

    def fail(part: str, problem: str) -> ChannelUriError:
        return ChannelUriError(uri, part, problem)

    if not isinstance(uri, str):
        raise ChannelUriError(repr(uri), "uri", "must be a string")
    if not uri.startswith(AERON_PREFIX):
        raise fail("scheme", "must start with 'aeron:' (e.g. aeron:udp?endpoint=host:port)")
    media, _, query = uri[len(AERON_PREFIX):].partition("?")
    if media == "ipc":
        raise fail("media", "'ipc' is not supported, only 'udp' (this transport has no shared-memory media)")
    if media != "udp":
        raise fail("media", f"{media!r} is not supported, only 'udp'")
    if not query:
        raise fail("endpoint", "aeron:udp needs an endpoint or control parameter")

    raw: dict[str, str] = {}
    order: list[tuple[str, str]] = []
    for segment in query.split("|"):
        key, eq, value = segment.partition("=")
        key = key.strip()
        if not eq or not key:
            raise fail(segment or "|", "expected key=value")
        if key not in _KNOWN:
            raise fail(key, "unknown parameter")
        if key in raw:
            raise fail(key, "given more than once")
        if value.strip() == "":
            raise fail(key, "empty value")
        raw[key] = value
        order.append((key, value))

    values: dict[str, object] = {}

    def parse(key: str, fn: Callable[[str], object]) -> None:
        if key in raw:
            try:
                values[key.replace("-", "_")] = fn(raw[key])
            except ValueError as exc:
                raise fail(f"{key}={raw[key]}", str(exc)) from None

    parse("endpoint", _parse_endpoint)
    parse("control", _parse_endpoint)
    parse("control-mode", _parse_control_mode)
    parse("interface", _parse_interface)
    parse("ttl", lambda t: _parse_int(t, 0, 255))
    parse("mtu", _parse_mtu)
    parse("term-length", _parse_term_length)
    parse("session-id", lambda t: _parse_int(t, _INT32_MIN, _INT32_MAX))
    parse("rcv-wnd", lambda t: _positive_size(t, "receiver window"))
    parse("fc", _parse_fc)
    parse("cc", _parse_cc)
    parse("gtag", lambda t: _parse_int(t, _INT64_MIN, _INT64_MAX))
    parse("init-term-id", lambda t: _parse_int(t, _INT32_MIN, _INT32_MAX))
    parse("term-id", lambda t: _parse_int(t, _INT32_MIN, _INT32_MAX))
    parse("term-offset", lambda t: _parse_int(t, 0, TERM_MAX_LENGTH))
    parse("so-rcvbuf", lambda t: _positive_size(t, "socket buffer"))
    parse("so-sndbuf", lambda t: _positive_size(t, "socket buffer"))
    parse("linger", parse_duration_ns)
    parse("nak-delay", parse_duration_ns)
    parse("max-resend", lambda t: _parse_int(t, 1, MAX_RESEND_LIMIT))
    parse("pub-wnd", lambda t: _positive_size(t, "publication window"))
    for flag in ("reliable", "eos", "tether", "rejoin", "sparse"):
        parse(flag, _parse_bool)
    if "alias" in raw:
        values["alias"] = raw["alias"]
    if "linger" in values:
        values["linger_ns"] = values.pop("linger")
    if "nak_delay" in values:
        values["nak_delay_ns"] = values.pop("nak_delay")

    channel = ChannelUri(params=tuple(order), **values)  # type: ignore[arg-type]
    _check_combination(channel, raw, uri)
    return channel


def _parse_control_mode(text: str) -> ControlMode:
    try:
        return ControlMode(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not manual or dynamic") from None


def _parse_cc(text: str) -> CongestionControlName:
    try:
        return CongestionControlName(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not static or cubic") from None


def _parse_mtu(text: str) -> int:
    mtu = parse_aeron_size(text)
    if not MIN_MTU <= mtu <= MAX_MTU or mtu % FRAME_ALIGNMENT:
        raise ValueError(f"{mtu} must be a multiple of {FRAME_ALIGNMENT} in [{MIN_MTU}, {MAX_MTU}]")
    return mtu


def _parse_term_length(text: str) -> int:
    length = parse_aeron_size(text)
    if not is_valid_term_length(length):
        raise ValueError(f"{length} must be a power of two in [{TERM_MIN_LENGTH}, {TERM_MAX_LENGTH}]")
    return length


def _positive_size(text: str, what: str) -> int:
    size = parse_aeron_size(text)
    if size <= 0 or size > _INT32_MAX:
        raise ValueError(f"{what} {size} must be in [1, {_INT32_MAX}]")
    return size


def _parse_fc(text: str) -> str:
    params = parse_flow_control_param(text)
    if params.name not in ("max", "min", "tagged"):
        raise ValueError(f"strategy {params.name!r} is not max, min or tagged")
    if params.name == "max" and (params.receiver_timeout_ns is not None or params.group_tag is not None
                                 or params.group_min_size is not None):
        raise ValueError("max takes no options")
    return text


def _check_combination(channel: ChannelUri, raw: dict[str, str], uri: str) -> None:
    def error(part: str, problem: str) -> ChannelUriError:
        return ChannelUriError(uri, part, problem)

    if channel.endpoint is None and channel.control is None and channel.control_mode is None:
        raise error("endpoint", "aeron:udp needs an endpoint or control parameter")
    if channel.control_mode is ControlMode.DYNAMIC and channel.control is None:
        raise error("control-mode=dynamic", "needs a control=host:port for receivers to announce themselves")
    ep = channel.endpoint
    if ep is not None and ep.is_multicast:
        ip = ep.ip
        assert ip is not None
        if isinstance(ip, ipaddress.IPv4Address) and int(ip) % 2 == 0:
            raise error(f"endpoint={raw['endpoint']}",
                        "multicast data address must be odd (control uses the next even address)")
        if isinstance(ip, ipaddress.IPv6Address) and int(ip) % 2 == 0:
            raise error(f"endpoint={raw['endpoint']}",
                        "multicast data address must be odd (control uses the next even address)")
        if ep.port == 0:
            raise error(f"endpoint={raw['endpoint']}", "a multicast endpoint needs a port")
        if channel.control_mode is not None:
            raise error("control-mode", "multi-destination-cast cannot use a multicast endpoint")
    if channel.control is not None and channel.control.is_multicast:
        raise error(f"control={raw['control']}", "control must be a unicast address")
    pinned = [k for k in ("init-term-id", "term-id", "term-offset") if k in raw]
    if pinned and len(pinned) != 3:
        missing = sorted({"init-term-id", "term-id", "term-offset"} - set(pinned))
        raise error(pinned[0], f"init-term-id, term-id and term-offset go together (missing {', '.join(missing)})")
    if pinned:
        assert channel.init_term_id is not None and channel.term_id is not None
        assert channel.term_offset is not None
        if term_count(channel.term_id, channel.init_term_id) < 0:
            raise error(f"term-id={raw['term-id']}", "is before init-term-id")
        if channel.term_offset > channel.term_length or channel.term_offset % FRAME_ALIGNMENT:
            raise error(f"term-offset={raw['term-offset']}",
                        f"must be a multiple of {FRAME_ALIGNMENT} no greater than the term length")
    if channel.rcv_wnd is not None and channel.rcv_wnd < channel.mtu:
        raise error(f"rcv-wnd={raw['rcv-wnd']}", f"is smaller than the mtu {channel.mtu}")
