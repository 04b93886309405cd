"""TLS on the client port: the server's SSL context from [tls], and who a client certificate names.

trio's SSLStream does the work; the connection handler already serves any stream (broker/streamio.py),
so TLS costs the plain port nothing: its sockets keep the direct write path, TLS ones use StreamIO.
The TLS handshake happens inside the first read, so it runs under the connection's handshake_timeout.
"""

from __future__ import annotations

import ssl
from typing import Any

from flowbroker.broker.config import ConfigError, TlsConfig

__all__ = ["server_context", "certificate_identity"]

_VERIFY = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def server_context(config: TlsConfig) -> ssl.SSLContext:
    """The context for the TLS listener; ConfigError naming the file that cannot be loaded."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.cert_file, config.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("tls", "cert_file", config.cert_file, f"cannot load it with key_file: {exc}") from None
    context.verify_mode = _VERIFY[config.verify_client]
    if config.ca_file:
        try:
            context.load_verify_locations(config.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("tls", "ca_file", config.ca_file, f"cannot load it: {exc}") from None
    return context


def certificate_identity(peercert: dict[str, Any] | None) -> str | None:
    """The subject's common name of a verified client certificate (`getpeercert()`), else None."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and isinstance(value, str) and value:
                return value
    return None
