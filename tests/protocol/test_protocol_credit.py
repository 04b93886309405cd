"""Byte credit: SenderWindow (sender side, DCP rules, absolute acks) and ReceiverWindow (receiver side)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowbroker.protocol import (
    ACK_BYTES,
    ACK_INTERVAL_NS,
    ReceiverWindow,
    BufferAck,
    SenderWindow,
    BufferState,
    CreditError,
    message_size,
)
from flowbroker.protocol.credit import HEADER_OVERHEAD, MESSAGE_OVERHEAD, text_size

S = 1_000_000_000  # ns per second

# --- SenderWindow ----------------------------------------------------------------------------------


def test_fresh_buffer() -> None:
    log = SenderWindow(100)
    assert log.may_send() and log.state is BufferState.SPACE_AVAILABLE
    assert log.outstanding == 0 and log.limit == 100


def test_overflow_by_one_message() -> None:
    log = SenderWindow(100)
    log.on_sent(99)
    assert log.may_send()  # one byte of space left: the next message may be any size
    log.on_sent(500)
    assert log.outstanding == 599
    assert not log.may_send() and log.state is BufferState.FULL
    assert log.on_ack(99) == 99
    assert not log.may_send()  # 500 outstanding is still over 100
    assert log.on_ack(500) == 401
    assert log.outstanding == 99 and log.may_send()


def test_exactly_full_is_full() -> None:
    log = SenderWindow(100)
    log.on_sent(100)
    assert not log.may_send() and log.state is BufferState.FULL
    log.on_ack(1)
    assert log.may_send()


def test_message_bigger_than_the_whole_buffer_goes_when_empty() -> None:
    log = SenderWindow(10)
    assert log.may_send()
    log.on_sent(10_000)
    assert not log.may_send()
    log.on_ack(9_999)
    assert log.may_send()  # one byte outstanding, under 10
    log.on_sent(10_000)
    assert not log.may_send()


def test_duplicate_and_stale_acks_change_nothing() -> None:
    log = SenderWindow(100)
    log.on_sent(300)
    assert log.on_ack(200) == 200
    assert log.on_ack(200) == 0  # duplicate
    assert log.on_ack(150) == 0  # stale, arrived late
    assert log.on_ack(0) == 0
    assert log.acked_position == 200 and log.outstanding == 100


def test_acking_more_than_was_sent_raises_and_changes_nothing() -> None:
    log = SenderWindow(100)
    log.on_sent(50)
    log.on_ack(20)
    with pytest.raises(CreditError):
        log.on_ack(51)
    assert log.acked_position == 20 and log.position == 50


def test_resize_below_in_flight_loses_nothing() -> None:
    log = SenderWindow(1000)
    for _ in range(9):
        log.on_sent(100)
    log.resize(100)
    assert log.position == 900 and log.outstanding == 900  # nothing forgotten or refused
    assert not log.may_send()
    assert log.on_ack(700) == 700
    assert not log.may_send()  # 200 outstanding > 100
    assert log.on_ack(850) == 150
    assert log.may_send()  # 50 < 100
    log.resize(5000)
    assert log.may_send() and log.limit == 850 + 5000


def test_size_zero_disables_flow_control() -> None:
    log = SenderWindow(0)
    assert log.state is BufferState.DISABLED
    for _ in range(100):
        assert log.may_send()
        log.on_sent(1 << 20)
    assert log.state is BufferState.DISABLED
    # Turning flow control off releases a full buffer; turning it on again applies it at once.
    full = SenderWindow(10)
    full.on_sent(100)
    assert not full.may_send()
    full.resize(0)
    assert full.may_send() and full.state is BufferState.DISABLED
    full.resize(10)
    assert not full.may_send()


def test_negative_sizes_are_refused() -> None:
    with pytest.raises(CreditError):
        SenderWindow(-1)
    with pytest.raises(CreditError):
        SenderWindow(10).resize(-1)


@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=30),
    data=st.data(),
)
def test_acks_in_any_order_with_duplicates_reach_the_in_order_state(sizes: list[int], data: st.DataObject) -> None:
    positions = []
    total = 0
    for size in sizes:
        total += size
        positions.append(total)
    # The receiver acknowledges at some of the message boundaries, always including the last.
    acks = sorted(set(data.draw(st.lists(st.sampled_from(positions), max_size=10))) | {total})
    in_order = SenderWindow(1000)
    in_order.on_sent(total)
    for a in acks:
        in_order.on_ack(a)

    delivered = data.draw(st.permutations(acks + data.draw(st.lists(st.sampled_from(acks), max_size=10))))
    log = SenderWindow(1000)
    log.on_sent(total)
    freed = 0
    for a in delivered:
        freed += log.on_ack(a)
        assert 0 <= log.outstanding <= total
    assert (log.acked_position, log.outstanding, log.may_send()) == (
        in_order.acked_position,
        in_order.outstanding,
        in_order.may_send(),
    )
    assert freed == total and log.outstanding == 0


@given(st.lists(st.tuples(st.sampled_from(["send", "ack", "resize"]), st.integers(0, 5000)), max_size=60))
def test_random_operations_keep_invariants(ops: list[tuple[str, int]]) -> None:
    """A sender that sends only when may_send() never has more than buffer + one message out."""
    log = SenderWindow(1000)
    largest = 0
    for op, n in ops:
        if op == "send" and log.may_send():
            before = log.outstanding
            assert log.window == 0 or before < log.window
            log.on_sent(n)
            largest = max(largest, n)
        elif op == "ack":
            target = min(log.position, log.acked_position + n)
            log.on_ack(target)
        elif op == "resize":
            log.resize(n)
        assert 0 <= log.outstanding
        assert log.acked_position <= log.position


# --- message_size -------------------------------------------------------------------------------


def test_message_size() -> None:
    assert message_size(b"") == MESSAGE_OVERHEAD
    assert message_size(b"x" * 100) == 100 + MESSAGE_OVERHEAD
    assert message_size(b"x", {"key": "value", "b": b"12", "n": 5, "none": None}) == (
        1 + MESSAGE_OVERHEAD + HEADER_OVERHEAD + (3 + 5) + (1 + 2) + (1 + 8) + (4 + 8) + 4 * HEADER_OVERHEAD
    )
    assert message_size(b"x", {}) == message_size(b"x", None)


def test_a_non_ascii_header_string_is_charged_four_bytes_a_character_and_its_utf8_bytes() -> None:
    """A header of 10^6 emoji was charged 1 MB (its code points) and took 8 MB in the broker once delivered
    (4 bytes a character, and the UTF-8 copy its DELIVER left): a client held 4.6 times the memory bound
    (a tester). Then twice its UTF-8 bytes: ASCII with one emoji in it is kept at 4 bytes a character plus
    its UTF-8 copy, 5 against 2 charged (1.9 times the bound, a tester). ASCII is charged as before; any
    other string 4 bytes a character plus its UTF-8 bytes (docs/protocol.md)."""
    base = MESSAGE_OVERHEAD + 2 * HEADER_OVERHEAD + 1
    assert message_size(b"", {"a": "ascii"}) == base + 5
    assert message_size(b"", {"a": "\u00e9" * 10}) == base + 40 + 20  # 2 bytes each in UTF-8
    assert message_size(b"", {"a": "\u6f22" * 10}) == base + 40 + 30
    assert message_size(b"", {"a": "\U0001f600" * 10}) == base + 40 + 40
    assert message_size(b"", {"a": "a" * 1000 + "\U0001f600"}) == base + 4 * 1001 + 1004
    assert message_size(b"", {"\u00e9": "x"}) == base - 1 + 4 + 2 + 1  # keys too
    assert message_size(b"", {"a": "\U0001f600".encode()}) == base + 4  # bytes: their length
    assert text_size("plain") == 5 and text_size("\udc80") == 4 + 3  # (a lone surrogate: surrogatepass)


@given(st.text(max_size=300))
def test_a_header_string_is_charged_at_least_what_cpython_keeps_of_it_once_delivered(text: str) -> None:
    """The charge covers the string's memory beyond its object's head (sys.getsizeof of it less an empty
    one's) and the UTF-8 copy that encoding it for a DELIVER leaves on it."""
    import sys

    kept = sys.getsizeof(text) - sys.getsizeof("")
    if not text.isascii():
        kept += len(text.encode("utf-8", "surrogatepass")) + 1
    assert text_size(text) + 64 >= kept  # (64: the head of a wider string, beside an ASCII one's)


# --- ReceiverWindow -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "buffer_size, expected",
    [
        (100, 20),  # 20 % of a small buffer
        (256_000, 51_200),  # the two rules meet
        (1 << 20, ACK_BYTES),  # 50 KiB caps a large buffer
        (10 << 20, 50 * 1024),
        (4, 1),  # never 0: every byte processed is eventually worth an ack
    ],
)
def test_threshold_is_min_of_20_percent_and_50_kib(buffer_size: int, expected: int) -> None:
    assert ReceiverWindow(buffer_size).threshold() == expected


