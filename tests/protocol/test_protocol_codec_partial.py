"""What the decoder holds between reads: only the partial frame, whose size it can tell once its prefix is in."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from flowbroker.protocol import PROTOCOL_VERSION, Connection, FrameDecoder, Hello, Noop, Role, encode_frame


def test_the_connection_tells_what_its_decoder_holds() -> None:
    conn = Connection(Role.BROKER)
    hello = encode_frame(Hello(PROTOCOL_VERSION, "t", True, []))
    conn.receive_data(hello + hello[:6])
    assert conn.next_frame() is not None and conn.next_frame() is None
    assert (conn.buffered, conn.next_frame_size) == (6, len(hello))


def test_a_decoded_frame_is_released_once_the_decoder_needs_more() -> None:
    decoder = FrameDecoder()
    big, small = encode_frame(Noop(2**60, False)), encode_frame(Noop(7, True))
    decoder.feed(big + small[:3])
    assert decoder.next_frame() == Noop(2**60, False)
    assert decoder.next_frame_size is None  # three bytes of the next prefix
    assert decoder.next_frame() is None
    assert decoder.buffered == 3 and len(decoder._buf) == 3  # the decoded frame's bytes are gone
    decoder.feed(small[3:5])
    assert decoder.next_frame_size == len(small) and decoder.next_frame() is None
    decoder.feed(small[5:])
    assert decoder.next_frame() == Noop(7, True) and decoder.buffered == 0


@given(st.lists(st.integers(0, 2**63), min_size=1, max_size=20), st.data())
def test_between_reads_only_the_partial_frame_is_held(nonces: list[int], data: st.DataObject) -> None:
    wire = b"".join(encode_frame(Noop(n, False)) for n in nonces)
    conn = FrameDecoder()
    sizes = [len(encode_frame(Noop(n, False))) for n in nonces]
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    pos = 0
    while pos < len(wire):
        step = data.draw(st.integers(1, len(wire) - pos))
        conn.feed(wire[pos : pos + step])
        pos += step
        while conn.next_frame() is not None:
            pass
        done = max([e for e in ends if e <= pos], default=0)
        assert conn.buffered == pos - done  # exactly the part of the frame in progress
        if conn.buffered >= 4:
            assert conn.next_frame_size == sizes[ends.index(min(e for e in ends if e > pos))]

