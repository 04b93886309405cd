"""Per-user resource limits over real sockets (issue 15.3): `max_queues` refuses one more declare with a
typed error naming the limit (the connection stays up), a redeclare is not a new queue, a delete frees a
slot, other users are not counted, and durable queues recovered at start count for their owner;
`credit_share_percent` caps what one user's producer connections hold of the credit pool together, so
another user's producer still gets its share, and a changed share reaches the open connections."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker import cliformat, views
from flowbroker.broker.server import BrokerServer
from flowbroker.broker.users import User, write_users
from flowbroker.protocol import ErrorCode
from flowbroker.protocol.scram import StoredCredential

from tests.serving import serving, url

LIMIT = 10.0
CRED = StoredCredential.from_password("pw", 4096)


def broker(users: Path, data_dir: Path, **sections: dict[str, Any]) -> AbstractAsyncContextManager[BrokerServer]:
    return serving(storage={"data_dir": str(data_dir)}, auth={"users_file": str(users)}, **sections)


async def test_max_queues_refuses_one_more_and_redeclare_delete_and_other_users_behave(tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    write_users(users, {"p": User("p", CRED, max_queues=2), "q": User("q", CRED)})
    async with broker(users, tmp_path / "data") as server:
        async with await fc.connect(url(server), auth=("p", "pw"), timeout=LIMIT) as conn, \
                await fc.connect(url(server), auth=("p", "pw"), timeout=LIMIT) as second, \
                await fc.connect(url(server), auth=("q", "pw"), timeout=LIMIT) as other:
            await conn.declare_queue("a")
            await second.declare_queue("b")  # the limit is the user's, over all its connections
            await conn.declare_queue("a")  # a redeclare is not a new queue
            await other.declare_queue("q1")  # another user is not counted
            with pytest.raises(fc.RequestError) as info:
                await second.declare_queue("c")
            assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and info.value.destination == "c"
            assert info.value.text == "user 'p' has its max_queues (2) declared"
            assert "c" not in server.core.queues
            await other.declare_queue("q2")  # and q is still not limited by p's limit
            await conn.delete_queue("a")  # a delete frees a slot, on the same connection that was refused
            await second.declare_queue("c")
            with pytest.raises(fc.RequestError):
                await conn.declare_queue("d")
            producer = conn.producer(routing_key="c")  # the refused connection stays up
            await producer.send(b"still up", timeout=LIMIT)
            await producer.flush(timeout=LIMIT)
            assert server.core.queues["c"].count == 1
            async with await fc.connect(url(server), timeout=LIMIT) as guest:  # the loopback user owns nothing
                await guest.declare_queue("g")
            assert server.core.queues["g"].owner is None and server.core.queues["c"].owner == "p"
            assert server.core.queues_by_owner == {"p": 2, "q": 2}


async def test_durable_queues_recovered_at_start_count_for_their_owner(tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    write_users(users, {"p": User("p", CRED, max_queues=2)})
    data = tmp_path / "data"
    async with broker(users, data) as server:
        async with await fc.connect(url(server), auth=("p", "pw"), timeout=LIMIT) as conn:
            await conn.declare_queue("d1", durable=True)
            await conn.declare_queue("d2", durable=True)
    async with broker(users, data) as server:
        assert server.core.queues["d1"].owner == "p" and server.core.queues_by_owner["p"] == 2
        async with await fc.connect(url(server), auth=("p", "pw"), timeout=LIMIT) as conn:
            with pytest.raises(fc.RequestError) as info:
                await conn.declare_queue("d3", durable=True)
            assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and "max_queues (2)" in info.value.text
            await conn.delete_queue("d1")
            await conn.declare_queue("d3", durable=True)


async def test_a_users_credit_share_caps_its_producers_together_and_leaves_the_rest_to_others(
        tmp_path: Path) -> None:
    """Static credit of 1 MiB per producer out of a 16 MiB pool; `hog` may hold 25% of it (about 4 MiB):
    its eight producers get four shares and four wait, while `calm`'s producer, registered after all of
    them, gets its full share."""
    users = tmp_path / "users.json"
    write_users(users, {"hog": User("hog", CRED, credit_share_percent=25), "calm": User("calm", CRED)})
    mib = 1 << 20
    credit = {"policy": "static", "static_size": mib, "min_size": 1024, "max_size": mib}
    async with broker(users, tmp_path / "data", server={"port": 0, "memory_quota": 16 * mib, "max_connections": 64,
                                                         "max_message_size": 1024},
                      credit=credit) as server:
        core = server.core
        async with await fc.connect(url(server), auth=("hog", "pw"), timeout=LIMIT) as admin:
            await admin.declare_queue("sink")
        async with AsyncExitStack() as stack:
            conns = [await stack.enter_async_context(await fc.connect(url(server), auth=("hog", "pw"), timeout=LIMIT))
                     for _ in range(8)]
            calm = await stack.enter_async_context(await fc.connect(url(server), auth=("calm", "pw"), timeout=LIMIT))
            for conn in [*conns, calm]:
                producer = conn.producer(routing_key="sink")
                await producer.send(b"x", timeout=LIMIT)
                await producer.flush(timeout=LIMIT)
            hog_ids = [s.conn_id for s in core.sessions.values() if s.identity == "hog"]
            calm_id = next(s.conn_id for s in core.sessions.values() if s.identity == "calm")
            cap = core.credit.owner_cap("hog")
            assert cap == core.credit.shareable // 4
            held = sum(core.credit.size_of(c) - 1 for c in hog_ids)
            assert held <= cap and held == core.credit.owner_share_used("hog")
            assert sum(core.credit.size_of(c) == mib for c in hog_ids) == cap // (mib - 1)
            assert core.credit.size_of(calm_id) == mib  # not starved by hog's many connections
            # the admin views show the cap, what of it is used, and which of hog's producers wait
            users_view = {u["user"]: u for u in views.policy_view(core)["users"]}
            assert users_view["hog"] == {"user": "hog", "credit_share_percent": 25.0, "cap": cap, "used": held,
                                         "connections": 8}
            assert users_view["calm"]["cap"] is None and users_view["calm"]["credit_share_percent"] is None
            states = {c["id"]: c["producer"]["credit_state"]
                      for c in views.connections_page(core, 0)["connections"]}
            assert sorted(states[c] for c in hog_ids) == ["producer"] * 4 + ["waiting"] * 4
            assert states[calm_id] == "producer"
            # and so do `flowbroker connections` (FLOW) and `flowbroker policy show`
            flows = [cliformat.connection_row(c)[7] for c in views.connections_page(core, 0)["connections"]]
            assert flows.count("waiting for credit") == 4
            lines = cliformat.policy_text(views.policy_view(core)).splitlines()
            hog_line = next(line for line in lines if line.startswith("user hog "))
            assert f"{cliformat.size_text(held)} of its cap {cliformat.size_text(cap)} (25 % of" in hog_line
            assert not any(line.startswith("user calm") for line in lines)  # no cap, no line
            producer = calm.producer(routing_key="sink")
            for _ in range(100):  # more than its 1 MiB grant
                await producer.send(b"y" * 1000, timeout=LIMIT)
            await producer.flush(timeout=LIMIT)
            # the users file gives hog a larger share: its open connections' grants follow at the re-read
            write_users(users, {"hog": User("hog", CRED, credit_share_percent=50), "calm": User("calm", CRED)})
            with trio.fail_after(LIMIT):
                while core.credit.owner_cap("hog") != core.credit.shareable // 2:
                    await trio.sleep(0.05)
            assert sum(core.credit.size_of(c) == mib for c in hog_ids) == min(8, core.credit.shareable // 2 // (mib - 1))
            assert core.credit.owner_share_used("hog") <= core.credit.shareable // 2
            assert core.credit.size_of(calm_id) == mib
