"""The transport's fast paths write and read exactly what the general ones do: an unfragmented append
(`TermAppender.append_unfragmented`, what `Publication.offer` tries first), the reader that hands whole
messages straight to the subscriber (`TermRebuilder.read_messages`), and a producer's cycles that keep
back a part-empty datagram at the tail (`Publication.do_work(whole_datagrams=True)`)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flowbroker.transport.publication import Publication, PublicationConfig
from flowbroker.transport.terms import FragmentAssembler, TermAppender, TermRebuilder

TERM = 64 * 1024
MTU = 1408
lengths = st.lists(st.integers(min_value=0, max_value=3 * MTU), min_size=1, max_size=120)


@settings(max_examples=200, deadline=None)
@given(lengths, st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_the_unfragmented_append_writes_the_bytes_append_writes(sizes: list[int], initial: int) -> None:
    fast = TermAppender(TERM, initial, 77, 1001, MTU)
    slow = TermAppender(TERM, initial, 77, 1001, MTU)
    for i, size in enumerate(sizes):
        message = bytes([i % 251]) * size
        position = fast.append_unfragmented(message, 1 << 62, 1 << 62, 5)
        if position == 0:  # not the fast path's case: it wrote nothing
            assert fast.position == slow.position
            position = fast.append(message, 5)
        assert position == slow.append(message, 5)
        assert bytes(fast._log) == bytes(slow._log)


def test_the_unfragmented_append_stops_at_the_limits_it_is_given() -> None:
    app = TermAppender(TERM, 0, 1, 2, MTU)
    assert app.append_unfragmented(b"x" * 100, 0, 1 << 62) == 0  # tail at the limit: back pressure
    assert app.append_unfragmented(b"x" * 100, 1 << 62, 100) == 0  # the frame would pass max_position
    assert app.append_unfragmented(b"x" * MTU, 1 << 62, 1 << 62) == 0  # two frames: the general path
    assert app.position == 0 and not any(app._log)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=80), st.integers(min_value=0, max_value=3 * MTU)),
                min_size=1, max_size=120), st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_the_append_of_a_head_and_a_body_writes_the_bytes_of_their_join(parts: list[tuple[int, int]],
                                                                        initial: int) -> None:
    """`append_unfragmented_parts(head, body)` (the broker's deliveries: envelope, then body) is
    `append_unfragmented(head + body)` byte for byte, refusing the same cases; through `Publication.offer_parts`
    the general path takes what the fast one refuses, as `offer` does."""
    parted = TermAppender(TERM, initial, 77, 1001, MTU)
    joined = TermAppender(TERM, initial, 77, 1001, MTU)
    for i, (head_size, body_size) in enumerate(parts):
        head, body = bytes([i % 251]) * head_size, bytes([(i + 7) % 251]) * body_size
        position = parted.append_unfragmented_parts(head, body, 1 << 62, 1 << 62, 5)
        expected = joined.append_unfragmented(head + body, 1 << 62, 1 << 62, 5)
        assert position == expected
        if position == 0:
            assert parted.position == joined.position
            parted.append(head + body, 5)
            joined.append(head + body, 5)
        assert bytes(parted._log) == bytes(joined._log)
    assert parted.append_unfragmented_parts(b"h", b"x" * 100, parted.position, 1 << 62) == 0  # at the limit
    parts_pub = Publication(PublicationConfig(5, 6, term_length=TERM, mtu=MTU), 0)
    joined_pub = Publication(PublicationConfig(5, 6, term_length=TERM, mtu=MTU), 0)
    parts_pub.publication_limit = joined_pub.publication_limit = TERM  # as if connected
    for i, (head_size, body_size) in enumerate(parts):
        head, body = bytes([i % 251]) * head_size, bytes([(i + 7) % 251]) * body_size
        assert parts_pub.offer_parts(head, body) == joined_pub.offer(head + body)
    assert bytes(parts_pub.appender._log) == bytes(joined_pub.appender._log)


@settings(max_examples=200, deadline=None)
@given(lengths, st.integers(min_value=1, max_value=300))
def test_read_messages_hands_over_what_read_and_the_assembler_do(sizes: list[int], limit: int) -> None:
    app = TermAppender(TERM, 3, 77, 1001, MTU)
    messages = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    end = 0
    for message in messages:
        if app.position + app.space_needed(len(message)) > TERM:
            break
        end = app.append(message)
    rebuilder = TermRebuilder(TERM, 3)
    rebuilder.partitions[0][:] = app.partitions[0]
    slow: list[bytes] = []
    fast: list[bytes] = []
    assembler = FragmentAssembler(lambda m: slow.append(bytes(m)))
    position = 0
    while position < end:
        position, _ = rebuilder.read(position, end, assembler, limit)
    fragments = FragmentAssembler(lambda m: fast.append(bytes(m)))
    position, wholes = 0, 0
    while position < end:
        position, _, count, _ = rebuilder.read_messages(position, end, lambda m: fast.append(bytes(m)), fragments, limit)
        wholes += count
    assert fast == slow == messages[:len(slow)]
    assert wholes == sum(1 for m in slow if len(m) <= MTU - 32)
    # A handler that returns true stops the read after that message (Aeron's controlled poll, BREAK):
    # reading on from where it stopped hands over the same messages, each once.
    stopping: list[bytes] = []
    stop_assembler = FragmentAssembler(lambda m: stopping.append(bytes(m)))

    def every_third(m: memoryview | bytes) -> bool:
        stopping.append(bytes(m))
        return len(stopping) % 3 == 0

    position, stops = 0, 0
    while position < end:
        position, _, _, stopped = rebuilder.read_messages(position, end, every_third, stop_assembler, limit)
        stops += stopped
    assert stopping == slow
    assert stops == sum(1 for i, m in enumerate(slow) if (i + 1) % 3 == 0 and len(m) <= MTU - 32)


def _datagrams(whole: bool, sizes: list[int]) -> list[bytes]:
    pub = Publication(PublicationConfig(5, 1001, term_length=TERM, mtu=MTU, max_messages_per_send=1024), 0,
                      destination=("127.0.0.1", 1))
    from flowbroker.transport.frames import StatusMessage, encode_status_message

    pub.do_work(0)  # SETUP
    pub.on_datagram(encode_status_message(StatusMessage(5, 1001, 0, 0, TERM // 2, 9)), ("127.0.0.1", 1), 1)
    out: list[bytes] = []
    for i, size in enumerate(sizes):
        while pub.offer(bytes([i % 251]) * size) < 0:
            pass  # ADMIN_ACTION at a term's end: offer again
        out += [d for d, _ in pub.do_work(2, whole_datagrams=whole)]
    out += [d for d, _ in pub.do_work(3)]  # the shell's cycle once the application yields
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=60))
def test_keeping_back_the_part_empty_datagram_sends_the_same_bytes_in_fewer_datagrams(sizes: list[int]) -> None:
    every = _datagrams(False, sizes)
    whole = _datagrams(True, sizes)
    assert b"".join(whole) == b"".join(every)
    assert len(whole) <= len(every)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(min_value=0, max_value=MTU), min_size=0, max_size=12), min_size=1, max_size=40),
       st.sampled_from([b"", b"\x00", b"\x01\x00\x03"]), st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_a_batch_append_writes_what_appending_each_message_behind_its_head_writes(
    batches: list[list[int]], head: bytes, initial: int
) -> None:
    fast = TermAppender(TERM, initial, 77, 1001, MTU)
    slow = TermAppender(TERM, initial, 77, 1001, MTU)
    for b, sizes in enumerate(batches):
        messages = [bytes([(b + i) % 251]) * size for i, size in enumerate(sizes)]
        before = fast.position
        position = fast.append_many(messages, head, 1 << 62, 1 << 62, 5)
        if position == 0:  # not its case (a frame too long, the term's end): all or none, so none
            assert fast.position == before and bytes(fast._log) == bytes(slow._log)
            for message in messages:
                position = fast.append(head + message, 5)
        for message in messages:
            slow.append(head + message, 5)
        assert position == slow.position == fast.position
        assert bytes(fast._log) == bytes(slow._log)


def test_a_batch_append_stops_at_the_limits_it_is_given() -> None:
    app = TermAppender(TERM, 0, 1, 2, MTU)
    three = [b"x" * 100] * 3  # 160 term bytes each: the last starts at 320, ends at 453
    assert app.append_many(three, b"\x00", 320, 1 << 62) == 0  # the last would start at the limit
    assert app.append_many(three, b"\x00", 1 << 62, 453) == 0  # the last frame would reach max_position
    assert app.append_many([b"x" * 10, b"x" * (MTU - 32)], b"\x00", 1 << 62, 1 << 62) == 0  # two frames
    assert app.position == 0 and not any(app._log)
    assert app.append_many(three, b"\x00", 321, 454) == 480
    pub = Publication(PublicationConfig(7, 1001, term_length=TERM, mtu=MTU), 0, destination=("127.0.0.1", 1))
    assert pub.offer_many(three, b"\x00") == 0  # not connected: no room below the publication limit
