"""A fuzz of the handshake (issue 15.6): 100,000 random and mutated HELLO, AUTH_RESPONSE and raw frames against
the broker's real connection handler, with a well-behaved client beside them that logged in with SCRAM
over real TCP and loses nothing.

The hostile handshakes run over trio's in-memory streams through `BrokerServer.serve_connection` (the same
handler the accept loop runs, TLS and TCP alike), so that 100,000 frames take seconds and not the
minutes as many TCP connections would; they are drawn from a seeded random.Random, so a failure
reproduces. Each handshake is one of: bytes that are not a frame; a HELLO with a random or mutated `auth`
(mechanisms, types, SCRAM client-first messages with bits flipped, cut or grown, PLAIN with wrong
passwords); a valid SCRAM start answered with a mutated, random or (now and then) correct client-final, which must log in; or a HELLO whose
msgpack array has fields of the wrong type. The checks: nobody but the bystander and those correct answers logged in; every
answer decodes and is ERROR + CLOSE (UNAUTHORIZED, MALFORMED_FRAME, UNEXPECTED_FRAME, ...) or
AUTH_CHALLENGE, or nothing; nothing was logged at ERROR and no INTERNAL_ERROR was answered; no session
is left; and the bystander's messages all arrived, once each, in order.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing

import flowbroker.client as fc
from flowbroker.broker.users import User, write_users
from flowbroker.protocol import (
    PROTOCOL_VERSION,
    AuthChallenge,
    AuthResponse,
    Close,
    Error,
    ErrorCode,
    Hello,
    Role,
    Welcome,
)
from flowbroker.protocol import Connection as ProtocolConnection
from flowbroker.protocol.codec import FrameDecoder
from flowbroker.protocol.scram import ScramClient, StoredCredential
from tests.e2e.hostile import BYSTANDER_QUEUE, Bystander

FRAMES = 100_000
WORKERS = 16
LIMIT = 5.0


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Flip, cut, grow or splice `data` (a SCRAM message, most often)."""
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.random()
        if op < 0.4 and out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif op < 0.6:
            out = out[: rng.randrange(len(out) + 1)]
        elif op < 0.8:
            i = rng.randrange(len(out) + 1)
            out[i:i] = rng.randbytes(rng.randrange(1, 16))
        else:
            i = rng.randrange(len(out) + 1)
            out[i:i] = rng.choice([b",", b"=", b"n,,", b"r=", b",p=", b"\x00", b"=3D", "é".encode()])
    return bytes(out[:1100])


def frame_bytes(obj: Any) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def random_auth(rng: random.Random, first: bytes) -> Any:
    draw = rng.random()
    if draw < 0.35:
        return {"mechanism": "SCRAM-SHA-256", "data": mutate(rng, first)}
    if draw < 0.5:
        return {"mechanism": "PLAIN", "username": rng.choice(["alice", "bob", "", "a" * 300]),
                "password": rng.choice(["", "wrong", "wonderland ", rng.randbytes(8).hex()])}
    if draw < 0.6:
        return {"mechanism": rng.choice(["SCRAM-SHA-1", "GSSAPI", "", "scram-sha-256", "PLAIN\x00"]),
                "data": rng.randbytes(rng.randrange(0, 64))}
    if draw < 0.7:
        return {"mechanism": "SCRAM-SHA-256", "data": rng.choice([None, 1, "n,,n=alice,r=x", [b"x"], {}])}
    if draw < 0.8:
        return {rng.choice(["mechanism", "data", "username", "x"]): rng.choice([1, "x", b"y", None, [1, 2]])}
    return None  # no credentials: refused ([auth] loopback_user = "")


class Tally:
    def __init__(self) -> None:
        self.frames = 0
        self.handshakes = 0
        self.answers: dict[str, int] = {}
        self.logins = 0  # correct logins the draw made (alice's password, an unchanged client-final)

    def saw(self, what: str) -> None:
        self.answers[what] = self.answers.get(what, 0) + 1


