"""The web console on the admin port (docs/console.md): a login page, browser sessions, and the static
files of a plain-JS page that polls the JSON API every second.

Why a server-side session map and not an HMAC of the token in the cookie: logging out must end the
session for good (an HMAC cookie stays valid until the token itself changes, so a copied cookie would
outlive the logout), and a random id says nothing about the token. The map is bounded (MAX_SESSIONS,
whoever holds the most giving way first) and every entry expires (SESSION_SECONDS), so logging in over
and over cannot grow the broker. Each session carries a second random value, answered by POST /login
alone and kept by the page in its origin's localStorage, required in `X-Flowbroker-CSRF` on every
request made with the cookie, reads included. Why both: the cookie is HttpOnly (no script reads it)
and SameSite=Strict, but a browser sends it to every port of the host, so another server there would
get it; the header value never leaves the page's own origin (scheme, host and port), and no request
the browser makes by itself carries it (it also stops another site driving the API, as a CSRF token).

The console itself holds no history: its charts are kept by the page from the polls, so the broker
does nothing for a console it would not do for `flowbroker queues`.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time

from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from importlib import resources

import trio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Scope

from flowbroker.broker.accept import RateLimitedLog
from flowbroker.broker.adminusers import AdminUsers, LoginRefused, LoginThrottled, peer_address
from flowbroker.broker.logsafe import logsafe

__all__ = [
    "BodyRefused",
    "COOKIE",
    "CSRF_HEADER",
    "PUBLIC_PATHS",
    "SessionStore",
    "console_routes",
    "cookie_name",
    "read_body",
    "session_id",
]

LOGGER = logging.getLogger("flowbroker.broker.console")
# An address whose failures put its turn past failed_login_max_delay is refused unlooked, as fast as it
# asks: logged once per 10 s with the count (a flood of wrong passwords wrote 33,000 lines in 15 s).
_LOG_UNLOOKED = RateLimitedLog(LOGGER, logging.WARNING)

COOKIE = "flowbroker_session"
"""The session cookie's name, followed by `_<admin port>` (cookie_name): a browser keeps one cookie per
name and host whatever the port, so two brokers on one host would otherwise log each other out."""
CSRF_HEADER = "x-flowbroker-csrf"
MAX_SESSIONS = 64
"""Browser sessions kept at once; a 65th login ends the oldest."""
MAX_LOGIN_BODY = 4096
"""POST /login's body, in bytes: a token or a user's name and password."""
SESSION_SECONDS = 8 * 3600
"""A session ends this long after login, used or not: log in again after a working day."""

STATIC = "/console/"
STATIC_FILES: dict[str, str] = {
    # name in broker/static/console/ -> content type; anything else under /console/ is a 404
    "console.html": "text/html; charset=utf-8",
    "login.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "login.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
PUBLIC_PATHS = frozenset({"/", "/login", STATIC + "login.js", STATIC + "console.css"})
"""What the admin app serves without a credential: the login page and its assets (`/` answers the
login page unless the request carries a valid session)."""

# The console's pages load only their own files and talk only to their own origin; no other site
# may frame them (the stop-all button must not be clickjacked).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True, slots=True)
class _Session:
    csrf: str
    expires: float
    read_only: bool = False  # at login; a user's session asks its user's tags again on every request
    who: str = ""  # the user, or "" for the admin token: whose rights, and whose sessions a full store ends first
    credential: str = ""  # the user's stored credential at login: a changed password (or a new user of that name) ends it


class SessionStore:
    """Browser sessions: random id -> CSRF value and expiry, at most `limit`. When full, a login ends the
    oldest session of whoever holds the most (its own, if that is the one logging in over and over): a
    monitoring user cannot log every administrator out by logging in 64 times.

    A user's session holds the user's name, not its rights: every look-up asks `users` (the users file,
    re-read when it changed) what the user may do now. A session fixed at login kept an administrator's
    rights after `flowbroker user delete` or a demotion to monitoring, while HTTP Basic lost them at once
    (a tester); the users file promises the open connections its new permissions within a second."""

    def __init__(self, limit: int = MAX_SESSIONS, lifetime: float = SESSION_SECONDS,
                 clock: Callable[[], float] = time.monotonic, users: AdminUsers | None = None):
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._limit = limit
        self._lifetime = lifetime
        self._clock = clock
        self._users = users

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, read_only: bool = False, who: str = "", credential: str = "") -> tuple[str, str]:
        """A new session for `who` (a user's name; "" for the admin token): (id for the cookie, CSRF value
        for the page)."""
        now = self._clock()
        for sid in [sid for sid, s in self._sessions.items() if s.expires <= now]:
            del self._sessions[sid]
        while len(self._sessions) >= self._limit:
            held = Counter(s.who for s in self._sessions.values())
            held[who] += 1  # the one logging in counts its new session: on a tie, its own oldest goes
            most = max(held.values())
            victim = next(sid for sid, s in self._sessions.items() if held[s.who] == most)
            del self._sessions[victim]
        sid, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        self._sessions[sid] = _Session(csrf, now + self._lifetime, read_only, who, credential)
        return sid, csrf

    def get(self, sid: str | None) -> tuple[str, bool] | None:
        """(CSRF value, read_only) of a live session, read_only as its user's tags are now; or None: no
        such session, or it expired, or its user was deleted or lost its admin tags (then it is ended)."""
        session = self._sessions.get(sid) if sid else None
        if sid is None or session is None:
            return None
        if session.expires <= self._clock():
            del self._sessions[sid]
            return None
        if not session.who or self._users is None:  # the admin token's session: the token does not change
            return session.csrf, session.read_only
        read_only = self._users.rights(session.who, session.credential or None)
        if read_only is None:
            del self._sessions[sid]
            LOGGER.warning("console: a session of user %s ended: the user was deleted, lost its admin tag or "
                           "had its password changed", logsafe(session.who))
            return None
        return session.csrf, read_only

    def read_only(self, sid: str | None) -> bool:
        live = self.get(sid)
        return live is not None and live[1]

    def csrf(self, sid: str | None) -> str | None:
        """The CSRF value of a live session, or None (unknown, expired or its user gone: then forgotten)."""
        live = self.get(sid)
        return live[0] if live is not None else None

    def end(self, sid: str | None) -> None:
        if sid:
            self._sessions.pop(sid, None)


class BodyRefused(Exception):
    """A request body refused by `read_body`: the answer's status, code and message (413s carry
    `Connection: close`: the rest of the body is never read, so the connection cannot carry another request)."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


