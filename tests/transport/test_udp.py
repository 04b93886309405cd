"""The trio UDP module with real sockets on 127.0.0.1 (multicast: a 239/8 group kept on lo with TTL 0)."""

from __future__ import annotations

import pytest
import trio

from flowbroker.transport import frames as f
from flowbroker.transport.channel import parse_channel
from flowbroker.transport.errors import EndpointClosedError
from flowbroker.transport.udp import (
    UdpEndpoint,
    open_publication_endpoint,
    open_subscription_endpoint,
    open_udp,
    resolve,
)

LOCAL = ("127.0.0.1", 0)


async def test_unicast_send_and_receive() -> None:
    async with open_udp(LOCAL) as a, open_udp(LOCAL) as b:
        setup = f.encode_setup(f.Setup(0, 7, 1001, 3, 3, 65536, 1408))
        assert a.send(setup, b.local_address)
        with trio.fail_after(5):
            data, source = await b.receive()
        assert source == a.local_address
        assert f.decode_datagram(data) == ([f.Setup(0, 7, 1001, 3, 3, 65536, 1408)], None)
        assert a.counters.datagrams_sent == 1 and a.counters.bytes_sent == 40
        assert b.counters.datagrams_received == 1 and b.counters.bytes_received == 40


async def test_receive_batch_drains_in_order() -> None:
    async with open_udp(LOCAL, so_rcvbuf=1 << 20) as a, open_udp(LOCAL, so_rcvbuf=1 << 20) as b:
        for i in range(50):
            assert a.send(i.to_bytes(4, "little") * 8, b.local_address)
        got: list[bytes] = []
        with trio.fail_after(5):
            while len(got) < 50:
                got.extend(d for d, _ in await b.receive_batch(16))
        assert got == [i.to_bytes(4, "little") * 8 for i in range(50)]
        assert b.try_receive() is None


async def test_receive_batch_respects_max_count() -> None:
    async with open_udp(LOCAL) as a, open_udp(LOCAL) as b:
        for i in range(5):
            a.send(bytes([i]), b.local_address)
        await trio.sleep(0.05)
        first = await b.receive_batch(3)
        assert [d for d, _ in first] == [b"\x00", b"\x01", b"\x02"]


async def test_a_batch_stops_at_the_datagram_that_reaches_max_bytes() -> None:
    """`try_receive_batch` never waits and returns what the socket holds, at most `max_count` datagrams and
    none after the one that brings the batch to `max_bytes` (the broker's pass bound); each datagram is its
    own bytes of exactly its length, whatever the endpoint's largest datagram."""
    async with open_udp(LOCAL, so_rcvbuf=1 << 20) as a, open_udp(LOCAL, so_rcvbuf=1 << 20) as b:
        assert b.try_receive_batch(8, 100) == []
        sizes = [40_000, 30_000, 20_000, 9_000, 10, 60_000]
        for i, size in enumerate(sizes):
            assert a.send(bytes([i]) * size, b.local_address)
        await trio.sleep(0.05)
        batches: list[list[bytes]] = []
        while len(batches) < 10:
            batch = b.try_receive_batch(8, 65536)
            if not batch:
                break
            assert {source for _, source in batch} == {a.local_address}
            batches.append([d for d, _ in batch])
        assert [[len(d) for d in batch] for batch in batches] == [[40_000, 30_000], [20_000, 9_000, 10, 60_000]]
        assert [d[0] for batch in batches for d in batch] == list(range(6))
        for i in range(3):
            a.send(b"%d" % i, b.local_address)
        with trio.fail_after(5):
            first = await b.receive_batch(8, 1)  # the bound reached by the first datagram
        assert [d for d, _ in first] == [b"0"]
        assert [d for d, _ in b.try_receive_batch(2)] == [b"1", b"2"]
        assert b.counters.datagrams_received == 9
        with trio.move_on_after(0.05) as idle:
            await b.wait_readable()  # nothing there: waits
        assert idle.cancelled_caught
        a.send(b"3", b.local_address)
        with trio.fail_after(5):
            await b.wait_readable()
        assert b.try_receive_batch() == [(b"3", a.local_address)]  # waiting took nothing


async def test_receive_into_caller_buffer() -> None:
    async with open_udp(LOCAL) as a, open_udp(LOCAL) as b:
        a.send(b"x" * 1500, b.local_address)
        buf = bytearray(2048)
        with trio.fail_after(5):
            n, source = await b.receive_into(buf)
        assert n == 1500 and buf[:n] == b"x" * 1500 and source == a.local_address


