"""Hostile traffic against a running broker, and the well-behaved client that must not notice it.

Shared by the fuzz test (tests/e2e/test_e2e_fuzz.py, which draws the seed and the frame corpus with
hypothesis) and the long run (benchmarks/fuzz_broker.py, 10^6 frames against a broker process).

Three parts:
- `moves()`: an endless, seeded stream of hostile `Move`s (one frame or one blob of bytes each):
  valid frames of every type with random fields (a corpus drawn from tests/protocol/protocol_strategies.py),
  requests on a small pool of queue and exchange names so that they reach deep into the broker,
  byte mutations (flip, insert, delete, truncate), huge length prefixes, frames cut short, frames
  before HELLO, TRANSFERs beyond credit, SETTLEs of random ranges, subscriptions with tiny prefetch
  and buffers, '#'-heavy topic bindings, long routing keys and headers near the limits.
- `HostileLink` / `hostile_connection()`: sends moves over TCP, one connection at a time per slot,
  reconnecting (with HELLO) whenever the broker closes it; a reader task drains and decodes what the
  broker answers and counts errors by code in `HostileStats`.
- `Bystander`: an SDK producer and consumer on its own queue, which records when each message
  arrived and how long it took, so a caller can check nothing was lost and nothing stalled.

Nothing here depends on the broker being in-process: it speaks only TCP on 127.0.0.1.
"""

from __future__ import annotations

import random
import time
import struct
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import trio

import flowbroker.client as fc
from flowbroker.protocol import (
    PROTOCOL_VERSION,
    Bind,
    BufferAck,
    BufferControl,
    BufferLimit,
    Cancel,
    Close,
    DeclareExchange,
    DeclareQueue,
    DeleteQueue,
    Error,
    Frame,
    FrameDecoder,
    Hello,
    LocalProtocolError,
    Noop,
    Outcome,
    ProtocolError,
    PurgeQueue,
    Settle,
    Subscribe,
    Transfer,
    TransferEntry,
    Unbind,
    encode_frame,
)
from flowbroker.protocol.limits import MAX_CONTROL_FRAME, MAX_HEADERS, MAX_KEY_BYTES, MAX_RANGES_PER_FRAME

from tests.protocol.protocol_strategies import any_frame

U64 = 2**64 - 1
LENGTH = struct.Struct(">I")
MAX_FRAME = 8 * 1024 * 1024  # the broker's default max_frame_size, which both the test and the script run with

QUEUES = ("h0", "h1", "h2", "h3")
EXCHANGES = (("hx.topic", "topic"), ("hx.direct", "direct"), ("hx.fanout", "fanout"))
TOPIC_WORDS = ("#", "#", "*", "a", "b", "")
KEY_WORDS = ("a", "b", "c", "", "#", "*")


