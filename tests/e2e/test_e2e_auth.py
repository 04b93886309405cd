"""Authentication on HELLO over real sockets (issue 15.1): the loopback user, SCRAM-SHA-256 and PLAIN,
wrong passwords (slowed, counted, logged), a replayed SCRAM message, a client that stops mid-handshake,
and a well-behaved client beside each failure that loses nothing. The identity shows in the admin view."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker.users import User, read_users, write_users
from flowbroker.broker.views import connection_view
from flowbroker.protocol import AuthChallenge, AuthResponse, ErrorCode, Hello, PROTOCOL_VERSION, Welcome
from flowbroker.protocol import Connection as ProtocolConnection
from flowbroker.protocol import Role
from flowbroker.protocol.scram import ScramClient, StoredCredential

LIMIT = 10.0
DELAY = 0.3


def users_file(tmp_path: Path) -> Path:
    path = tmp_path / "users.json"
    write_users(path, {
        "alice": User("alice", StoredCredential.from_password("wonderland", 4096)),
        "bob": User("bob", StoredCredential.from_password("builder", 4096)),
    })
    return path


async def start(start_flowbroker: Any, tmp_path: Path, **auth: Any) -> Any:
    return await start_flowbroker(auth={"users_file": str(users_file(tmp_path)), "failed_login_delay": DELAY,
                                        **auth}, udp={"enabled": False})


async def roundtrip(url: str, auth: Any = None, queue: str = "q") -> None:
    """Publish and consume one message: the connection does what the protocol lets it."""
    async with await fc.connect(url, auth=auth, timeout=LIMIT) as conn:
        await conn.declare_queue(queue)
        producer = conn.producer(routing_key=queue)
        await producer.send(b"m", timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
        async with conn.consumer(queue) as consumer:
            assert (await consumer.receive(timeout=LIMIT)).body == b"m"


async def test_without_credentials_a_loopback_client_is_the_loopback_user(start_flowbroker: Any, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flowbroker.broker.server"):
        broker = await start(start_flowbroker, tmp_path)
    assert any(r.getMessage().startswith("loopback user 'guest': ") for r in caplog.records)  # said at start
    async with await fc.connect(broker.url, timeout=LIMIT) as conn:
        assert conn.welcome.identity == "guest"
        (session,) = broker.core.sessions.values()
        assert connection_view(session, 0)["identity"] == "guest"
    await roundtrip(broker.url)


async def test_without_a_loopback_user_a_client_without_credentials_is_told_what_to_do(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flowbroker.broker.server"):
        broker = await start(start_flowbroker, tmp_path, loopback_user="")
    assert any(r.getMessage() == 'no loopback user ([auth] loopback_user = ""): every client must log in'
               for r in caplog.records)  # said at start, as the loopback user is (docs/security.md)
    with pytest.raises(fc.HandshakeError) as info:
        await fc.connect(broker.url, timeout=LIMIT)
    assert info.value.code is ErrorCode.UNAUTHORIZED
    assert "requires authentication" in str(info.value) and "auth=(USER, PASSWORD)" in str(info.value)


async def test_scram_logs_in_and_the_broker_proves_it_knows_the_credential(start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path, loopback_user="")
    async with await fc.connect(broker.url, auth=("alice", "wonderland"), timeout=LIMIT) as conn:
        assert conn.welcome.identity == "alice" and conn.welcome.auth_data is not None
        (session,) = broker.core.sessions.values()
        assert session.identity == "alice"
    await roundtrip(broker.url, fc.Credentials("bob", "builder"))
    assert broker.server.authenticator.successes == 2


@pytest.mark.parametrize("auth", [("alice", "Wonderland"), ("carol", "wonderland"),
                                  fc.Credentials("alice", "x", "PLAIN"), fc.Credentials("nobody", "x", "PLAIN")],
                         ids=["scram-wrong-password", "scram-unknown-user", "plain-wrong-password", "plain-unknown-user"])
async def test_a_failed_login_is_refused_slowly_counted_and_logged_and_others_lose_nothing(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, auth: Any) -> None:
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=("alice", "wonderland"), timeout=LIMIT) as good:
        await good.declare_queue("beside")
        producer = good.producer(routing_key="beside")
        await producer.send(b"before", timeout=LIMIT)
        began = trio.current_time()
        with caplog.at_level(logging.WARNING, logger="flowbroker.broker.server"):
            with pytest.raises(fc.HandshakeError) as info:
                await fc.connect(broker.url, auth=auth, timeout=LIMIT)
        assert trio.current_time() - began >= DELAY
        assert info.value.code is ErrorCode.UNAUTHORIZED
        name = auth[0] if isinstance(auth, tuple) else auth.username
        assert f"authentication failed for user {name!r}" in str(info.value)
        assert str(info.value).count("authentication failed") == 1  # the ERROR's text, not CLOSE's copy too
        assert "password" not in str(info.value).replace("PASSWORD", "")  # no hint which part was wrong
        assert any("login refused for user" in r.getMessage() and name in r.getMessage() for r in caplog.records)
        assert broker.server.authenticator.failures == 1
        assert broker.core.errors_sent[ErrorCode.UNAUTHORIZED] == 1
        await producer.send(b"after", timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
        async with good.consumer("beside") as consumer:
            assert [(await consumer.receive(timeout=LIMIT)).body for _ in range(2)] == [b"before", b"after"]


async def test_plain_is_allowed_from_loopback_and_refused_where_configured_never(
        start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=fc.Credentials("bob", "builder", "PLAIN"), timeout=LIMIT) as conn:
        assert conn.welcome.identity == "bob" and conn.welcome.auth_data is None
    (tmp_path / "n").mkdir()
    never = await start(start_flowbroker, tmp_path / "n", plain="never")
    with pytest.raises(fc.HandshakeError, match="PLAIN is not allowed here"):
        await fc.connect(never.url, auth=fc.Credentials("bob", "builder", "PLAIN"), timeout=LIMIT)


class RawClient:
    """The handshake by hand, to replay and to stop half way."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.proto = ProtocolConnection(Role.CLIENT)

    @classmethod
    async def open(cls, port: int) -> RawClient:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, frame: Any) -> None:
        await self.stream.send_all(self.proto.send(frame))

    async def next(self) -> Any:
        with trio.fail_after(LIMIT):
            while (frame := self.proto.next_frame()) is None:
                data = await self.stream.receive_some(65536)
                if not data:
                    return None
                self.proto.receive_data(data)
        return frame


