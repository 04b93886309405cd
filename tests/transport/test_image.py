"""The receiver: setup, images, NAKs, SM scheduling tied to processing, liveness, EOS, tethering."""

from __future__ import annotations

from flowbroker.transport.channel import parse_channel
from flowbroker.transport.frames import (
    SM_EOS_FLAG,
    SM_SETUP_FLAG,
    DataFrame,
    Nak,
    RttMeasurement,
    Setup,
    StatusMessage,
    decode_datagram,
    encode_data,
    encode_heartbeat,
    encode_rttm,
    encode_setup,
)
from flowbroker.transport.image import Image, ImageState, ImageTimers, SubscriberState
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig

PUB = ("10.0.0.1", 40001)
TERM = 64 * 1024
WINDOW = TERM // 2  # static window: min(128 KiB, term / 2)
MS = 1_000_000
INITIAL = 2**31 - 1  # the second term has id -2**31


def setup(term_offset: int = 0, active_term_id: int = INITIAL, mtu: int = 1408) -> bytes:
    return encode_setup(Setup(term_offset, 7, 10, INITIAL, active_term_id, TERM, mtu, 0))


def data(term_offset: int, payload: bytes, term_id: int = INITIAL, flags: int = 0xC0) -> bytes:
    return encode_data(DataFrame(32 + len(payload), flags, term_offset, 7, 10, term_id, 0, payload))


def control(out: list[tuple[bytes, object]]) -> list[object]:
    result: list[object] = []
    for datagram, address in out:
        assert address == PUB
        decoded, reason = decode_datagram(datagram, TERM)
        assert reason is None
        result.extend(decoded)
    return result


def sms(out: list[tuple[bytes, object]]) -> list[StatusMessage]:
    return [f for f in control(out) if isinstance(f, StatusMessage)]


def channel_with_image(**config: object) -> tuple[ReceiveChannel, Image]:
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3, **config))  # type: ignore[arg-type]
    channel.add_subscription(0)
    channel.on_datagram(setup(), PUB, 0)
    return channel, channel.images[7]


def test_data_for_an_unknown_session_elicits_setup_at_most_once_a_second() -> None:
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3))
    channel.add_subscription(0)
    channel.on_datagram(data(0, b"x"), PUB, 0)
    assert sms(channel.do_work(0)) == [StatusMessage(7, 10, 0, 0, 0, 3, None, SM_SETUP_FLAG)]
    channel.on_datagram(data(64, b"x"), PUB, 500 * MS)
    assert channel.do_work(500 * MS) == []
    channel.on_datagram(data(64, b"x"), PUB, 1001 * MS)
    assert len(sms(channel.do_work(1001 * MS))) == 1
    channel.on_datagram(encode_heartbeat(0, 8, 10, 0, eos=True), PUB, 1001 * MS)  # EOS never elicits
    assert channel.dispositions["unknown_session"] == 1 and channel.dispositions["elicit_setup"] == 2


def test_setup_creates_an_image_that_answers_at_once_with_its_window() -> None:
    channel, image = channel_with_image()
    assert sms(channel.do_work(0)) == [StatusMessage(7, 10, INITIAL, 0, WINDOW, 3, None, 0)]
    assert image.join_position == 0


def test_setup_is_validated() -> None:
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3, receiver_window=4096))
    channel.add_subscription(0)
    channel.on_datagram(setup(mtu=8192), PUB, 0)  # MTU bigger than the receiver window
    assert not channel.images and channel.dispositions["setup_rejected:mtu_exceeds_window"] == 1
    channel.on_datagram(encode_setup(Setup(0, 7, 11, 0, 0, TERM, 1408, 0)), PUB, 0)
    assert not channel.images and channel.dispositions["other_stream"] == 1


def test_join_mid_stream_at_the_senders_position() -> None:
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3))
    channel.add_subscription(0)
    channel.on_datagram(setup(term_offset=1024, active_term_id=-(2**31)), PUB, 0)
    assert channel.images[7].join_position == TERM + 1024
    assert sms(channel.do_work(0))[0].consumption_term_id == -(2**31)


