"""The management HTTP API: a thin Starlette app over `BrokerCore`, served by hypercorn inside the
broker's own `trio.run` (docs/management.md).

Every request needs the admin credential, `Authorization: Bearer <token>` (401 without it, 403 with a
wrong one), or a web console session (flowbroker.broker.console: a cookie, plus its session's header value
on every request); only the console's login page and its assets are public, and `GET /metrics` (served here
unless `[metrics] endpoint` gives it a port of its own) unless `[metrics] require_token`. Endpoints only
translate HTTP to core calls and core objects to JSON through
flowbroker.broker.views; every endpoint is `async def`, so it runs on the trio thread like the
rest of the broker (Starlette would run a plain `def` endpoint in a worker thread, racing the core).
Errors are `{"error": {"code": ..., "message": ..., "field": ...}}` with the HTTP status that fits.

Nothing a request sends can make the broker hold more than it must: a body is refused by its
Content-Length before any of it is read, and a body without one (chunked) is read only up to
MAX_BODY; lists come in pages (flowbroker.broker.views) whose cost is that of the page, and a page's
views are made and encoded in slices of about a millisecond in the broker's turn for heavy HTTP answers
(flowbroker.broker.httpturns), so no page, and no number of them at once, holds the broker's thread for
longer than a slice.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import trio
from starlette.applications import Starlette
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from flowbroker.broker.accept import RateLimitedLog
from flowbroker.broker.privatefile import read_private, write_private
from flowbroker.broker import console, views
from flowbroker.broker.logsafe import logsafe
from flowbroker.broker.listen_hints import listen_hint
from flowbroker.broker.hostcheck import LoopbackHostOnly, is_loopback_host
from flowbroker.broker.httpserve import HttpServer
from flowbroker.broker.httpturns import HttpTurns
from flowbroker.broker.adminusers import AdminUsers, LoginRefused, LoginThrottled, basic_credentials, peer_address
from flowbroker.broker.auth import LoginThrottle
from flowbroker.broker.config import AdminConfig, valid_token
from flowbroker.broker.users import UserStore
from flowbroker.broker.console import PUBLIC_PATHS
from flowbroker.broker.core import BrokerCore, RequestError
from flowbroker.policies.credit import PolicyConfigError
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.names import OVERFLOW, OVERFLOW_DROP_HEAD, OVERFLOW_REJECT, TIME_QUEUE_ARGUMENTS

__all__ = ["AdminServer", "AdminStartError", "BearerAuth", "HttpListener", "create_app", "listen", "publish_token", "resolve_token", "url_host",
           "reusable_token",
           "write_token_file"]

LOGGER = logging.getLogger("flowbroker.broker.admin")
# An address whose failures put its turn past failed_login_max_delay is refused unlooked, as fast as it
# asks: logged once per 10 s with the count (a flood of wrong passwords wrote 33,000 lines in 15 s).
_LOG_UNLOOKED = RateLimitedLog(LOGGER, logging.WARNING)
# A wrong bearer token is someone guessing or a stale token file: worth a line, not one per request.
_LOG_WRONG_TOKEN = RateLimitedLog(LOGGER, logging.WARNING)
HTTP_LOGGER = logging.getLogger("flowbroker.broker.admin.http")
HTTP_DRAIN_SECONDS = 2.0
"""At shutdown, how long the HTTP listeners (admin API, /metrics) answer the requests already in flight."""
# hypercorn's own "Running on http://... (CTRL + C to quit)" repeats our "admin API on" line: not logged.
HTTP_LOGGER.addFilter(lambda record: not str(record.msg).startswith("Running on"))
MAX_BODY = 64 * 1024
HTTP_STALL_SECONDS = 10.0
"""An HTTP client that takes none of an answer's bytes for this long is cut off by the kernel
(TCP_USER_TIMEOUT, which Linux applies to a zero window too). hypercorn writes with no deadline of its
own, in a shielded scope: a client that asked for /metrics (no token needed) and never read held the
whole answer in the broker's memory, and kept the broker from exiting at SIGTERM, for as long as it
stayed connected."""
HTTP_READ_SECONDS = 10.0
"""An HTTP connection that sends nothing for this long, past the longest the broker itself makes an answer
wait (AdminServer.read_timeout), is closed (hypercorn's `read_timeout`, which bounds every read of the
connection, HTTP/1.1 and HTTP/2 alike; hypercorn's own default is none). Without it, a connection that sent
POST /login's headers with a Content-Length and no body, or an HTTP/2 preface and nothing more (hypercorn
never starts its keep-alive timer on an HTTP/2 connection that opened no stream), was held for good: 1,500
of them used up the broker's descriptors, and new SDK connections failed with EMFILE (a tester)."""

