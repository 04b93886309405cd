"""A loopback HTTP port answers only requests addressed to a loopback name: DNS rebinding.

A page on another site can point a name it controls at 127.0.0.1 after the browser looked it up once, and
its scripts then read the admin port as their own origin: a tester's page read all of /metrics (queue,
client and user names) that way, and could try /login guesses. The browser sends that name in `Host`,
so a port listening on a loopback address refuses a request whose `Host` is not `localhost` (or a
`*.localhost` name, which browsers keep on loopback) or a loopback address, with `421 Misdirected
Request`. A port listening on other addresses (a container's, `0.0.0.0`) is reached by names of its
own, which the broker cannot know: it is left alone, and its protection is the network it is on
(docs/security.md). Requests without `Host` (HTTP/1.0 tools) go through.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["LoopbackHostOnly", "is_loopback_host"]


def is_loopback_host(host: str) -> bool:
    """`localhost`, a `*.localhost` name or a loopback address (with or without IPv6 brackets)."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: bytes) -> str:
    """The host part of a Host header: `[::1]:5681` -> `::1`, `localhost:5681` -> `localhost`."""
    text = value.decode("latin-1").strip()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class LoopbackHostOnly:
    """ASGI middleware for an app served on a loopback address (see the module docstring)."""

    def __init__(self, app: ASGIApp, what: str):
        self.app = app
        self.what = what  # "[admin] port 5681", for the answer's text

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((value for name, value in scope["headers"] if name == b"host"), None)
            if host is not None and not is_loopback_host(_host_name(host)):
                body: dict[str, Any] = {"error": {
                    "code": "host_not_allowed",
                    "message": f"{self.what} listens on a loopback address and answers requests for localhost "
                               "or a loopback address only: a name that points here from elsewhere is DNS "
                               "rebinding, or a proxy that should pass Host: localhost",
                }}
                await JSONResponse(body, status_code=421)(scope, receive, send)
                return
        await self.app(scope, receive, send)
