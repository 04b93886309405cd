"""The web console in a real Chromium (Debian's /usr/bin/chromium, driven by Playwright's sync API)
against a `flowbroker serve` process, while a real SDK producer sends to a queue nobody consumes:
log in (a wrong token first), see the queue saturate and the producer it stops, raise its thresholds
through the form (and see a bad change refused with the broker's message), stop every producer and
see the producer's sends stop, start them again, log out. The broker's own API is the judge of every
change the console makes. The screenshot it takes is docs/console.png when FLOWBROKER_UPDATE_SCREENSHOT=1 (so that a test run
leaves the work tree as it found it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import ConsoleMessage, Dialog, Page, expect, sync_playwright

import flowbroker.client as fc
from flowbroker.client import blocking
from tests.e2e.daemon import FLOWBROKER, free_port, stop, wait_listening

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "console-e2e-token-0123456789"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "console.png"
UPDATE_SCREENSHOT = "FLOWBROKER_UPDATE_SCREENSHOT"  # =1: the run also rewrites docs/console.png
HOSTILE = "<img src=x onerror=\"alert('xss')\">"  # a queue name is the client's, not HTML
CLIENT = "orders-producer"


@dataclass
class Broker:
    url: str
    admin_url: str

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.admin_url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def producer_view(self) -> dict[str, Any]:
        conns: list[dict[str, Any]] = self.api("GET", "/api/connections")["connections"]
        [conn] = [c for c in conns if c["client_name"] == CLIENT]
        return conn


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    port, admin_port = free_port(), free_port()
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[server]\nport = {port}\n\n[admin]\nport = {admin_port}\ntoken = "{TOKEN}"\n\n'
                      '[udp]\nendpoint = "127.0.0.1:0"\n')
    proc = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, proc)
        wait_listening(admin_port, proc)
        yield Broker(f"flowbroker://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err


class Producer(threading.Thread):
    """A real SDK producer: one 100-byte message to 'orders' every 0.1 s, never waiting for credit
    (`block=False`), with at most 5 transfers in flight; `sent` and `completed` as the SDK counts them."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.ready = threading.Event()
        self.finish = threading.Event()
        self.sent = self.completed = self.refused_credit = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with blocking.connect(self.url, client_name=CLIENT, timeout=5) as conn:
                conn.declare_queue("orders", flow_stop_count=30, flow_resume_count=15)
                producer = conn.producer(routing_key="orders", window=5)
                self.ready.set()
                while not self.finish.is_set():
                    try:
                        producer.send(b"x" * 100, block=False)
                    except fc.FlowControlled:
                        self.refused_credit += 1
                    stats = producer.statistics()
                    self.sent, self.completed = stats.sent, stats.completed
                    self.finish.wait(0.1)
                producer.flush(timeout=10)
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.ready.set()


expect.set_options(timeout=15_000)  # 2 shared cores: a poll and a redraw may take a while


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        time.sleep(0.1)


def _chart_tail(page: Page, queue: str) -> list[int]:
    """The last depth, stop and resume values of a queue's uPlot chart (console.js keeps its charts
    in the page's `charts` map)."""
    tail: list[int] = page.evaluate("(q) => charts.get(q).plot.data.slice(1).map((s) => s[s.length - 1])", queue)
    return tail


def row(page: Page, table: str, key: str, value: str, column: str) -> Any:
    return page.locator(f"#{table} tbody tr[data-{key}='{value}'] td.{column}")


def test_the_console_watches_and_drives_a_broker_in_chromium(broker: Broker, tmp_path: Path) -> None:
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: `make system-tools` installs Debian's chromium"
    producer = Producer(broker.url)  # started once the console is open: its chart shows the queue fill
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 800})
                _drive(page, broker, producer, tmp_path / "console.png")
            finally:
                browser.close()
    finally:
        producer.finish.set()
        if producer.is_alive():
            producer.join(30)
    assert not producer.is_alive() and producer.error is None, producer.error


