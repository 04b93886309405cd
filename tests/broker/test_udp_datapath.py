"""The broker's UDP data path under attack, sans-IO: whatever arrives on its endpoint for a session the broker
did not hand out is refused, counted by its reason, creates nothing and is answered with nothing.

The datagrams are what an attacker who can reach the port would send: random bytes of every length, valid
Aeron frames of every type (DATA, heartbeats, PAD, SETUP, SM with and without a group tag, NAK, ERR, RTTM,
RSP_SETUP, and the types nobody here speaks) with random session and stream ids, and those frames cut
short at every length and with bytes flipped. The expected reason comes from the header alone
(``_expected``), as DataPath promises: too short for its type's ids or a type no side takes -> "malformed",
anything else about a session id that is not live -> "unregistered_session".
"""

from __future__ import annotations

import random
import struct
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.broker.udp.datapath import REFUSAL_REASONS, DataPath
from flowbroker.transport import frames as f
from tests.broker.coreharness import Harness

DATAGRAMS = 100_000
ENDPOINT = ("127.0.0.1", 5682)
ATTACKER = ("127.0.0.1", 40000)

_INGRESS_TYPES = {f.FrameType.DATA, f.FrameType.PAD, f.FrameType.SETUP}
_EGRESS_TYPES = {f.FrameType.SM, f.FrameType.NAK, f.FrameType.ERR, f.FrameType.RTTM}


def _expected(datagram: bytes) -> str:
    """The refusal DataPath owes a datagram whose session id is not live, read from its header only."""
    if len(datagram) < 8:
        return "malformed"
    ftype = struct.unpack_from("<H", datagram, 6)[0]
    if ftype in _INGRESS_TYPES:
        return "malformed" if len(datagram) < 20 else "unregistered_session"
    if ftype in _EGRESS_TYPES:
        return "malformed" if len(datagram) < 16 else "unregistered_session"
    return "malformed"


class _Attack:
    """A DataPath inside a real BrokerCore (in memory, fake clock), and what must not change."""

    def __init__(self, seed: int = 1) -> None:
        self.harness = Harness()
        self.wakes = 0
        self.datapath = DataPath(self.harness.config.udp, self.harness.core, ENDPOINT, self._wake, seed=seed)
        self.harness.core.udp = self.datapath
        self.live = set(self.datapath.session_ids.live)
        self.publications = dict(self.datapath.ingress.publications)
        self.subscriptions = dict(self.datapath.egress.subscriptions)

    def _wake(self) -> None:
        self.wakes += 1

    def unregistered(self, rng: random.Random) -> int:
        while True:
            session_id = rng.randrange(-(2**31), 2**31)
            if session_id not in self.datapath.session_ids.live:
                return session_id

    def assert_nothing_created(self) -> None:
        dp = self.datapath
        assert dp.session_ids.live == self.live
        assert dp.ingress.publications == self.publications
        assert dp.egress.subscriptions == self.subscriptions
        assert dp.do_work(self.harness.now) == []  # refused datagrams are answered with nothing
        assert self.wakes == 0
        assert len(self.harness.core.sessions) == 0  # no publication session was opened


def _frames(rng: random.Random, session_id: int) -> list[bytes]:
    """One valid frame of every type for ``session_id``, random fields."""
    stream_id = rng.randrange(-(2**31), 2**31)
    term_id = rng.randrange(-(2**31), 2**31)
    offset = rng.randrange(0, 1 << 20) & ~31
    payload = rng.randbytes(rng.randrange(0, 1500))
    return [
        f.encode_data(f.DataFrame(32 + len(payload), f.UNFRAGMENTED, offset, session_id, stream_id, term_id,
                                  rng.getrandbits(63), payload)),
        f.encode_heartbeat(offset, session_id, stream_id, term_id),
        f.encode_data(f.DataFrame(rng.randrange(32, 4096), f.UNFRAGMENTED, offset, session_id, stream_id, term_id,
                                  frame_type=f.FrameType.PAD)),
        f.encode_setup(f.Setup(offset, session_id, stream_id, term_id, term_id + rng.randrange(0, 4),
                               rng.choice([65536, 2 << 20, 1 << 30, 3, -1]), rng.choice([1408, 8192, 65504, 0]))),
        f.encode_status_message(f.StatusMessage(session_id, stream_id, term_id, offset, rng.randrange(0, 1 << 31),
                                                rng.getrandbits(63), flags=rng.choice([0, f.SM_SETUP_FLAG]))),
        f.encode_status_message(f.StatusMessage(session_id, stream_id, term_id, offset, 65536, 7,
                                                group_tag=rng.getrandbits(63))),
        f.encode_nak(f.Nak(session_id, stream_id, term_id, offset, rng.randrange(0, 1 << 20))),
        f.encode_error(f.ErrorFrame(session_id, stream_id, rng.getrandbits(63), f.ERROR_CODE_IMAGE_REJECTED,
                                    "x" * rng.randrange(0, 1100))),
        f.encode_rttm(f.RttMeasurement(session_id, stream_id, rng.getrandbits(63), 0, rng.getrandbits(63),
                                       flags=rng.choice([0, f.RTTM_REPLY_FLAG]))),
        f.encode_response_setup(f.ResponseSetup(session_id, stream_id, rng.randrange(-(2**31), 2**31))),
        # types no side speaks (RES, ATS_*, EXT) and unassigned ones, with a plausible header and ids
        struct.pack("<iBBHii", 24, 0, 0, rng.choice([7, 8, 9, 10, 0xFFFF, rng.randrange(12, 0xFFFF)]),
                    session_id, stream_id) + rng.randbytes(8),
    ]


