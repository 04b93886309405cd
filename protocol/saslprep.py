"""SASLprep (RFC 4013), the stringprep (RFC 3454) profile SCRAM (RFC 5802 section 2.2) prepares user
names and passwords with, so that a password typed as "I\\u00adX" or with a no-break space is the same
password everywhere. Standard library only (`stringprep`, `unicodedata`); sans-IO.

Steps, in the RFC's order: map non-ASCII spaces (table C.1.2) to SPACE and remove the characters
"commonly mapped to nothing" (B.1); normalise to NFKC; refuse the prohibited characters (C.1.2, C.2.1,
C.2.2, C.3, C.4, C.5, C.6, C.7, C.8, C.9); check bidirectional text (RFC 3454 section 6); and, for
stored strings (a password being hashed into the users file, a user name being added), refuse
unassigned code points (A.1), which queries (a client logging in) may carry.

Printable ASCII comes out unchanged, so credentials made before SASLprep from ASCII passwords stay valid.
"""

from __future__ import annotations

import stringprep
import unicodedata

__all__ = ["SaslprepError", "saslprep"]


class SaslprepError(ValueError):
    """The string cannot be prepared: names the rule and the code point (never the string, which may be a
    password)."""


_PROHIBITED = (
    (stringprep.in_table_c12, "a non-ASCII space"),
    (stringprep.in_table_c21_c22, "a control character"),
    (stringprep.in_table_c3, "a private use character"),
    (stringprep.in_table_c4, "a non-character code point"),
    (stringprep.in_table_c5, "a surrogate code point"),
    (stringprep.in_table_c6, "a character inappropriate for plain text"),
    (stringprep.in_table_c7, "a character inappropriate for canonical representation"),
    (stringprep.in_table_c8, "a character that changes display properties or is deprecated"),
    (stringprep.in_table_c9, "a tagging character"),
)


def saslprep(text: str, *, stored: bool = False, what: str = "string") -> str:
    """`text` prepared by SASLprep; `stored`: refuse unassigned code points too (RFC 3454 section 7).
    SaslprepError names `what` (e.g. "password"), the rule and the code point."""
    if text.isascii() and text.isprintable():
        return text  # the common case: nothing to map, normalise or prohibit
    mapped = "".join(" " if stringprep.in_table_c12(c) else c for c in text if not stringprep.in_table_b1(c))
    prepared = unicodedata.normalize("NFKC", mapped)
    for c in prepared:
        for test, name in _PROHIBITED:
            if test(c):
                raise SaslprepError(f"{what}: {name} (U+{ord(c):04X}) is prohibited (RFC 4013)")
        if stored and stringprep.in_table_a1(c):
            raise SaslprepError(f"{what}: unassigned code point U+{ord(c):04X} (RFC 4013)")
    if any(stringprep.in_table_d1(c) for c in prepared):
        if any(stringprep.in_table_d2(c) for c in prepared):
            raise SaslprepError(f"{what}: mixes right-to-left and left-to-right characters (RFC 3454 section 6)")
        if not (stringprep.in_table_d1(prepared[0]) and stringprep.in_table_d1(prepared[-1])):
            raise SaslprepError(f"{what}: right-to-left text must begin and end with a right-to-left "
                                "character (RFC 3454 section 6)")
    return prepared