async def test_receive_is_cancellable_and_close_is_clean() -> None:
    endpoint = open_udp(LOCAL)
    with trio.move_on_after(0.05) as scope:
        await endpoint.receive()
    assert scope.cancelled_caught
    endpoint.close()
    endpoint.close()  # idempotent
    assert endpoint.closed
    with pytest.raises(EndpointClosedError):
        endpoint.send(b"x", ("127.0.0.1", 9))
    with pytest.raises(EndpointClosedError):
        await endpoint.receive()


async def test_close_wakes_a_blocked_receiver() -> None:
    endpoint = open_udp(LOCAL)
    outcome: list[BaseException] = []

    async def reader() -> None:
        try:
            await endpoint.receive()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.01)
            endpoint.close()
    assert len(outcome) == 1 and isinstance(outcome[0], trio.ClosedResourceError)


async def test_sending_to_a_closed_port_raises_nothing() -> None:
    async with open_udp(LOCAL) as a, open_udp(LOCAL) as b:
        dead = open_udp(LOCAL)
        dead_address = dead.local_address
        dead.close()
        for _ in range(3):
            a.send(b"into the void", dead_address)
        a.send(b"alive", b.local_address)
        with trio.fail_after(5):
            assert (await b.receive())[0] == b"alive"
        assert a.try_receive() is None


async def test_bounded_kernel_buffer_drops_not_blocks() -> None:
    async with open_udp(LOCAL) as a, open_udp(LOCAL, so_rcvbuf=4096) as b:
        for _ in range(2000):
            a.send(bytes(1024), b.local_address)
        received = 0
        while b.try_receive() is not None:
            received += 1
        assert 0 < received < 2000


async def test_send_wait() -> None:
    async with open_udp(LOCAL) as a, open_udp(LOCAL) as b:
        await a.send_wait(b"waited", b.local_address)
        with trio.fail_after(5):
            assert (await b.receive())[0] == b"waited"


async def test_unicast_channel_sockets_and_reply_to_source() -> None:
    sub = await open_subscription_endpoint(parse_channel("aeron:udp?endpoint=127.0.0.1:0"))
    port = sub.local_address[1]
    channel = parse_channel(f"aeron:udp?endpoint=127.0.0.1:{port}|interface=127.0.0.1")
    async with sub, await open_publication_endpoint(channel) as pub:
        hb = f.encode_heartbeat(0, 5, 6, 7)
        data_addr = await resolve(channel.endpoint)  # type: ignore[arg-type]
        assert pub.send(hb, data_addr)
        with trio.fail_after(5):
            datagram, source = await sub.receive()
        assert datagram == hb
        sm = f.encode_status_message(f.StatusMessage(5, 6, 7, 0, 65536, 99))
        sub.send(sm, source)  # SMs go back to the data's source address
        with trio.fail_after(5):
            reply, _ = await pub.receive()
        assert f.decode_datagram(reply)[0] == [f.StatusMessage(5, 6, 7, 0, 65536, 99)]


async def test_mdc_publication_binds_control() -> None:
    probe = open_udp(LOCAL)
    port = probe.local_address[1]
    probe.close()
    channel = parse_channel(f"aeron:udp?control=127.0.0.1:{port}|control-mode=dynamic")
    async with await open_publication_endpoint(channel) as pub:
        assert pub.local_address == ("127.0.0.1", port)


async def test_resolve_names() -> None:
    channel = parse_channel("aeron:udp?endpoint=localhost:4050")
    host, port = await resolve(channel.endpoint)  # type: ignore[arg-type]
    assert port == 4050 and host in ("127.0.0.1", "::1")


async def test_multicast_data_and_control_groups_on_loopback() -> None:
    probe = open_udp(LOCAL)
    port = probe.local_address[1]
    probe.close()
    channel = parse_channel(f"aeron:udp?endpoint=239.255.77.1:{port}|interface=127.0.0.1|ttl=0")
    async with await open_subscription_endpoint(channel) as sub, await open_publication_endpoint(channel) as pub:
        assert pub.send(b"data", ("239.255.77.1", port))
        with trio.fail_after(5):
            data, _ = await sub.receive()
        assert data == b"data"
        control = channel.control_endpoint
        assert control is not None and control.host == "239.255.77.2"
        assert sub.send(b"sm", (control.host, control.port))
        with trio.fail_after(5):
            reply, _ = await pub.receive()
        assert reply == b"sm"
        # The data group is not the control group: the publication never hears its own data.
        assert pub.try_receive() is None


def test_endpoint_type() -> None:
    endpoint = open_udp(LOCAL)
    try:
        assert isinstance(endpoint, UdpEndpoint) and endpoint.fileno() >= 0
    finally:
        endpoint.close()
