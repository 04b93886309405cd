"""The CLI's admin client says what is wrong with the token it was told to use, and URLs name IPv6 hosts
in brackets."""

from __future__ import annotations

from pathlib import Path

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
