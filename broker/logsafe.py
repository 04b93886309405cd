"""Text a peer chose, made safe to put in a log line or a terminal table.

Client names, queue names and the text of a peer's ERROR are free text from the wire. Written raw, a
newline forges a log line, an escape sequence rewrites a terminal, a bidi override reverses what an
operator reads, and a 64 KiB error text floods the log. `logsafe()` escapes every character that is
not printable (as `\\n`, `\\x1b`, `\\u202e`; a backslash as `\\\\`, so the result reads back
unambiguously) and cuts the text to `limit` characters first, so its cost is bounded by `limit`, not by
what was sent. The broker's logs use it; the CLI's tables may too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["logsafe", "LOG_INTERVAL", "PEER_TEXT_LIMIT", "RateLimitedLog"]

PEER_TEXT_LIMIT = 200
"""Characters of a peer-supplied text kept in a log line (the rest is counted, not shown)."""

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def logsafe(text: object, limit: int | None = PEER_TEXT_LIMIT, *, backslash: bool = True) -> str:
    """`text` (str() of it) with control and format characters escaped, cut to `limit` characters
    (None: not cut, for CLI tables whose names the broker already bounded).

    A cut text ends with `...(+N chars)`. Printable text, including non-ASCII letters, is unchanged.
    `backslash=False` leaves backslashes alone, for texts that show names with repr() already.
    """
    value = text if isinstance(text, str) else str(text)
    extra = len(value) - limit if limit is not None else 0
    if extra > 0:
        value = value[:limit]
    if not value.isprintable() or (backslash and "\\" in value):  # plain text costs one scan
        # str.isprintable() is False for Unicode's "Other" and "Separator" categories but the space:
        # controls, format characters (bidi overrides), surrogates, unassigned, line separators.
        value = "".join(_escape(c) if (c == "\\" and backslash) or not c.isprintable() else c for c in value)
    return f"{value}...(+{extra} chars)" if extra > 0 else value


LOG_INTERVAL = 10.0
"""Seconds between two lines of one RateLimitedLog."""


def _trio_time() -> float:
    import trio  # (the shells' clock: imported where one is used, not by the sans-IO core)

    return trio.current_time()


class RateLimitedLog:
    """Logs a recurring message at most once per `interval` seconds, saying how many it left out. `clock`:
    seconds, trio's by default (the shells'); the sans-IO core passes its own."""

    def __init__(
        self, logger: logging.Logger, level: int, interval: float = LOG_INTERVAL,
        clock: Callable[[], float] | None = None,
    ):
        self.logger = logger
        self.clock = clock or _trio_time
        self.level = level
        self.interval = interval
        self.suppressed = 0
        self._last = -float("inf")

    def __call__(self, message: str, *args: object, exc_info: BaseException | None = None) -> bool:
        """Log it, or count it as left out; True if it was logged (a caller may log the others elsewhere)."""
        now = self.clock()
        if now - self._last < self.interval:
            self.suppressed += 1
            return False
        if self.suppressed:
            message += " (and %d more like it in the last %.0f s)"
            args = (*args, self.suppressed, now - self._last)
        self.logger.log(self.level, message, *args, exc_info=exc_info)
        self._last = now
        self.suppressed = 0
        return True
