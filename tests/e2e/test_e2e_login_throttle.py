"""Failed logins throttled per source address, over real sockets: a guesser opening many connections at
once from 127.0.0.1 gets its attempts looked at one at a time (the rest refused unlooked), counted in the
metrics, while a well-behaved client logged in beside it loses nothing and a login from another address
(127.0.0.2) is not made to wait."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import flowbroker.client as fc
from flowbroker.broker.auth import FORGET_AFTER
from flowbroker.broker.metrics import BrokerCollector
from flowbroker.broker.users import User, write_users
from flowbroker.client.handshake import connect_stream
from flowbroker.protocol import ErrorCode
from flowbroker.protocol.scram import StoredCredential

LIMIT = 10.0
S = 1_000_000_000


async def login_from_elsewhere(port: int) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
    async with await connect_stream(stream, auth=("alice", "right"), timeout=LIMIT) as elsewhere:
        assert elsewhere.welcome.identity == "alice"


async def test_a_guesser_on_many_connections_is_throttled_and_nobody_else_is(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flowbroker.broker.server")
    users = tmp_path / "users.json"
    write_users(users, {"alice": User("alice", StoredCredential.from_password("right", 4096))})
    broker = await start_flowbroker(auth={"users_file": str(users), "failed_login_delay": 0.05,
                                          "failed_login_max_delay": 2.0}, udp={"enabled": False})
    throttle = broker.core.login_throttle
    outcomes: list[str] = []

    async def guess(password: str) -> None:
        with pytest.raises(fc.HandshakeError) as info:
            await fc.connect(broker.url, auth=("alice", password), timeout=LIMIT)
        assert info.value.code is ErrorCode.UNAUTHORIZED
        assert "(UNAUTHORIZED)" in str(info.value)  # said in the text too (docs/spark.md quotes it)
        throttled = "too many failed logins from 127.0.0.1" in str(info.value)
        # unlooked: not an AuthenticationError (these credentials were not refused; a reconnect retries)
        assert isinstance(info.value, fc.AuthenticationError) is not throttled, info.value
        outcomes.append("throttled" if throttled else "failed")

    async with await fc.connect(broker.url, auth=("alice", "right"), timeout=LIMIT) as good:
        await good.declare_queue("work")
        producer = good.producer(routing_key="work")
        await guess("wrong-0")  # the first failure: from now on 127.0.0.1's attempts wait their turn
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(guess, f"wrong-{i + 1}")
            for i in range(200):  # the client logged in beside the guesser is not slowed nor loses anything
                await producer.send(b"%d" % i, timeout=LIMIT)
            await producer.flush(timeout=LIMIT)
            await login_from_elsewhere(broker.port)  # during the attack
        delayed_before = throttle.delayed
        await login_from_elsewhere(broker.port)  # while 127.0.0.1 is throttled: not made to wait
        assert throttle.delayed == delayed_before and throttle.failures("127.0.0.2", broker.core.clock_ns()) == 0
        async with good.consumer("work", prefetch=200) as consumer:
            got = [(await consumer.receive(timeout=LIMIT)).body for _ in range(200)]
        assert got == [b"%d" % i for i in range(200)]
    assert len(outcomes) == 41
    # after the first failure the attempts were looked at one at a time, 0.05, 0.1, 0.2 ... 2 s apart:
    # of 40 sent at once only the few whose turn came within 2 s were looked at, the rest refused unlooked
    # (all 40 would have been looked at, in parallel, by the per-connection delay alone)
    assert outcomes.count("failed") <= 20 and outcomes.count("throttled") >= 20
    assert throttle.delayed >= 1 and throttle.refused == outcomes.count("throttled")
    assert throttle.failures("127.0.0.1", broker.core.clock_ns()) == outcomes.count("failed")
    samples = {s.name: s.value for m in BrokerCollector(broker.core).collect() for s in m.samples}
    assert samples["flowbroker_logins_throttled_total"] == throttle.refused
    assert samples["flowbroker_logins_delayed_total"] == throttle.delayed
    assert samples["flowbroker_login_throttle_sources"] == 1
    # the unlooked refusals are logged at most once per 10 s, naming the user the attempt gave (SCRAM's
    # n=): a guesser wrote 1,168 lines a minute, none with the name (a tester)
    lines = [r.getMessage() for r in caplog.records if "throttled (too many failed logins" in r.getMessage()]
    assert len(lines) == 1 and "login refused for user alice: throttled" in lines[0], lines


async def test_a_client_that_timed_out_waiting_its_turn_gets_that_turn_when_it_retries(start_flowbroker: Any,
                                                                                        tmp_path: Path) -> None:
    """Behind a guesser's address, a client whose connect timed out while its login waited left its turn
    taken: the address's next turn went one step further, past failed_login_max_delay, and its retry with a
    longer timeout was refused unlooked (a tester: the SDK's default 10 s against a 30 s turn). The broker
    now sees the socket close while the login waits and gives the turn to the next attempt."""
    users = tmp_path / "users.json"
    write_users(users, {"alice": User("alice", StoredCredential.from_password("right", 4096))})
    broker = await start_flowbroker(auth={"users_file": str(users), "failed_login_delay": 0.05,
                                          "failed_login_max_delay": 1.0}, udp={"enabled": False})
    for i in range(6):  # one guess after another: turns 0.05, 0.1 ... 1 s apart, the next turn 1 s away
        with pytest.raises(fc.HandshakeError):
            await fc.connect(broker.url, auth=("alice", f"wrong-{i}"), timeout=LIMIT)
    with pytest.raises(fc.HandshakeError, match="within 0.4 s"):  # its turn is about 0.95 s away
        await fc.connect(broker.url, auth=("alice", "right"), timeout=0.4)
    await trio.sleep(0.1)  # the broker sees the close
    async with await fc.connect(broker.url, auth=("alice", "right"), timeout=LIMIT) as conn:
        assert conn.welcome.identity == "alice"  # before: refused, its turn 1.5 s away, over the 1 s cap


async def test_a_login_that_times_out_waiting_for_its_turn_says_the_broker_may_be_delaying_it(
        start_flowbroker: Any, tmp_path: Path) -> None:
    """After a few mistyped passwords the CLI said only "no WELCOME ... within 10.0 s", as for a broker that
    is down (a tester): with credentials sent, the timeout names the login throttle."""
    users = tmp_path / "users.json"
    write_users(users, {"alice": User("alice", StoredCredential.from_password("right", 4096))})
    broker = await start_flowbroker(auth={"users_file": str(users), "failed_login_delay": 5.0,
                                          "failed_login_max_delay": 10.0}, udp={"enabled": False})
    broker.core.login_throttle.failed("127.0.0.1", broker.core.clock_ns())  # its next login waits its turn
    with pytest.raises(fc.HandshakeError) as info:
        await fc.connect(broker.url, auth=("alice", "right"), timeout=0.5)
    assert "no WELCOME" in str(info.value) and "delays the logins of an address that failed" in str(info.value)
    with pytest.raises(fc.HandshakeError) as plain:  # without credentials there is nothing to throttle
        await fc.connect("flowbroker://127.0.0.1:9", timeout=0.5)
    assert "delays the logins" not in str(plain.value)


async def test_a_login_waiting_its_turn_goes_when_the_failure_is_forgotten_whatever_is_in_flight(
        autojump_clock: trio.testing.MockClock, start_flowbroker: Any, tmp_path: Path) -> None:
    """One typo, then clients logging in again and again from the same address: with some of their logins
    always in flight the failure was never forgotten, and each turn was further away (a tester: four
    clients waited up to 30 s for a minute, seven refused unlooked, against "10 s after one failure").
    In virtual time: the login whose turn is 16 s away goes when the failure is forgotten, at 10 s."""
    autojump_clock.autojump_threshold = 0.05  # virtual time jumps only while the real sockets are quiet
    users = tmp_path / "users.json"
    write_users(users, {"alice": User("alice", StoredCredential.from_password("right", 4096))})
    broker = await start_flowbroker(auth={"users_file": str(users), "failed_login_delay": 1.0,
                                          "failed_login_max_delay": 30.0}, udp={"enabled": False})
    throttle, clock_ns = broker.core.login_throttle, broker.core.clock_ns
    failed_ns = clock_ns()
    throttle.failed("127.0.0.1", failed_ns)  # the typo
    # four logins from there in flight, and not ending here: turns at 1, 2, 4 and 8 s, the next at 16 s
    assert [throttle.admit("127.0.0.1", failed_ns) for _ in range(4)] == [1 * S, 2 * S, 4 * S, 8 * S]
    async with await fc.connect(broker.url, auth=("alice", "right"), timeout=30) as conn:
        assert conn.welcome.identity == "alice"
        waited_ns = clock_ns() - failed_ns
    assert FORGET_AFTER * S <= waited_ns < 16 * S, waited_ns  # before: at its turn, 16 s
    delayed = throttle.delayed
    async with await fc.connect(broker.url, auth=("alice", "right"), timeout=LIMIT):
        pass
    assert throttle.delayed == delayed and len(throttle) == 0  # forgotten, those four still in flight
