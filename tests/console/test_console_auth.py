"""The web console's credential rules over real HTTP on 127.0.0.1 (broker/console.py, broker/admin.py):
without a credential only the login page and its assets are served; a login with the admin token
sets an HttpOnly, SameSite=Strict session cookie; the cookie reads the API but changes nothing
without the session's CSRF header; logging out ends the session; the bearer token still works."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest
import trio

from flowbroker.broker.console import COOKIE, MAX_SESSIONS, SessionStore

TOKEN = "console-admin-token-0123456789"


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, cookies: list[str]):
        self.status = status
        self.headers = headers
        self.body = body
        self.cookies = cookies  # every Set-Cookie header

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


async def request(broker: Any, method: str, path: str, body: bytes | None = None,
               headers: dict[str, str] | None = None) -> Answer:
    """One request with http.client in a worker thread (no cookie jar: the tests send cookies by hand)."""
    port = int(broker.admin_url.rsplit(":", 1)[1])

    def call() -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data,
                          [v for k, v in resp.getheaders() if k.lower() == "set-cookie"])
        finally:
            conn.close()

    return await trio.to_thread.run_sync(call)


def cookie(broker: Any) -> str:
    """The session cookie's name on this broker: one per admin port."""
    return f"{COOKIE}_{broker.admin_url.rsplit(':', 1)[1]}"


async def login(broker: Any, token: str = TOKEN) -> tuple[str, str]:
    """Log in as the page does; returns (the cookie header to send, the CSRF value)."""
    answer = await request(broker, "POST", "/login", json.dumps({"token": token}).encode(),
                        {"Content-Type": "application/json"})
    assert answer.status == 200, answer.text
    [set_cookie] = answer.cookies
    pair = set_cookie.split(";")[0]
    assert pair.startswith(f"{cookie(broker)}=")
    return pair, answer.json()["csrf"]


@pytest.fixture
async def broker(start_flowbroker: Any) -> Any:
    return await start_flowbroker(admin={"token": TOKEN})


async def test_without_a_credential_only_the_login_page_and_its_assets_are_served(broker: Any) -> None:
    for path in ("/", "/login"):
        page = await request(broker, "GET", path)
        assert page.status == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="token"' in page.text and "console.js" not in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY"
    for asset in ("/console/login.js", "/console/console.css"):
        assert (await request(broker, "GET", asset)).status == 200
    for path in ("/console/console.js", "/console/console.html", "/console/uPlot.iife.min.js", "/session",
                 "/api/queues", "/api/broker"):
        answer = await request(broker, "GET", path)
        assert answer.status == 401 and answer.json()["error"]["code"] == "unauthorized", path
    refused = await request(broker, "POST", "/api/producers/stop-all")
    assert refused.status == 401 and not broker.core.producers_stopped
    # a cookie that is no session is no credential either
    forged = await request(broker, "GET", "/api/queues", headers={"Cookie": f"{cookie(broker)}=made-up"})
    assert forged.status == 401 and "log in" in forged.json()["error"]["message"]