def test_sm_position_follows_processing_not_arrival() -> None:
    channel, image = channel_with_image()
    channel.do_work(0)
    sub_messages: list[bytes] = []
    payload = b"p" * 992  # 1024-byte frames
    for i in range(16):
        channel.on_datagram(data(i * 1024, payload), PUB, MS)
    assert sms(channel.do_work(MS)) == []  # 16 KiB arrived, nothing processed: no SM
    assert image.hwm_position == image.rebuild_position == 16 * 1024
    sub = channel._subscriptions[1]
    assert sub.poll(lambda m: sub_messages.append(bytes(m)), 4) == 4
    assert sms(channel.do_work(2 * MS)) == []  # 4 KiB processed < window / 4
    sub.poll(lambda m: sub_messages.append(bytes(m)), 5)
    sent = sms(channel.do_work(3 * MS))
    assert [(s.consumption_term_offset, s.receiver_window) for s in sent] == [(9 * 1024, WINDOW)]
    # and every 200 ms regardless
    assert sms(channel.do_work(200 * MS)) == []
    assert len(sms(channel.do_work(204 * MS))) == 1
    assert len(sub_messages) == 9


def test_sm_on_term_rotation() -> None:
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3))
    sub = channel.add_subscription(0)
    channel.on_datagram(setup(term_offset=TERM - 1024), PUB, 0)
    channel.do_work(0)
    channel.on_datagram(data(TERM - 1024, b"a" * 992), PUB, MS)
    channel.on_datagram(data(0, b"b" * 10, term_id=-(2**31)), PUB, MS)
    channel.do_work(MS)
    assert sub.poll(lambda m: None, 10) == 2
    sent = sms(channel.do_work(2 * MS))  # only 1 KiB + 64 consumed, but a new term
    assert [(s.consumption_term_id, s.consumption_term_offset) for s in sent] == [(-(2**31), 64)]


def test_gap_is_naked_after_the_delay_and_retried_every_10ms() -> None:
    channel, image = channel_with_image()
    channel.do_work(0)
    channel.on_datagram(data(0, b"a" * 32), PUB, 0)
    channel.on_datagram(data(256, b"c" * 32), PUB, 0)  # 64..256 lost

    def naks(at: int) -> list[Nak]:
        return [f for f in control(channel.do_work(at)) if isinstance(f, Nak)]

    assert naks(0) == []
    assert naks(100_000) == [Nak(7, 10, INITIAL, 64, 192)]
    assert naks(5 * MS) == []
    assert naks(10 * MS + 100_000) == [Nak(7, 10, INITIAL, 64, 192)]
    channel.on_datagram(data(64, b"b" * 160), PUB, 11 * MS)  # retransmit fills it
    assert naks(30 * MS) == [] and image.rebuild_position == 320


def test_data_outside_the_window_is_dropped() -> None:
    channel, image = channel_with_image()
    channel.do_work(0)
    channel.on_datagram(data(TERM // 2, b"x"), PUB, 0)  # beyond last SM + term/2: overrun
    assert image.overruns == 1 and channel.dispositions["out_of_window"] == 1
    channel.on_datagram(data(0, b"x", term_id=INITIAL - 1), PUB, 0)  # before the initial term
    assert image.underruns == 1


def test_liveness_timeout_drains_with_eos_sms_then_removes_the_image() -> None:
    gone: list[Image] = []
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3))
    channel.add_subscription(0, on_unavailable_image=gone.append)
    channel.on_datagram(setup(), PUB, 0)
    for t in range(0, 10_001, 200):  # the receiver runs (at least every SM timeout), the publication is silent
        channel.do_work(t * MS)
    assert sms(channel.do_work(10_001 * MS))[0].flags == SM_EOS_FLAG
    image = channel.images[7]
    assert image.state is ImageState.DRAINING
    eos = sms(channel.do_work(10_202 * MS))
    assert eos and all(s.flags == SM_EOS_FLAG for s in eos)
    channel.do_work(11_002 * MS)
    assert 7 not in channel.images and gone == [image]


