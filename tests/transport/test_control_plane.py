"""ERR frames for refused images (receiver sends, publication reacts) and MDC receivers announcing themselves.

Sans-IO: a real ``Publication`` and real ``ReceiveChannel``s exchange datagrams by hand, with the time
passed in.
"""

from __future__ import annotations

import struct

from flowbroker.transport.frames import (
    ERROR_CODE_IMAGE_REJECTED,
    SM_SETUP_FLAG,
    ErrorFrame,
    Setup,
    StatusMessage,
    decode_datagram,
    encode_error,
    encode_setup,
    encode_status_message,
)
from flowbroker.transport.flow_control import flow_control_from_param
from flowbroker.transport.publication import OfferResult, Publication, PublicationConfig
from flowbroker.transport.subscription import ReceiveChannel, ReceiverConfig

TERM = 64 * 1024
MS = 1_000_000
PUB = ("10.0.0.1", 40001)
SUB_A = ("10.0.0.2", 40002)
SUB_B = ("10.0.0.3", 40003)
CONTROL = ("10.0.0.1", 40100)

Outbox = list[tuple[bytes, object]]


def decoded(out: Outbox) -> list[tuple[object, object]]:
    result: list[tuple[object, object]] = []
    for datagram, address in out:
        frames, reason = decode_datagram(datagram, TERM)
        assert reason is None, reason
        result.extend((frame, address) for frame in frames)
    return result


def errors(out: Outbox) -> list[tuple[ErrorFrame, object]]:
    return [(f, a) for f, a in decoded(out) if isinstance(f, ErrorFrame)]


def channel(receiver_id: int, **config: object) -> ReceiveChannel:
    rc = ReceiveChannel(10, ReceiverConfig(receiver_id=receiver_id, **config))  # type: ignore[arg-type]
    rc.add_subscription(0)
    return rc


# ------------------------------------------------------------------------------------------ receiver sends ERR


def test_a_setup_the_receiver_cannot_take_is_answered_with_err_at_the_sm_pace() -> None:
    rc = channel(3, receiver_window=4096, group_tag=77)
    big_mtu = encode_setup(Setup(0, 7, 10, 0, 0, TERM, 8192, 0))  # MTU larger than the 4 KiB window
    rc.on_datagram(big_mtu, PUB, 0)
    assert not rc.images
    assert rc.dispositions["setup_rejected:mtu_exceeds_window"] == 1
    (err, address), = errors(rc.do_work(0))
    assert address == PUB  # unicast: back to the data's source
    assert (err.session_id, err.stream_id, err.receiver_id, err.error_code) == (7, 10, 3, ERROR_CODE_IMAGE_REJECTED)
    assert err.group_tag == 77
    assert "mtu_exceeds_window" in err.message and "mtu=8192" in err.message
    # The publication repeats SETUP every 100 ms; ERR goes out at most once per SM timeout (200 ms).
    rc.on_datagram(big_mtu, PUB, 100 * MS)
    assert errors(rc.do_work(100 * MS)) == []
    rc.on_datagram(big_mtu, PUB, 201 * MS)
    assert len(errors(rc.do_work(201 * MS))) == 1
    assert rc.errors_sent == 2
    assert rc.dispositions["setup_rejected:mtu_exceeds_window"] == 3  # every SETUP still counted once
    # Another publication's SETUP is rate-limited on its own.
    rc.on_datagram(encode_setup(Setup(0, 8, 10, 0, 0, TERM, 8192, 0)), PUB, 202 * MS)
    assert [e.session_id for e, _ in errors(rc.do_work(202 * MS))] == [8]


