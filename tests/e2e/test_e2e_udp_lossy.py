"""A registered UDP publication reaches the broker through a lossy relay (tests/e2e/udprelay.py) and every
message is routed exactly once, in order.

It registers with REGISTER_PUBLICATION itself, naming the relay's server-side port as its source (the SDK
registers its own socket's port, which the relay cannot present), and publishes with the transport's
PublicationDriver.

Loss, duplication and reordering hit DATA and SETUP on the way in and the broker's SMs and NAK
answers on the way out; the image's NAKs and the publication's retransmits repair them, and the broker
refuses nothing from a well-behaved producer.
"""

from __future__ import annotations

import pytest
import trio

import flowbroker.client as fb
from flowbroker.protocol.envelope import encode_publish
from flowbroker.protocol.frames import ClosePublication, RegisterPublication
from flowbroker.transport.publication import Publication, PublicationConfig
from flowbroker.transport.udp import PublicationDriver, now_ns, open_udp
from tests.conftest import RunningBroker
from tests.e2e.udprelay import Impairment, LossyRelay

MESSAGES = 20_000
QUEUE = "udp-lossy"


@pytest.mark.parametrize("pace", [False, True], ids=["unpaced", "paced"])
async def test_a_publication_through_loss_duplication_and_reordering_is_routed_exactly_once_in_order(
    start_flowbroker, pace: bool,
) -> None:
    """Paced ([queues] pace_producers, a consumer prefetch of 10 so that it paces), the holds wait for the
    queue's release as well as for retransmits: still exactly once, in order."""
    broker: RunningBroker = await start_flowbroker(queues={"pace_producers": pace})
    datapath = broker.core.udp
    assert datapath is not None and broker.udp_port is not None
    impairment = Impairment(loss=0.05, duplication=0.01, reordering=0.01)
    relay = LossyRelay(("127.0.0.1", broker.udp_port), seed=5, to_server=impairment, to_client=impairment)
    endpoint = open_udp(("127.0.0.1", 0), so_rcvbuf=4 << 20)
    received: list[bytes] = []
    with trio.fail_after(120):
        async with await fb.connect(broker.url, client_name="udp-lossy") as conn, relay, endpoint:
            await conn.declare_queue(QUEUE)
            answer = await conn._request(lambda rid: RegisterPublication(rid, "", QUEUE, 1001, relay.server_port), 10)
            session_id = int(answer["session_id"])
            pub_session = broker.core.sessions[answer["connection"]]
            assert list(datapath.ingress.publications) == [session_id]
            config = PublicationConfig(session_id=session_id, stream_id=int(answer["stream_id"]),
                                       term_length=int(answer["term_length"]), mtu=int(answer["mtu"]),
                                       initial_term_id=12345)
            publication = Publication(config, now_ns(), destination=relay.client_address)
            driver = PublicationDriver(publication, endpoint)

            async def consume() -> None:
                async with conn.consumer(QUEUE, prefetch=10 if pace else 1000) as consumer:
                    async for msg in consumer:
                        received.append(msg.body)
                        await msg.ack()
                        if len(received) == MESSAGES:
                            break

            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay.run)
                nursery.start_soon(driver.run)
                async with trio.open_nursery() as work:
                    work.start_soon(consume)
                    for i in range(MESSAGES):
                        position = await driver.publish(encode_publish(b"m%d" % i), deadline=trio.current_time() + 30)
                        assert position > 0, f"publish {i} failed with {position}"
                await trio.sleep(0.3)  # late duplicates and retransmits must route nothing twice
                assert datapath.refused.total() == 0, datapath.refused  # nothing of ours was refused
                await conn._request(lambda rid: ClosePublication(rid, session_id), 10)
                while datapath.ingress.publications:  # gone once its image has drained
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
            assert broker.core.queues[QUEUE].count == 0
    assert received == [b"m%d" % i for i in range(MESSAGES)]
    up, down = relay.counters["to_server"], relay.counters["to_client"]
    assert up.dropped > 0 and up.duplicated > 0 and up.reordered > 0 and down.received > 0
    assert publication.counters.naks_received > 0 and publication.counters.retransmits_sent > 0
    assert session_id not in datapath.session_ids.live  # given back
    assert (pub_session.paced_total > 0) == pace
