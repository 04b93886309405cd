"""The sender state machine: SETUP, sender limit, heartbeats, back pressure, retransmits, end of stream."""

from __future__ import annotations

from flowbroker.transport.channel import parse_channel
from flowbroker.transport.flow_control import MinFlowControl
from flowbroker.transport.frames import (
    SM_EOS_FLAG,
    SM_SETUP_FLAG,
    DataFrame,
    FrameType,
    Nak,
    RttMeasurement,
    Setup,
    StatusMessage,
    decode_datagram,
    encode_nak,
    encode_rttm,
    encode_status_message,
)
from flowbroker.transport.publication import OfferResult, Publication, PublicationConfig

SUB = ("10.0.0.2", 40002)
TERM = 64 * 1024
MS = 1_000_000


def make(**overrides: int) -> Publication:
    fields: dict[str, int] = dict(session_id=5, stream_id=10, term_length=TERM, initial_term_id=100)
    fields.update(overrides)
    return Publication(PublicationConfig(**fields), 0, destination=SUB)


def frames(out: list[tuple[bytes, object]]) -> list[object]:
    result: list[object] = []
    for data, address in out:
        assert address == SUB
        decoded, reason = decode_datagram(data, TERM)
        assert reason is None
        result.extend(decoded)
    return result


def sm(pub: Publication, position: int, window: int, *, receiver_id: int = 1, flags: int = 0, now_ns: int = 0) -> None:
    term_id = pub.initial_term_id + (position >> 16)
    message = StatusMessage(pub.session_id, pub.stream_id, term_id, position & (TERM - 1), window, receiver_id, None, flags)
    pub.on_datagram(encode_status_message(message), SUB, now_ns)


def test_setup_every_100ms_until_the_first_sm_and_no_data_before_it() -> None:
    pub = make()
    assert pub.offer(b"x") == OfferResult.NOT_CONNECTED
    first = frames(pub.do_work(0))
    assert first == [Setup(0, 5, 10, 100, 100, TERM, 1408, 0, 0)]
    assert pub.do_work(50 * MS) == []
    assert isinstance(frames(pub.do_work(100 * MS))[0], Setup)
    sm(pub, 0, 4096, now_ns=101 * MS)
    assert pub.is_connected
    position = pub.offer(b"hello")
    assert position == 64  # 32 header + 5 payload, aligned
    sent = frames(pub.do_work(102 * MS))
    assert len(sent) == 1 and isinstance(sent[0], DataFrame) and sent[0].payload == b"hello"
    assert frames(pub.do_work(150 * MS)) == []  # no more SETUPs once connected


def test_sm_asking_for_setup_gets_one() -> None:
    pub = make()
    pub.do_work(0)
    sm(pub, 0, 4096, now_ns=MS)
    pub.do_work(2 * MS)
    sm(pub, 0, 0, flags=SM_SETUP_FLAG, now_ns=3 * MS)
    assert any(isinstance(f, Setup) for f in frames(pub.do_work(3 * MS)))


def test_sender_limit_bounds_what_is_sent_and_frames_are_batched_to_the_mtu() -> None:
    pub = make(max_messages_per_send=8)
    pub.do_work(0)
    sm(pub, 0, 1000)
    for i in range(100):
        assert pub.offer(bytes([i]) * 20) > 0  # 52-byte frames, 64 aligned
    out = pub.do_work(MS)
    sent = [f for f in frames(out) if isinstance(f, DataFrame)]
    assert len(sent) == 1000 // 64  # only whole frames inside the window
    assert pub.sender_position == 15 * 64
    assert len(out) == 1  # all in one datagram (960 bytes < MTU)
    sm(pub, 64 * 15, 64 * 85)
    out = pub.do_work(2 * MS)
    assert [len(d) for d, _ in out] == [1408] * 3 + [5440 - 3 * 1408] and pub.sender_position == 6400


def test_heartbeat_after_100ms_without_data() -> None:
    pub = make()
    pub.do_work(0)
    sm(pub, 0, 4096)
    pub.offer(b"abc")
    pub.do_work(MS)
    assert pub.do_work(100 * MS) == []
    beat = frames(pub.do_work(101 * MS))
    assert beat == [DataFrame(0, 0xC0, 64, 5, 10, 100, 0, b"", FrameType.DATA)]
    assert pub.counters.heartbeats_sent == 1