_MANY_RANGES = [
    [(start + 2 * i, start + 2 * i) for i in range(n)]
    for n in (MAX_RANGES_PER_FRAME, MAX_RANGES_PER_FRAME + 1, 5000)
    for start in (1, 1000, U64 // 2)
]

# -- moves -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """A byte-level change to an encoded frame; positions are fractions of its length, so the same
    mutation applies to the frame whatever transfer id it was given."""

    op: str  # flip | insert | delete | truncate
    at: float
    value: int = 0  # the xor mask (flip) or the byte inserted
    count: int = 1

    def apply(self, data: bytes) -> bytes:
        i = min(len(data) - 1, int(self.at * len(data)))
        if self.op == "flip":
            return data[:i] + bytes([data[i] ^ (self.value or 1)]) + data[i + 1 :]
        if self.op == "insert":
            return data[:i] + bytes([self.value]) * self.count + data[i:]
        if self.op == "delete":
            return data[:i] + data[i + self.count :]
        return data[: max(1, i)]  # truncate: the rest of the stream then reads as the next frame


@dataclass(frozen=True)
class Move:
    """One thing a hostile connection does: send one frame (encoded when sent, so that a TRANSFER
    takes the connection's next transfer id unless `keep_id`), possibly mutated, or raw bytes."""

    kind: str
    frame: Frame | None = None
    raw: bytes = b""
    mutations: tuple[Mutation, ...] = ()
    keep_id: bool = False
    before_hello: bool = False  # on a fresh connection that never said HELLO
    close_after: bool = False  # end the connection after it (what was cut short stays cut short)

    def describe(self, limit: int = 300) -> str:
        what = repr(self.frame) if self.frame is not None else f"raw {self.raw[:64]!r} ({len(self.raw)} bytes)"
        if len(what) > limit:
            what = what[:limit] + f"... ({len(what)} chars)"
        extra = "".join(
            f" {flag}" for flag, on in (("before-hello", self.before_hello), ("close-after", self.close_after),
                                        ("keep-id", self.keep_id)) if on
        )
        muts = f" mutated {list(self.mutations)}" if self.mutations else ""
        return f"{self.kind}{extra}: {what}{muts}"

    def encode(self, next_transfer_id: int) -> bytes:
        """The bytes to send (b"" if the frame cannot be encoded: a value msgpack cannot carry)."""
        data = self.raw
        frame = self.frame
        if frame is not None:
            if isinstance(frame, Transfer) and not self.keep_id:
                entries = _packed_entries(frame)
                if entries is None:
                    return b""
                body = b"\x93\x0a" + msgpack.packb(next_transfer_id) + entries
                data = LENGTH.pack(len(body)) + body + data
            else:
                try:
                    data = encode_frame(frame) + data
                except LocalProtocolError:
                    return b""
        for mutation in self.mutations:
            if data:
                data = mutation.apply(data)
        return data


_last_entries: tuple[Transfer | None, bytes | None] = (None, None)


def _packed_entries(frame: Transfer) -> bytes | None:
    """The msgpack of a TRANSFER's entries, remembered for the last frame (a burst repeats one)."""
    global _last_entries
    last, packed = _last_entries
    if last is None or last.entries is not frame.entries:
        try:
            packed = encode_frame(frame)[4 + 2 + len(msgpack.packb(frame.first_id)) :]
        except LocalProtocolError:
            packed = None
        _last_entries = (frame, packed)
    return packed


WEIGHTS: dict[str, float] = {
    "corpus": 5,  # a frame of any type with random fields, as protocol_strategies draws them
    "request": 20,  # declare / bind / unbind / delete / purge / cancel / noop on the pool's names
    "transfer": 25,
    "over-credit": 0.25,  # a burst of transfers far beyond a producer's buffer
    "settle": 10,
    "subscribe": 6,
    "buffer": 5,
    "topic": 3,  # '#'-heavy bindings and long routing keys
    "headers": 4,  # header counts and sizes around the limits
    "mutate": 2,
    "huge-prefix": 0.5,
    "partial": 0.5,
    "before-hello": 0.7,
    "garbage": 0.5,
}
"""How often each kind comes (relative). The kinds that end a connection are kept rare, so that most
frames reach a session that has built up state, and a long run does not exhaust ephemeral ports."""


def moves(seed: int, corpus: list[Frame], focus: str | None = None, without: frozenset[str] = frozenset()) -> Iterator[Move]:
    """An endless stream of hostile moves, the same for the same arguments. `focus`: a kind made five
    times as frequent, so that a run can dwell on one attack; `without`: kinds left out."""
    rng = random.Random(seed)
    kinds = [k for k in WEIGHTS if k not in without]
    weights = [WEIGHTS[k] * (5 if k == focus else 1) for k in kinds]
    make = _Maker(rng, corpus)
    while True:
        kind = rng.choices(kinds, weights)[0]
        yield from getattr(make, kind.replace("-", "_"))()


class _Maker:
    """One method per kind of move; each returns the moves of one attack."""

    def __init__(self, rng: random.Random, corpus: list[Frame]):
        self.rng = rng
        self.frames = corpus or [Noop(1, False)]
        self.request_id = 0

    # fields

    def rid(self) -> int:
        self.request_id += 1
        return self.request_id if self.rng.random() < 0.9 else self.rng.choice((0, U64, self.request_id - 1))

    def queue(self) -> str:
        r = self.rng.random()
        return self.rng.choice(QUEUES) if r < 0.9 else "h" * 256 if r < 0.905 else self.rng.choice(("", "nope"))

    def count(self, small: int, big: int) -> int:
        return self.rng.randint(0, small) if self.rng.random() < 0.8 else self.rng.randint(0, big)

    def u64ish(self) -> int:
        return self.rng.choice((0, 1, 2, 100, 4096, 1 << 20, 1 << 31, 1 << 32, U64, self.rng.randint(0, U64)))

    def body(self) -> bytes:
        n = self.rng.choice((0, 1, 10, 100, 1000, 4000)) if self.rng.random() < 0.995 else self.rng.randint(0, 256 * 1024)
        return self.rng.randbytes(n) if n < 200 else bytes([self.rng.randint(0, 255)]) * n

    def topic_key(self, words: tuple[str, ...]) -> str:
        n = self.rng.choice((1, 2, 5, 20, 100)) if self.rng.random() < 0.7 else self.rng.choice((128, 129, 500, 5000))
        if n > 100:  # a random stretch repeated: long keys cost the generator little
            return ".".join(self.rng.choices(words, k=32) * (n // 32) + self.rng.choices(words, k=n % 32))
        return ".".join(self.rng.choices(words, k=n))

    def routing_key(self) -> str:
        """Half the time as many words as MAX_KEY_BYTES allows (128), random (no cache holds them)."""
        if self.rng.random() < 0.5:
            return ".".join(self.rng.choices("abc", k=MAX_KEY_BYTES // 2))[: MAX_KEY_BYTES - 1]
        return self.topic_key(KEY_WORDS)

    def header_map(self) -> dict[str, Any] | None:
        if self.rng.random() < 0.8:
            return None
        n = self.rng.choice((1, 3, MAX_HEADERS - 1, MAX_HEADERS, MAX_HEADERS + 1, 300))
        size = self.rng.choice((0, 8, 100)) if n > 3 else self.rng.choice((0, 8, 1000, 60_000))
        return {f"k{i}" + "k" * self.rng.choice((0, 0, 250)): ("v" * size if i % 2 else i) for i in range(n)}

    def entry(self, rich: bool) -> TransferEntry:
        """A message for a pool queue, exchange or nowhere; `rich` ones may be large or carry headers."""
        rng = self.rng
        r = rng.random()
        if r < 0.6:
            exchange, key = "", self.queue()
        elif not rich:
            return TransferEntry(rng.choice(EXCHANGES)[0], rng.choice(("a", "a.b", "b.a.a", "#", "")), b"x")
        elif r < 0.95:
            exchange, key = rng.choice(EXCHANGES)[0], self.topic_key(KEY_WORDS)
        else:
            exchange, key = rng.choice(("nope", "", "hx.topic")), "z" * rng.choice((255, 256, 257, 70_000))
        if not rich:
            return TransferEntry(exchange, key, b"small body")
        return TransferEntry(exchange, key, self.body(), self.header_map(), rng.choice((None, "p1")),
                             rng.choice((None, 0, 1, U64)))

    def ranges(self) -> list[tuple[int, int]]:
        rng = self.rng
        if rng.random() < 0.1:  # at and over the per-frame limit: every other tag
            return rng.choice(_MANY_RANGES)
        out = []
        for _ in range(rng.choice((1, 1, 2, 10, 30))):
            if rng.random() < 0.7:
                first = rng.randint(1, 300)
                out.append((first, first + rng.randint(0, 50)))
            else:  # wide ones; now and then reversed or from 0 (malformed: the connection ends)
                a, b = max(1, self.u64ish()), max(1, self.u64ish())
                out.append((min(a, b), max(a, b)) if rng.random() < 0.97 else (b, a - 1))
        return out

    # kinds

    def corpus(self) -> list[Move]:
        # A corpus TRANSFER keeps its random first_id only sometimes: renumbered, its entries get in.
        return [Move("corpus", self.rng.choice(self.frames), keep_id=self.rng.random() < 0.2)]

    def request(self) -> list[Move]:
        rng = self.rng
        pick = rng.randrange(8)
        frame: Frame
        if pick == 0:
            args = rng.choice((None, {}, {"max_size": 1 << 20}, {"flow_stop_count": 5, "flow_resume_count": 2},
                               {"max_size": -1}, {"overflow": "drop-head"}, {"flow_stop_size": U64}, {"nope": 1}))
            frame = DeclareQueue(self.rid(), self.queue(), rng.random() < 0.1, args)
        elif pick == 1:
            name, kind = rng.choice(EXCHANGES)
            frame = DeclareExchange(self.rid(), name, kind if rng.random() < 0.8 else rng.choice(("topic", "x", "")))
        elif pick == 2:
            frame = Bind(self.rid(), self.queue(), rng.choice(EXCHANGES)[0], self.topic_key(TOPIC_WORDS))
        elif pick == 3:
            frame = Unbind(self.rid(), self.queue(), rng.choice(EXCHANGES)[0], self.topic_key(TOPIC_WORDS))
        elif pick == 4:
            frame = (DeleteQueue if rng.random() < 0.3 else PurgeQueue)(self.rid(), self.queue())
        elif pick == 5:
            frame = Cancel(self.rid(), rng.randint(0, 8))
        else:
            frame = Noop(self.u64ish(), rng.random() < 0.3)
        return [Move("request", frame)]

    def transfer(self) -> list[Move]:
        rng = self.rng
        n = rng.choice((1, 1, 1, 2, 5, 20)) if rng.random() < 0.98 else rng.choice((1024, 1025, 3000))
        if n > 100:  # many empty messages: the per-item limits, not the byte limits
            entries = [TransferEntry("", self.queue(), b"")] * n
        else:
            entries = [self.entry(rich=n <= 2) for _ in range(n)]
        return [Move("transfer", Transfer(1, entries))]

    def over_credit(self) -> list[Move]:
        """TRANSFERs sent without waiting for credit. Each empty message costs MESSAGE_OVERHEAD (512)
        bytes of credit, so 20 frames of 1,024 cost 10 MiB of credit for 200 KB on the wire."""
        queue = self.queue()
        entries = [TransferEntry("", queue, b"")] * 1024
        return [Move("over-credit", Transfer(1, entries)) for _ in range(20)]

    def settle(self) -> list[Move]:
        return [Move("settle", Settle(self.rng.choice(list(Outcome)), self.ranges()))]

    def subscribe(self) -> list[Move]:
        rng = self.rng
        frame = Subscribe(self.rid(), rng.randint(0, 8), self.queue(), rng.choice((0, 1, 1, 2, 3, U64)),
                          rng.choice((0, 1, 10, 200, 4096, U64)))
        return [Move("subscribe", frame)]

    def buffer(self) -> list[Move]:
        rng = self.rng
        opaque = rng.choice((0, 0, 1, 2, 8, U64))
        pick = rng.random()
        if pick < 0.4:
            return [Move("buffer", BufferControl(opaque, rng.choice((0, 1, 100, 4096, 1 << 20, U64))))]
        if pick < 0.7:  # an answer to a shrink it never got, or stale, or lowering below what it sent
            return [Move("buffer", BufferLimit(rng.choice((1, 1, 2, 3, U64)), rng.choice((1, 100, 4096, 1 << 20, U64)),
                                               rng.choice((0, 1, 4096, 1 << 20, self.u64ish()))))]
        return [Move("buffer", BufferAck(opaque, self.u64ish(), self.u64ish()))]

    def topic(self) -> list[Move]:
        """Bindings of '#'-heavy keys (some at the key limit, all distinct), then messages with long
        routing keys, each different so that no routing cache can answer for them."""
        rng = self.rng
        name, queue = "hx.topic", self.queue()
        out = [Move("topic", DeclareExchange(self.rid(), name, "topic")), Move("topic", DeclareQueue(self.rid(), queue))]
        for _ in range(rng.choice((1, 5, 20, 50))):
            if rng.random() < 0.5:  # at, under or just over MAX_KEY_BYTES, wildcards all along
                key = "#." * (MAX_KEY_BYTES // 2 - 3) + "%03d" % rng.randrange(1000) + rng.choice(("", ".#", ".#.*"))
            else:
                key = self.topic_key(TOPIC_WORDS)
            out.append(Move("topic", Bind(self.rid(), queue, name, key)))
        entries = [TransferEntry(name, self.routing_key(), b"t") for _ in range(rng.choice((1, 3, 10)))]
        out.append(Move("topic", Transfer(1, entries)))
        return out

    def headers(self) -> list[Move]:
        """Header counts around MAX_HEADERS, or (rarely) one header that takes the whole message to
        just under or over the default max_message_size (4 MiB)."""
        if self.rng.random() < 0.002:
            size = 4 * 1024 * 1024 - 64 + self.rng.choice((-1, 0, 1, 64))
            headers: dict[str, Any] = {"big": "v" * size}
        else:
            n = self.rng.choice((MAX_HEADERS - 1, MAX_HEADERS, MAX_HEADERS + 1))
            value = "v" * self.rng.choice((0, 10, 1000))
            headers = {f"h{i:03d}": value for i in range(n)}
        return [Move("headers", Transfer(1, [TransferEntry("", self.queue(), b"h", headers)]))]

    def mutate(self) -> list[Move]:
        rng = self.rng
        base = rng.choice((self.corpus()[0], self.request()[0], self.transfer()[0], self.settle()[0]))
        mutations = tuple(
            Mutation(rng.choice(("flip", "flip", "insert", "delete", "truncate")), rng.random(),
                     rng.randint(0, 255), rng.choice((1, 1, 4, 100)))
            for _ in range(rng.choice((1, 1, 2, 4)))
        )
        return [replace(base, kind="mutate", mutations=mutations)]

    def huge_prefix(self) -> list[Move]:
        rng = self.rng
        choice = rng.randrange(4)
        if choice == 0:  # refused from the prefix alone
            raw = LENGTH.pack(rng.choice((MAX_FRAME + 1, 1 << 31, 2**32 - 1))) + b"\x92\x0a"
            return [Move("huge-prefix", raw=raw)]
        if choice == 1:  # a control frame over MAX_CONTROL_FRAME: refused from its first six bytes
            return [Move("huge-prefix", raw=LENGTH.pack(MAX_CONTROL_FRAME + 1) + b"\x93\x13", close_after=True)]
        if choice == 2:  # a TRANSFER the broker must buffer, then the stream ends inside it
            return [Move("huge-prefix", raw=LENGTH.pack(MAX_FRAME) + b"\x93\x0a\x01\x91", close_after=True)]
        return [Move("huge-prefix", raw=LENGTH.pack(0))]

    def partial(self) -> list[Move]:
        base = self.rng.choice((self.corpus()[0], self.transfer()[0], self.settle()[0]))
        return [replace(base, kind="partial", mutations=(Mutation("truncate", self.rng.random()),), close_after=True)]

    def before_hello(self) -> list[Move]:
        base = self.rng.choice((self.corpus()[0], self.request()[0], self.transfer()[0],
                                Move("", Hello(PROTOCOL_VERSION + self.rng.randint(0, 1), "h", True, []))))
        return [replace(base, kind="before-hello", before_hello=True)]

    def garbage(self) -> list[Move]:
        body = self.rng.randbytes(self.rng.randint(1, 200))
        return [Move("garbage", raw=LENGTH.pack(len(body)) + body)]


# -- hostile connections -----------------------------------------------------------------------

SEND_TIMEOUT = 2.0  # seconds: the broker reads every connection all the time, so a send never waits this long
RETIRE_SECONDS = 1.0  # how long a connection we have given up on may still answer before we close it


@dataclass
class HostileStats:
    frames_sent: int = 0  # moves written to a socket in full (a burst or a blob counts as one each)
    bytes_sent: int = 0
    connections: int = 0  # opened, with or without HELLO
    refused_connects: int = 0
    closed_by_broker: int = 0  # the broker ended the stream (EOF or reset) before we closed it
    send_timeouts: int = 0  # the broker did not take our bytes for SEND_TIMEOUT
    errors: Counter[str] = field(default_factory=Counter)  # ERROR frames the broker answered, by code
    error_samples: dict[str, str] = field(default_factory=dict)  # the first text of each code
    undecodable: list[str] = field(default_factory=list)  # broker output a client could not decode

    def merge(self, other: HostileStats) -> None:
        for name in ("frames_sent", "bytes_sent", "connections", "refused_connects", "closed_by_broker",
                     "send_timeouts"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.errors.update(other.errors)
        for code, text in other.error_samples.items():
            self.error_samples.setdefault(code, text)
        self.undecodable += other.undecodable


class HostileLink:
    """One TCP connection of a hostile slot. Its reader drains and decodes what the broker sends
    (a hostile client that stopped reading would be another attack; this one always reads)."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.decoder: FrameDecoder | None = FrameDecoder(MAX_FRAME)
        self.next_transfer_id = 1
        self.closed = False  # by either end: the slot's next move opens a new connection
        self.we_closed = False
        self.scope = trio.CancelScope()

    @classmethod
    async def open(cls, port: int, stats: HostileStats, hello: Hello | None) -> HostileLink | None:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            stats.refused_connects += 1
            return None
        stats.connections += 1
        link = cls(stream)
        if hello is not None and not await link.send(encode_frame(hello), stats):
            await link.aclose()
            return None
        return link

    async def send(self, data: bytes, stats: HostileStats) -> bool:
        with trio.move_on_after(SEND_TIMEOUT) as scope:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.closed = True
                return False
            stats.bytes_sent += len(data)
            return True
        if scope.cancelled_caught:
            stats.send_timeouts += 1
        self.retire(0)
        return False

    def retire(self, seconds: float = RETIRE_SECONDS) -> None:
        """Give up on this connection: the slot opens a new one; this one may answer for `seconds`."""
        self.closed = True
        self.scope.deadline = min(self.scope.deadline, trio.current_time() + seconds)

    async def read(self, stats: HostileStats) -> None:
        try:
            with self.scope:
                try:
                    while data := await self.stream.receive_some(65536):
                        self._decode(data, stats)
                    if not self.we_closed:
                        stats.closed_by_broker += 1
                except trio.BrokenResourceError:  # reset by the broker
                    if not self.we_closed:
                        stats.closed_by_broker += 1
                except (trio.ClosedResourceError, OSError):
                    pass
        finally:
            self.closed = self.we_closed = True
            await trio.aclose_forcefully(self.stream)

    def _decode(self, data: bytes, stats: HostileStats) -> None:
        decoder = self.decoder
        if decoder is None:
            return
        decoder.feed(data)
        try:
            while (frame := decoder.next_frame()) is not None:
                if isinstance(frame, Error):
                    code = frame.code.name
                    stats.errors[code] += 1
                    stats.error_samples.setdefault(code, frame.text[:300])
        except ProtocolError as exc:
            stats.undecodable.append(f"{type(exc).__name__}: {exc}"[:500])
            self.decoder = None  # the rest of this stream cannot be framed

    async def aclose(self) -> None:
        self.we_closed = True
        self.closed = True
        self.scope.cancel()
        await trio.aclose_forcefully(self.stream)


async def hostile_connection(
    port: int,
    source: Iterator[Move],
    stats: HostileStats,
    should_stop: Callable[[], bool],
    log: deque[Move],
) -> None:
    """Play `source`'s moves over one connection at a time, reconnecting whenever the broker has
    closed it, until `should_stop()`. Every third connection says HELLO without flow control.
    `log` receives every move, for the report of a failure."""
    async with trio.open_nursery() as nursery:
        link: HostileLink | None = None
        opened = 0
        try:
            while not should_stop():
                move = next(source)
                log.append(move)
                if link is None or link.closed or move.before_hello:
                    if link is not None:
                        link.retire()
                    hello = None if move.before_hello else Hello(PROTOCOL_VERSION, f"hostile-{opened}", opened % 3 != 2, [])
                    opened += 1
                    link = await HostileLink.open(port, stats, hello)
                    if link is None:
                        await trio.sleep(0.01)
                        continue
                    nursery.start_soon(link.read, stats)
                data = move.encode(link.next_transfer_id)
                if data and await link.send(data, stats):
                    stats.frames_sent += 1
                    if isinstance(move.frame, Transfer) and not move.keep_id and not move.mutations:
                        link.next_transfer_id += len(move.frame.entries)
                if move.close_after:
                    await link.aclose()
                elif move.before_hello:
                    link.retire()  # the broker answers and closes it; the next move opens another
        finally:
            nursery.cancel_scope.cancel()
            if link is not None:
                await link.aclose()


def strategy_corpus(count: int, seed: int) -> list[Frame]:
    """`count` frames of every type with random fields, drawn from protocol_strategies' `any_frame`
    (for a script; the test draws its corpus as part of each example)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    frames: list[Frame] = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(any_frame)
    def collect(frame: Frame) -> None:
        frames.append(frame)

    collect()
    return frames


# -- the bystander -----------------------------------------------------------------------------

STAMP = struct.Struct("<QQ")  # sequence number, CLOCK_MONOTONIC nanoseconds when sent
BYSTANDER_QUEUE = "bystander-calm"  # no hostile move names it


class Bystander:
    """A well-behaved SDK producer and consumer on a queue of its own: bursts of `burst` messages,
    `pause` seconds apart. It records each arrival (time.monotonic) and its end-to-end latency."""

    def __init__(self, conn: fc.Connection, *, burst: int = 5, pause: float = 0.001, timeout: float = 5.0):
        self.conn = conn
        self.burst = burst
        self.pause = pause
        self.timeout = timeout
        self.producer = conn.producer(routing_key=BYSTANDER_QUEUE, window=50)
        self.sent = 0
        self.sequences: list[int] = []
        self.arrivals: list[float] = []
        self.latencies_ns: list[int] = []
        self.redelivered = 0
        self.stopped = trio.Event()

    async def produce(self) -> None:
        while not self.stopped.is_set():
            for _ in range(self.burst):
                await self.producer.send(STAMP.pack(self.sent, time.monotonic_ns()) + b"calm" * 8, timeout=self.timeout)
                self.sent += 1
            await trio.sleep(self.pause)

    async def consume(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.conn.consumer(BYSTANDER_QUEUE, prefetch=50) as consumer:
            task_status.started()
            async for msg in consumer:
                now = time.monotonic_ns()
                seq, stamp = STAMP.unpack_from(msg.body)
                self.arrivals.append(now / 1e9)
                self.sequences.append(seq)
                self.latencies_ns.append(now - stamp)
                self.redelivered += msg.redelivered
                await msg.ack()

    async def wait_for(self, count: int) -> None:
        """Until `count` more messages have arrived."""
        target = len(self.sequences) + count
        with trio.fail_after(self.timeout):
            while len(self.sequences) < target:
                await trio.sleep(0.005)

    async def finish(self) -> None:
        """Stop producing; wait until everything sent has arrived (or the timeout)."""
        self.stopped.set()
        await self.producer.flush(timeout=self.timeout)
        with trio.move_on_after(self.timeout):
            while len(self.sequences) < self.sent:
                await trio.sleep(0.005)

    def losses(self) -> str | None:
        """What went wrong with exactly-once-in-order delivery, or None."""
        if self.sequences != list(range(self.sent)):
            seen = Counter(self.sequences)
            missing = [i for i in range(self.sent) if i not in seen][:10]
            doubled = [i for i, n in seen.items() if n > 1][:10]
            disorder = next((i for i, s in enumerate(self.sequences) if i and s < self.sequences[i - 1]), None)
            return (f"bystander sent {self.sent}, received {len(self.sequences)}: missing {missing}, "
                    f"doubled {doubled}, first out of order at arrival {disorder}")
        if self.redelivered or self.producer.stats.failed:
            return f"bystander: {self.redelivered} redelivered, {self.producer.stats.failed} failed sends"
        return None

    def worst_gap(self, start: float, end: float) -> float:
        """The longest time without an arrival between `start` and `end` (time.monotonic seconds):
        between consecutive arrivals, counting the first arrival after `end` as the end of a gap."""
        times = [start, *(t for t in self.arrivals if start < t <= end)]
        after = next((t for t in self.arrivals if t > end), end)
        times.append(after)
        return max(b - a for a, b in zip(times, times[1:]))


def percentile(values: list[int], p: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] if ordered else 0