BODY_SECONDS = 10.0
"""How long a request body may take to arrive, whole (408 after): a byte every few seconds kept the read
timeout from ever passing, and an unauthenticated client held POST /login connections open for good (a
tester: 1,100 of them took every descriptor of a broker and its data port refused new clients)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body, never holding more than `limit` bytes of it: refused 413 by its Content-Length before any
    of it is read, and as soon as a body without one (chunked) goes over; 408 if it is not all in within
    BODY_SECONDS. The admin API's bodies (broker/admin.py) and POST /login's. Raises BodyRefused."""
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):
            raise BodyRefused(400, "invalid_argument", f"Content-Length {length[:32]!r} is not a byte count")
        digits = length.lstrip("0")  # (a figure of thousands of digits is not given to int(): Python refuses it)
        if len(digits) > len(str(limit)) or int(digits or "0") > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    total = 0
    try:
        with trio.move_on_after(BODY_SECONDS) as deadline:
            async with aclosing(request.stream()) as stream:  # closed at once when we stop early
                async for chunk in stream:
                    total += len(chunk)
                    if total > limit:
                        raise _too_large(limit)
                    chunks.append(chunk)
        if deadline.cancelled_caught:
            raise BodyRefused(408, "request_timeout", f"the request body did not arrive within {BODY_SECONDS:g} s "
                                                      f"({total} bytes of it did)", {"Connection": "close"})
    except ClientDisconnect:  # nobody to answer; not a bug to log with a traceback
        # (either way: the client closed it, or the server's read timeout closed a body that stopped coming,
        # which this text blamed on the client, a tester)
        raise BodyRefused(400, "invalid_json", "the connection ended before the end of the body: the client closed "
                                               "it, or sent nothing more for longer than the read timeout") from None
    return b"".join(chunks)


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, "too_large", f"request body over {limit} bytes", {"Connection": "close"})


def cookie_name(scope: Scope) -> str:
    """`flowbroker_session_<port>`, the port the admin server listens on (the same behind a proxy)."""
    server = scope.get("server")
    return f"{COOKIE}_{server[1]}" if server and server[1] else COOKIE


def session_id(scope: Scope) -> str | None:
    """The session cookie's value in a request's headers, if any."""
    wanted = cookie_name(scope)
    name: bytes
    value: bytes
    for name, value in scope.get("headers", ()):
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, val = part.strip().partition("=")
                if key == wanted and val:
                    return str(val)
    return None


def _static(name: str) -> Response:
    data = resources.files("flowbroker.broker").joinpath("static", "console", name).read_bytes()
    return Response(data, media_type=STATIC_FILES[name], headers=SECURITY_HEADERS)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status,
                        headers={**SECURITY_HEADERS, **(headers or {})})