def test_a_receiver_that_did_not_run_keeps_its_image_and_reads_what_waited() -> None:
    """Liveness counts the time the receiver ran: its process stopped 12 s (SIGSTOP) with the publication's
    datagrams waiting in its socket, the first cycle on resume (before they are read) keeps the image, and
    the data of before and during the stop is taken in order. A tester's consumer drained its image there
    and was given a new one at the sender's position: 369 messages skipped."""
    channel, image = channel_with_image()
    got: list[bytes] = []
    sub = channel._subscriptions[1]
    channel.on_datagram(data(0, b"before"), PUB, MS)
    channel.do_work(MS)
    sub.poll(lambda m: got.append(bytes(m)), 10)
    resumed = 12_000 * MS  # stopped from 1 ms: no cycle, no datagram read
    assert sms(channel.do_work(resumed))[0].flags == 0  # not the EOS of an image declared dead
    assert image.state is ImageState.ACTIVE and channel.images[7] is image
    channel.on_datagram(data(64, b"during"), PUB, resumed + MS)  # what waited in the socket
    channel.do_work(resumed + MS)
    sub.poll(lambda m: got.append(bytes(m)), 10)
    assert got == [b"before", b"during"]
    # A publication really gone still times out: 10 s of silence while the receiver runs.
    t = resumed + MS
    while t < resumed + 10_200 * MS and image.state is ImageState.ACTIVE:
        t += 200 * MS
        channel.do_work(t)
    assert image.state is ImageState.DRAINING and t > resumed + 10_000 * MS  # type: ignore[comparison-overlap]  # narrowed above


def test_end_of_stream_after_everything_is_consumed() -> None:
    channel, image = channel_with_image()
    sub = channel._subscriptions[1]
    channel.on_datagram(data(0, b"last"), PUB, MS)
    channel.on_datagram(encode_heartbeat(64, 7, 10, INITIAL, eos=True), PUB, MS)
    channel.do_work(MS)
    assert image.end_of_stream_position == 64 and image.state is ImageState.ACTIVE  # not yet consumed
    sub.poll(lambda m: None, 10)
    channel.do_work(2 * MS)
    assert image.state is ImageState.DRAINING  # type: ignore[comparison-overlap]  # mypy keeps the narrowing above
    # Issue 11, transport fix (c): the publication's heartbeats while the image drains are what they are,
    # not out_of_window refusals.
    for t in range(3, 6):
        channel.on_datagram(encode_heartbeat(64, 7, 10, INITIAL, eos=True), PUB, t * MS)
    assert channel.dispositions["draining"] == 3 and channel.dispositions["out_of_window"] == 0
    assert "draining" not in dict(channel.statistics().refused)


def test_tethered_subscriptions_hold_the_window_at_the_slowest() -> None:
    channel, image = channel_with_image()
    fast = channel._subscriptions[1]
    slow = channel.add_subscription(0)
    for i in range(16):
        channel.on_datagram(data(i * 1024, b"p" * 992), PUB, MS)
    channel.do_work(MS)
    fast.poll(lambda m: None, 16)
    slow.poll(lambda m: None, 2)
    assert sms(channel.do_work(2 * MS)) == []  # the slow one has not moved a quarter window
    slow.poll(lambda m: None, 7)
    assert sms(channel.do_work(3 * MS))[0].consumption_term_offset == 9 * 1024  # the minimum, not 16 KiB


