"""Permissions per user (issue 15.3) over real sockets: each of configure, write and read allowed and refused
at declare, delete, bind, purge, publish (per message's exchange) and subscribe; a refusal is an ERROR
UNAUTHORIZED naming the resource and the permission, the connection stays up and a connection beside it
loses nothing; a changed users file applies to connections already open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import flowbroker.client as fc
from flowbroker.broker.journal import segment_name
from flowbroker.broker.journalrecord import EXCHANGE, MESSAGE, QUEUE, encode
from flowbroker.broker.users import User, write_users
from flowbroker.protocol import ErrorCode
from flowbroker.protocol.scram import StoredCredential

LIMIT = 10.0
CRED = StoredCredential.from_password("pw", 4096)


def write(path: Path, **patterns: str) -> None:
    write_users(path, {"p": User("p", CRED, (), patterns.get("configure", r"^p\."), patterns.get("write", r"^p\."),
                                 patterns.get("read", r"^p\."))})


async def start(start_flowbroker: Any, tmp_path: Path, **patterns: str) -> Any:
    users = tmp_path / "users.json"
    write(users, **patterns)
    # static credit: under the default policy a second producer connection waits for the first, idle one
    # to give back credit it was promised (the pool is shared; a shrink takes effect as it is used)
    broker = await start_flowbroker(auth={"users_file": str(users)}, udp={"enabled": False},
                                    credit={"policy": "static"})
    async with await fc.connect(broker.url, timeout=LIMIT) as guest:  # the loopback user may do anything
        for queue in ("other", "p.q"):
            await guest.declare_queue(queue)
        await guest.declare_exchange("other.x", "fanout")
        await guest.declare_exchange("p.x", "fanout")
    return broker


async def refused(call: Any, permission: str, kind: str, name: str) -> None:
    with pytest.raises(fc.RequestError) as info:
        await call
    assert info.value.code is ErrorCode.UNAUTHORIZED and info.value.destination == name
    assert info.value.text == f"access refused: user 'p' has no {permission} permission on {kind} {name!r}"


async def test_configure_is_checked_at_declare_and_delete(start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
        await conn.declare_queue("p.mine")
        await conn.declare_exchange("p.ex", "topic")
        await refused(conn.declare_queue("q"), "configure", "queue", "q")
        await refused(conn.declare_exchange("ex", "topic"), "configure", "exchange", "ex")
        await refused(conn.delete_queue("other"), "configure", "queue", "other")
        await refused(conn.delete_exchange("other.x"), "configure", "exchange", "other.x")
        await conn.delete_queue("p.mine")
        await conn.delete_exchange("p.ex")
    assert "q" not in broker.core.queues and "other" in broker.core.queues and "other.x" in broker.core.exchanges


async def test_a_durable_declare_needs_configure_too_and_a_refused_one_journals_nothing(
        start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
        await conn.declare_queue("p.durable", durable=True)
        await refused(conn.declare_queue("durable", durable=True), "configure", "queue", "durable")
    assert broker.core.queues["p.durable"].durable and "durable" not in broker.core.queues
    journal = broker.core.journal
    assert journal is not None and journal.next_qid == 2  # one durable queue journalled: the allowed one


async def test_bind_needs_write_on_the_queue_and_read_on_the_exchange(start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
        await conn.bind("p.q", "p.x")
        await refused(conn.bind("other", "p.x"), "write", "queue", "other")
        await refused(conn.bind("p.q", "other.x"), "read", "exchange", "other.x")
        await refused(conn.unbind("other", "p.x"), "write", "queue", "other")
        await conn.unbind("p.q", "p.x")


async def test_subscribe_and_purge_need_read_on_the_queue(start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path, read=r"^p\.q$")
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
        await conn.purge_queue("p.q")
        await refused(conn.purge_queue("other"), "read", "queue", "other")
        with pytest.raises(fc.RequestError) as info:
            async with conn.consumer("other"):
                pass
        assert info.value.code is ErrorCode.UNAUTHORIZED and "read permission on queue 'other'" in info.value.text
        async with conn.consumer("p.q"):
            pass


async def test_publish_needs_write_on_each_messages_exchange_and_the_connection_stays_up(
        start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, timeout=LIMIT) as guest:
        await guest.bind("p.q", "p.x")
        await guest.bind("other", "other.x")
        beside = guest.producer(exchange="other.x")
        async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
            allowed = conn.producer(exchange="p.x")
            denied = conn.producer(exchange="other.x")
            default = conn.producer(routing_key="p.q")  # the default exchange: amq.default
            for i in range(3):
                await allowed.send(b"ok%d" % i, timeout=LIMIT)
                await denied.send(b"no", timeout=LIMIT)
                await default.send(b"no", timeout=LIMIT)
                await beside.send(b"beside", timeout=LIMIT)
            await allowed.flush(timeout=LIMIT)
            with pytest.raises(fc.PublishError) as info:
                await denied.flush(timeout=LIMIT)
            assert info.value.code is ErrorCode.UNAUTHORIZED and info.value.destination == "other.x"
            assert "no write permission on exchange 'other.x'" in info.value.text
            with pytest.raises(fc.PublishError) as info:
                await default.flush(timeout=LIMIT)
            assert "no write permission on exchange 'amq.default'" in info.value.text
            await beside.flush(timeout=LIMIT)
            assert not conn.is_closed
            await conn.declare_queue("p.after")  # still up
        assert broker.core.queues["p.q"].statistics().messages == 3
        assert broker.core.queues["other"].statistics().messages == 3  # only the guest's


async def test_changed_permissions_apply_to_open_connections(start_flowbroker: Any, tmp_path: Path) -> None:
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
        producer = conn.producer(routing_key="p.q")
        await producer.send(b"refused", timeout=LIMIT)
        with pytest.raises(fc.PublishError):
            await producer.flush(timeout=LIMIT)
        await trio.sleep(0.05)  # a distinct modification time
        write(tmp_path / "users.json", write=r"^(p\.|amq\.default$)")
        with trio.fail_after(LIMIT):
            while True:
                await producer.send(b"allowed", timeout=LIMIT)
                try:
                    await producer.flush(timeout=LIMIT)
                    break
                except fc.PublishError:
                    await trio.sleep(0.2)
        write_users(tmp_path / "users.json", {})  # the user deleted: nothing more
        with trio.fail_after(LIMIT):
            while True:
                try:
                    await conn.declare_queue("p.more")
                    await trio.sleep(0.2)
                except fc.RequestError as exc:
                    assert exc.code is ErrorCode.UNAUTHORIZED
                    break


async def test_a_consumer_whose_read_permission_is_revoked_stops_receiving_and_is_told(
        start_flowbroker: Any, tmp_path: Path) -> None:
    """Only new requests were checked: a subscription made before its user lost read on the queue kept
    receiving every later message (a tester, for an edited pattern and a deleted user alike)."""
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn, \
            await fc.connect(broker.url, timeout=LIMIT) as guest:
        consumer = conn.consumer("p.q")
        await consumer.subscribe()
        feeder = guest.producer(routing_key="p.q")
        await feeder.send(b"before", timeout=LIMIT)
        await feeder.flush(timeout=LIMIT)
        for i in range(3):
            await feeder.send(b"buffered %d" % i, timeout=LIMIT)
        await feeder.flush(timeout=LIMIT)
        assert (await consumer.receive(timeout=LIMIT)).body == b"before"  # (not acked: it goes back)
        with trio.fail_after(LIMIT):
            while consumer.buffered < 3:  # delivered to the SDK, not handed out yet
                await trio.sleep(0.01)
        await trio.sleep(0.05)  # a distinct modification time
        write(tmp_path / "users.json", read=r"^nothing$")
        queue = broker.core.queues["p.q"]
        with trio.fail_after(LIMIT):  # the broker ended the subscription and requeued what it had delivered
            while len(queue.store) != 4:
                await trio.sleep(0.05)
        await trio.sleep(0.2)  # its ERROR reaches the SDK
        # the buffered ones are not handed out (a tester's were, and their acks settled nothing while
        # another consumer got them again): the next receive raises
        with pytest.raises(fc.PublishError) as ended:
            await consumer.receive(timeout=LIMIT)
        assert ended.value.code is ErrorCode.UNAUTHORIZED and ended.value.destination == "p.q"
        await feeder.send(b"after", timeout=LIMIT)
        await feeder.flush(timeout=LIMIT)
        with trio.fail_after(LIMIT):  # all requeued, "after" kept: they wait for a reader allowed to read
            while len(queue.store) != 5:
                await trio.sleep(0.05)


async def test_a_users_max_connections_refuses_one_more_and_not_others(start_flowbroker: Any, tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    write_users(users, {"p": User("p", CRED, (), ".*", ".*", ".*", 2), "q": User("q", CRED)})
    broker = await start_flowbroker(auth={"users_file": str(users)}, udp={"enabled": False})
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT), \
            await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT):
        with pytest.raises(fc.HandshakeError) as info:
            await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT)
        assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and "max_connections (2)" in str(info.value)
        async with await fc.connect(broker.url, auth=("q", "pw"), timeout=LIMIT):  # another user: no limit
            pass
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as again:  # closed ones free it
        assert again.welcome.identity == "p"


async def test_a_users_file_broken_while_running_is_logged_once_and_the_users_stay(
        start_flowbroker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broker = await start(start_flowbroker, tmp_path)
    await trio.sleep(0.05)  # a distinct modification time
    (tmp_path / "users.json").write_text("{not json")
    with trio.fail_after(LIMIT):
        while not any("users file:" in r.getMessage() for r in caplog.records if r.levelname == "ERROR"):
            await trio.sleep(0.1)
    await trio.sleep(2.5)  # two more looks at the file: nothing more is said
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "users file:" in r.getMessage()]
    assert len(errors) == 1 and "the 1 user(s) read before stay in force" in errors[0], errors
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as conn:
        await conn.declare_queue("p.still")


async def test_a_user_cannot_claim_another_users_producer_id(start_flowbroker: Any, tmp_path: Path) -> None:
    """Producer ids are each user's own: p, who may not publish there, sends sequences 0-4 under the id
    the guest then uses; the guest's 0-4 used to complete as duplicates of p's refused messages and
    vanish. All ten of the guest's land now."""
    broker = await start(start_flowbroker, tmp_path)
    async with await fc.connect(broker.url, auth=("p", "pw"), timeout=LIMIT) as mallory:
        claim = mallory.producer(routing_key="other", producer_id="loader", idempotent=True)
        for i in range(5):
            await claim.send(b"claim %d" % i, timeout=LIMIT)
        with pytest.raises(fc.PublishError):  # refused: p may not write to the default exchange
            await claim.flush(timeout=LIMIT)
    async with await fc.connect(broker.url, timeout=LIMIT) as guest:
        good = guest.producer(routing_key="other", producer_id="loader", idempotent=True)
        for i in range(10):
            await good.send(b"good %d" % i, timeout=LIMIT)
        await good.flush(timeout=LIMIT)
        assert good.statistics().failed == 0
    assert broker.core.queues["other"].count == 10