LOGIN_BODY = 'log in with a JSON body {"token": "..."} or {"username": "...", "password": "..."}'


def console_routes(token: str, sessions: SessionStore, users: AdminUsers | None = None) -> list[BaseRoute]:
    """The console's routes. `/login`, `/` (without a session) and the login assets are public
    (PUBLIC_PATHS); the rest sits behind the admin app's auth middleware like /api/*."""
    expected = token.encode()

    async def index(request: Request) -> Response:
        if sessions.csrf(session_id(request.scope)) is None:
            return _static("login.html")
        return _static("console.html")

    async def login_page(request: Request) -> Response:
        # Always the form, even with a live cookie: the page that lost its header value (another
        # browser profile's storage, cleared storage) comes here to log in again.
        return _static("login.html")

    async def login(request: Request) -> Response:
        # JSON only: a cross-site HTML form cannot send application/json, so it cannot log a
        # browser into this broker under the attacker's credential either.
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return _error(415, "unsupported_media_type", LOGIN_BODY)
        try:  # read no further than the limit: refused by its Content-Length at once, or once past it
            body = await read_body(request, MAX_LOGIN_BODY)
        except BodyRefused as exc:  # (a peer that hung up mid-body gets an answer no one reads, and no log line)
            return _error(exc.status, exc.code, exc.message, exc.headers)
        try:
            doc = json.loads(body)
            given = doc.get("token") if doc.get("username") is None else None
            if given is None:
                name, password = doc["username"], doc["password"]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            # (RecursionError: "[[[[..." a few thousand deep, the decoder's own recursion; uncaught, it was a
            # 500 with a 48-line traceback in the log per request, from anyone: a tester's 22 MB in 10 s)
            return _error(400, "invalid_json", LOGIN_BODY)
        read_only, user_name, credential = False, "", ""
        peer = peer_address(request.scope.get("client"))  # for the log, as the data port says it
        if given is None:  # an admin user (broker/adminusers.py)
            if users is None:
                return _error(403, "forbidden", "this broker has no admin users: log in with the admin token")
            client = request.client
            try:  # waits its address's turn after failures; a refusal waits [auth] failed_login_delay
                user, read_only = await users.login(name if isinstance(name, str) else "",
                                                    password if isinstance(password, str) else "",
                                                    client.host if client is not None else None)
            except LoginThrottled as exc:
                _LOG_UNLOOKED("console: a login refused unlooked: %s", exc)
                return _error(429, exc.code, str(exc), {"Retry-After": str(exc.retry_after)})
            except LoginRefused as exc:
                LOGGER.warning("console: login from %s refused for user %s: %s", peer, logsafe(name), exc.reason)
                return _error(403, "forbidden", "wrong user or password, or the user has no admin tag")
            user_name, credential = user.name, user.credential.encode()
            who = f"user {user.name}" + (" (monitoring: read only)" if read_only else "")
        elif not isinstance(given, str) or not hmac.compare_digest(given.strip().encode(), expected):
            LOGGER.warning("console: login from %s refused: wrong admin token", peer)
            return _error(403, "forbidden", "the admin token is wrong")
        else:
            who = "the admin token"
        sid, csrf = sessions.create(read_only, user_name, credential)
        LOGGER.info("console: logged in with %s (%d session(s) open)", who, len(sessions))
        response = JSONResponse({"csrf": csrf, "expires_in_seconds": SESSION_SECONDS, "read_only": read_only},
                                headers=SECURITY_HEADERS)
        response.set_cookie(cookie_name(request.scope), sid, max_age=SESSION_SECONDS, path="/", httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    async def session(request: Request) -> Response:
        live = sessions.get(session_id(request.scope))
        if live is None:  # reached with the bearer token: a script has no browser session
            return _error(404, "not_found", "no browser session: log in at /")
        # read_only: a monitoring user's session; the page hides what the API would refuse it (403 read_only)
        return JSONResponse({"csrf": live[0], "read_only": live[1]}, headers=SECURITY_HEADERS)

    async def logout(request: Request) -> Response:
        sessions.end(session_id(request.scope))
        response = JSONResponse({"logged_out": True}, headers=SECURITY_HEADERS)
        response.delete_cookie(cookie_name(request.scope), path="/", httponly=True, samesite="strict")
        return response

    async def static(request: Request) -> Response:
        name = request.path_params["file"]
        if name not in STATIC_FILES:
            return _error(404, "not_found", f"no endpoint {request.url.path}")
        return _static(name)

    return [
        Route("/", index, methods=["GET"]),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/session", session, methods=["GET"]),
        Route("/logout", logout, methods=["POST"]),
        Route(STATIC + "{file}", static, methods=["GET"]),
    ]
