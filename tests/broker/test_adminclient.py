"""The CLI's admin client says what is wrong with the token it was told to use, and URLs name IPv6 hosts
in brackets."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import click
import pytest

from flowbroker.broker.admin import url_host
from flowbroker.broker.adminclient import AdminClient


def test_a_token_file_given_that_cannot_be_read_is_named_not_asked_for(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`--token-file /nonexistent` was told to set the environment or pass --token-file (a tester)."""
    monkeypatch.delenv("FLOWBROKER_ADMIN_TOKEN", raising=False)
    client = AdminClient("http://127.0.0.1:5681", str(tmp_path / "nonexistent"))
    assert client.token is None
    assert "the token file given (--token-file or FLOWBROKER_ADMIN_TOKEN_FILE) cannot be read" in client._no_token
    assert "nonexistent" in client._no_token and "pass --token-file" not in client._no_token


def test_an_ipv6_host_goes_into_a_url_in_brackets() -> None:
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1" and url_host("broker") == "broker"


def test_https_to_the_plain_admin_port_says_to_use_http() -> None:
    """`--admin-url https://...` against the broker's admin port said 'is the broker running with its admin
    API on?' while it was (a tester): a TLS handshake with a plain-HTTP port says to use http://."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = AdminClient(f"https://127.0.0.1:{server.server_address[1]}", None, timeout=5)
        with pytest.raises(click.ClickException) as info:
            client.request("GET", "/api/broker")
        assert "give an http:// URL" in info.value.message
    finally:
        server.shutdown()
        server.server_close()


def test_the_cli_connects_within_its_timeout_long_enough_for_a_throttled_login() -> None:
    """publish --timeout 60 gave up connecting after 10 s, so a login the broker delayed for its address's
    failures (a turn up to 30 s away) could never be waited out, though the error said a longer timeout would
    (a tester)."""
    from flowbroker.broker.cli import CLI_CONNECT_SECONDS, _connect_timeout

    assert _connect_timeout(60) == CLI_CONNECT_SECONDS == 35.0 and _connect_timeout(0.2) == 1.0
    assert _connect_timeout(5) == 5.0


def test_a_peer_that_accepts_and_never_answers_is_said_to_be_no_admin_port() -> None:
    """`--admin-url http://silent-peer` printed a bare "timed out" after 10 s (a tester)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        client = AdminClient(f"http://127.0.0.1:{silent.getsockname()[1]}", None, timeout=0.5)
        client.token = "x"
        with pytest.raises(click.ClickException) as info:
            client.request("GET", "/api/broker")
    assert "timed out" in info.value.message and "admin port" in info.value.message
