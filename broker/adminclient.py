"""The admin HTTP API as the `flowbroker` management commands see it: requests with the standard
library (they should start fast), the token, pages, and every failure as one readable line (a
ClickException): a refused connection named as such, and a peer that is not the admin API (the
broker port, which answers HTTP with a 400 naming the admin API) said to be so."""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from flowbroker.broker.cliformat import printable
from flowbroker.broker.config import DEFAULT_TOKEN_FILE, token_file_for

__all__ = ["AdminClient", "DEFAULT_ADMIN_URL", "PAGE_SIZE", "TOKEN_ENV"]

BROKER_PORT_ANSWER = "This is the flowbroker broker port"
"""How the broker's HTTP 400 to a request on its protocol port begins (broker/server.py)."""

DEFAULT_ADMIN_URL = "http://127.0.0.1:5681"
TOKEN_ENV = "FLOWBROKER_ADMIN_TOKEN"
PAGE_SIZE = 1000
"""Objects asked for per request when listing: the admin API's maximum `limit`."""
BUSY_RETRY_SECONDS = 30.0
"""How long a request refused because the admin port has `max_connections` open is tried again, once a
`Retry-After` (1 s): such a refusal comes before the request is read, so any request may be sent again.
`flowbroker top` ended at the first one, the moment an operator watches (a tester)."""