async def test_an_anchored_pattern_does_not_allow_the_name_with_a_newline_recovered_or_declared(
        start_flowbroker: Any, tmp_path: Path) -> None:
    """security.md: "anchor it: `^orders$`". A user with all three patterns `^orders$` declared `orders\\n`,
    a queue alice had declared, read her message from it, published to an exchange `orders\\n` and deleted
    the queue (a tester): Python's `$` matches before a final newline, and such names were declared. They
    are refused now, and a queue an older broker journalled under one is recovered (alice's message in it)
    but not allowed by `^orders$`; the loopback user drains and deletes it."""
    journal = tmp_path / "data" / "journal"
    journal.mkdir(parents=True)
    (journal / segment_name(1)).write_bytes(
        encode([QUEUE, 1, "orders\n", {}, 0]) + encode([EXCHANGE, "orders\n", "fanout"])
        + encode([MESSAGE, 1, 0, "", "orders\n", b"alice's", None, 519, None, None]))
    users = tmp_path / "users.json"
    write_users(users, {"ord": User("ord", CRED, (), "^orders$", "^orders$", "^orders$")})
    broker = await start_flowbroker(auth={"users_file": str(users)}, udp={"enabled": False},
                                    storage={"data_dir": str(tmp_path / "data")})
    assert broker.core.queues["orders\n"].count == 1
    async with await fc.connect(broker.url, auth=("ord", "pw"), timeout=LIMIT) as conn:
        await conn.declare_queue("orders")
        for call, permission in ((conn.declare_queue("orders\n"), "configure"), (conn.purge_queue("orders\n"), "read"),
                                 (conn.delete_queue("orders\n"), "configure")):
            with pytest.raises(fc.RequestError) as info:
                await call
            assert info.value.code is ErrorCode.UNAUTHORIZED and info.value.destination == "orders\n"
            assert info.value.text == f"access refused: user 'ord' has no {permission} permission on queue 'orders\\n'"
        with pytest.raises(fc.RequestError) as info:
            async with conn.consumer("orders\n"):
                pass
        assert info.value.code is ErrorCode.UNAUTHORIZED
        producer = conn.producer(exchange="orders\n")
        await producer.send(b"x", timeout=LIMIT)
        with pytest.raises(fc.PublishError) as published:
            await producer.flush(timeout=LIMIT)
        assert published.value.code is ErrorCode.UNAUTHORIZED and published.value.destination == "orders\n"
    async with await fc.connect(broker.url, timeout=LIMIT) as guest:  # the loopback user: not checked
        for call, kind in ((guest.declare_queue("orders\n"), "queue"), (guest.declare_exchange("x\x00", "fanout"), "exchange")):
            with pytest.raises(fc.RequestError) as info:
                await call
            assert info.value.code is ErrorCode.INVALID_ARGUMENT and "must not contain control characters" in info.value.text
            assert info.value.text.startswith(f"{kind} name ")
        async with guest.consumer("orders\n") as consumer:  # recovered: reached by its name
            message = await consumer.receive(timeout=LIMIT)
            assert message.body == b"alice's"
            await message.ack()
        await guest.delete_queue("orders\n")
    assert "orders\n" not in broker.core.queues
