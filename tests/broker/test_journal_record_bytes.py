"""The journal's estimate of a live message's record (`_record_bytes`) is from above, whatever its names.

Compaction copies forward the live messages of segments at most a quarter live by this estimate; an
estimate below the record (len() of a non-ASCII name counted its characters, not its up to 4 UTF-8 bytes
each) let it rewrite segments far more live than the quarter it promises (docs/storage.md)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.broker.journal import _record_bytes
from flowbroker.broker.journalrecord import MESSAGE, encode
from flowbroker.broker.message import Message
from flowbroker.protocol.credit import message_size

_names = st.text(max_size=255)
_headers = st.none() | st.dictionaries(st.text(max_size=20), st.text(max_size=40) | st.binary(max_size=40)
                                       | st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4)


@given(exchange=_names, key=_names, body=st.binary(max_size=300), headers=_headers,
       producer=st.none() | st.text(min_size=1, max_size=255), sequence=st.none() | st.integers(0, 2**63 - 1),
       qid=st.integers(0, 2**32), offset=st.integers(0, 2**63 - 1))
def test_the_estimate_is_never_below_the_record(exchange: str, key: str, body: bytes, headers: dict[str, Any] | None,
                                                 producer: str | None, sequence: int | None, qid: int,
                                                 offset: int) -> None:
    size = message_size(body, headers)
    msg = Message(exchange, key, body, headers, size, producer, sequence)
    record = encode([MESSAGE, qid, offset, exchange, key, body, headers, size, producer, sequence])
    assert _record_bytes(msg) >= len(record)


def test_names_and_a_producer_id_of_astral_characters_are_counted_by_their_bytes() -> None:
    astral = "\U0001f600" * 255
    for exchange, key, pid in ((astral, "", None), ("", astral, None), ("", "", astral)):
        msg = Message(exchange, key, b"", None, message_size(b""), pid, 2**63 - 1 if pid else None)
        record = encode([MESSAGE, 2**32, 2**63 - 1, exchange, key, b"", None, msg.size, pid, msg.sequence])
        assert len(record) > 4 * 255 and _record_bytes(msg) >= len(record)
