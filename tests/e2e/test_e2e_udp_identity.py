"""UDP bound to the authenticated TCP connection (issue 15.5): a UDP publication registered by a user is that
user's (its session's identity, its permissions: REGISTER_PUBLICATION needs write on the exchange, and each
message over UDP is checked as over TCP, revocation included); datagrams for its session from another
source are dropped and counted as `wrong_source`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker.users import User, write_users
from flowbroker.protocol import ErrorCode
from flowbroker.protocol.scram import StoredCredential
from flowbroker.transport.udp.sockets import open_udp

from tests.e2e.test_e2e_udp_attack import _wrong_source

LIMIT = 10.0
CRED = StoredCredential.from_password("pw", 4096)


def write(path: Path, write_pattern: str) -> None:
    write_users(path, {"p": User("p", CRED, (), ".*", write_pattern, ".*")})


async def test_a_udp_publication_is_its_users_and_only_its_source_counts(start_flowbroker: Any, tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    write(users, r"^amq\.default$")
    broker = await start_flowbroker(auth={"users_file": str(users)}, credit={"policy": "static"})
    datapath = broker.core.udp
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
        await conn.declare_queue("u")
        await conn.declare_exchange("x.denied", "fanout")
        with pytest.raises(fc.RequestError) as info:  # registration needs write on the exchange
            async with conn.producer("x.denied", "k", transport="udp") as producer:
                await producer.send(b"never", timeout=LIMIT)
        assert info.value.code is ErrorCode.UNAUTHORIZED and "write permission on exchange 'x.denied'" in info.value.text
        async with conn.producer("", "u", transport="udp") as producer:
            await producer.send(b"first", timeout=LIMIT)
            await producer.flush(timeout=LIMIT)
            (session_id, pub), = datapath.ingress.publications.items()
            assert pub.session.identity == "p" and pub.session.access is pub.owner.access
            refused = datapath.refused["wrong_source"]
            spoofer = open_udp(("127.0.0.1", 0))
            rng = random.Random(5)
            for _ in range(200):
                spoofer.send(_wrong_source(rng, session_id), ("127.0.0.1", broker.udp_port))
            spoofer.close()
            with trio.fail_after(LIMIT):
                while datapath.refused["wrong_source"] < refused + 180:  # loopback may drop a few
                    await trio.sleep(0.05)
            await producer.send(b"second", timeout=LIMIT)
            await producer.flush(timeout=LIMIT)
            await trio.sleep(0.05)
            write(users, r"^$")  # revoked: the next messages over UDP are refused as over TCP
            with trio.fail_after(LIMIT):
                while True:
                    await producer.send(b"after", timeout=LIMIT)
                    try:
                        await producer.flush(timeout=LIMIT)
                    except fc.PublishError as exc:
                        assert exc.code is ErrorCode.UNAUTHORIZED
                        break
                    await trio.sleep(0.2)
        assert broker.core.queues["u"].statistics().messages >= 2