def test_publication_window_back_pressures_the_application() -> None:
    pub = make(publication_window=4096)
    pub.do_work(0)
    sm(pub, 0, 0)  # connected, but the receiver grants nothing
    results = [pub.offer(b"z" * 100) for _ in range(40)]
    accepted = [r for r in results if r > 0]
    assert results[len(accepted)] == OfferResult.BACK_PRESSURED
    assert all(r == OfferResult.BACK_PRESSURED for r in results[len(accepted):])
    assert pub.position - pub.sender_position < 4096 + 160
    sm(pub, 0, 8192)
    pub.do_work(MS)
    assert pub.offer(b"z" * 100) > 0  # sending moved the publication limit


def test_offer_after_close_and_eos_linger() -> None:
    pub = make(linger_ns=1000 * MS)
    pub.do_work(0)
    sm(pub, 0, 65536)
    pub.offer(b"last")
    pub.close(MS)
    assert pub.offer(b"more") == OfferResult.CLOSED
    assert isinstance(frames(pub.do_work(2 * MS))[0], DataFrame)  # the appended data still drains
    eos = [f for f in frames(pub.do_work(3 * MS)) if isinstance(f, DataFrame)]
    assert eos == [DataFrame(0, 0xE0, 64, 5, 10, 100, 0, b"", FrameType.DATA)]
    assert not pub.is_done
    pub.do_work(900 * MS)
    assert not pub.is_done
    pub.do_work(1004 * MS)
    assert pub.is_done


def test_nak_retransmits_at_once_then_lingers_and_caps_concurrent_resends() -> None:
    pub = make(max_resend=2)
    pub.do_work(0)
    sm(pub, 0, 65536)
    for _ in range(10):
        pub.offer(b"q" * 200)  # 232 -> 256 bytes each
    pub.do_work(MS)
    pub.do_work(MS)
    assert pub.sender_position == 2560

    def nak(offset: int, length: int, at: int) -> list[object]:
        pub.on_datagram(encode_nak(Nak(5, 10, 100, offset, length)), SUB, at)
        return frames(pub.do_work(at))

    resent = nak(256, 512, 2 * MS)
    assert [f.term_offset for f in resent if isinstance(f, DataFrame)] == [256, 512]
    assert nak(256, 512, 5 * MS) == []  # lingering: ignored
    assert len(nak(1024, 256, 5 * MS)) == 1
    assert nak(1536, 256, 5 * MS) == []  # two resends already in flight (max-resend=2)
    assert len(nak(256, 256, 13 * MS)) == 1  # linger over: served again
    assert nak(4096, 256, 14 * MS) == []  # never sent: not a retransmit
    assert pub.counters.retransmits_sent == 3 and pub.counters.retransmitted_bytes == 512 + 256 + 256
    assert pub.counters.naks_ignored == 3


def test_connection_lost_after_five_seconds_without_sms() -> None:
    pub = make()
    pub.do_work(0)
    sm(pub, 0, 4096, now_ns=0)
    pub.do_work(1)
    assert pub.offer(b"a") > 0
    for t in range(100, 5001, 100):  # the sender runs (at least every heartbeat interval), the receiver is silent
        pub.do_work(t * MS)
    pub.do_work(5001 * MS)
    assert not pub.is_connected
    assert pub.offer(b"a") == OfferResult.NOT_CONNECTED


def test_a_sender_that_did_not_run_keeps_its_receivers_until_it_reads_what_waited() -> None:
    """Liveness counts the time the sender ran: its process stopped 12 s (SIGSTOP) with the receiver's
    status messages waiting in its socket, the first cycle on resume (before they are read) keeps the
    receiver connected and the publication limit where it was. A tester's producer found itself not
    connected there, its claimed batch was refused and it died with INTERNAL_ERROR. A receiver really
    gone still times out, 5 s of silence while the sender runs."""
    pub = make(connection_timeout_ns=5000 * MS)
    pub.do_work(0)
    sm(pub, 0, 4096, now_ns=0)
    assert pub.offer(b"a") > 0
    pub.do_work(MS)
    limit = pub.publication_limit
    resumed = 12_000 * MS  # stopped from 1 ms: no cycle, no status message read
    pub.do_work(resumed)
    assert pub.is_connected and pub.publication_limit == limit
    assert pub.offer_many([b"b", b"c"], b"\x00") > 0
    t = resumed
    while t < resumed + 6000 * MS and pub.is_connected:
        t += 100 * MS
        pub.do_work(t)
    assert not pub.is_connected and resumed + 4800 * MS < t <= resumed + 5200 * MS  # (less the timer slack)