def _drive(page: Page, broker: Broker, producer: Producer, screenshot: Path) -> None:
    errors: list[str] = []
    dialogs: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(message.text)

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("console", on_console)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", on_dialog)

    # -- log in: a wrong token is refused on the page, the right one opens the console
    page.goto(broker.admin_url + "/")
    admin_port = broker.admin_url.rsplit(":", 1)[1]
    expect(page.locator("#token-file")).to_have_text(f"~/.flowbroker/admin-token-{admin_port}")
    page.fill("#token", "not-the-admin-token-at-all")
    page.click("#login")
    expect(page.locator("#login-error")).to_have_text("the admin token is wrong")
    assert page.context.cookies() == []
    errors.clear()  # the browser logs the refused login's 403 as an error: expected
    page.fill("#token", TOKEN)
    page.click("#login")
    expect(page.locator("#stop-all")).to_be_visible()
    [cookie] = page.context.cookies()
    assert cookie["name"] == f"flowbroker_session_{admin_port}"

    # -- the admin port's own 503 (max_connections open) is a line of text, shown as such, not "HTTP 503"
    busy = f"[admin] port {admin_port} has 64 connections open (its max_connections); try again when one closes\n"
    page.route("**/api/broker", lambda route: route.fulfill(status=503, content_type="text/plain", body=busy))
    expect(page.locator("#updated")).to_have_text(f"not updated: HTTP 503: {busy.strip()}")
    page.unroute("**/api/broker")
    expect(page.locator("#updated")).not_to_contain_text("not updated")
    errors.clear()  # the browser logs the 503s as errors: expected
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert page.evaluate("document.cookie") == ""  # the page's scripts cannot read the session
    # the cookie alone reads nothing (a browser sends it to every port of the host): the header value
    # the login answered, kept in this origin's storage, goes with every request of the page
    alone = {"Cookie": f"{cookie['name']}={cookie['value']}"}
    assert page.request.get(broker.admin_url + "/api/queues", headers=alone).status == 403
    csrf = page.evaluate("window.localStorage.getItem('flowbroker-csrf')")
    assert csrf and page.request.get(broker.admin_url + "/api/queues", headers={**alone, "X-Flowbroker-CSRF": csrf}
                                     ).status == 200
    producer.start()
    assert producer.ready.wait(20) and producer.error is None, producer.error

    # -- the queue saturates under the producer, and the console names the producer it stops
    saturated = row(page, "queues", "queue", "orders", "saturated")
    expect(saturated).to_contain_text("yes for", timeout=20_000)
    expect(saturated).to_contain_text("flow_stop_count")
    conn_id = broker.producer_view()["id"]
    expect(row(page, "queues", "queue", "orders", "stopped-producers")).to_have_text(f"{conn_id}:{CLIENT}")
    expect(row(page, "queues", "queue", "orders", "stop")).to_contain_text("30 /")
    expect(row(page, "queues", "queue", "orders", "held")).not_to_have_text("0")
    expect(row(page, "connections", "client", CLIENT, "role")).to_have_text("producer")
    expect(row(page, "connections", "client", CLIENT, "flow")).to_contain_text("stopped for")
    expect(row(page, "connections", "client", CLIENT, "destinations")).to_contain_text("orders (flow_stop_count")
    expect(row(page, "connections", "client", CLIENT, "granted")).to_contain_text("iB")
    expect(page.locator("#charts .chart[data-queue='orders'] canvas")).to_have_count(1)
    # what the chart draws: the depth against the stop and resume lines (the last points, from the page)
    # (waited for: a poll can land between the stop at 31 and the producer's window of 5 filling up)
    wait_for(lambda: _chart_tail(page, "orders") == [35, 30, 15], "the chart's depth reaches 35 at the stop line 30")
    expect(page.locator("#broker-summary")).to_have_text("flowbroker: 1 connection(s), 1 queue(s), 1 saturated, "
                                                        "5 transfer(s) held")
    time.sleep(4)  # a few more seconds of history on the chart: the depth flat at the stop line
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get(UPDATE_SCREENSHOT) == "1":
        shutil.copyfile(screenshot, DOCS_SCREENSHOT)
    assert broker.api("GET", "/api/queues/orders")["saturated"]

    # -- a name a client chose is shown as text, never run as HTML
    with blocking.connect(broker.url, client_name="namer", timeout=5) as conn:
        conn.declare_queue(HOSTILE)
    expect(page.locator("#queues td.name", has_text="<img")).to_have_text(HOSTILE)
    expect(page.locator("#threshold-queue option", has_text="<img")).to_have_count(1)
    assert page.locator("img").count() == 0 and not any("xss" in d for d in dialogs)

    # -- the thresholds form: a change the broker refuses shows its message, and nothing changes
    page.select_option("#threshold-queue", "orders")
    page.fill("#flow_stop_count", "1000")
    page.fill("#flow_resume_count", "2000")
    page.click("#apply-thresholds")
    expect(page.locator("#thresholds-result")).to_contain_text("Refused: ")
    expect(page.locator("#thresholds-result")).to_contain_text("flow_resume_count")
    assert broker.api("GET", "/api/queues/orders")["thresholds"]["flow_stop_count"] == 30
    # ... and an accepted one is applied by the broker, which releases the producer; only the fields
    # edited are sent, so what another operator changed meanwhile (here a size, by the API) stays
    broker.api("PATCH", "/api/queues/orders", {"flow_stop_size": 4 << 20, "flow_resume_size": 3 << 20})
    expect(row(page, "queues", "queue", "orders", "stop")).to_have_text("30 / 4.00 MiB")  # the page has seen it
    expect(page.locator("#flow_stop_size")).to_have_value(str(80 << 20))  # the form has not: stale
    page.fill("#flow_resume_count", "800")
    completed = producer.completed
    page.click("#apply-thresholds")
    expect(page.locator("#thresholds-result")).to_contain_text("flow_stop_count 1000, flow_resume_count 800")
    assert "flow_stop_count: 30 -> 1000" in dialogs[-1] and "flow_resume_count: 15 -> 800" in dialogs[-1]
    orders = broker.api("GET", "/api/queues/orders")
    assert orders["thresholds"]["flow_stop_count"] == 1000 and orders["thresholds"]["flow_resume_count"] == 800
    assert orders["saturated"] is False
    assert (orders["thresholds"]["flow_stop_size"], orders["thresholds"]["flow_resume_size"]) == (4 << 20, 3 << 20)
    wait_for(lambda: producer.completed > completed + 10, "the released producer's messages complete")
    wait_for(lambda: _chart_tail(page, "orders")[1:] == [1000, 800], "the chart's lines move to the new thresholds")
    expect(saturated).to_have_text("no")
    expect(page.locator("#broker-summary")).to_contain_text("2 queue(s), 0 saturated, 0 transfer(s) held")

    # -- a count past the broker's bound is refused in its words, before anything is asked or sent
    asked = len(dialogs)
    page.fill("#flow_stop_count", "1e20")
    page.click("#apply-thresholds")
    expect(page.locator("#thresholds-result")).to_have_text("flow_stop_count must be an integer in [0, 2^50] (0 = off)")
    assert len(dialogs) == asked
    page.fill("#flow_stop_count", "")

    # -- a time threshold (seconds, fractions allowed) through the same form, shown after count / size
    page.fill("#flow_stop_age", "-1")  # the input's own min="0" stops the form before anything is asked or sent
    page.click("#apply-thresholds")
    assert page.locator("#flow_stop_age").evaluate("e => e.validity.rangeUnderflow") and len(dialogs) == asked
    page.fill("#flow_stop_age", "600.5")
    page.click("#apply-thresholds")
    expect(page.locator("#thresholds-result")).to_contain_text("flow_stop_age 600.5")
    assert "flow_stop_age: 0 -> 600.5" in dialogs[-1]
    assert broker.api("GET", "/api/queues/orders")["thresholds"]["flow_stop_age"] == 600.5
    expect(row(page, "queues", "queue", "orders", "stop")).to_have_text("1000 / 4.00 MiB · age 600.5 s")
    expect(saturated).to_have_text("no")

    # -- stop-all: the producer is held broker-wide and its sends stop
    page.click("#stop-all")
    assert "Stop every producer" in dialogs[-1]
    expect(page.locator("#banner")).to_be_visible()
    expect(row(page, "connections", "client", CLIENT, "destinations")).to_contain_text("* (stop-all)")
    assert broker.api("GET", "/api/broker")["producers_stopped"] is True
    wait_for(lambda: broker.producer_view()["flow"]["admin_stopped"], "the producer told it is stopped")
    time.sleep(1.5)  # what was in flight when the stop came is held, then its window of 5 is full
    sent, completed = producer.sent, producer.completed
    time.sleep(2)  # ~20 sends were due in these 2 s
    assert (producer.sent, producer.completed) == (sent, completed)
    assert broker.producer_view()["producer"]["transfers_held"] > 0

    # -- start-all: its sends go on
    page.click("#start-all")
    assert "Start every producer" in dialogs[-1]
    expect(page.locator("#banner")).to_be_hidden()
    wait_for(lambda: producer.completed > completed + 10, "the producer's sends go on after start-all")
    assert broker.api("GET", "/api/broker")["producers_stopped"] is False
    expect(row(page, "connections", "client", CLIENT, "flow")).to_have_text("running")

    # no script error, no CSP violation, no missing file: only the refused PATCH's 400, logged by the browser
    assert [e for e in errors if "status of 400" not in e] == [], errors

    # -- log out: back at the login page, and the cookie opens nothing any more
    page.click("#logout")
    expect(page.locator("#token")).to_be_visible()
    assert page.context.cookies() == []
    assert page.evaluate("window.localStorage.getItem('flowbroker-csrf')") is None
    old = {"Cookie": f"{cookie['name']}={cookie['value']}", "X-Flowbroker-CSRF": csrf}  # what a copy would carry
    assert page.request.get(broker.admin_url + "/api/queues", headers=old).status == 401


