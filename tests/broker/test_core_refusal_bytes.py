"""One TRANSFER's refusals always fit what a reading client may have waiting: a frame carries at most
1,024 messages and each refusal is one ERROR, so each ERROR's text and destination are bounded in bytes
(broker/outbox.py `refusal`). Counted by their bytes (c0c3600), 1,024 refusals quoting a long non-ASCII
exchange name passed MAX_CONTROL_BYTES, and the broker cut off a client that read everything it was sent."""

from __future__ import annotations

from flowbroker.broker.outbox import MAX_CONTROL_BYTES, REFUSAL_TEXT_BYTES, control_cost
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error
from flowbroker.protocol.limits import MAX_ENTRIES_PER_FRAME
from tests.broker.coreharness import Harness


def test_a_frame_of_refusals_quoting_a_long_non_ascii_name_does_not_cut_off_its_client() -> None:
    h = Harness(server={"max_frame_size": 16 * 1024 * 1024}, credit={"policy": "static", "static_size": 4 << 20})
    p = h.producer("p")
    p.register()
    missing = "\U0001F600" * 1000  # an exchange no one declared, as long as a frame allows
    p.send_many([(missing, "\U0001F600" * 64, b"", None)] * MAX_ENTRIES_PER_FRAME, force=True)
    assert p.session.outbox.fault is None and not p.session.outbox.overflowed
    assert p.session.outbox.control_bytes <= MAX_CONTROL_BYTES
    p.pump()
    errors = [f for f in p.frames if isinstance(f, Error)]
    assert len(errors) == MAX_ENTRIES_PER_FRAME and {e.code for e in errors} == {ErrorCode.NOT_FOUND}
    first = errors[0]
    assert first.text.startswith("no exchange named '\U0001F600") and first.text.endswith("...")
    assert first.destination == missing[:255]  # no declared name is longer
    assert control_cost(first) <= 64 + REFUSAL_TEXT_BYTES + 4 * 255