class AdminClient:
    """The admin API over HTTP with the standard library; every failure is a ClickException.

    The token comes from `token_file` when one is given (--token-file, FLOWBROKER_ADMIN_TOKEN_FILE),
    else from FLOWBROKER_ADMIN_TOKEN, else from the file a broker without a configured token writes
    for the admin port the URL names (DEFAULT_TOKEN_FILE with `{port}` replaced).
    Never from the command line, where `ps` shows it to every user of the host."""

    def __init__(self, url: str, token_file: str | None, timeout: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        if "://" not in url:  # "127.0.0.1:5681" is meant as http://127.0.0.1:5681, not a URL scheme
            url = "http://" + url
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._sleep, self._clock = sleep, clock
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https"):
            raise click.ClickException(
                f"--admin-url {printable(url)}: the admin API is http:// or https:// (e.g. {DEFAULT_ADMIN_URL})")
        try:
            self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        except ValueError:
            raise click.ClickException(f"--admin-url {printable(url)}: the port is not a number") from None
        self.token: str | None = None
        self._told_busy = False  # the admin port's 503 was said on stderr (once: `top` asks every second)
        self._no_token = ""  # why there is none: said once the URL has been seen to be the admin API
        from_env = os.environ.get(TOKEN_ENV, "").strip()
        if token_file is None and from_env:
            self.token, self.token_source = from_env, TOKEN_ENV
            return
        path = Path(token_file).expanduser() if token_file else token_file_for(DEFAULT_TOKEN_FILE, self.port)
        self.token_source = str(path)
        try:
            self.token = path.read_text().strip()
        except OSError as exc:
            if token_file:  # the file given cannot be read: say that, not to give one (a tester)
                self._no_token = (f"no admin token: the token file given (--token-file or "
                                  f"FLOWBROKER_ADMIN_TOKEN_FILE) cannot be read: {printable(path)}: "
                                  f"{exc.strerror or exc}")
            else:
                self._no_token = (f"no admin token: set {TOKEN_ENV} or pass --token-file, or run where the broker "
                                  f"wrote its generated token ({printable(path)}: {exc.strerror or exc})")
            return
        if not self.token:
            self.token, self._no_token = None, f"no admin token: {printable(path)} is empty"

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request; JSON object in, JSON object out. Without a token it is still sent (without
        credentials), so that a wrong port or a broker that is not running is named as such, not as a
        missing token; the admin API's 401 to it is then the token's error."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        busy_until = self._clock() + BUSY_RETRY_SECONDS
        while True:
            try:
                return self._answer(self._send(req))
            except _Busy as busy:
                if self._clock() + busy.retry_after > busy_until:
                    raise click.ClickException(f"{busy.description} (tried for {BUSY_RETRY_SECONDS:g} s)") from None
                if not self._told_busy:  # said once, on stderr: it printed nothing for 30 s (a tester)
                    self._told_busy = True
                    click.echo(f"{busy.description}; trying again for up to {BUSY_RETRY_SECONDS:g} s", err=True)
                self._sleep(busy.retry_after)

    def _send(self, req: urllib.request.Request) -> bytes:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw: bytes = resp.read()
                return raw
        except urllib.error.HTTPError as exc:
            with exc:
                body = exc.read()
                description = self._describe(exc.code, body)
                if exc.code == 503 and exc.headers.get("content-type", "").startswith("text/plain"):
                    # the port's own refusal (broker/httpserve.py), not an API answer (503 not_on_disk_yet
                    # is JSON: that change was made, and is not to be sent again)
                    raise _Busy(description, _retry_after(exc.headers.get("retry-after"))) from None
            if self.token is None and exc.code in (401, 403) and not description.startswith(self.url):
                raise click.ClickException(self._no_token) from None
            raise click.ClickException(description) from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or exc.reason or type(exc.reason).__name__
            hint = ("this port speaks plain HTTP, as the broker's admin API does: give an http:// URL (https:// is "
                    "for a TLS proxy in front of it)" if "WRONG_VERSION_NUMBER" in str(reason)
                    else "is the broker running with its admin API on?")
            raise click.ClickException(f"cannot reach the admin API at {self.url}: {reason} ({hint})") from None
        except http.client.HTTPException as exc:  # BadStatusLine, RemoteDisconnected: a peer that is not HTTP
            raise click.ClickException(
                f"{self.url} did not answer in HTTP ({type(exc).__name__}): it is not the admin API; is it the "
                f"broker port? The admin (HTTP) API listens on port 5681 unless [admin] port says otherwise "
                f"(--admin-url, FLOWBROKER_ADMIN_URL)"
            ) from None
        except TimeoutError as exc:  # (a bare "timed out" said nothing of what to check, a tester)
            raise click.ClickException(
                f"admin API at {self.url}: {exc}: something accepted the connection but did not answer in HTTP; "
                "is it the broker's admin port (5681 unless [admin] port says otherwise; --admin-url, "
                "FLOWBROKER_ADMIN_URL), and is that broker responsive?") from None
        except OSError as exc:
            raise click.ClickException(f"admin API at {self.url}: {exc}") from None

    def _answer(self, raw: bytes) -> dict[str, Any]:
        try:
            answer = json.loads(raw)
        except ValueError:
            raise click.ClickException(f"admin API at {self.url} answered something that is not JSON") from None
        if not isinstance(answer, dict):
            raise click.ClickException(f"admin API at {self.url} answered an unexpected {type(answer).__name__}")
        return answer

    def _describe(self, status: int, raw: bytes) -> str:
        try:
            error = json.loads(raw)["error"]
            message = f"{error['message']}"
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:400].strip() or "no details"
            if message.startswith(BROKER_PORT_ANSWER):  # the broker's answer to HTTP on its own port
                return f"{self.url} is the flowbroker broker port, not its admin API: {printable(message)}"
        text = f"admin API: HTTP {status}: {printable(message, backslash=False)}"
        if status in (401, 403):
            text += f" (token from {printable(self.token_source)})"
        return text

    def pages(self, path: str, key: str, after: str | None, limit: int,
              params: dict[str, str] | None = None) -> Iterator[tuple[list[dict[str, Any]], Any]]:
        """Follow the API's cursor: (objects, next cursor) for each page of `path`'s list `key`,
        from after `after` (the start when None), until the end or `limit` objects (0: no limit);
        `params` go with every request. The last cursor is where a later `--after` would go on (None:
        nothing is left)."""
        cursor: Any = after
        remaining = limit
        while True:
            query: dict[str, Any] = {**(params or {}), "limit": min(PAGE_SIZE, remaining) if limit else PAGE_SIZE}
            if cursor is not None:
                query["after"] = cursor
            answer = self.request("GET", f"{path}?{urllib.parse.urlencode(query)}")
            items, cursor = answer[key], answer.get("next")
            yield items, cursor
            remaining -= len(items)
            if cursor is None or (limit and remaining <= 0):
                return


class _Busy(Exception):
    """The admin port refused the connection: `max_connections` are open."""

    def __init__(self, description: str, retry_after: float):
        super().__init__(description)
        self.description = description
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float:
    """A Retry-After in seconds, between 0.1 and 5 (1 when absent or not a number)."""
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        seconds = 1.0
    return min(5.0, max(0.1, seconds)) if seconds == seconds else 1.0