def test_min_flow_control_receivers_are_not_timed_out_by_the_senders_stop() -> None:
    """The min strategy's own receiver timeout is excused the same stop (its receivers pace the stream)."""
    pub = Publication.from_channel(parse_channel("aeron:udp?endpoint=10.0.0.2:40002|fc=min,t:5s"), 10, 5, 0,
                                   destination=SUB)
    pub.do_work(0)
    sm(pub, 0, 4096, now_ns=0)
    pub.do_work(MS)
    assert isinstance(pub.flow_control, MinFlowControl) and pub.flow_control.receiver_count == 1
    pub.do_work(12_000 * MS)
    assert pub.flow_control.receiver_count == 1 and pub.is_connected


def test_offer_many_keeps_a_claim_made_under_a_higher_limit() -> None:
    """A claim checked against the limit holds when the limit drops before the append (nobody connected:
    the limit falls to the sender position), as Aeron's tryClaim does."""
    pub = make()
    pub.do_work(0)
    sm(pub, 0, 4096, now_ns=0)
    pub.do_work(MS)
    claimed = pub.publication_limit
    sm(pub, 0, 4096, receiver_id=1, flags=SM_EOS_FLAG, now_ns=2 * MS)  # the receiver's image goes
    assert not pub.is_connected and pub.publication_limit == pub.sender_position
    assert pub.offer_many([b"a"], b"\x00") == 0
    assert pub.offer_many([b"a"], b"\x00", claimed) == 64


def test_rejoin_at_consumed_sends_a_new_image_what_the_dead_one_did_not_consume() -> None:
    """A receiver whose image died (the sender stopped past its 10 s liveness) asks for SETUP: with
    rejoin_at_consumed the SETUP and the data start at what it last reported consumed; without it (Aeron),
    at the sender position, skipping what was sent into the dead image (a tester: 1,000 messages lost)."""
    for rejoin in (True, False):
        pub = Publication(PublicationConfig(5, 10, term_length=TERM, initial_term_id=100), 0, destination=SUB,
                          rejoin_at_consumed=rejoin)
        pub.do_work(0)
        sm(pub, 0, 4096, now_ns=0)
        for _ in range(20):
            assert pub.offer(b"m" * 100) > 0
        pub.do_work(MS)
        sm(pub, 640, 4096, now_ns=2 * MS)  # consumed 4 of the 20 messages sent
        pub.do_work(3 * MS)
        assert pub.sender_position == 20 * 160
        sm(pub, 1280, 4096, flags=SM_EOS_FLAG, now_ns=4 * MS)  # its image drains, having consumed 8
        sm(pub, 0, 0, flags=SM_SETUP_FLAG, now_ns=5 * MS)  # and it has none any more
        out = frames(pub.do_work(6 * MS))
        setup = [f for f in out if isinstance(f, Setup)]
        assert len(setup) == 1 and not [f for f in out if isinstance(f, DataFrame) and f.frame_length > 0]
        if not rejoin:
            assert setup[0].term_offset == 20 * 160
            continue
        assert setup[0].term_offset == 1280 and pub.sender_position == 1280
        sm(pub, 1280, 4096, now_ns=7 * MS)  # the new image's first status message
        data = [f for f in frames(pub.do_work(8 * MS)) if isinstance(f, DataFrame)]
        assert [f.term_offset for f in data][:2] == [1280, 1440] and pub.sender_position == 20 * 160