def test_ack_after_20_percent_processed() -> None:
    sched = ReceiverWindow(1000, opaque=7)
    assert sched.on_consumed(199, 1) is None
    assert sched.pending == 199
    ack = sched.on_consumed(1, 2)
    assert ack == BufferAck(7, 200, 200)
    assert sched.pending == 0
    assert sched.on_consumed(150, 3) is None
    assert sched.on_consumed(150, 4) == BufferAck(7, 300, 500)  # one ack for everything pending


def test_ack_after_50_kib_processed_on_a_large_buffer() -> None:
    sched = ReceiverWindow(10 << 20)
    assert sched.on_consumed(ACK_BYTES - 1, 1) is None
    ack = sched.on_consumed(1, 2)
    assert ack is not None and ack.freed == ACK_BYTES and ack.acked_position == ACK_BYTES


def test_timer_acks_what_is_pending_once_per_interval() -> None:
    sched = ReceiverWindow(1000)
    sched.on_consumed(10, 0)  # under the threshold
    assert sched.poll(ACK_INTERVAL_NS - 1) is None
    ack = sched.poll(ACK_INTERVAL_NS)
    assert ack is not None and ack.freed == 10 and ack.acked_position == 10
    assert sched.poll(ACK_INTERVAL_NS) is None
    sched.on_consumed(5, ACK_INTERVAL_NS + 1)
    assert sched.poll(2 * ACK_INTERVAL_NS - 1) is None  # not before the interval has passed again
    assert sched.poll(2 * ACK_INTERVAL_NS) == BufferAck(0, 5, 15)


