"""logsafe(): what a peer names or says cannot forge a log line or a terminal, and costs a bounded amount."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker.logsafe import PEER_TEXT_LIMIT, logsafe


def test_plain_text_and_non_ascii_letters_are_unchanged() -> None:
    assert logsafe("orders.eu-west") == "orders.eu-west"
    assert logsafe("commandes-été 注文") == "commandes-été 注文"


def test_controls_format_characters_and_backslashes_are_escaped() -> None:
    assert logsafe("a\nb\r\tc") == "a\\nb\\r\\tc"
    assert logsafe("\x1b[2J\x00\x7f") == "\\x1b[2J\\x00\\x7f"
    assert logsafe("abc\u202edef\u2028") == "abc\\u202edef\\u2028"  # a bidi override, a line separator
    assert logsafe("C:\\x1b") == "C:\\\\x1b"  # a literal backslash cannot pass for an escape


def test_long_text_is_cut_first_and_says_how_much_was_left_out() -> None:
    assert logsafe("x" * (PEER_TEXT_LIMIT + 50)) == "x" * PEER_TEXT_LIMIT + "...(+50 chars)"
    assert logsafe("\n" * 1_000_000, limit=3) == "\\n\\n\\n...(+999997 chars)"


@given(st.text(), st.integers(min_value=1, max_value=300))
def test_the_result_is_printable_and_bounded(text: str, limit: int) -> None:
    safe = logsafe(text, limit)
    assert safe.isprintable()
    assert len(safe) <= 10 * limit + len("...(+ chars)") + 20