def test_a_setup_that_fails_validation_is_answered_with_err() -> None:
    rc = channel(3)
    bad_term = bytearray(encode_setup(Setup(0, 7, 10, 0, 0, TERM, 1408, 0)))
    struct.pack_into("<i", bad_term, 28, 3 * TERM)  # not a power of two
    rc.on_datagram(bytes(bad_term), PUB, 0)
    assert rc.dispositions["rejected:bad_field"] == 1 and not rc.images
    (err, address), = errors(rc.do_work(0))
    assert address == PUB and err.session_id == 7 and err.error_code == ERROR_CODE_IMAGE_REJECTED
    assert "bad_field" in err.message
    # Not our stream, or no subscriber: nothing to refuse, no ERR.
    other_stream = bytearray(bad_term)
    struct.pack_into("<i", other_stream, 16, 11)
    rc.on_datagram(bytes(other_stream), PUB, 300 * MS)
    nobody = ReceiveChannel(10, ReceiverConfig(receiver_id=4))
    nobody.on_datagram(bytes(bad_term), PUB, 300 * MS)
    assert errors(rc.do_work(300 * MS)) == [] and errors(nobody.do_work(300 * MS)) == []
    assert rc.errors_sent == 1 and nobody.errors_sent == 0


def test_err_goes_to_the_control_address_when_there_is_one() -> None:
    rc = channel(3, receiver_window=4096, control_address=CONTROL, multicast=True)
    rc.on_datagram(encode_setup(Setup(0, 7, 10, 0, 0, TERM, 8192, 0)), PUB, 0)
    assert [a for _, a in errors(rc.do_work(0))] == [CONTROL]


# ------------------------------------------------------------------------------------------ publication gets ERR


def connected_publication(fc: str | None = None) -> Publication:
    pub = Publication(
        PublicationConfig(session_id=7, stream_id=10, term_length=TERM), 0,
        destination=SUB_A, flow_control=flow_control_from_param(fc),
    )
    pub.do_work(0)
    return pub


def sm_from(pub: Publication, receiver_id: int, source: object, position: int, now_ns: int) -> None:
    sm = StatusMessage(7, 10, position >> 16, position & (TERM - 1), 32 * 1024, receiver_id)
    pub.on_datagram(encode_status_message(sm), source, now_ns)


def test_err_from_the_only_receiver_disconnects_the_publication() -> None:
    pub = connected_publication()
    seen: list[tuple[ErrorFrame, object]] = []
    pub.error_handler = lambda err, source: seen.append((err, source))
    sm_from(pub, 3, SUB_A, 0, MS)
    assert pub.is_connected and pub.offer(b"x") > 0
    err = ErrorFrame(7, 10, 3, ERROR_CODE_IMAGE_REJECTED, "image rejected: go away")
    pub.on_datagram(encode_error(err), SUB_A, 2 * MS)
    assert pub.counters.errors_received == 1 and pub.last_error == err and seen == [(err, SUB_A)]
    assert not pub.is_connected
    assert pub.offer(b"y") == OfferResult.NOT_CONNECTED
    # Someone else's ERR (another session on the same control port) changes nothing.
    pub.on_datagram(encode_error(ErrorFrame(8, 10, 3, ERROR_CODE_IMAGE_REJECTED, "")), SUB_A, 3 * MS)
    assert pub.counters.errors_received == 1 and pub.counters.invalid_packets == 0


def test_err_removes_the_receiver_from_min_flow_control() -> None:
    pub = connected_publication("min")
    sm_from(pub, 3, SUB_A, 0, MS)
    sm_from(pub, 4, SUB_B, 0, MS)
    while pub.offer(bytes(1000)) > 0:
        pass
    for step in range(40):
        pub.do_work(2 * MS + step)
    assert pub.sender_position == 31 * 1056  # what fits below the 32 KiB limit
    sm_from(pub, 3, SUB_A, 32 * 1024, 3 * MS)  # A has consumed it all; B still at 0 holds the limit
    assert pub.sender_limit == 32 * 1024
    pub.on_datagram(encode_error(ErrorFrame(7, 10, 4, ERROR_CODE_IMAGE_REJECTED, "no")), SUB_B, 4 * MS)
    assert pub.sender_limit == 64 * 1024  # B is gone: only A's position + window counts
    assert pub.is_connected