def _datagram(rng: random.Random, attack: _Attack) -> bytes:
    kind = rng.random()
    if kind < 0.25:  # random bytes, mostly short, sometimes up to the largest UDP payload
        n = rng.choice([rng.randrange(0, 48), rng.randrange(0, 2048), rng.randrange(0, 65508)])
        return rng.randbytes(n)
    frame = rng.choice(_frames(rng, attack.unregistered(rng)))
    if kind < 0.55:
        return frame
    if kind < 0.8:  # cut short at any length, header included
        return frame[: rng.randrange(0, len(frame))]
    mutated = bytearray(frame)  # flipped bytes (the type and ids included), or a tail appended
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(0, len(mutated))
        mutated[i] ^= 1 << rng.randrange(8)
    if rng.random() < 0.3:
        mutated += rng.randbytes(rng.randrange(1, 64))
    return bytes(mutated)


def test_a_hundred_thousand_hostile_datagrams_are_refused_by_reason_and_create_nothing() -> None:
    attack = _Attack(seed=3)
    dp = attack.datapath
    rng = random.Random(20261123)
    expected: Counter[str] = Counter()
    for i in range(DATAGRAMS):
        datagram = _datagram(rng, attack)
        expected[_expected(datagram)] += 1
        # every buffer type the shell may hand over, from a few source addresses
        data: bytes | bytearray | memoryview = (datagram, bytearray(datagram), memoryview(datagram))[i % 3]
        source = (ATTACKER[0], ATTACKER[1] + i % 7)
        before = sum(dp.refused.values())
        dp.on_datagram(data, source, attack.harness.now)
        assert sum(dp.refused.values()) == before + 1, f"datagram {i} ({datagram[:40].hex()}) not counted once"
        if i % 1000 == 0:
            attack.harness.advance(0.001)
    assert dp.datagrams_received == DATAGRAMS
    assert sum(dp.refused.values()) == DATAGRAMS
    assert dp.refused == expected
    assert set(dp.refused) <= set(REFUSAL_REASONS)
    # both reasons really occurred, in numbers: the corpus reached past the length checks
    assert expected["malformed"] > DATAGRAMS // 10 and expected["unregistered_session"] > DATAGRAMS // 4
    attack.assert_nothing_created()
    stats = dp.statistics()
    assert stats.datagrams_received == DATAGRAMS and dict(stats.refused) == dict(expected)
    assert stats.publications == 0 and stats.subscriptions == 0


def test_every_frame_type_at_every_length_is_refused_by_the_reason_its_header_gives() -> None:
    """Each frame of every type, cut at every length from 0 to its whole: the boundary between "malformed"
    and "unregistered_session" is exactly where the session and stream ids become readable."""
    attack = _Attack(seed=4)
    dp = attack.datapath
    rng = random.Random(5)
    expected: Counter[str] = Counter()
    sent = 0
    for frame in _frames(rng, attack.unregistered(rng)):
        for n in range(0, min(len(frame), 96) + 1):
            dp.on_datagram(frame[:n], ATTACKER, attack.harness.now)
            expected[_expected(frame[:n])] += 1
            sent += 1
    assert dp.refused == expected and sum(dp.refused.values()) == sent == dp.datagrams_received
    # per type: the shortest cut that is counted as unregistered (not malformed)
    assert _expected(f.encode_heartbeat(0, 5, 6, 7)[:19]) == "malformed"
    assert _expected(f.encode_heartbeat(0, 5, 6, 7)[:20]) == "unregistered_session"
    assert _expected(f.encode_nak(f.Nak(5, 6, 7, 0, 1))[:15]) == "malformed"
    assert _expected(f.encode_nak(f.Nak(5, 6, 7, 0, 1))[:16]) == "unregistered_session"
    attack.assert_nothing_created()


_ATTACK = _Attack(seed=9)  # shared by the property's examples: it must hold for any sequence of them


def _header_like() -> st.SearchStrategy[bytes]:
    """Bytes with an Aeron-looking header: a length, version, flags, a type (known ones often), ids, a tail."""
    return st.builds(
        lambda length, flags, ftype, ids, tail: struct.pack("<iBBH", length, 0, flags, ftype) + ids + tail,
        st.integers(-(2**31), 2**31 - 1), st.integers(0, 255),
        st.one_of(st.sampled_from([int(t) for t in f.FrameType]), st.integers(0, 0xFFFF)),
        st.binary(max_size=8), st.binary(max_size=64),
    )


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=2048), _header_like()), min_size=1, max_size=20))
def test_property_any_bytes_are_counted_once_and_change_nothing(datagrams: list[bytes]) -> None:
    dp = _ATTACK.datapath
    received, refused = dp.datagrams_received, Counter(dp.refused)
    assert not dp.session_ids.live  # no session was handed out: every id in these bytes is unregistered
    for datagram in datagrams:
        dp.on_datagram(datagram, ATTACKER, _ATTACK.harness.now)
        refused[_expected(datagram)] += 1
        received += 1
    assert dp.datagrams_received == received
    assert dp.refused == refused and sum(dp.refused.values()) == received
    _ATTACK.assert_nothing_created()