def test_timer_re_advertises_once_per_interval_when_nothing_is_pending() -> None:
    sched = ReceiverWindow(1000)
    sched.on_consumed(300, 1 * S)  # acked at once (over 20 %)
    acks = [a for t in range(0, 21 * S, S // 10) if (a := sched.poll(t)) is not None]
    # Sent at 1 s; re-advertised at 6, 11, 16 s: the absolute position, nothing newly freed.
    assert acks == [BufferAck(0, 0, 300)] * 3
    assert sched.acked_position == 300


def test_threshold_ack_restarts_the_interval() -> None:
    sched = ReceiverWindow(1000)
    assert sched.on_consumed(200, 3 * S) is not None
    sched.on_consumed(1, 3 * S)
    assert sched.poll(5 * S) is None  # only 2 s since the last ack
    assert sched.poll(8 * S) == BufferAck(0, 1, 201)


def test_buffer_zero_sends_no_acks() -> None:
    sched = ReceiverWindow(0)
    assert sched.on_consumed(1 << 30, 0) is None
    assert sched.poll(100 * S) is None
    assert sched.flush(100 * S) is None


def test_flush_acks_pending_now() -> None:
    sched = ReceiverWindow(1000)
    assert sched.flush(0) is None
    sched.on_consumed(3, 0)
    assert sched.flush(1) == BufferAck(0, 3, 3)
    assert sched.flush(2) is None


def test_a_dropped_ack_is_recovered_by_the_next_poll() -> None:
    """The last ack before the sender blocks is lost; the next poll re-advertises the absolute
    position and the sender carries on, without any byte being counted twice."""
    sender = SenderWindow(1000)
    receiver = ReceiverWindow(1000)
    now = 0
    in_flight: list[int] = []
    dropped = 0
    sent_msgs = 0
    while sent_msgs < 40:
        while sender.may_send():
            sender.on_sent(150)
            in_flight.append(150)
            sent_msgs += 1
        # The receiver processes everything in flight; acks come back, but the third is lost.
        while in_flight:
            now += 1000
            ack = receiver.on_consumed(in_flight.pop(0), now)
            if ack is not None:
                if dropped == 0 and sent_msgs >= 14:
                    dropped = ack.acked_position
                    continue
                sender.on_ack(ack.acked_position)
        if not sender.may_send():
            assert dropped  # the sender only stalls because of the lost ack
            assert receiver.on_consumed(0, now) is None  # nothing new to trigger an ack
            assert receiver.poll(now) is None  # and the interval has not passed
            now += ACK_INTERVAL_NS
            ack = receiver.poll(now)
            assert ack is not None and ack.acked_position == receiver.consumed_position
            assert sender.on_ack(ack.acked_position) > 0
            assert sender.may_send()
    assert dropped
    assert sender.acked_position < receiver.consumed_position  # the tail is under the threshold ...
    ack = receiver.poll(now + ACK_INTERVAL_NS)  # ... until the timer acknowledges it
    assert ack is not None
    sender.on_ack(ack.acked_position)
    assert sender.acked_position == receiver.consumed_position == sender.position


@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=60),
    buffer_size=st.integers(1, 5000),
    channel=st.data(),
)
def test_lossy_duplicating_reordering_ack_channel_neither_stalls_nor_overruns(
    sizes: list[int], buffer_size: int, channel: st.DataObject
) -> None:
    """Acks may be lost, duplicated or delayed; with a poll each interval the sender always gets
    all its messages through, and it never starts a message with the buffer full."""
    sender = SenderWindow(buffer_size)
    receiver = ReceiverWindow(buffer_size)
    queue = list(sizes)
    link: list[int] = []  # data in flight to the receiver
    acks: list[BufferAck] = []  # acks in flight to the sender
    now = 0
    for _ in range(10 * len(sizes) + 100):
        if not queue and not link and sender.acked_position == sender.position:
            break
        now += channel.draw(st.sampled_from([1, 1000, ACK_INTERVAL_NS]))
        if queue and sender.may_send():
            assert sender.outstanding < buffer_size
            size = queue.pop(0)
            sender.on_sent(size)
            link.append(size)
        deliver: bool = channel.draw(st.booleans())  # drawn apart: `link and draw()` infers list[int]
        if link and deliver:
            ack = receiver.on_consumed(link.pop(0), now)
            if ack is not None:
                acks.append(ack)
        ack = receiver.poll(now)
        if ack is not None:
            acks.append(ack)
        while acks:
            fate = channel.draw(st.sampled_from(["deliver", "drop", "duplicate", "delay"]))
            ack = acks.pop(channel.draw(st.integers(0, len(acks) - 1)))
            if fate == "deliver":
                sender.on_ack(ack.acked_position)
            elif fate == "duplicate":
                sender.on_ack(ack.acked_position)
                sender.on_ack(ack.acked_position)
            elif fate == "delay":
                acks.append(ack)
                break
        assert 0 <= sender.outstanding
    # Whatever the channel did, draining the link and two intervals of polls settle everything.
    while link:
        now += 1
        receiver.on_consumed(link.pop(0), now)
    for _ in range(2):
        now += ACK_INTERVAL_NS
        ack = receiver.poll(now)
        assert ack is not None
        sender.on_ack(ack.acked_position)
    for stale in acks:
        sender.on_ack(stale.acked_position)  # late duplicates change nothing
    assert sender.acked_position == receiver.consumed_position == sender.position
    if queue:
        assert sender.may_send()  # never stuck with messages left to send