async def test_a_replayed_scram_response_does_not_log_in(start_flowbroker: Any, tmp_path: Path) -> None:
    """An eavesdropper holding a whole successful exchange replays it: the broker's nonce is new each
    time, so the recorded proof is for another conversation."""
    broker = await start(start_flowbroker, tmp_path, loopback_user="")
    scram = ScramClient("alice", "wonderland")
    first = scram.first()
    recorded = await RawClient.open(broker.port)
    await recorded.send(Hello(PROTOCOL_VERSION, "c", True, [], {"mechanism": "SCRAM-SHA-256", "data": first}))
    challenge = await recorded.next()
    assert isinstance(challenge, AuthChallenge)
    final = scram.final(challenge.data)
    await recorded.send(AuthResponse(final))
    assert isinstance(await recorded.next(), Welcome)
    await recorded.stream.aclose()

    replay = await RawClient.open(broker.port)
    await replay.send(Hello(PROTOCOL_VERSION, "c", True, [], {"mechanism": "SCRAM-SHA-256", "data": first}))
    assert isinstance(await replay.next(), AuthChallenge)
    await replay.send(AuthResponse(final))
    error = await replay.next()
    assert error.code is ErrorCode.UNAUTHORIZED and "authentication failed for user 'alice'" in error.text
    assert broker.server.authenticator.failures == 1
    await replay.stream.aclose()


async def test_a_client_that_stops_mid_handshake_is_closed_at_the_handshake_timeout(
        start_flowbroker: Any, tmp_path: Path) -> None:
    users = users_file(tmp_path)
    broker = await start_flowbroker(auth={"users_file": str(users), "loopback_user": ""}, udp={"enabled": False},
                                    server={"port": 0, "memory_quota": 1 << 30, "handshake_timeout": 0.5})
    silent = await RawClient.open(broker.port)
    scram = ScramClient("alice", "wonderland")
    await silent.send(Hello(PROTOCOL_VERSION, "c", True, [], {"mechanism": "SCRAM-SHA-256", "data": scram.first()}))
    assert isinstance(await silent.next(), AuthChallenge)
    began = trio.current_time()
    await roundtrip(broker.url, ("alice", "wonderland"))  # served meanwhile
    assert await silent.next() is None  # closed, without a frame
    assert trio.current_time() - began < 3.0  # handshake_timeout 0.5 s, counted from the connection
    assert not broker.core.sessions
    await silent.stream.aclose()


async def test_a_response_before_any_challenge_or_a_second_hello_is_refused(start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path, loopback_user="")
    raw = await RawClient.open(broker.port)
    await raw.stream.send_all(raw.proto.send(Hello(PROTOCOL_VERSION, "c", True, [],
                                                   {"mechanism": "SCRAM-SHA-256", "data": b"n,,n=alice,r=abc"})))
    assert isinstance(await raw.next(), AuthChallenge)
    hello_again = msgpack.packb([1, 1, "c", True, []])
    await raw.stream.send_all(len(hello_again).to_bytes(4, "big") + hello_again)
    error = await raw.next()
    assert error.code is ErrorCode.UNEXPECTED_FRAME
    await raw.stream.aclose()