def test_untethered_subscription_is_left_behind_then_rejoins() -> None:
    timers = ImageTimers(untethered_window_limit_timeout_ns=100 * MS, untethered_resting_timeout_ns=200 * MS)
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3, timers=timers))
    fast = channel.add_subscription(0)
    lagging = channel.add_subscription(0, tether=False)
    channel.on_datagram(setup(), PUB, 0)
    image = channel.images[7]
    now = 0
    offset = 0
    # the fast subscriber keeps the window full; the untethered one reads nothing
    while now < 450 * MS:
        while offset + 1024 <= image.last_sm_position + WINDOW:
            channel.on_datagram(data(offset % TERM, b"p" * 992, term_id=INITIAL + offset // TERM if offset < TERM else -(2**31)), PUB, now)
            offset += 1024
        fast.poll(lambda m: None, 100)
        channel.do_work(now)
        now += 5 * MS
        state = image.subscriber_state(lagging.subscription_id)
        if now < 100 * MS:
            assert state is SubscriberState.ACTIVE
        if 110 * MS < now < 200 * MS:
            assert state is SubscriberState.LINGER and not lagging.images  # told: image unavailable
            assert image.next_sm_position <= WINDOW  # but still holding the window
        if 210 * MS < now < 400 * MS:
            assert state is SubscriberState.RESTING
        if offset >= TERM + WINDOW:
            break
    assert image.next_sm_position > WINDOW  # the window moved on without it
    while image.subscriber_state(lagging.subscription_id) is SubscriberState.RESTING:
        channel.do_work(now)
        now += 5 * MS
    assert lagging.images and lagging.position(7) == image.rebuild_position  # rejoined at the current position


def test_cubic_image_measures_rtt_with_rttm() -> None:
    channel, image = channel_with_image(congestion_control="cubic")
    assert image.window_length == 10 * 1408
    channel.do_work(0)
    requests = [f for f in control(channel.do_work(11 * MS)) if isinstance(f, RttMeasurement)]
    assert requests == [RttMeasurement(7, 10, 11 * MS, 0, 3, 0x80)]
    channel.on_datagram(encode_rttm(RttMeasurement(7, 10, 11 * MS, 0, 3, 0)), PUB, 11 * MS + 250_000)
    assert image.congestion.should_measure_rtt(12 * MS) is False
    assert getattr(image.congestion, "rtt_ns") == 250_000


def test_every_datagram_is_accounted_for_and_nothing_raises() -> None:
    channel, _ = channel_with_image()
    junk = [b"", b"\x01", b"\x00" * 8, b"\xff" * 40, data(0, b"ok"), data(3, b"bad offset"),
            data(0, b"x")[:-1] + b"\x01\x01", encode_setup(Setup(0, 7, 10, 0, 0, 1000, 1408, 0)),
            encode_heartbeat(0, 7, 10, INITIAL)[:31], data(0, b"ok") + b"trailing"]
    for datagram in junk:
        channel.on_datagram(datagram, PUB, 0)
    assert channel.datagrams_received == len(junk) + 1  # + the SETUP
    assert sum(channel.dispositions.values()) == channel.datagrams_received


def test_receiver_config_from_channel() -> None:
    uri = parse_channel("aeron:udp?endpoint=127.0.0.1:40457|rcv-wnd=64k|cc=cubic|gtag=9|session-id=7")
    config = ReceiverConfig.from_channel(uri, receiver_id=11)
    assert (config.receiver_window, config.congestion_control, config.group_tag, config.session_id) == (
        64 * 1024, "cubic", 9, 7)


def test_an_mtu_above_half_the_term_but_within_the_configured_window_is_accepted() -> None:
    """Issue 11, transport fix (b): the C driver checks the SETUP's mtu against the receiver window as
    configured, not as clamped to term_length / 2, so mtu=65504 with term-length=65536 works from a C
    driver to us as it does between C drivers."""
    channel = ReceiveChannel(10, ReceiverConfig(receiver_id=3, receiver_window=128 * 1024, so_rcvbuf=1 << 20))
    channel.add_subscription(0)
    channel.on_datagram(encode_setup(Setup(0, 7, 10, INITIAL, INITIAL, 65536, 65504, 0)), PUB, 0)
    assert 7 in channel.images and channel.dispositions["setup"] == 1
    assert channel.images[7].window_length == 32 * 1024  # the window itself stays clamped to term / 2