async def test_a_wrong_token_or_a_non_json_login_sets_no_cookie(broker: Any) -> None:
    wrong = await request(broker, "POST", "/login", json.dumps({"token": "wrong-token-wrong-token"}).encode(),
                       {"Content-Type": "application/json"})
    assert wrong.status == 403 and wrong.json()["error"]["message"] == "the admin token is wrong"
    assert wrong.cookies == []
    # an HTML form on another site can post urlencoded or text/plain, never application/json
    form = await request(broker, "POST", "/login", f"token={TOKEN}".encode(),
                      {"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status == 415 and form.cookies == []
    garbled = await request(broker, "POST", "/login", b"{not json", {"Content-Type": "application/json"})
    assert garbled.status == 400 and garbled.cookies == []


async def test_the_session_cookie_needs_the_header_value_from_the_login_for_every_request(broker: Any) -> None:
    answer = await request(broker, "POST", "/login", json.dumps({"token": TOKEN}).encode(),
                        {"Content-Type": "application/json"})
    [set_cookie] = answer.cookies
    attributes = [a.strip().lower() for a in set_cookie.split(";")]
    assert "httponly" in attributes and "samesite=strict" in attributes and "path=/" in attributes
    assert not any(a == "secure" for a in attributes)  # plain HTTP on 127.0.0.1 (docs/console.md)
    session, csrf = set_cookie.split(";")[0], answer.json()["csrf"]
    assert len(session.split("=", 1)[1]) >= 40 and len(csrf) >= 40 and TOKEN not in set_cookie

    page = await request(broker, "GET", "/", headers={"Cookie": session})
    assert page.status == 200 and "/console/console.js" in page.text
    assert 'id="token"' in (await request(broker, "GET", "/login", headers={"Cookie": session})).text
    assert (await request(broker, "GET", "/console/uPlot.iife.min.js", headers={"Cookie": session})).status == 200
    # The cookie alone reads nothing: a browser sends it to every port of the host, so a server on
    # another port has it; it cannot have the header value, which only the login's answer carried.
    for path in ("/session", "/api/queues", "/api/broker"):
        alone = await request(broker, "GET", path, headers={"Cookie": session})
        assert alone.status == 403 and alone.json()["error"]["code"] == "csrf", path
    with_header = {"Cookie": session, "X-Flowbroker-CSRF": csrf}
    got = await request(broker, "GET", "/session", headers=with_header)
    assert got.status == 200 and got.json() == {"csrf": csrf, "read_only": False}
    assert (await request(broker, "GET", "/api/queues", headers=with_header)).status == 200

    for headers in ({"Cookie": session}, {"Cookie": session, "X-Flowbroker-CSRF": "guessed"}):
        refused = await request(broker, "POST", "/api/producers/stop-all", headers=headers)
        assert refused.status == 403 and refused.json()["error"]["code"] == "csrf"
        assert not broker.core.producers_stopped
    other_csrf = (await login(broker))[1]  # another session's CSRF value is no good for this one
    refused = await request(broker, "POST", "/api/producers/stop-all",
                         headers={"Cookie": session, "X-Flowbroker-CSRF": other_csrf})
    assert refused.status == 403 and not broker.core.producers_stopped
    done = await request(broker, "POST", "/api/producers/stop-all",
                      headers={"Cookie": session, "X-Flowbroker-CSRF": csrf})
    assert done.status == 200 and broker.core.producers_stopped

    out = await request(broker, "POST", "/logout", headers={"Cookie": session, "X-Flowbroker-CSRF": csrf})
    assert out.status == 200 and any(c.startswith(f'{cookie(broker)}=""') or "max-age=0" in c.lower() for c in out.cookies)
    after = await request(broker, "GET", "/api/queues", headers={"Cookie": session, "X-Flowbroker-CSRF": csrf})
    assert after.status == 401  # the session is gone on the server, not only in the browser
    assert 'id="token"' in (await request(broker, "GET", "/", headers={"Cookie": session})).text


async def test_the_bearer_token_still_works_for_scripts(broker: Any) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    done = await request(broker, "POST", "/api/producers/stop-all", headers=bearer)  # no CSRF header needed
    assert done.status == 200 and broker.core.producers_stopped
    assert (await request(broker, "POST", "/api/producers/start-all", headers=bearer)).status == 200
    assert not broker.core.producers_stopped
    # a wrong bearer token is refused even beside a valid cookie: the header is what is checked
    session, _ = await login(broker)
    wrong = await request(broker, "GET", "/api/queues", headers={"Authorization": "Bearer wrong-wrong-wrong",
                                                               "Cookie": session})
    assert wrong.status == 403
    assert (await request(broker, "GET", "/session", headers=bearer)).status == 404  # no browser session


async def test_every_static_file_is_shipped_and_nothing_else_is_served(broker: Any) -> None:
    session, _ = await login(broker)
    from flowbroker.broker.console import STATIC_FILES
    for name, content_type in STATIC_FILES.items():
        answer = await request(broker, "GET", f"/console/{name}", headers={"Cookie": session})
        assert answer.status == 200 and answer.headers["content-type"] == content_type and answer.body, name
    for path in ("/console/../console.py", "/console/README.md", "/console/%2e%2e%2fconsole.py", "/console/"):
        assert (await request(broker, "GET", path, headers={"Cookie": session})).status == 404, path


async def test_two_brokers_on_one_host_keep_their_own_sessions(broker: Any, start_flowbroker: Any) -> None:
    """A browser keeps one cookie per name and host, whatever the port: each admin port names its own."""
    other = await start_flowbroker(admin={"token": TOKEN})
    mine, my_csrf = await login(broker)
    theirs, their_csrf = await login(other)
    assert mine.split("=")[0] != theirs.split("=")[0]
    both = f"{mine}; {theirs}"  # what the browser sends to either port
    assert (await request(broker, "GET", "/api/queues", headers={"Cookie": both, "X-Flowbroker-CSRF": my_csrf})
            ).status == 200
    assert (await request(other, "GET", "/api/queues", headers={"Cookie": both, "X-Flowbroker-CSRF": their_csrf})
            ).status == 200
    # and one broker's session is no credential on the other, under the other's cookie name
    swapped = f"{cookie(other)}={mine.split('=', 1)[1]}"
    assert (await request(other, "GET", "/api/queues", headers={"Cookie": swapped, "X-Flowbroker-CSRF": my_csrf})
            ).status == 401


def test_the_session_store_is_bounded_and_sessions_expire() -> None:
    now = [1000.0]
    store = SessionStore(limit=3, lifetime=60, clock=lambda: now[0])
    ids = [store.create()[0] for _ in range(4)]
    assert len(store) == 3 and store.csrf(ids[0]) is None and store.csrf(ids[3]) is not None
    now[0] += 59.9
    assert store.csrf(ids[1]) is not None
    now[0] += 0.1
    assert store.csrf(ids[1]) is None and len(store) == 2  # an expired one is forgotten when seen
    store.create()
    assert len(store) == 1  # and every expired one when a session is made
    store.end(ids[3])
    assert store.csrf(ids[3]) is None and store.csrf(None) is None
    assert MAX_SESSIONS >= 16


def test_a_full_session_store_ends_the_sessions_of_whoever_holds_the_most() -> None:
    store = SessionStore(limit=4, lifetime=60, clock=lambda: 1000.0)
    admin = store.create(False, "root")[0]
    token = store.create(False, "")[0]
    watcher = [store.create(True, "watcher")[0] for _ in range(10)]  # a monitoring user logging in over and over
    assert store.csrf(admin) is not None and store.csrf(token) is not None
    assert [store.csrf(sid) is not None for sid in watcher] == [False] * 8 + [True] * 2  # its own oldest went
    store.create(False, "ops")  # full: the one holding most (watcher, 2) gives way, not the oldest (root's)
    assert store.csrf(admin) is not None and store.csrf(watcher[8]) is None and len(store) == 4
    again = store.create(False, "root")[0]  # a tie (root 2 with this one, every other 1): its own oldest goes
    assert store.csrf(admin) is None and store.csrf(again) is not None and store.csrf(token) is not None
