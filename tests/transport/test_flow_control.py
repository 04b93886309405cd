"""Flow-control strategies: how SMs from one or many receivers become the sender limit."""

from __future__ import annotations

import pytest

from flowbroker.transport.flow_control import (
    MaxFlowControl,
    MinFlowControl,
    TaggedFlowControl,
    flow_control_from_param,
    parse_duration_ns,
    parse_flow_control_param,
    register_flow_control,
)
from flowbroker.transport.frames import SM_EOS_FLAG, StatusMessage
from flowbroker.transport.positions import compute_position

TERM_LENGTH = 64 * 1024
BITS = 16
INITIAL_TERM_ID = 2**31 - 2  # the stream wraps the int32 term id after two terms
ADDR = ("127.0.0.1", 40001)


def sm(receiver_id: int, position: int, window: int, *, gtag: int | None = None, flags: int = 0) -> StatusMessage:
    term_id = INITIAL_TERM_ID + (position >> BITS)
    term_id = (term_id + 2**31) % 2**32 - 2**31
    return StatusMessage(7, 1001, term_id, position & (TERM_LENGTH - 1), window, receiver_id, gtag, flags)


def on_sm(fc: object, message: StatusMessage, limit: int, now_ns: int = 0) -> int:
    assert isinstance(fc, (MaxFlowControl, MinFlowControl))
    return fc.on_status_message(message, ADDR, limit, INITIAL_TERM_ID, BITS, now_ns)


def test_sm_helper_crosses_the_term_id_wrap() -> None:
    message = sm(1, 3 * TERM_LENGTH + 64, 0)
    assert message.consumption_term_id == -(2**31) + 1
    assert compute_position(message.consumption_term_id, message.consumption_term_offset, BITS, INITIAL_TERM_ID) == 3 * TERM_LENGTH + 64


def test_max_takes_the_fastest_receiver_and_never_moves_back() -> None:
    fc = MaxFlowControl()
    limit = on_sm(fc, sm(1, 1000, 500), 0)
    assert limit == 1500
    limit = on_sm(fc, sm(2, 200, 500), limit)  # slower receiver does not pull the limit back
    assert limit == 1500
    limit = on_sm(fc, sm(2, 3 * TERM_LENGTH, 4096), limit)  # across the term-id wrap
    assert limit == 3 * TERM_LENGTH + 4096
    assert fc.has_required_receivers()
    assert fc.on_idle(10**12, limit, 0, False) == limit


def test_min_takes_the_slowest_live_receiver() -> None:
    fc = MinFlowControl()
    limit = on_sm(fc, sm(1, 10_000, 1000), 0, now_ns=0)
    assert limit == 11_000
    limit = on_sm(fc, sm(2, 4_000, 1000), limit, now_ns=1)
    assert limit == 5_000  # the slow one sets the pace, even if that lowers the limit
    limit = on_sm(fc, sm(2, 20_000, 1000), limit, now_ns=2)
    assert limit == 11_000  # now receiver 1 is the slowest


def test_min_forgets_a_silent_receiver_after_the_timeout() -> None:
    fc = MinFlowControl(receiver_timeout_ns=1_000)
    on_sm(fc, sm(1, 10_000, 1000), 0, now_ns=0)
    limit = on_sm(fc, sm(2, 4_000, 1000), 0, now_ns=500)
    assert limit == 5_000
    # receiver 1 keeps reporting, receiver 2 goes silent
    on_sm(fc, sm(1, 12_000, 1000), limit, now_ns=1_400)
    assert fc.on_idle(1_400, limit, 0, False) == 5_000  # 900 ns silent: still counted
    assert fc.on_idle(1_501, limit, 0, False) == 13_000  # 1001 ns silent: dropped
    assert fc.receiver_count == 1


def test_min_drops_a_receiver_that_says_end_of_stream_or_errs() -> None:
    fc = MinFlowControl()
    on_sm(fc, sm(1, 10_000, 1000), 0)
    limit = on_sm(fc, sm(2, 4_000, 1000), 0)
    assert limit == 5_000
    limit = on_sm(fc, sm(2, 4_000, 1000, flags=SM_EOS_FLAG), limit)
    assert limit == 11_000 and fc.receiver_count == 1
    fc.on_error(1, 0)
    assert fc.receiver_count == 0


def test_min_group_size_gates_connection_and_sending() -> None:
    fc = flow_control_from_param("min,g:/2")
    assert not fc.has_required_receivers()
    limit = fc.on_status_message(sm(1, 0, 1000), ADDR, 0, INITIAL_TERM_ID, BITS, 0)
    assert limit == 0 and not fc.has_required_receivers()
    limit = fc.on_status_message(sm(2, 0, 800), ADDR, limit, INITIAL_TERM_ID, BITS, 0)
    assert limit == 800 and fc.has_required_receivers()


def test_tagged_counts_only_receivers_with_the_tag() -> None:
    fc = TaggedFlowControl(group_tag=7)
    limit = on_sm(fc, sm(1, 100_000, 1000), 0)  # untagged: does not move the limit
    assert limit == 0
    limit = on_sm(fc, sm(2, 4_000, 1000, gtag=7), limit)
    assert limit == 5_000
    limit = on_sm(fc, sm(3, 1_000, 1000, gtag=8), limit)  # wrong tag: ignored
    assert limit == 5_000
    limit = on_sm(fc, sm(4, 2_000, 1000, gtag=7), limit)
    assert limit == 3_000
    assert fc.receiver_count == 2


def test_tagged_with_group_size_and_timeout_from_the_uri() -> None:
    fc = flow_control_from_param("tagged,g:99/2,t:250ms")
    assert isinstance(fc, TaggedFlowControl)
    assert fc.group_tag == 99 and fc.group_min_size == 2 and fc.receiver_timeout_ns == 250_000_000
    limit = on_sm(fc, sm(1, 0, 1000, gtag=99), 0, now_ns=0)
    assert limit == 0 and not fc.has_required_receivers()
    limit = on_sm(fc, sm(2, 64, 1000, gtag=99), limit, now_ns=0)
    assert limit == 1000 and fc.has_required_receivers()
    assert fc.on_idle(300_000_000, limit, 0, False) == limit  # both expired: limit stays, not connected
    assert not fc.has_required_receivers()


def test_retransmission_cap_depends_on_strategy() -> None:
    assert MaxFlowControl().max_retransmission_length(10**9, 1000) == 16_000
    assert MinFlowControl().max_retransmission_length(10**9, 1000) == 4_000
    assert MaxFlowControl().max_retransmission_length(500, 1000) == 500


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fastest", "unsupported flow control strategy: fc=fastest"),
        ("tagged", "needs a group tag"),
        ("min,x:1", "unknown option 'x:1'"),
        ("min,t:soon", "bad receiver timeout 't:soon'"),
        ("tagged,g:abc/2", "bad group 'g:abc/2'"),
        ("max,t:1s", "fc=max takes no options"),
    ],
)
def test_bad_fc_values_name_the_bad_part(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        flow_control_from_param(value)


def test_parse_helpers() -> None:
    assert parse_duration_ns("5s") == 5_000_000_000
    assert parse_duration_ns("100us") == 100_000
    assert parse_duration_ns("42") == 42
    assert parse_flow_control_param("min,t:1ms,g:3/4").group_min_size == 4
    assert isinstance(flow_control_from_param(None), MaxFlowControl)
    assert isinstance(flow_control_from_param("max"), MaxFlowControl)


def test_custom_strategy_registers_by_name() -> None:
    register_flow_control("always-max", lambda params: MaxFlowControl())
    assert isinstance(flow_control_from_param("always-max"), MaxFlowControl)