async def one_handshake(server: Any, rng: random.Random, tally: Tally, first: bytes) -> None:
    """One hostile handshake over an in-memory stream pair; checks the broker's answers as it goes."""
    client, broker_end = trio.testing.memory_stream_pair()
    proto = ProtocolConnection(Role.CLIENT)
    decoder = FrameDecoder()
    answers: list[Any] = []
    legit = False

    async def read_all() -> None:
        while data := await client.receive_some(65536):
            decoder.feed(bytes(data))
            while (frame := decoder.next_frame()) is not None:
                answers.append(frame)

    async def next_answer() -> Any:
        while not answers:
            data = await client.receive_some(65536)
            if not data:
                return None
            decoder.feed(bytes(data))
            while (frame := decoder.next_frame()) is not None:
                answers.append(frame)
        return answers.pop(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_connection, broker_end)
        with trio.fail_after(LIMIT):
            kind = rng.random()
            if kind < 0.1:  # not a frame at all
                await client.send_all(rng.randbytes(rng.randrange(1, 64)))
                tally.frames += 1
            elif kind < 0.2:  # a HELLO array with fields of the wrong types, or too few or many
                fields: list[Any] = [1, PROTOCOL_VERSION, "fuzz", True, [], {"mechanism": "PLAIN"}]
                i = rng.randrange(1, len(fields))
                fields[i] = rng.choice([None, -1, "x", b"x", 1.5, [None], {"a": 1}, True])
                await client.send_all(frame_bytes(fields[: rng.randrange(1, len(fields) + 2)]))
                tally.frames += 1
            elif kind < 0.45:  # a valid SCRAM start, then a mutated, replayed or random client-final
                user, password = rng.choice(["alice", "bob"]), rng.choice(["wonderland", "x"])
                scram = ScramClient(user, password)
                await client.send_all(proto.send(Hello(PROTOCOL_VERSION, "fuzz", True, [],
                                                       {"mechanism": "SCRAM-SHA-256", "data": scram.first()})))
                tally.frames += 1
                challenge = await next_answer()
                if isinstance(challenge, AuthChallenge):
                    tally.saw("AUTH_CHALLENGE")
                    final = scram.final(challenge.data)
                    response = rng.choice([mutate(rng, final), final if rng.random() < 0.3 else rng.randbytes(40)])
                    if rng.random() < 0.1:  # a frame other than AUTH_RESPONSE instead
                        await client.send_all(frame_bytes([1, PROTOCOL_VERSION, "again", True, []]))
                    else:
                        await client.send_all(proto.send(AuthResponse(response)))
                        # the one right answer: alice's password and the client-final unchanged
                        legit = (user, password) == ("alice", "wonderland") and response == final
                    tally.frames += 1
                else:
                    answers.insert(0, challenge)
            else:  # a HELLO with random or mutated credentials
                await client.send_all(proto.send(Hello(PROTOCOL_VERSION, "fuzz", rng.random() < 0.5, [],
                                                       random_auth(rng, first))))
                tally.frames += 1
            await client.send_eof()
            await read_all()
        await client.aclose()
    tally.handshakes += 1
    if legit:  # a correct login drawn by chance: WELCOME, then the broker closes as we did
        assert isinstance(answers[0], Welcome) and answers[0].identity == "alice", answers
        tally.logins += 1
        answers = answers[1:]
    for frame in answers:
        assert isinstance(frame, (Error, Close, AuthChallenge)), f"the broker answered {frame!r}"
        if isinstance(frame, Error):
            assert frame.code is not ErrorCode.INTERNAL_ERROR, frame
            tally.saw(frame.code.name)
        elif isinstance(frame, AuthChallenge):
            tally.saw("AUTH_CHALLENGE")


async def test_a_hundred_thousand_hostile_handshakes_beside_an_authenticated_client(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    users = tmp_path / "users.json"
    # 64 PBKDF2 iterations, not 4096: the fuzz is of the handshake's parsing and state, and each SCRAM
    # exchange costs the test's client a PBKDF2 (and each PLAIN try the broker one)
    write_users(users, {"alice": User("alice", StoredCredential.from_password("wonderland", 64)),
                        "bob": User("bob", StoredCredential.from_password("builder", 64))})
    broker = await start_flowbroker(auth={"users_file": str(users), "loopback_user": "", "failed_login_delay": 0},
                                    udp={"enabled": False}, queues={"max_size": 4 << 20})
    server = broker.server
    first = ScramClient("alice", "wonderland").first()
    tally = Tally()
    caplog.set_level(logging.ERROR)
    async with await fc.connect(broker.url, auth=("alice", "wonderland"), timeout=LIMIT) as conn:
        await conn.declare_queue(BYSTANDER_QUEUE)
        bystander = Bystander(conn, pause=0.01, timeout=30.0)  # 500 msgs/s: the handshakes get the CPU
        async with trio.open_nursery() as nursery:
            await nursery.start(bystander.consume)
            nursery.start_soon(bystander.produce)

            async def worker(seed: int) -> None:
                rng = random.Random(seed)
                while tally.frames < FRAMES:
                    await one_handshake(server, rng, tally, first)

            async with trio.open_nursery() as fuzzers:
                for seed in range(WORKERS):
                    fuzzers.start_soon(worker, 1500 + seed)
            await bystander.finish()
            nursery.cancel_scope.cancel()
        assert bystander.losses() is None, bystander.losses()
        assert bystander.sent > 0
        assert not conn.is_closed
    assert tally.frames >= FRAMES
    # the bystander and the correct logins drawn; nothing else logged in
    assert tally.logins > 0 and server.authenticator.successes == 1 + tally.logins
    assert tally.answers.get("UNAUTHORIZED", 0) > FRAMES // 4 and tally.answers.get("AUTH_CHALLENGE", 0) > FRAMES // 10
    assert tally.answers.get("MALFORMED_FRAME", 0) > 0 and tally.answers.get("UNEXPECTED_FRAME", 0) > 0
    with trio.fail_after(LIMIT):
        while broker.core.sessions:
            await trio.sleep(0.01)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:5]
