"""Broker URLs: `flowbroker://host:port` (`flowbroker+tls://host:port` over TLS), optionally `?udp=host:port`.

A URL rather than (host, port) arguments so that configuration files, environment variables and Spark
options can carry one string. The scheme, host and port mean something, and one query parameter, `udp`:
the broker's UDP endpoint for UDP producers when it is not the one the broker announces (a broker behind
NAT). The parser refuses the rest instead of silently ignoring it, so a typo in a URL fails at connect
time, not in production.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

__all__ = ["BrokerAddress", "parse_url", "DEFAULT_URL", "DEFAULT_HOST", "DEFAULT_PORT", "SCHEME", "TLS_SCHEME",
           "DEFAULT_TLS_PORT"]

SCHEME = "flowbroker"
TLS_SCHEME = "flowbroker+tls"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5680
DEFAULT_TLS_PORT = 5671  # [tls] port's default
DEFAULT_URL = f"{SCHEME}://{DEFAULT_HOST}:{DEFAULT_PORT}"


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    host: str
    port: int
    udp: str | None = None  # the `udp` query: the broker's UDP endpoint as host:port
    tls: bool = False  # flowbroker+tls://

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = TLS_SCHEME if self.tls else SCHEME
        return f"{scheme}://{host}:{self.port}" + (f"?udp={self.udp}" if self.udp else "")


def parse_url(url: str = DEFAULT_URL) -> BrokerAddress:
    """Parse `flowbroker://host[:port]` or `flowbroker+tls://host[:port]`; a missing host or port takes
    the default (5680, or 5671 over TLS).

    Raises ValueError for another scheme, a bad port, or a path, query, fragment or credentials
    (credentials belong in the `auth` argument, not in a URL that ends up in logs).
    """
    parts = urlsplit(url)
    if parts.scheme not in (SCHEME, TLS_SCHEME):
        raise ValueError(f"{url!r}: the scheme must be {SCHEME}:// or {TLS_SCHEME}://")
    tls = parts.scheme == TLS_SCHEME
    if parts.path not in ("", "/") or parts.fragment:
        raise ValueError(f"{url!r}: a broker URL has no path or fragment")
    udp = _udp_query(url, parts.query)
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{url!r}: pass credentials with auth=, not in the URL")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    default_port = DEFAULT_TLS_PORT if tls else DEFAULT_PORT
    return BrokerAddress(parts.hostname or DEFAULT_HOST, default_port if port is None else port, udp, tls)


def _udp_query(url: str, query: str) -> str | None:
    """The `udp=host:port` query, checked; ValueError for any other query."""
    if not query:
        return None
    try:
        params = parse_qs(query, strict_parsing=True)
    except ValueError:
        raise ValueError(f"{url!r}: the query must be udp=HOST:PORT") from None
    if set(params) != {"udp"} or len(params["udp"]) != 1:
        raise ValueError(f"{url!r}: the only query a broker URL takes is udp=HOST:PORT")
    return check_udp_endpoint(params["udp"][0], f"{url!r}: udp")


def check_udp_endpoint(value: str, name: str) -> str:
    """`value` if it is HOST:PORT with a port in [1, 65535], else ValueError naming it `name`: the URL's
    `udp` query and a UDP producer's `udp_endpoint` are checked alike, when given, not at first use."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{name}={value!r} must be HOST:PORT with a port in [1, 65535]")
    return value
