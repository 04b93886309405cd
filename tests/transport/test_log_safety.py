"""The receive log cannot be corrupted from the wire, and a failing handler loses no message.

* A datagram far ahead of the window (or behind what was cleaned) is refused and counted by the image and
  by the ``TermRebuilder`` itself: it never cleans data a subscriber has not read.
* A poll handler that raises gets the fragments of that call again, and a message whose first fragments
  were read by an earlier call is still delivered whole, exactly once after the handler succeeds.
"""

from __future__ import annotations

import pytest

from flowbroker.transport.frames import BEGIN_FLAG, END_FLAG, DataFrame, Setup, encode_data, encode_setup
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig
from flowbroker.transport.terms import FragmentAssembler, TermRebuilder

PUB = ("10.0.0.1", 40001)
TERM = 64 * 1024
MS = 1_000_000
INITIAL = 1000


def data(term_offset: int, payload: bytes, term_id: int = INITIAL, flags: int = 0xC0) -> bytes:
    return encode_data(DataFrame(32 + len(payload), flags, term_offset, 7, 10, term_id, 0, payload))


def channel_with_image() -> ReceiveChannel:
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3))
    channel.add_subscription(0)
    channel.on_datagram(encode_setup(Setup(0, 7, 10, INITIAL, INITIAL, TERM, 1408, 0)), PUB, 0)
    channel.do_work(0)
    return channel


# ------------------------------------------------------------------------------------------ out of the window


def test_rebuilder_refuses_a_datagram_beyond_its_log_and_keeps_unread_data() -> None:
    log = TermRebuilder(TERM, INITIAL)
    assert log.insert(INITIAL, 0, data(0, b"unread"))
    before = bytes(log.partitions[0][:64])
    # Three terms ahead would land in partition 0 over the unread frame; the old rebuilder would also have
    # cleaned two terms behind it (everything). Both are refused and counted.
    assert not log.insert(INITIAL + 3, 0, data(0, b"evil", term_id=INITIAL + 3))
    assert not log.insert(INITIAL + 7, 4096, data(4096, b"evil", term_id=INITIAL + 7))
    assert not log.insert(INITIAL + 2, TERM - 32, data(TERM - 32, b"x" * 64, term_id=INITIAL + 2))  # past term end
    assert log.out_of_range == 3
    assert bytes(log.partitions[0][:64]) == before and log.clean_position == 0
    got: list[bytes] = []
    assert log.read(0, 64, FragmentAssembler(lambda m: got.append(bytes(m))))[1] == 1
    assert got == [b"unread"]
    # The edge of the range: the last bytes of term INITIAL + 2 are in; behind clean_position is out.
    assert log.insert(INITIAL + 2, TERM - 64, data(TERM - 64, b"edge", term_id=INITIAL + 2))
    log.clean_to(TERM)
    assert not log.insert(INITIAL, 128, data(128, b"stale"))  # partition 0 now stands for term INITIAL + 3
    assert log.insert(INITIAL + 3, 0, data(0, b"next lap", term_id=INITIAL + 3))
    assert log.out_of_range == 4


def test_image_counts_far_ahead_and_wrapped_datagrams_and_still_delivers_everything() -> None:
    channel = channel_with_image()
    image = channel.images[7]
    channel.on_datagram(data(0, b"first"), PUB, MS)
    for term_id in (INITIAL + 1, INITIAL + 3, INITIAL + 1000, INITIAL + 2**30):
        channel.on_datagram(data(0, b"far ahead", term_id=term_id), PUB, MS)
    channel.on_datagram(data(0, b"wrapped", term_id=INITIAL - 5), PUB, MS)  # before the initial term id
    channel.on_datagram(data(TERM // 2, b"just past the window"), PUB, MS)
    assert image.overruns == 5 and image.underruns == 1
    assert channel.dispositions["out_of_window"] == 6 and channel.dispositions["data"] == 1
    assert image.rebuilder.out_of_range == 0  # the image refused them before the log saw them
    assert image.hwm_position == 64 and image.rebuilder.clean_position == 0
    channel.on_datagram(data(64, b"second"), PUB, MS)
    channel.do_work(2 * MS)
    got: list[bytes] = []
    sub = channel._subscriptions[1]
    sub.poll(lambda m: got.append(bytes(m)), 10)
    assert got == [b"first", b"second"]


# ------------------------------------------------------------------------------------------ failing handlers


def fragmented(total: int) -> tuple[bytes, list[bytes], int]:
    """A message of ``total`` bytes as MTU-1408 fragments (datagrams at their offsets), and its end."""
    message = bytes(i % 251 for i in range(total))
    datagrams: list[bytes] = []
    offset = 0
    chunks = [message[i:i + 1376] for i in range(0, total, 1376)]
    for k, chunk in enumerate(chunks):
        flags = (BEGIN_FLAG if k == 0 else 0) | (END_FLAG if k == len(chunks) - 1 else 0)
        datagrams.append(data(offset, chunk, flags=flags))
        offset += (32 + len(chunk) + 31) & ~31
    return message, datagrams, offset


def test_a_message_begun_in_an_earlier_poll_survives_a_failing_handler() -> None:
    channel = channel_with_image()
    message, datagrams, end = fragmented(3000)  # three fragments: B, middle, E
    for d in datagrams:
        channel.on_datagram(d, PUB, MS)
    channel.on_datagram(data(end, b"after"), PUB, MS)
    channel.do_work(2 * MS)
    sub = channel._subscriptions[1]
    image = channel.images[7]
    got: list[bytes] = []

    def good(m: memoryview | bytes) -> None:
        got.append(bytes(m))

    def bad(m: memoryview | bytes) -> None:
        raise RuntimeError("application failed")

    assert sub.poll(good, 1) == 1  # only the BEGIN fragment: nothing delivered yet
    assert got == [] and image.subscriber_position(1) == 1408
    with pytest.raises(RuntimeError):
        sub.poll(bad, 10)  # reads middle and END, the handler raises on the whole message
    assert image.subscriber_position(1) == 1408  # nothing of that call counts as consumed
    with pytest.raises(RuntimeError):
        sub.poll(bad, 10)  # and again: still nothing lost
    assert sub.poll(good, 10) == 3
    assert got == [message, b"after"]
    assert image.subscriber_position(1) == end + 64


def test_a_failing_handler_midway_gets_that_calls_messages_again() -> None:
    """At-least-once on handler failure: what that call delivered before the failure comes again."""
    channel = channel_with_image()
    channel.on_datagram(data(0, b"one"), PUB, MS)
    message, datagrams, end = fragmented(2000)
    for d in datagrams:  # the fragmented message after "one" (64 bytes further on)
        shifted = d[:8] + (int.from_bytes(d[8:12], "little") + 64).to_bytes(4, "little") + d[12:]
        channel.on_datagram(shifted, PUB, MS)
    channel.do_work(2 * MS)
    sub = channel._subscriptions[1]
    got: list[bytes] = []
    calls = 0

    def flaky(m: memoryview | bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("once")
        got.append(bytes(m))

    with pytest.raises(RuntimeError):
        sub.poll(flaky, 10)  # "one" delivered, then the fragmented message fails
    assert channel.images[7].subscriber_position(1) == 0
    assert sub.poll(flaky, 10) == 3
    assert got == [b"one", b"one", message]
    assert channel.images[7].subscriber_position(1) == end + 64
