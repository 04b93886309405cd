"""Broker URLs: `flowbroker://host:port`.

A URL rather than (host, port) arguments so that configuration files, environment variables and Spark
options can carry one string. Only the scheme, host and port mean anything today; the parser refuses
the rest instead of silently ignoring it, so a typo in a URL fails at connect time, not in production.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["BrokerAddress", "parse_url", "DEFAULT_URL", "DEFAULT_HOST", "DEFAULT_PORT", "SCHEME"]

SCHEME = "flowbroker"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5680
DEFAULT_URL = f"{SCHEME}://{DEFAULT_HOST}:{DEFAULT_PORT}"


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}://{host}:{self.port}"


def parse_url(url: str = DEFAULT_URL) -> BrokerAddress:
    """Parse `flowbroker://host[:port]`; a missing host or port takes the default.

    Raises ValueError for another scheme, a bad port, or a path, query, fragment or credentials
    (credentials belong in the `auth` argument, not in a URL that ends up in logs).
    """
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise ValueError(f"{url!r}: the scheme must be {SCHEME}://")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a broker URL has no path, query or fragment")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{url!r}: pass credentials with auth=, not in the URL")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    return BrokerAddress(parts.hostname or DEFAULT_HOST, DEFAULT_PORT if port is None else port)