async def test_a_password_typed_in_another_unicode_form_logs_in_by_saslprep(start_flowbroker: Any,
                                                                          tmp_path: Path) -> None:
    """RFC 4013: a password set as "I<soft hyphen>X<no-break space>café" is the same as "<ROMAN NUMERAL
    NINE> café" (with é composed or not), over SCRAM and PLAIN; a control character is refused by the SDK."""
    path = tmp_path / "users.json"
    write_users(path, {"\u00e9le": User("\u00e9le", StoredCredential.from_password("I\u00adX\u00a0cafe\u0301"))})
    broker = await start_flowbroker(auth={"users_file": str(path), "failed_login_delay": DELAY}, udp={"enabled": False})
    for auth in (("e\u0301le", "\u2168 caf\u00e9"), fc.Credentials("\u00e9le", "IX caf\u00e9", "PLAIN")):
        async with await fc.connect(broker.url, auth=auth, timeout=LIMIT) as conn:
            assert conn.welcome.identity == "\u00e9le"
    with pytest.raises(fc.InvalidCredentials, match="password: a control character") as info:
        await fc.connect(broker.url, auth=("\u00e9le", "IX\x07"), timeout=LIMIT)
    # typed as the SDK's (`except FlowbrokerError` missed it, a tester), and still a ValueError
    assert isinstance(info.value, fc.HandshakeError) and isinstance(info.value, ValueError)


async def test_a_slow_password_check_holds_no_other_connection(start_flowbroker: Any, tmp_path: Path,
                                                               stalled_password_checks: threading.Event) -> None:
    """A PLAIN password is checked with PBKDF2 at the user's iterations (0.3 s at 10^6): checked on the event
    loop, a guesser's wrong passwords froze the broker for every client (a tester: 1.8 s pauses for a
    logged-in producer). The check stands in here for a slow one: it blocks its thread for up to 5 s, while
    another client logs in and round-trips a message."""
    broker = await start(start_flowbroker, tmp_path)
    async with trio.open_nursery() as nursery:
        async def guess() -> None:
            with pytest.raises(fc.HandshakeError):
                await fc.connect(broker.url, auth=fc.Credentials("alice", "guess", "PLAIN"), timeout=LIMIT)

        began = trio.current_time()  # (the broker runs in this process: a blocked loop holds this task too)
        nursery.start_soon(guess)
        await trio.sleep(0.2)  # its check is running now
        await roundtrip(broker.url, fc.Credentials("bob", "builder"))  # SCRAM: no PBKDF2 on the broker
        took = trio.current_time() - began
        stalled_password_checks.set()
    assert took < 2.5, f"another client waited {took:.1f} s for the password check"


async def test_a_users_file_user_named_as_the_loopback_user_cannot_log_in(start_flowbroker: Any, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """After `flowbroker user add guest`, that user was the loopback clients' identity too (a tester, 2 of 2
    each): a loopback client's idempotent "job-42" message was taken as a duplicate of the users-file
    guest's and lost, the guest's UNAUTHORIZED refusal was replayed to the loopback client, and one open
    loopback client used up the guest's max_connections of 1. Its logins are refused now, by SCRAM and
    PLAIN, with the same answer as a name the file does not hold; the file holding it is said at ERROR
    at start and when the file changes; the loopback client sends its "job-42" and it lands."""
    caplog.set_level(logging.INFO, logger="flowbroker.broker.server")
    path = users_file(tmp_path)
    users = read_users(path)
    write_users(path, {**users, "guest": User("guest", StoredCredential.from_password("guestpw", 4096),
                                              write="^$", max_connections=1)})

    def clash_errors() -> int:
        return sum(r.levelno == logging.ERROR and "user 'guest' has the loopback user's name" in r.getMessage()
                   for r in caplog.records)

    broker = await start_flowbroker(auth={"users_file": str(path), "failed_login_delay": DELAY}, udp={"enabled": False})
    assert clash_errors() == 1  # said at start
    async with await fc.connect(broker.url, timeout=LIMIT) as loopback:
        assert loopback.welcome.identity == "guest"
        await loopback.declare_queue("gq")
        for auth in (("guest", "guestpw"), fc.Credentials("guest", "guestpw", "PLAIN"), ("guest", "wrong")):
            with pytest.raises(fc.AuthenticationError) as info:
                await fc.connect(broker.url, auth=auth, timeout=LIMIT)
            assert info.value.code is ErrorCode.UNAUTHORIZED  # not max_connections' RESOURCE_EXHAUSTED
            assert "user 'guest' is this broker's loopback user ([auth] loopback_user)" in str(info.value)
        producer = loopback.producer(routing_key="gq", producer_id="job-42", idempotent=True)
        await producer.send(b"loopback: order B", timeout=LIMIT)
        await producer.flush(timeout=LIMIT)
        assert broker.core.queues["gq"].statistics().messages == 1
    assert broker.server.authenticator.successes == 1  # the loopback client alone

    write_users(path, {**read_users(path), "carol": User("carol", StoredCredential.from_password("pw", 4096))})
    with trio.fail_after(LIMIT):  # the broker looks at the file each second
        while clash_errors() < 2:
            await trio.sleep(0.05)