def test_err_drops_a_dynamic_mdc_destination() -> None:
    pub = Publication(PublicationConfig(session_id=7, stream_id=10, term_length=TERM), 0, dynamic=True)
    for source in (SUB_A, SUB_B):
        announce = StatusMessage(0, 0, 0, 0, 0, 1, None, SM_SETUP_FLAG)
        pub.on_datagram(encode_status_message(announce), source, 0)
    assert sorted(pub.destinations) == [SUB_A, SUB_B]  # type: ignore[type-var]
    pub.on_datagram(encode_error(ErrorFrame(7, 10, 9, ERROR_CODE_IMAGE_REJECTED, "no")), SUB_B, MS)
    assert pub.destinations == [SUB_A]


def test_refused_image_end_to_end_by_hand() -> None:
    """A publication whose MTU the receiver refuses learns it from the ERR and never connects."""
    pub = Publication(PublicationConfig(session_id=7, stream_id=10, term_length=TERM, mtu=8192), 0, destination=SUB_A)
    rc = channel(3, receiver_window=4096)
    now = 0
    for step in range(6):
        now = step * 100 * MS
        for datagram, _ in pub.do_work(now):
            rc.on_datagram(datagram, PUB, now)
        for datagram, address in rc.do_work(now):
            assert address == PUB
            pub.on_datagram(datagram, SUB_A, now)
    assert pub.counters.setups_sent == 6 and rc.errors_sent == 3
    assert pub.counters.errors_received == 3 and pub.last_error is not None
    assert pub.last_error.receiver_id == 3 and "mtu_exceeds_window" in pub.last_error.message
    assert not pub.is_connected and not rc.images


# ------------------------------------------------------------------------------------------ MDC announcements


def test_a_receiver_with_a_control_address_announces_itself_every_second() -> None:
    rc = ReceiveChannel(10, ReceiverConfig(receiver_id=3, control_address=CONTROL))
    assert rc.do_work(0) == []  # no subscription, nothing to announce
    rc.add_subscription(5 * MS)
    assert rc.next_deadline_ns(5 * MS) == 5 * MS
    announce = StatusMessage(0, 0, 0, 0, 0, 3, None, SM_SETUP_FLAG)
    assert decoded(rc.do_work(5 * MS)) == [(announce, CONTROL)]
    assert rc.do_work(500 * MS) == []
    assert decoded(rc.do_work(1005 * MS)) == [(announce, CONTROL)]
    assert rc.announcements_sent == 2
    # Multicast receivers send to the control group but never announce (Aeron's don't).
    mc = ReceiveChannel(10, ReceiverConfig(receiver_id=4, control_address=CONTROL, multicast=True))
    mc.add_subscription(0)
    assert mc.do_work(0) == [] and mc.announcements_sent == 0


def test_a_dynamic_publication_learns_announcing_receivers_and_sets_them_up() -> None:
    pub = Publication(PublicationConfig(session_id=7, stream_id=10, term_length=TERM), 0, dynamic=True)
    receivers = {SUB_A: ReceiveChannel(10, ReceiverConfig(receiver_id=1, control_address=CONTROL)),
                 SUB_B: ReceiveChannel(10, ReceiverConfig(receiver_id=2, control_address=CONTROL))}
    subs = {address: rc.add_subscription(0) for address, rc in receivers.items()}
    got: dict[object, list[bytes]] = {address: [] for address in receivers}

    def exchange(now: int) -> None:
        for address, rc in receivers.items():
            for datagram, destination in rc.do_work(now):
                assert destination == CONTROL
                pub.on_datagram(datagram, address, now)
        for datagram, destination in pub.do_work(now):
            receivers[destination].on_datagram(datagram, CONTROL, now)  # type: ignore[index]

    for step in range(5):
        exchange(step * MS)
    assert sorted(pub.destinations) == [SUB_A, SUB_B]  # type: ignore[type-var]
    assert all(7 in rc.images for rc in receivers.values()) and pub.is_connected
    for i in range(50):
        assert pub.offer(i.to_bytes(4, "little")) > 0
    for step in range(5, 10):
        exchange(step * MS)
        for address, sub in subs.items():
            sub.poll(lambda m, a=address: got[a].append(bytes(m)), 100)  # type: ignore[misc]
    expected = [i.to_bytes(4, "little") for i in range(50)]
    assert got[SUB_A] == expected and got[SUB_B] == expected