PeerOf = Callable[[int], str | None]


class NameConvertor(PathConvertor):
    """A queue or exchange name in a path: the whole rest of it, whatever it holds. Starlette's `path`
    (`.*`) stops at a newline, and a name may contain one (the CLI escapes it when it prints it)."""

    regex = r"[\s\S]*"


register_url_convertor("name", NameConvertor())


class AdminStartError(Exception):
    """The admin API cannot start (token file not writable, address in use); the broker does not start."""


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers


def _error_response(status: int, code: str, message: str, field: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    return JSONResponse({"error": body}, status_code=status, headers=headers)


# -- the credential ----------------------------------------------------------------------------


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to `path` with mode 0600 (its folder 0700 when created), atomically: a CLI that
    reads the file while the broker starts sees the old token or the new one, never half of it."""
    write_private(path, token + "\n")


def reusable_token(path: Path) -> str | None:
    """The token in `path` if a broker may reuse it: a regular file of ours that no one else can read
    (mode 0600 or stricter), holding a valid token. Anything else (missing, unreadable, someone
    else's, loosened permissions, garbage) is not reused: a fresh token replaces it."""
    token = read_private(path)
    return token if token is not None and valid_token(token) else None


def resolve_token(config: AdminConfig, port: int) -> tuple[str, bool]:
    """The admin credential and whether it must be written to the token file once the port is bound.

    The configured token if there is one; else the valid token already in the token file of `port`
    (a restarted broker keeps the credential its CLI has); else a fresh random one. Nothing is
    written here: a broker that then fails to bind must not replace the token of the broker that
    holds the port (its CLI would get 403 until that broker restarted). With port 0 the file's name
    is known only after the bind, so the token is always fresh."""
    if config.token:
        return config.token, False
    if port:
        existing = reusable_token(config.token_path(port))
        if existing is not None:
            return existing, False
    return secrets.token_urlsafe(32), True


def publish_token(config: AdminConfig, port: int, token: str) -> Path:
    """Write a generated token to the token file of the bound `port`, for the CLI to read."""
    path = config.token_path(port)
    try:
        write_token_file(path, token)
    except OSError as exc:
        raise AdminStartError(
            f"[admin] token_file = {config.token_file!r}: cannot write the generated admin token to "
            f"{path}: {exc.strerror or exc}; set [admin] token or another token_file"
        ) from None
    LOGGER.debug("no [admin] token configured: generated one and wrote it to %s (mode 0600)", path)
    return path


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class BearerAuth:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <token>`, or the web console's
    session cookie (flowbroker.broker.console) with that session's X-Flowbroker-CSRF header (the
    console's own files load with the cookie alone). PUBLIC_PATHS (the console's login page and its assets) and `open_paths`
    (`/metrics` unless `[metrics] require_token`: docs/metrics.md) need neither."""

    def __init__(self, app: ASGIApp, token: str, sessions: console.SessionStore | None = None,
                 open_paths: frozenset[str] = frozenset(), users: AdminUsers | None = None):
        self.app = app
        self._token = token.encode()
        self._sessions = sessions
        self._public = PUBLIC_PATHS | open_paths
        self._users = users  # admin users (broker/adminusers.py): HTTP Basic, beside the token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._public:
            refusal = await self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _refusal(self, scope: Scope) -> Response | None:
        """None when the request may go on, else the answer that refuses it."""
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        if not header and self._sessions is not None:
            sid = console.session_id(scope)
            if sid is not None:
                live = self._sessions.get(sid)  # asks the users file: a deleted user's session ends here
                return self._session_refusal(scope, *(live or (None, False)))
        scheme, _, credential = header.partition(b" ")
        if scheme.lower() == b"basic" and self._users is not None:
            return await self._basic_refusal(scope, credential)
        if not header or scheme.lower() != b"bearer" or not credential.strip():
            basic = ", or an admin user's HTTP Basic credentials" if self._users is not None else ""
            return _error_response(
                401, "unauthorized",
                f"this needs 'Authorization: Bearer <token>' (the admin token: [admin] token, or the token file){basic}",
                headers={"WWW-Authenticate": 'Bearer realm="flowbroker"'},
            )
        if not hmac.compare_digest(credential.strip(), self._token):
            _LOG_WRONG_TOKEN("admin API: %s %s from %s refused: wrong admin token", scope["method"],
                             logsafe(scope["path"]), peer_address(scope.get("client")))
            return _error_response(403, "forbidden", "the admin token is wrong")
        return None

    async def _basic_refusal(self, scope: Scope, credential: bytes) -> Response | None:
        """An admin user by HTTP Basic: administrator may do anything, monitoring only read. A refused
        password is answered after [auth] failed_login_delay, and an address that keeps failing waits its
        turn (AdminUsers.login)."""
        assert self._users is not None
        pair = basic_credentials(credential)
        client = scope.get("client")
        try:
            user, read_only = await self._users.login(*(pair or ("", "")), client[0] if client else None)
        except LoginThrottled as exc:
            _LOG_UNLOOKED("admin API: HTTP Basic credentials refused unlooked: %s", exc)
            return _error_response(429, exc.code, str(exc), headers={"Retry-After": str(exc.retry_after)})
        except LoginRefused as exc:  # the address and the reason, as the data port logs a refused login
            LOGGER.warning("admin API: HTTP Basic from %s refused for user %s: %s", peer_address(client),
                           logsafe(pair[0]) if pair is not None else "(malformed)",
                           exc.reason if pair is not None else "malformed credentials")
            return _error_response(403, "forbidden", "wrong user or password, or the user has no admin tag "
                                                     "(administrator or monitoring)")
        if read_only and scope["method"] not in SAFE_METHODS:
            return _read_only_refusal(user.name)
        return None

    @staticmethod
    def _session_refusal(scope: Scope, csrf: str | None, read_only: bool = False) -> Response | None:
        if csrf is None:
            return _error_response(401, "unauthorized", "the console session has ended (logged out, expired, or "
                                                        "its user deleted or without an admin tag): log in at /")
        if scope["method"] == "GET" and scope["path"].startswith(console.STATIC):
            return None  # the page's own files, which the browser loads without the header: nothing of the broker's
        # The header on every request, reads too: a browser sends the cookie to every port of its host,
        # so another server there gets it; the header's value came in the login's answer, kept by the
        # page in its own origin's storage, and no request of the browser's own making carries it.
        given = b""
        for name, value in scope["headers"]:
            if name == console.CSRF_HEADER.encode():
                given = value
                break
        if not hmac.compare_digest(given, csrf.encode()):
            return _error_response(403, "csrf", "a request with the console's cookie needs its "
                                                "X-Flowbroker-CSRF header (the value POST /login answered)")
        if read_only and scope["method"] not in SAFE_METHODS and scope["path"] != "/logout":
            return _read_only_refusal("this console session's user")  # ending its own session changes nothing
        return None


def _read_only_refusal(who: str) -> Response:
    return _error_response(403, "read_only", f"{who} has the monitoring tag: it may read, not change anything")


# -- the app -----------------------------------------------------------------------------------


Handler = Callable[[Request], Awaitable[Any]]


COMMIT_WAIT_SECONDS = 10.0
"""How long a change to something durable waits for the journal's commit before its answer says it is
not on disk yet (503): a disk alarm or a failing disk keeps the journal retrying."""


class _Committed:
    """A `CommitWaiter` (broker/journal.py) that sets an event."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = trio.Event()

    def release(self) -> None:
        self.event.set()


def _json(value: Any) -> bytes:
    """`value` as Starlette's JSONResponse encodes it (compact, UTF-8, no NaN)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _page_pieces(page: views.Page[Any]) -> Iterator[bytes]:
    """A page's JSON, an object's view made and encoded a step at a time: joined, the very bytes of
    `JSONResponse(page.as_dict())` for the same state."""
    yield b'{' + _json(page.key) + b':['
    comma = b""
    for shown in page.views():
        yield comma + _json(shown)
        comma = b","
    yield b'],"next":' + _json(page.cursor) + b'}'


async def _page_response(page: views.Page[Any], turns: HttpTurns) -> Response:
    """A page built in slices in the broker's turn (broker/httpturns.py): made in one go, a page of 1,000
    queues of 250-character names (917 KB, 20-40 ms of CPU) held every connection that long, and 20
    clients looping on it raised a bystander's median message latency from 0.7 ms to 110-650 ms (a tester)."""
    pieces: list[bytes] = []
    await turns.build(_page_pieces(page), pieces)
    return Response(b"".join(pieces), media_type=JSONResponse.media_type)


def _json_endpoint(handler: Handler, core: BrokerCore | None = None,
                   turns: HttpTurns | None = None) -> Callable[[Request], Awaitable[Response]]:
    """Turn a handler's result into JSON and its errors into the error object; a page (`views.Page`) is
    made in slices in `turns`. A request that journalled
    something (a durable queue deleted, purged, declared, a binding of one) is answered once it is on
    disk, as the broker protocol's requests are: answered at once, a kill -9 right after could undo it."""
    turns = turns if turns is not None else HttpTurns()

    async def endpoint(request: Request) -> Response:
        journal = core.journal if core is not None and request.method not in SAFE_METHODS else None
        try:
            if journal is not None:  # the body read first: durable traffic meanwhile is not this request's
                request.state.body = await _read_body(request)
            journalled = journal.records_appended if journal is not None else 0
            result = await handler(request)
            if journal is not None and journal.records_appended != journalled:
                committed = _Committed()
                journal.after_commit(committed)
                with trio.move_on_after(COMMIT_WAIT_SECONDS):
                    await committed.event.wait()
                if not committed.event.is_set():
                    raise ApiError(503, "not_on_disk_yet", f"the change is made but the journal has not written it "
                                                          f"within {COMMIT_WAIT_SECONDS:g} s (a disk alarm? see GET "
                                                          "/api/broker journal); a crash before it is written undoes it")
            if isinstance(result, views.Page):
                return await _page_response(result, turns)
        except ApiError as exc:
            return _error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)
        except RequestError as exc:
            status = 404 if exc.code is ErrorCode.NOT_FOUND else 400
            code = "not_found" if status == 404 else "invalid_argument"
            return _error_response(status, code, str(exc), None if status == 404 else _field_in(str(exc)))
        except PolicyConfigError as exc:
            return _error_response(400, "invalid_argument", f"{exc.key}: {exc.reason} (got {exc.shown})", exc.key)
        except Exception as exc:  # a bug here must not take the broker down; say so and log it
            # the path is the client's: escaped so it cannot forge log lines
            LOGGER.exception("admin: %s %s failed", request.method, logsafe(request.url.path))
            return _error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")
        return JSONResponse(result)

    return endpoint


def _field_in(message: str) -> str | None:
    """The argument a core RequestError names as "unknown queue argument 'x'" (a message naming
    something else in quotes, an exchange or a queue, names no field)."""
    found = re.search(r"\bargument '([^']*)'", message)
    return found.group(1) if found else None


async def _read_body(request: Request) -> bytes:
    """The body, never holding more than MAX_BODY bytes of it (console.read_body): refused by Content-Length
    before reading, and cut off as soon as a body without one (chunked) goes over. Read once: `_json_endpoint`
    may have read it already (`request.state.body`)."""
    body: bytes | None = getattr(request.state, "body", None)
    if body is not None:
        return body
    try:
        return await console.read_body(request, MAX_BODY)
    except console.BodyRefused as exc:
        raise ApiError(exc.status, exc.code, exc.message, headers=exc.headers) from None


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await _read_body(request)
    if not raw.strip():
        raise ApiError(400, "invalid_json", "the request needs a JSON object body")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        if "int_max_str_digits" in str(exc):  # Python's advice to its programmers is none to an API user
            raise ApiError(400, "invalid_json", "the body has an integer of more than 4,300 digits: no value "
                                                "here is that large") from None
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # "[[[[..." 30,000 deep: the decoder's recursion, not a bug of ours
        raise ApiError(400, "invalid_json", "the body is nested too deeply to be a request") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object")
    return body


K = TypeVar("K", str, int)


def _is_count(text: str) -> bool:
    """Digits, and few enough for int(): over 4,300 of them int() raises (a 500, a tester); no count or id
    the API takes has more than 20."""
    return text.isascii() and text.isdigit() and len(text) <= 20


def _query(request: Request, known: tuple[str, ...]) -> Any:
    """The request's query parameters: another than `known`, or one given twice, is a 400 naming it (a
    typo silently ignored, or one of two values silently used, hides a script's bug: testers)."""
    params = request.query_params
    for name in params:
        if name not in known:
            raise ApiError(400, "invalid_argument", f"unknown parameter {name!r}; known: {', '.join(known)}", name)
        if len(params.getlist(name)) > 1:
            raise ApiError(400, "invalid_argument", f"parameter {name!r} given more than once", name)
    return params


def _page(request: Request, key: type[K], also: tuple[str, ...] = ()) -> tuple[K | None, int]:
    """`?after=` (a name, or a connection id) and `?limit=` (1..MAX_LIMIT, default DEFAULT_LIMIT)
    of a list endpoint; any other parameter than those and `also` is a 400 naming it, so a typo is not
    silently ignored."""
    params = _query(request, ("after", "limit", *also))
    text = params.get("limit")
    limit = views.DEFAULT_LIMIT
    if text is not None:
        if not _is_count(text) or not 1 <= int(text) <= views.MAX_LIMIT:
            raise ApiError(400, "invalid_argument", f"limit must be an integer from 1 to {views.MAX_LIMIT}", "limit")
        limit = int(text)
    after = params.get("after")
    if after is None:
        return None, limit
    if key is int and not _is_count(after):
        raise ApiError(400, "invalid_argument", "after must be a connection id (an integer >= 0 of at most 20 "
                                                "digits)", "after")
    return key(after), limit


class AdminApi:
    """The endpoints, bound to one core. `peer_of(conn_id)` gives a connection's peer address."""

    def __init__(self, core: BrokerCore, peer_of: PeerOf | None = None,
                 ports: Callable[[], tuple[int | None, int | None]] | None = None):
        self.core = core
        self.peer_of = peer_of
        self.ports = ports

    def now(self) -> int:
        return self.core.clock_ns()

    async def broker(self, request: Request) -> Any:
        port, admin_port = self.ports() if self.ports else (None, None)
        return views.broker_view(self.core, port=port, admin_port=admin_port)

    async def list_queues(self, request: Request) -> Any:
        after, limit = _page(request, str, ("saturated",))
        saturated = request.query_params.get("saturated")
        if saturated is None or saturated == "false":
            return views.paged_queues(self.core, self.now(), after, limit)
        if saturated != "true":
            raise ApiError(400, "invalid_argument", "saturated must be true (only the saturated queues) or false "
                                                    "(every queue, as without it)", "saturated")
        return views.paged_queues(self.core, self.now(), after, limit, saturated=True)

    async def show_queue(self, request: Request) -> Any:
        queue = self.core.get_queue(request.path_params["name"])
        return views.queue_view(queue, self.now())

    async def patch_queue(self, request: Request) -> Any:
        name = request.path_params["name"]
        self.core.get_queue(name)  # 404 before 400: an unknown queue is the first thing wrong
        body = await _json_body(request)
        if not body:
            raise ApiError(400, "invalid_argument", f"give at least one of: {', '.join(views.THRESHOLD_KEYS)}")
        for key, value in body.items():
            if key not in views.THRESHOLD_KEYS:
                raise ApiError(400, "invalid_argument",
                               f"unknown threshold {key!r}; known: {', '.join(views.THRESHOLD_KEYS)}", key)
            if key == OVERFLOW:
                if not isinstance(value, str):
                    raise ApiError(400, "invalid_argument",
                                   f"overflow must be \"{OVERFLOW_REJECT}\" or \"{OVERFLOW_DROP_HEAD}\"", key)
            elif key in TIME_QUEUE_ARGUMENTS:  # seconds; off with 0 (the thresholds validate the rest)
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                    raise ApiError(400, "invalid_argument", f"{key} must be a number of seconds >= 0 (0 = off)", key)
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 50):
                # (the bound of the TOML's byte keys: past it, a figure is a typo, not a queue's size)
                raise ApiError(400, "invalid_argument",
                               f"{key} must be an integer in [0, 2^50] (or null for the default)", key)
        queue = self.core.set_queue_thresholds(name, body)
        LOGGER.info("admin: queue %r thresholds changed: %s", name, body)
        return views.queue_view(queue, self.now())

    async def delete_queue(self, request: Request) -> Any:
        """Delete a queue with its messages and bindings; its subscribers get ERROR NOT_FOUND (as DELETE_QUEUE)."""
        name = request.path_params["name"]
        messages = self.core.delete_queue(name)
        LOGGER.info("admin: queue %r deleted with %d message(s)", name, messages)
        return {"queue": name, "deleted": messages}

    async def purge_queue(self, request: Request) -> Any:
        """Drop a queue's ready messages (as PURGE_QUEUE); unsettled deliveries stay with their consumers."""
        name = request.path_params["name"]
        purged = self.core.get_queue(name).purge()
        LOGGER.info("admin: queue %r purged of %d message(s)", name, purged)
        return {"queue": name, "purged": purged}

    async def list_connections(self, request: Request) -> Any:
        after, limit = _page(request, int)
        return views.paged_connections(self.core, self.now(), self.peer_of, after, limit)

    async def close_connection(self, request: Request) -> Any:
        """End a connection (ERROR + CLOSE CONNECTION_FORCED within a second): the operator's remedy for a
        client that holds what others wait for. `?reason=` is said to the client and logged."""
        text = request.path_params["conn_id"]
        # Checked here, not by the route's int converter: 5,000 digits made that raise while routing, a
        # text/plain 500 and a traceback (a tester).
        if not _is_count(text):
            why = "no connection id has more than 20 digits" if text.isascii() and text.isdigit() else \
                "a connection id is an integer"
            raise ApiError(404, "not_found", f"no connection {logsafe(text, 40)}: {why} (GET /api/connections)")
        conn_id = int(text)
        reason = _query(request, ("reason",)).get("reason") or "DELETE /api/connections"
        session = self.core.force_close(conn_id, reason[:256])
        LOGGER.warning("admin: connection %d (%s) closed by an operator: %s", conn_id,
                       logsafe(session.client_name or "-"), logsafe(reason[:256]))
        return {"connection": conn_id, "closed": True}

    async def list_exchanges(self, request: Request) -> Any:
        after, limit = _page(request, str)
        return views.paged_exchanges(self.core, after, limit)

    async def delete_exchange(self, request: Request) -> Any:
        name = request.path_params["name"]
        bindings = self.core.delete_exchange(name)
        LOGGER.info("admin: exchange %r deleted with %d binding(s)", name, bindings)
        return {"exchange": name, "bindings": bindings}

    async def stop_all(self, request: Request) -> Any:
        self.core.stop_all_producers()
        LOGGER.warning("admin: all producers stopped")
        return self._producers()

    async def start_all(self, request: Request) -> Any:
        self.core.start_all_producers()
        LOGGER.warning("admin: all producers started")
        return self._producers()

    def _producers(self) -> dict[str, Any]:
        flow_controlled = [s.conn_id for s in self.core.sessions.values() if s.flow_control]
        return {"producers_stopped": self.core.producers_stopped, "connections": flow_controlled}

    async def get_policy(self, request: Request) -> Any:
        return views.policy_view(self.core)

    async def put_policy(self, request: Request) -> Any:
        body = await _json_body(request)
        if not body:
            raise ApiError(400, "invalid_argument", "give the policy and/or any [credit] key")
        for key, value in body.items():
            if key == "policy":
                if not isinstance(value, str):  # (it said "policy must be a number", a tester)
                    raise ApiError(400, "invalid_argument", "policy must be a string: none, static, dynamic or "
                                                            "aggressive", key)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                what = "a number, a percent" if key.endswith("_percent") else "an integer number of bytes"
                raise ApiError(400, "invalid_argument", f"{key} must be {what}", key)
        self.core.set_credit_policy(**body)
        LOGGER.info("admin: credit policy changed: %s", body)
        return views.policy_view(self.core)


async def _index(index: dict[str, Any]) -> dict[str, Any]:
    return index


async def _not_found(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return _error_response(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")
    if exc.status_code == 404:
        if request.url.path == "/metrics":  # (a scraper pointed here after the metrics moved, a tester)
            return _error_response(404, "not_found", "GET /metrics is not served on this port: [metrics] endpoint "
                                                     "serves it on a port of its own (logged at start and written "
                                                     "to --port-file as metrics_port), or [metrics] enabled = false")
        return _error_response(404, "not_found", f"no endpoint {request.url.path}")
    return _error_response(exc.status_code, "http_error", str(exc.detail))


def create_app(core: BrokerCore, token: str, peer_of: PeerOf | None = None,
               ports: Callable[[], tuple[int | None, int | None]] | None = None,
               metrics: Route | None = None, metrics_need_token: bool = False,
               users: UserStore | None = None, failed_delay: float = 1.0,
               throttle: LoginThrottle | None = None, turns: HttpTurns | None = None) -> ASGIApp:
    """The admin ASGI app: Starlette routes behind bearer-token auth (or an admin user's, from `users`);
    `metrics` is the `GET /metrics` route when the metrics are served here (broker/metricshttp.py), open
    unless `metrics_need_token`; `turns` is the broker's turn for heavy answers, which pages take (and
    /metrics, wherever it is served)."""
    api = AdminApi(core, peer_of, ports)
    turns = turns if turns is not None else HttpTurns()

    def j(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return _json_endpoint(handler, core, turns)
    routes: list[BaseRoute] = [
        Route("/api/broker", j(api.broker), methods=["GET"]),
        Route("/api/queues", j(api.list_queues), methods=["GET"]),
        # A queue or exchange name may contain "/" (sent as is or as %2F, which the server decodes
        # before routing), so the name is the whole rest of the path (NameConvertor).
        Route("/api/queues/{name:name}/purge", j(api.purge_queue), methods=["POST"]),
        Route("/api/queues/{name:name}", j(api.show_queue), methods=["GET"]),
        Route("/api/queues/{name:name}", j(api.patch_queue), methods=["PATCH"]),
        Route("/api/queues/{name:name}", j(api.delete_queue), methods=["DELETE"]),
        Route("/api/connections", j(api.list_connections), methods=["GET"]),
        Route("/api/connections/{conn_id}", j(api.close_connection), methods=["DELETE"]),
        Route("/api/exchanges", j(api.list_exchanges), methods=["GET"]),
        Route("/api/exchanges/{name:name}", j(api.delete_exchange), methods=["DELETE"]),
        Route("/api/producers/stop-all", j(api.stop_all), methods=["POST"]),
        Route("/api/producers/start-all", j(api.start_all), methods=["POST"]),
        Route("/api/policy", j(api.get_policy), methods=["GET"]),
        Route("/api/policy", j(api.put_policy), methods=["PUT"]),
    ]
    # GET /api/ (where the broker port's answer to HTTP points): what there is, not a 404
    index = {"endpoints": [f"{method} {route.path.replace(':name', '')}" for route in routes
                           if isinstance(route, Route) for method in sorted(route.methods or ()) if method != "HEAD"],
             "docs": "docs/management.md"}
    routes += [Route(path, j(lambda request: _index(index)), methods=["GET"]) for path in ("/api", "/api/")]
    open_paths: frozenset[str] = frozenset()
    if metrics is not None:
        routes.append(metrics)
        open_paths = frozenset() if metrics_need_token else frozenset({metrics.path})
    admin_users = AdminUsers(users, failed_delay, throttle, core.clock_ns) if users is not None else None
    sessions = console.SessionStore(users=admin_users)
    routes += console.console_routes(token, sessions, admin_users)
    app = Starlette(routes=routes, exception_handlers={HTTPException: _not_found})
    return BearerAuth(app, token, sessions, open_paths, admin_users)


# -- listening ---------------------------------------------------------------------------------


_ADDRESS_OPTIONS = {  # where each HTTP listener's address is set, for the hint of an error
    "admin": ("--admin-host or [admin] host", "--admin-port or [admin] port"),
    "metrics": ("--metrics-endpoint or [metrics] endpoint", "--metrics-endpoint or [metrics] endpoint"),
}


def listen(host: str, port: int, section: str) -> tuple[int, int]:
    """Bind and listen on host:port before any nursery, so an address in use is a plain AdminStartError
    naming `[section]` and what to do, not an exception group; returns (descriptor, port) for `HttpServer`."""
    host_option, port_option = _ADDRESS_OPTIONS.get(section, (f"[{section}] host", f"[{section}] port"))

    def start_error(exc: OSError) -> AdminStartError:
        hint = listen_hint(exc, host, host_option, port_option)
        return AdminStartError(f"[{section}] cannot listen on {host}:{port}: {exc.strerror or exc} ({hint})")

    try:
        family, type_, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, type_, proto)
    except OSError as exc:
        raise start_error(exc) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # (Linux) inherited by every accepted socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(HTTP_STALL_SECONDS * 1000))
        sock.bind(address)
        sock.listen(128)  # connections wait in the backlog until HttpServer accepts them
    except OSError as exc:
        sock.close()
        raise start_error(exc) from None
    bound = int(sock.getsockname()[1])
    return sock.detach(), bound  # HttpServer takes the socket over by its descriptor


def url_host(host: str) -> str:
    """`host` as a URL's authority takes it: an IPv6 address in brackets (`http://::1:8080` is no URL)."""
    return f"[{host}]" if ":" in host else host


# -- the server --------------------------------------------------------------------------------


class HttpListener:
    """One HTTP app served with hypercorn's trio worker on a port of its own (the admin API, or
    /metrics on its own port).

    `bind()` (synchronous, before any nursery, so an address in use is a plain `AdminStartError` and
    not an exception group) opens the listening socket and learns the port; `await
    nursery.start(listener.serve)` serves on it; `shutdown()` stops it gracefully. Subclasses set
    `app` and say what to do once bound (`_bound`) and what to log when serving (`_serving_line`)."""

    app: ASGIApp
    logger: logging.Logger = LOGGER  # where the serving line goes

    def __init__(self, host: str, port: int, section: str, max_connections: int):
        self.host = host
        self.max_connections = max_connections
        self.http: HttpServer | None = None
        """What serves the port, while it is served (its `open` and `refused` counts)."""
        self._requested_port = port
        self._section = section  # the config section an address-in-use error names
        self.port: int | None = None
        self._fd: int | None = None
        self._shutdown = trio.Event()
        self.stopped = trio.Event()
        """Set once serving has ended: after `shutdown()`, when the requests in flight have been answered
        (or `graceful_timeout` passed), so the broker waits for it before it cancels what is left."""

    def bind(self) -> int:
        fd, port = listen(self.host, self._requested_port, self._section)
        try:
            self._bound(port)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.port = fd, port
        return port

    def _bound(self, port: int) -> None:
        """The port is ours: whatever must wait for that (nothing by default)."""

    def _serving_line(self) -> str:
        raise NotImplementedError

    def shutdown(self) -> None:
        self._shutdown.set()

    def read_timeout(self) -> float:
        """How long a connection may send nothing before it is closed: HTTP_READ_SECONDS past the longest
        the app itself may take to answer (a client waiting for its answer sends nothing either, and
        hypercorn's read_timeout does not tell it from one that stalls). /metrics answers within seconds."""
        return HTTP_READ_SECONDS

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        if self._fd is None:
            self.bind()
        assert self._fd is not None and self.port is not None
        fd, self._fd = self._fd, None
        self.logger.info("%s", self._serving_line())
        task_status.started(self.port)
        try:
            app = self.app
            if is_loopback_host(self.host):  # DNS rebinding (broker/hostcheck.py)
                app = LoopbackHostOnly(app, f"[{self._section}] port {self.port}")
            self.http = HttpServer(app, fd, max_connections=self.max_connections,
                                   read_timeout=self.read_timeout(), drain_seconds=HTTP_DRAIN_SECONDS,
                                   errorlog=HTTP_LOGGER, what=f"[{self._section}] port {self.port}")
            await self.http.serve(self._shutdown)
        finally:
            self.stopped.set()


class AdminServer(HttpListener):
    """The admin API (`[admin]`): its token file is written only once its port is bound."""

    def __init__(self, config: AdminConfig, core: BrokerCore, peer_of: PeerOf | None = None,
                 broker_port: Callable[[], int | None] | None = None, metrics: Route | None = None,
                 metrics_need_token: bool = False, users: UserStore | None = None, failed_delay: float = 1.0,
                 throttle: LoginThrottle | None = None, turns: HttpTurns | None = None):
        super().__init__(config.host, config.port, "admin", config.max_connections)
        self.config = config
        self.core = core
        self.token, self._token_unwritten = resolve_token(config, config.port)
        self._token_origin = "generated at start" if self._token_unwritten else "reused"
        self._broker_port = broker_port or (lambda: None)
        # a login waits at most its address's turn (failed_login_max_delay) and then failed_login_delay
        self._longest_login = failed_delay + (throttle.max_ns / 1e9 if throttle is not None else 0.0)
        self.app = create_app(core, self.token, peer_of, lambda: (self._broker_port(), self.port), metrics,
                              metrics_need_token, users, failed_delay, throttle, turns)

    def read_timeout(self) -> float:
        # the answers that wait: a change to something durable (COMMIT_WAIT_SECONDS, then 503), a login
        return HTTP_READ_SECONDS + max(COMMIT_WAIT_SECONDS, self._longest_login)

    def _bound(self, port: int) -> None:
        if self._token_unwritten:  # only now: a broker that could not bind must not touch the file
            publish_token(self.config, port, self.token)
            self._token_unwritten = False

    def _serving_line(self) -> str:
        # The one line that says where the API is and where its credential comes from (with
        # --admin-port 0, the only place the chosen port is printed: docs/management.md).
        assert self.port is not None
        token = ("[admin] token (configured)" if self.config.token
                 else f"{self.config.token_path(self.port)} ({self._token_origin}, mode 0600)")
        return f"admin API on http://{url_host(self.config.host)}:{self.port}, token in {token}"
