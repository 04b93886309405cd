"""`Image.hold`/`release` and `Image.window_cap`: what lets the broker make the SM's consumption position its
completion point and the SM window its producer's credit, and the SDK's UDP consumer advance on processing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.transport.positions import frame_space
from flowbroker.transport.terms import TermAppender
from tests.transport.test_image import INITIAL, PUB, WINDOW, channel_with_image, data, sms

MS = 1_000_000


def test_a_held_message_keeps_the_consumption_position_behind_until_released() -> None:
    channel, image = channel_with_image()
    image.window_cap = 512  # an SM once the position moved a quarter of it (128 bytes)
    channel.do_work(0)  # the first SM
    channel.on_datagram(data(0, b"a" * 100), PUB, 1 * MS)
    channel.on_datagram(data(160, b"b" * 100), PUB, 1 * MS)
    channel.do_work(1 * MS)  # the rebuild position moves in the duty cycle
    got: list[bytes] = []
    assert image.poll(1, lambda m: got.append(bytes(m)), 10) == 2
    assert image.subscriber_position(1) == 320
    image.hold(1, 160)  # the second message is not completed yet
    out = sms(channel.do_work(300 * MS))
    assert [sm.consumption_term_offset for sm in out] == [160]
    image.release(1, 160)
    assert [sm.consumption_term_offset for sm in sms(channel.do_work(600 * MS))] == [320]
    assert image.subscriber_hold(1) == 0


def test_release_beyond_the_hold_is_clamped_and_unknown_subscribers_are_ignored() -> None:
    _, image = channel_with_image()
    image.hold(1, 64)
    image.release(1, 1000)
    assert image.subscriber_hold(1) == 0
    image.hold(99, 10)
    image.release(99, 10)  # no such subscriber: nothing happens


def test_window_cap_bounds_the_advertised_window_and_zero_closes_it() -> None:
    channel, image = channel_with_image()
    assert [sm.receiver_window for sm in sms(channel.do_work(0))] == [WINDOW]
    image.window_cap = 4096
    assert [sm.receiver_window for sm in sms(channel.do_work(1 * MS))] == [4096]
    image.window_cap = 0
    assert [sm.receiver_window for sm in sms(channel.do_work(2 * MS))] == [0]
    image.window_cap = None  # no cap: the congestion window again
    assert [sm.receiver_window for sm in sms(channel.do_work(3 * MS))] == [WINDOW]
    assert image.window_length == WINDOW


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20_000), min_size=1, max_size=40), st.sampled_from([64, 1408, 8192]))
def test_frame_space_is_what_an_appended_message_moves_the_position_by(lengths: list[int], mtu: int) -> None:
    appender = TermAppender(1 << 20, INITIAL, 7, 10, mtu)
    for length in lengths:
        before = appender.position
        expected = frame_space(length, mtu)
        if appender.term_offset + expected > appender.term_length:
            continue  # padding to the next term is not the message's
        assert appender.append(b"x" * length) - before == expected == appender.frame_space(length)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4096)), max_size=60))
def test_the_consumption_position_never_goes_back_and_never_passes_the_subscriber(ops: list[tuple[bool, int]]) -> None:
    channel, image = channel_with_image()
    image.window_cap = 16 * 1024
    channel.do_work(0)
    held = 0
    offset = 0
    last = 0
    now = MS
    for is_message, n in ops:
        now += 250 * MS
        if is_message and offset + 64 <= 16 * 1024:
            channel.on_datagram(data(offset, b"m" * 32), PUB, now)
            for sm in sms(channel.do_work(now)):
                assert last <= sm.consumption_term_offset
                last = sm.consumption_term_offset
            image.poll(1, lambda m: None, 10)
            image.hold(1, 64)
            held += 64
            offset += 64
        else:
            amount = min(n, held)
            image.release(1, amount)
            held -= amount
        for sm in sms(channel.do_work(now)):
            assert last <= sm.consumption_term_offset <= image.subscriber_position(1) - image.subscriber_hold(1)
            last = sm.consumption_term_offset


def test_status_message_due_says_when_the_next_duty_cycle_would_report_what_was_consumed() -> None:
    """What the SDK's UDP consumer asks after each processed message before running a whole duty cycle."""
    channel, image = channel_with_image()
    image.window_cap = 512  # an SM once the position moved a quarter of it (128 bytes)
    channel.do_work(0)  # the first SM
    channel.do_work(0)  # the cap is the window now
    assert not image.status_message_due()
    channel.on_datagram(data(0, b"a" * 100), PUB, 1 * MS)
    channel.on_datagram(data(160, b"b" * 100), PUB, 1 * MS)
    channel.do_work(1 * MS)
    image.poll(1, lambda m: None, 10)
    image.hold(1, 320)  # polled, not processed: nothing to report
    assert not image.status_message_due()
    assert sms(channel.do_work(2 * MS)) == []
    image.release(1, 160)  # 160 bytes processed: more than a quarter of the window
    assert image.status_message_due()
    assert [sm.consumption_term_offset for sm in sms(channel.do_work(3 * MS))] == [160]
    assert not image.status_message_due()


def _begin_of_a_fragmented_message(hold_partial: bool) -> list[int]:
    """Two full fragments (BEGIN, middle) of a message whose END has not arrived, polled; the SMs' positions."""
    channel, image = channel_with_image()
    image.window_cap = 512
    image.hold_partial = hold_partial
    channel.do_work(0)
    payload = 1408 - 32  # the image's mtu 1408: a full fragment's payload
    channel.on_datagram(data(0, b"a" * payload, flags=0x80), PUB, 1 * MS)  # BEGIN
    channel.on_datagram(data(1408, b"b" * payload, flags=0x00), PUB, 1 * MS)  # middle
    channel.do_work(1 * MS)
    got: list[bytes] = []
    image.poll(1, lambda m: got.append(bytes(m)), 10)
    assert got == [] and image.subscriber_position(1) == 2 * 1408  # read past, nothing handed up
    return [sm.consumption_term_offset for sm in sms(channel.do_work(300 * MS))]


def test_hold_partial_reports_no_fragment_of_a_message_not_yet_whole() -> None:
    """The SDK's UDP consumer reported the first fragments of a 100 KB message as consumed, and the broker
    took the next message into a window that had not been freed: two whole messages unprocessed at a
    16 KiB window (a tester). With `hold_partial` the status message stays at the message's start; without
    (Aeron's way, and the broker's ingress, whose windows may be smaller than a message), it passes them."""
    assert _begin_of_a_fragmented_message(True) == [0]
    assert _begin_of_a_fragmented_message(False) == [2 * 1408]