def test_a_receiver_silent_past_the_timeout_keeps_what_it_reported_consumed_and_never_opens_the_window() -> None:
    """A consumer stopped past the connection timeout: the publication sends nothing beyond the window it
    last advertised, its consumption position stays what it reported (the broker's views read the whole
    stream as unacknowledged: 962,080 bytes against a 262,144-byte window), and its next status message,
    at the same position, connects it again."""
    pub = make()
    pub.do_work(0)
    sm(pub, 0, 4096, now_ns=0)
    for _ in range(200):
        assert pub.offer(b"m" * 100) > 0
    pub.do_work(MS)
    sm(pub, 2048, 4096, now_ns=2 * MS)
    for t in range(3, 50):
        pub.do_work(t * MS)
    sent = pub.sender_position
    assert 6144 - 160 < sent <= pub.sender_limit == 6144 and pub.consumption_position == 2048
    for t in range(100, 12_000, 100):
        pub.do_work(t * MS)
    assert not pub.is_connected
    assert (pub.sender_position, pub.sender_limit, pub.consumption_position) == (sent, 6144, 2048)
    sm(pub, 2048, 4096, now_ns=12_000 * MS)
    assert pub.is_connected and pub.sender_limit == 6144


def test_receiver_saying_end_of_stream_disconnects() -> None:
    pub = make()
    pub.do_work(0)
    sm(pub, 0, 4096)
    sm(pub, 0, 4096, flags=SM_EOS_FLAG)
    pub.do_work(MS)
    assert not pub.is_connected


def test_min_group_size_keeps_the_publication_unconnected() -> None:
    pub = Publication(PublicationConfig(5, 10, TERM, initial_term_id=100), 0, destination=SUB,
                      flow_control=MinFlowControl(group_min_size=2))
    pub.do_work(0)
    sm(pub, 0, 4096, receiver_id=1)
    assert not pub.is_connected and pub.offer(b"x") == OfferResult.NOT_CONNECTED
    sm(pub, 0, 4096, receiver_id=2)
    pub.do_work(1)
    assert pub.is_connected and pub.offer(b"x") > 0


def test_max_position_exceeded_at_the_end_of_the_position_space() -> None:
    pub = make(initial_term_id=0, active_term_id=2**31 - 1, term_offset=TERM - 64)
    pub.do_work(0)
    sm(pub, pub.start_position, 4096)
    assert pub.offer(b"x" * 40) == OfferResult.MAX_POSITION_EXCEEDED


def test_rotation_returns_admin_action_then_the_retry_succeeds() -> None:
    pub = make(term_offset=TERM - 64)
    pub.do_work(0)
    sm(pub, pub.start_position, 65536)
    assert pub.offer(b"x" * 100) == OfferResult.ADMIN_ACTION
    assert pub.offer(b"x" * 100) == TERM + 160
    out = frames(pub.do_work(MS))
    pad = out[0]
    assert isinstance(pad, DataFrame) and pad.is_pad and pad.frame_length == 64 and pad.term_id == 100
    data = out[1]
    assert isinstance(data, DataFrame) and data.term_id == 101 and data.term_offset == 0


def test_rttm_request_is_echoed() -> None:
    pub = make()
    pub.on_datagram(encode_rttm(RttMeasurement(5, 10, 12345, 0, 77, 0x80)), SUB, 0)
    replies = [f for f in frames(pub.do_work(0)) if isinstance(f, RttMeasurement)]
    assert replies == [RttMeasurement(5, 10, 12345, 0, 77, 0)]


def test_garbage_on_the_control_port_is_counted_not_raised() -> None:
    pub = make()
    for junk in (b"", b"\x00" * 7, b"\xff" * 64, encode_nak(Nak(5, 10, 100, 0, 0))[:20]):
        pub.on_datagram(junk, SUB, 0)
    assert pub.counters.invalid_packets == 4


def test_from_channel_uses_the_uri_parameters() -> None:
    channel = parse_channel("aeron:udp?endpoint=127.0.0.1:40456|mtu=4096|term-length=128k|fc=min,g:/2|pub-wnd=8k")
    pub = Publication.from_channel(channel, 10, 42, 0, destination=("127.0.0.1", 40456))
    assert pub.mtu == 4096 and pub.term_length == 128 * 1024 and pub.publication_window == 8192
    assert isinstance(pub.flow_control, MinFlowControl) and pub.flow_control.group_min_size == 2


def test_next_deadline_before_the_first_sm_is_the_next_setup() -> None:
    """An unconnected publication's deadline moves with its SETUPs (a stale one made the shell spin)."""
    pub = make()
    assert pub.next_deadline_ns() == 0
    for step in range(5):
        now = step * 100 * MS
        assert isinstance(frames(pub.do_work(now))[0], Setup)
        assert pub.next_deadline_ns() == now + 100 * MS
