"""`conn.consumer(exchange=..., transport="udp", group=..., multicast=...)`: what the SDK checks before it
opens a multicast socket or sends JOIN_GROUP (the group itself is tested end to end in
tests/e2e/test_e2e_multicast.py, inside a network namespace with a multicast route)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

import flowbroker.client as fc
from flowbroker.client.groupconsumer import parse_group_address
from tests.client.fakebroker import FakeBroker

Start = Callable[..., Awaitable[FakeBroker]]


def test_the_group_address_must_be_an_odd_ipv4_multicast_address_and_a_port() -> None:
    assert parse_group_address("239.1.2.3:40457") == ("239.1.2.3", 40457)
    for bad in ("239.1.2.4:40457", "10.0.0.1:40457", "239.1.2.3", "239.1.2.3:0", "239.1.2.3:x", "[ff02::1]:1",
                "host:40457"):
        with pytest.raises(ValueError, match=r"^multicast="):  # names the argument
            parse_group_address(bad)


async def test_group_membership_arguments_are_checked(start_broker: Start) -> None:
    broker = await start_broker()
    async with await fc.connect(broker.url) as conn:
        with pytest.raises(ValueError, match="multicast group member"):
            conn.consumer(group="g", multicast="239.1.2.3:40457", transport="udp")  # no exchange
        with pytest.raises(ValueError, match="multicast group member"):
            conn.consumer(exchange="x", group="g", multicast="239.1.2.3:40457")  # not udp
        with pytest.raises(ValueError, match="multicast group member"):
            conn.consumer("q", exchange="x", group="g", multicast="239.1.2.3:40457", transport="udp")
        with pytest.raises(ValueError, match="fc must be"):
            conn.consumer(exchange="x", group="g", multicast="239.1.2.3:40457", transport="udp", fc="max")
        with pytest.raises(ValueError, match="odd IPv4 multicast"):
            conn.consumer(exchange="x", group="g", multicast="239.1.2.4:40457", transport="udp")
        with pytest.raises(ValueError, match="for a multicast group member"):
            conn.consumer("q", exchange="x")
        with pytest.raises(ValueError, match="needs a queue"):
            conn.consumer()