def test_a_monitoring_user_sees_no_change_buttons_and_a_forced_change_is_still_refused(tmp_path: Path) -> None:
    """A user with the monitoring tag logs in to the console with its name and password: the stop-all and
    start-all buttons and the thresholds form are not shown (the page says it is read only), the views
    are; a change forced from the page's own session (with its CSRF token) is refused with 403 read_only
    and changes nothing; an administrator's session beside it keeps the buttons."""
    from flowbroker.broker.users import User, write_users
    from flowbroker.protocol.scram import StoredCredential

    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: `make system-tools` installs Debian's chromium"
    users = tmp_path / "users.json"
    watch_pw, root_pw = StoredCredential.from_password("w4tch-pw"), StoredCredential.from_password("r00t-pw")
    write_users(users, {"watch": User("watch", watch_pw, ("monitoring",)),
                        "root": User("root", root_pw, ("administrator",))})
    port, admin_port = free_port(), free_port()
    config = tmp_path / "flowbroker.toml"
    config.write_text(f'[server]\nport = {port}\n\n[admin]\nport = {admin_port}\ntoken = "{TOKEN}"\n\n'
                      f'[udp]\nenabled = false\n\n[auth]\nusers_file = "{users}"\nfailed_login_delay = 0.1\n')
    proc = subprocess.Popen([FLOWBROKER, "serve", "--config", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, proc)
        wait_listening(admin_port, proc)
        broker = Broker(f"flowbroker://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
        with blocking.connect(broker.url, timeout=10) as conn:
            conn.declare_queue("watched")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                watcher = browser.new_context().new_page()
                _log_in(watcher, broker, "watch", "w4tch-pw")
                expect(row(watcher, "queues", "queue", "watched", "saturated")).to_be_visible()  # views: shown
                expect(watcher.locator("#read-only")).to_be_visible()
                for hidden in ("#stop-all", "#start-all", "#thresholds-form", "#apply-thresholds"):
                    expect(watcher.locator(hidden)).to_be_hidden()
                expect(watcher.locator("#logout")).to_be_visible()
                forced = watcher.evaluate("""async () => {
                    const csrf = window.localStorage.getItem("flowbroker-csrf");
                    const session = await (await fetch("/session", {headers: {"X-Flowbroker-CSRF": csrf}})).json();
                    const answer = await fetch("/api/producers/stop-all", {method: "POST",
                        headers: {"X-Flowbroker-CSRF": session.csrf}, credentials: "same-origin"});
                    return {status: answer.status, body: await answer.json(), read_only: session.read_only};
                }""")
                assert forced["read_only"] is True and forced["status"] == 403, forced
                assert forced["body"]["error"]["code"] == "read_only"
                assert broker.api("GET", "/api/broker")["producers_stopped"] is False  # nothing changed

                admin = browser.new_context().new_page()  # an administrator beside it keeps the buttons
                _log_in(admin, broker, "root", "r00t-pw")
                expect(admin.locator("#stop-all")).to_be_visible()
                expect(admin.locator("#thresholds-form")).to_be_visible()
                expect(admin.locator("#read-only")).to_be_hidden()

                # Two tabs of one browser: the second's login replaces the cookie's session (and the
                # header value in the origin's storage); Log out in the first ends that session on the
                # broker (it sent the first session's stale value, was refused 403 and left it open).
                context = browser.new_context()
                first, second = context.new_page(), context.new_page()
                _log_in(first, broker, "root", "r00t-pw")
                second.goto(broker.admin_url + "/login")
                second.fill("#username", "root")
                second.fill("#password", "r00t-pw")
                second.click("#login")
                expect(second.locator("#logout")).to_be_visible()
                [cookie] = context.cookies()
                csrf = second.evaluate("window.localStorage.getItem('flowbroker-csrf')")
                live = {"Cookie": f"{cookie['name']}={cookie['value']}", "X-Flowbroker-CSRF": csrf}
                assert first.request.get(broker.admin_url + "/api/broker", headers=live).status == 200
                first.click("#logout")
                expect(first.locator("#username")).to_be_visible()
                assert first.request.get(broker.admin_url + "/api/broker", headers=live).status == 401

                # root demoted to monitoring while its page is open: the page drops its change buttons
                # within seconds (it kept them until a reload, a tester), and shows them again if promoted
                demoted = {"watch": User("watch", watch_pw, ("monitoring",)),
                           "root": User("root", root_pw, ("monitoring",))}  # (the same credential: not ended)
                write_users(users, demoted)
                expect(admin.locator("#read-only")).to_be_visible()
                expect(admin.locator("#stop-all")).to_be_hidden()
                demoted["root"] = User("root", root_pw, ("administrator",))
                write_users(users, demoted)
                expect(admin.locator("#stop-all")).to_be_visible()
                expect(admin.locator("#read-only")).to_be_hidden()
            finally:
                browser.close()
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err


def _log_in(page: Page, broker: Broker, user: str, password: str) -> None:
    page.goto(broker.admin_url + "/")
    page.fill("#username", user)
    page.fill("#password", password)
    page.click("#login")
    expect(page.locator("#logout")).to_be_visible()


def test_a_saturated_queue_is_shown_however_many_queues_are_named_before_it(broker: Broker) -> None:
    """The page reads the first 1,000 queues by name: 1,000 queues named before 'orders' (an attacker
    needs only to declare them) took it off the page, and the header counted "0 saturated of the first
    1000" beside the producer it held (a tester). The page also reads the saturated queues' own page."""
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: `make system-tools` installs Debian's chromium"
    with blocking.connect(broker.url, client_name="namer", timeout=10) as conn:
        for i in range(1000):
            conn.declare_queue(f"a-{i:04}")
    producer = Producer(broker.url)
    producer.start()
    try:
        assert producer.ready.wait(20) and producer.error is None, producer.error
        wait_for(lambda: broker.api("GET", "/api/queues/orders")["saturated"], "'orders' saturates")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(broker.admin_url + "/")
                page.fill("#token", TOKEN)
                page.click("#login")
                expect(row(page, "queues", "queue", "orders", "saturated")).to_contain_text("yes for", timeout=30_000)
                expect(page.locator("#broker-summary")).to_contain_text("1001 queue(s), 1 saturated,")
                expect(page.locator("#charts .chart[data-queue='orders'] canvas")).to_have_count(1)  # the deepest
                expect(page.locator("#threshold-queue option[value='orders']")).to_have_count(1)
                expect(page.locator("#updated")).to_contain_text("and every saturated one")
            finally:
                browser.close()
    finally:
        producer.finish.set()
        broker.api("PATCH", "/api/queues/orders", {"flow_stop_count": 1000, "flow_resume_count": 800})
        producer.join(30)
    assert not producer.is_alive() and producer.error is None, producer.error


def test_a_threshold_typed_back_to_its_filled_value_is_sent_and_a_cut_saturated_list_is_said(broker: Broker) -> None:
    """The form sends the fields typed in: one typed back to the value the form was filled with, after
    someone else changed it, was dropped with "Nothing to change" (a tester). And the line under the
    header said "every saturated one" while more than 1000 were saturated and some were not listed."""
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: `make system-tools` installs Debian's chromium"
    with blocking.connect(broker.url, timeout=10) as conn:
        conn.declare_queue("q", flow_stop_count=30, flow_resume_count=15)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            dialogs: list[str] = []

            def on_dialog(dialog: Dialog) -> None:
                dialogs.append(dialog.message)
                dialog.accept()

            page.on("dialog", on_dialog)
            page.goto(broker.admin_url + "/")
            page.fill("#token", TOKEN)
            page.click("#login")
            page.select_option("#threshold-queue", "q")
            expect(page.locator("#flow_stop_count")).to_have_value("30")
            broker.api("PATCH", "/api/queues/q", {"flow_stop_count": 50, "flow_resume_count": 25})  # someone else
            expect(row(page, "queues", "queue", "q", "stop")).to_contain_text("50 /")
            page.fill("#flow_stop_count", "30")  # back to what it was: typed, so sent
            page.fill("#flow_resume_count", "15")
            page.click("#apply-thresholds")
            expect(page.locator("#thresholds-result")).to_contain_text("flow_stop_count 30, flow_resume_count 15")
            assert "flow_stop_count: 50 -> 30" in dialogs[-1]
            thresholds = broker.api("GET", "/api/queues/q")["thresholds"]
            assert (thresholds["flow_stop_count"], thresholds["flow_resume_count"]) == (30, 15)

            # a queue named "." is refused by the page, before anything is asked or sent (the request went
            # to PATCH /api/queues/ and said "no queue named ''", a tester)
            with blocking.connect(broker.url, timeout=10) as conn:
                conn.declare_queue(".")
            page.wait_for_function("() => [...document.querySelectorAll('#threshold-queue option')]"
                                   ".some(o => o.value === '.')")
            page.select_option("#threshold-queue", ".")
            page.fill("#flow_stop_count", "7")
            asked = len(dialogs)
            page.click("#apply-thresholds")
            expect(page.locator("#thresholds-result")).to_contain_text("cannot be changed from this page")
            expect(page.locator("#thresholds-result")).to_contain_text("flowbroker queue set")
            assert len(dialogs) == asked

            # more than 1000 saturated (the API's page says so with its cursor): the line says the list was cut
            page.route("**/api/queues?saturated=true&limit=1000",
                       lambda route: route.fulfill(status=200, content_type="application/json",
                                                   body='{"queues": [], "next": "zz"}'))
            expect(page.locator("#updated")).to_contain_text("(the first 1000 saturated queues by name)")
        finally:
            browser.close()
