"""A hypothesis state machine over `BrokerCore`: flow-controlled producers, watermark queues and
consumers with prefetch and byte buffers, driven by random sequences of sends, deliveries, settlements,
buffer acknowledgements, buffer resizes, threshold and credit policy changes, purges, CANCELs, queue
deletes, topic bindings and consumer disconnects.

Each simulated client acts only on the frames it receives, as the SDK does: a producer sends only
while its window of uncompleted transfers and its byte credit allow. The model records the fate of
every (producer, transfer, queue) copy and checks, at every step and after a final drain:

- nothing is lost or duplicated: each copy ends exactly once as acked, rejected by the client,
  purged, or refused with an ERROR naming its transfer; never two live deliveries of one copy;
- the first deliveries of a producer's messages to a queue come in the order it sent them, and
  only a copy that was delivered before is marked redelivered;
- a queue's count and size are what the model says is in it, and never negative;
- credit never goes negative and the broker never grants bytes the producer did not send;
- a flow-controlled connection (producer, or consumer as the SDK's default makes it) has the policy's
  provisional buffer until its first transfer registers it with the credit policy; registered producers
  have the policy's size for the number registered, and the buffers granted to all flow-controlled
  connections stay within the aggressive bound;
- a queue exceeds its stop thresholds by at most the producers' windows (count) and buffers plus
  one message each (size), beyond what it held when a threshold was lowered under it;
- an uncompleted transfer is held by a saturated destination that still has it, its producer has
  been told FLOW_STOPPED for it, and after the drain every transfer is complete and resumed;
- a CANCEL gives the subscription's unsettled deliveries back to the queue (its answer counts them),
  and they are delivered again, flagged redelivered; a queue delete ends every copy in it (ready and
  unsettled, its answer counts them), tells its subscribers NOT_FOUND once each, and routes nothing to
  it again; settling a deleted queue's delivery later is accepted and changes nothing;
- a consumer's BUFFER_CONTROL (connection or subscription) paces deliveries by the new size from then
  on (deliveries already made were paced by the size in force then), and a credit policy change
  (the admin's PUT /api/policy) re-sizes every producer's buffer within the pool;
- a topic exchange delivers a message to exactly the queues whose binding keys match its routing key,
  computed by the model with a regular expression per binding key (`*` one word, `#` zero or more),
  across binds and unbinds while messages flow (the broker caches routes).

Each rule counts what it did with `event()`: `pytest --hypothesis-show-statistics` shows them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

from tests.broker.coreharness import Consumer, Harness, Producer
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from flowbroker.broker.message import Message
from flowbroker.policies.credit import WAIT_GRANT
from flowbroker.protocol.credit import message_size
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Cancel, DeleteQueue, DeliveryEntry, FlowStopped, Ok

MAX_MESSAGE = 100  # bodies above this are refused with MESSAGE_TOO_LARGE
BIGGEST = message_size(b"0:0:" + b"." * MAX_MESSAGE) + 4  # the largest message that can be enqueued
LARGEST_SENT = message_size(b"9:999:" + b"." * 110)  # the largest message `burst` sends (refused or not)
TYPICAL = message_size(b"0:0:" + b"." * (MAX_MESSAGE // 2))
"""A message of middling size. Every byte figure below (watermarks, buffers, the credit pool) is a
multiple of it, so each holds a handful of messages whatever `MESSAGE_OVERHEAD` is."""
POOL = max(12 * TYPICAL, 1100)  # the aggressive pool: 0.1 % of the quota (at least 1 MiB by config)
QUOTA = 1000 * POOL
MIN_BUFFER = 7 * TYPICAL // 4
MAX_BUFFER = 17 * TYPICAL
Copy = tuple[int, int, str]  # (producer index, transfer id, queue)
CONSUMER_BUFFERS = [0, 0, 2 * TYPICAL // 3, 7 * TYPICAL // 4, 14 * TYPICAL // 3]  # 0 = off
TOPIC_WORDS = ["a", "b", "c"]
BINDING_KEYS = st.lists(st.sampled_from(["a", "b", "*", "#"]), min_size=1, max_size=3).map(".".join)
ROUTING_KEYS = st.lists(st.sampled_from(TOPIC_WORDS), min_size=1, max_size=3).map(".".join)


def topic_pattern(binding_key: str) -> re.Pattern[str]:
    """The model's own topic matcher, independent of broker/topic.py: a binding key as a regular
    expression over the routing key with a dot before every word, so `#` can match no word at all
    (`a.#` matches `a`), `*` exactly one."""
    parts = []
    for word in binding_key.split("."):
        if word == "#":
            parts.append(r"(?:\.[^.]*)*")
        elif word == "*":
            parts.append(r"\.[^.]*")
        else:
            parts.append(r"\." + re.escape(word))
    return re.compile("".join(parts))


def topic_routes(bindings: set[tuple[str, str]], routing_key: str) -> list[str]:
    """The queues a topic exchange with `bindings` ((queue, binding key) pairs) routes `routing_key` to."""
    return sorted({q for q, key in bindings if topic_pattern(key).fullmatch("." + routing_key)})


def parse(body: bytes) -> tuple[int, int]:
    pid, tid, _ = body.split(b":", 2)
    return int(pid), int(tid)


@dataclass
class QueueModel:
    name: str
    max_count: int
    stop_count: int = 0
    stop_size: int = 0
    base_count: int = 0  # what may sit in the queue un-held (see check_bounds)
    base_size: int = 0


@dataclass
class ConsumerModel:
    client: Consumer
    subs: dict[int, str]  # sub id -> queue
    prefetch: dict[int, int]
    buffers: dict[int, int]  # opaque (0 = connection) -> buffer size, 0 = off; live subscriptions only
    last_size: dict[int, int] = field(default_factory=dict)  # opaque -> size of the last delivery
    last_tag: dict[int, int] = field(default_factory=dict)  # opaque -> highest delivery tag
    checked: int = 0  # deliveries already checked
    # opaque -> every buffer size in force since its last delivery (a resize must not make an earlier
    # delivery, paced by the larger size, look like an overrun)
    in_force: dict[int, list[int]] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)  # subscriptions cancelled or whose queue was deleted
    expected_errors: int = 0  # NOT_FOUND from deleted queues it subscribed to


def thresholds(data: st.DataObject, max_count: int) -> dict[str, float]:
    top = min(max_count or 6, 6)
    # hypothesis favours the first alternative and small values: keep "off" (0) the rarer choice
    stop_c = data.draw(st.one_of(st.integers(1, top), st.just(0)), label="flow_stop_count")
    resume_c = data.draw(st.integers(0, stop_c), label="flow_resume_count") if stop_c else 0
    t = TYPICAL
    stop_s = data.draw(st.sampled_from([3 * t, 3 * t // 2, 9 * t // 2, 8 * t, 0, 0]), label="flow_stop_size")
    resume_s = data.draw(st.integers(0, stop_s), label="flow_resume_size") if stop_s else 0
    # the time thresholds (the flow timer evaluates them on `tick`, which lets 5 s pass): mostly off
    stop_d = data.draw(st.sampled_from([0, 0, 0.5, 0.5, 20.0]), label="flow_stop_drain_time")
    stop_a = data.draw(st.sampled_from([0, 0, 1.0, 1.0, 20.0]), label="flow_stop_age")
    return {
        "flow_stop_count": stop_c,
        "flow_resume_count": resume_c,
        "flow_stop_size": stop_s,
        "flow_resume_size": resume_s,
        "flow_stop_drain_time": stop_d,
        "flow_resume_drain_time": stop_d / 2,
        "flow_stop_age": stop_a,
        "flow_resume_age": stop_a / 2,
    }


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Harness
        self.producers: list[Producer] = []
        self.closed_producers: set[int] = set()
        self.queues: dict[str, QueueModel] = {}
        self.fan: list[str] = []
        self.consumers: list[ConsumerModel] = []
        self.admin: Consumer
        self.targets: dict[tuple[int, int], list[str]] = {}  # (pid, tid) -> queues it was routed to
        # Where each message was sent: ("fan", ""), ("top", routing key) or ("queue", name). A message
        # parked under the memory alarm (broker/parking.py) is routed later, to the queues its route
        # reaches then: its targets are [] while parked (`parked`), and set when the core routes it.
        self.route_of: dict[tuple[int, int], tuple[str, str]] = {}
        self.parked: dict[int, set[int]] = {}  # pid -> its transfer ids parked now
        self.sizes: dict[tuple[int, int], int] = {}
        self.fate: dict[Copy, str] = {}
        self.live: dict[Copy, tuple[int, int]] = {}  # copy -> (consumer id, tag) of its live delivery
        self.seen: set[Copy] = set()  # copies delivered at least once
        self.consumer_ids = 0
        self.consumer_by_id: dict[int, ConsumerModel] = {}
        self.saw_refusal = False
        self.aggressive = False
        self.static_size = 0
        self.registered: set[int] = set()  # producers that sent a TRANSFER: registered with the policy
        self.steps = 0
        self.last_first: dict[tuple[int, int, str], int] = {}  # (consumer, producer, queue) -> transfer id
        self.topic: set[tuple[str, str]] = set()  # (queue, binding key) of the topic exchange "top"
        self.deleted: set[str] = set()  # queues deleted (their names are never reused)
        self.queue_serial = 0
        # What the credit pool bounds (docs/policies.md): Σ max(grant, window) <= pool, except after a
        # policy change shrank the pool below what was promised. Then the promises beyond each
        # connection's first byte (which the reserve holds, so a new connection still gets its wait
        # grant) never grow until they fit the shareable part again (as tests/policies/ checks).
        self.promised = 0
        self.policy_changes = 0

    # -- set-up -----------------------------------------------------------------------------------

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        server = {"max_message_size": MAX_MESSAGE, "max_frame_size": 4096, "memory_quota": QUOTA, "max_connections": 20}
        # Sometimes a broker-wide memory watermark low enough to trip: every producer is then held on `*`.
        server["memory_watermark"] = data.draw(st.sampled_from([0, 0, 1_500, 3_000]), label="memory watermark")
        if data.draw(st.booleans(), label="aggressive policy"):
            # a pool of 0.1 % of the quota = POOL bytes, shared: every producer's first send (which
            # registers it) and every disconnect of a registered one resizes
            self.aggressive = True
            credit: dict[str, object] = {
                "policy": "aggressive", "aggressive_percent": 0.1, "min_size": MIN_BUFFER, "max_size": MAX_BUFFER,
            }
        else:
            self.static_size = data.draw(st.integers(MIN_BUFFER, MAX_BUFFER), label="buffer")
            credit = {"policy": "static", "static_size": self.static_size}
        self.h = Harness(server=server, credit=credit)
        self.admin = self.h.consumer("admin")
        assert isinstance(self.admin.declare_exchange("fan", "fanout"), Ok)
        assert isinstance(self.admin.declare_exchange("top", "topic"), Ok)
        for _ in range(data.draw(st.integers(1, 3), label="queues")):
            self._declare_queue(data)
        if not self.fan:
            self._bind_fan(min(self.queues))
        for _ in range(data.draw(st.integers(0, 4), label="topic bindings")):
            self.bind_topic(data)
        for _ in range(data.draw(st.integers(1, 3), label="producers")):
            self._open_producer(data)
        for _ in range(data.draw(st.integers(1, 3), label="consumers")):
            self._open_consumer(data)

    def _declare_queue(self, data: st.DataObject) -> str:
        name = f"q{self.queue_serial}"
        self.queue_serial += 1
        max_count = data.draw(st.sampled_from([0, 8, 0, 4, 0, 12]), label="max_count")
        t = thresholds(data, max_count)
        answer = self.admin.declare_queue(name, max_count=max_count, max_size=0, overflow="reject", **t)
        assert isinstance(answer, Ok), answer
        model = QueueModel(name, max_count)
        self._set_stops(model, t)
        self.queues[name] = model
        if data.draw(st.booleans(), label=f"fan->{name}"):
            self._bind_fan(name)
        return name

    def _bind_fan(self, name: str) -> None:
        assert isinstance(self.admin.bind(name, "fan"), Ok)
        self.fan.append(name)

    def _open_producer(self, data: st.DataObject) -> None:
        window = data.draw(st.integers(1, 6), label="window")
        # the SDK answers every BUFFER_CONTROL with BUFFER_LIMIT; a client from before it does not
        fences = data.draw(st.booleans(), label="answers BUFFER_CONTROL (BUFFER_LIMIT)")
        p = self.h.producer(f"p{len(self.producers)}", window=window, fences=fences)
        p.reads_credit = False  # the model reads every frame itself (_absorb_producer)
        assert p.welcome_buffer == WAIT_GRANT  # provisional until its first transfer
        if self.h.core.producers_stopped:
            assert "*" in {f.destination for f in p.pump() if isinstance(f, FlowStopped)}
        self.producers.append(p)

    def _set_stops(self, model: QueueModel, t: dict[str, float]) -> None:
        model.stop_count = int(t["flow_stop_count"])
        model.stop_size = int(t["flow_stop_size"])
        q = self.h.core.queues[model.name]
        model.base_count = max(model.stop_count, q.count)
        model.base_size = max(model.stop_size, q.size)

    def _open_consumer(self, data: st.DataObject) -> None:
        self.consumer_ids += 1
        cid = self.consumer_ids
        # SDK connections are flow-controlled by default, consumers too: they must not count as producers
        c = self.h.consumer(f"c{cid}", flow_control=data.draw(st.booleans(), label=f"c{cid} flow control"))
        t = TYPICAL
        conn_buffer = data.draw(st.sampled_from([0, 0, 7 * t // 6, 7 * t // 2, 7 * t]), label="connection buffer")
        if conn_buffer:
            c.set_buffer(0, conn_buffer)
        model = ConsumerModel(c, {}, {}, {0: conn_buffer})
        model.in_force[0] = [conn_buffer]
        names = sorted(self.queues)
        chosen = [q for q in names if data.draw(st.booleans(), label=f"c{cid} subscribes {q}")]
        for q in chosen or [data.draw(st.sampled_from(names), label="queue")]:
            self._subscribe(data, model, q)
        self.consumers.append(model)
        self.consumer_by_id[cid] = model
        self._absorb(cid, model)

    def _subscribe(self, data: st.DataObject, model: ConsumerModel, queue: str) -> int:
        prefetch = data.draw(st.integers(1, 5), label="prefetch")
        buffer = data.draw(st.sampled_from(CONSUMER_BUFFERS), label="subscription buffer")
        sub = model.client.subscribe(queue, prefetch=prefetch, buffer_size=buffer)
        model.subs[sub] = queue
        model.prefetch[sub] = prefetch
        model.buffers[sub] = buffer
        model.in_force[sub] = [buffer]
        return sub

    def _end_subscription(self, model: ConsumerModel, sub: int) -> None:
        """The broker forgot `sub` (CANCEL, or its queue was deleted): no prefetch or buffer to check."""
        model.gone.add(sub)
        model.prefetch.pop(sub, None)
        model.buffers.pop(sub, None)
        model.in_force.pop(sub, None)

    # -- model helpers ----------------------------------------------------------------------------

    def _set_fate(self, copy: Copy, fate: str) -> None:
        assert copy not in self.fate, f"{copy} ended twice: {self.fate[copy]} and {fate}"
        pid, tid, q = copy
        assert q in self.targets[(pid, tid)], f"{copy} was never routed to {q}"
        self.fate[copy] = fate

    def _route_now(self, pid: int, tid: int) -> list[str]:
        """The queues a message's route reaches now (a queue deleted since: none)."""
        kind, key = self.route_of[(pid, tid)]
        if kind == "fan":
            return list(self.fan)
        if kind == "top":
            return topic_routes(self.topic, key)
        return [key] if key in self.queues else []

    def _sync_parked(self, pid: int) -> None:
        """After the core may have parked or routed `pid`'s parked transfers (a send, a pump): those
        parked now reach no queue yet; those routed since reach what their route reaches now."""
        p = self.producers[pid]
        now = {rest.tid + i for rest in p.session.parked.rests for i in range(len(rest.sizes))}
        for tid in self.parked.get(pid, set()) - now:
            self.targets[(pid, tid)] = self._route_now(pid, tid)
            event("parked message routed")
        for tid in now:
            self.targets[(pid, tid)] = []
        self.parked[pid] = now
        if now:
            event("parked under the memory alarm")

    def _absorb_producer(self, pid: int) -> None:
        p = self.producers[pid]
        before = len(p.errors)
        p.pump()
        self._sync_parked(pid)  # (pump routes what was parked, once the alarm is off)
        for err in p.errors[before:]:
            assert err.ref_id is not None, err
            key = (pid, err.ref_id)
            if err.code is ErrorCode.MESSAGE_TOO_LARGE:
                for q in self.targets[key]:
                    self._set_fate((pid, err.ref_id, q), "refused")
            elif err.code is ErrorCode.NOT_FOUND:  # a parked message to a queue deleted meanwhile
                assert self.route_of[key] == ("queue", err.destination) and err.destination in self.deleted, err
            else:
                assert err.code is ErrorCode.QUEUE_FULL, err
                assert err.destination in self.targets[key]
                assert self.queues[err.destination].max_count, "only a hard limit refuses"
                self._set_fate((pid, err.ref_id, err.destination), "refused")
            self.saw_refusal = True
        # every transfer the client still waits for is one it was told is flow-stopped
        for tid in p.outstanding:
            assert "*" in p.stopped or any(q in p.stopped for q in self.targets[(pid, tid)]), (
                f"p{pid} transfer {tid} to {self.targets[(pid, tid)]} is held, but it was told only {sorted(p.stopped)}"
            )

    def _absorb(self, cid: int, model: ConsumerModel) -> None:
        """Collect a consumer's frames and check each new delivery."""
        c = model.client
        c.pump()
        unexpected = [e for e in c.errors if not (e.code is ErrorCode.NOT_FOUND and e.destination in self.deleted)]
        assert not unexpected, unexpected
        assert len(c.errors) <= model.expected_errors, c.errors
        for sub, entry in c.deliveries[model.checked :]:
            self._on_delivery(cid, model, sub, entry)
        model.checked = len(c.deliveries)
        # prefetch and byte buffers were respected
        for sub, prefetch in model.prefetch.items():
            assert len(c.tags(sub)) <= prefetch
        for opaque, sizes in model.in_force.items():
            if 0 not in sizes:  # never off since the last delivery
                size = max(sizes)
                last = model.last_size.get(opaque, 0)
                before_last = c.delivered_bytes.get(opaque, 0) - last
                assert before_last < c.acked_bytes.get(opaque, 0) + size or last == 0, (
                    f"c{cid} buffer {opaque} overrun: {before_last} delivered before the last message, "
                    f"{c.acked_bytes.get(opaque, 0)} acked, buffer {size} (in force since: {sizes})"
                )

    def _on_delivery(self, cid: int, model: ConsumerModel, sub: int, entry: DeliveryEntry) -> None:
        assert sub not in model.gone, f"c{cid} got a delivery on subscription {sub} after it ended"
        queue = model.subs[sub]
        pid, tid = parse(entry.body)
        copy = (pid, tid, queue)
        assert queue in self.targets[(pid, tid)], f"{(pid, tid)} delivered from {queue}, routed to {self.targets[(pid, tid)]}"
        assert copy not in self.fate, f"{copy} delivered after it ended as {self.fate.get(copy)}"
        assert copy not in self.live, f"{copy} delivered twice at once"
        assert entry.redelivered or copy not in self.seen, f"{copy} delivered again without the redelivered flag"
        if not entry.redelivered:
            # one consumer sees a producer's messages to a queue first-delivered in send order
            key = (cid, pid, queue)
            assert self.last_first.get(key, 0) < tid, f"{copy} first-delivered to c{cid} after {self.last_first[key]}"
            self.last_first[key] = tid
        self.seen.add(copy)
        self.live[copy] = (cid, entry.delivery_tag)
        # the last dispatched is the highest tag (the wire groups DELIVER frames by subscription)
        size = message_size(entry.body, entry.headers)
        tag = entry.delivery_tag
        for opaque in (0, sub):
            if tag > model.last_tag.get(opaque, 0):
                model.last_tag[opaque] = tag
                model.last_size[opaque] = size
                model.in_force[opaque] = [model.buffers.get(opaque, 0)]  # sent under the size now in force

    def _undelivered_before(self, pid: int, tid: int, queue: str) -> list[int]:
        return [
            t
            for (p, t), qs in self.targets.items()
            if p == pid and t < tid and queue in qs and (p, t, queue) not in self.seen
            and self.fate.get((p, t, queue)) not in ("refused", "purged", "deleted")
        ]

    def _collect_all(self) -> None:
        """Every client reads its frames; then nothing dispatched is unobserved, so the copies seen so
        far must be, per producer and queue, all its eligible transfers up to some point (FIFO)."""
        for pid in range(len(self.producers)):
            if pid not in self.closed_producers:
                self._absorb_producer(pid)
        for cid, model in list(self.consumer_by_id.items()):
            self._absorb(cid, model)
        newest: dict[tuple[int, str], int] = {}
        for pid, tid, queue in self.seen:
            newest[(pid, queue)] = max(newest.get((pid, queue), 0), tid)
        for (pid, queue), tid in newest.items():
            skipped = self._undelivered_before(pid, tid, queue)
            assert not skipped, f"p{pid}'s transfer {tid} was delivered from {queue} before {skipped}"

    # -- rules ------------------------------------------------------------------------------------

    # Hypothesis orders rules by name among equals and favours early ones, and swarm-disables a random
    # subset of rules per run; sending is what everything else reacts to, so it has two early names.
    @rule(data=st.data())
    def burst(self, data: st.DataObject) -> None:
        """A burst of sends from one producer, each only while its window and credit allow."""
        pid = data.draw(st.integers(0, len(self.producers) - 1), label="producer")
        p = self.producers[pid]
        if pid in self.closed_producers:
            return
        if data.draw(st.booleans(), label="read frames first"):
            self._absorb_producer(pid)  # a real client reads while it sends
        names = sorted(self.queues)
        for _ in range(data.draw(st.integers(1, 10), label="burst")):
            if not p.can_send():
                event("send blocked", "window" if len(p.outstanding) >= (p.window or 0) else "credit")
                return
            target = data.draw(st.sampled_from(names + ["fan", "top"]), label="target")
            pad = data.draw(st.one_of(st.integers(0, 90), st.integers(0, 110)), label="pad")
            tid = p.next_id
            body = b"%d:%d:" % (pid, tid) + b"." * pad
            if target == "fan":
                self.route_of[(pid, tid)] = ("fan", "")
                self.targets[(pid, tid)] = list(self.fan)
                assert p.send("fan", "", body) == tid
            elif target == "top":
                key = data.draw(ROUTING_KEYS, label="routing key")
                self.route_of[(pid, tid)] = ("top", key)
                self.targets[(pid, tid)] = topic_routes(self.topic, key)
                event("topic route", f"{len(self.targets[(pid, tid)])} queue(s)")
                assert p.send("top", key, body) == tid
            else:
                self.route_of[(pid, tid)] = ("queue", target)
                self.targets[(pid, tid)] = [target]
                assert p.send("", target, body) == tid
            self._sync_parked(pid)
            self.sizes[(pid, tid)] = message_size(body)
            self.registered.add(pid)  # its first transfer registered it with the credit policy

    @rule(data=st.data())
    def burst_again(self, data: st.DataObject) -> None:
        self.burst(data)

    @rule(data=st.data())
    def pump_producer(self, data: st.DataObject) -> None:
        pid = data.draw(st.integers(0, len(self.producers) - 1), label="producer")
        if pid not in self.closed_producers:
            self._absorb_producer(pid)

    @rule()
    def collect_all(self) -> None:
        self._collect_all()
        self._check_contents()

    @rule(data=st.data())
    def pump_consumer(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.consumer_by_id)), label="consumer")
        self._absorb(cid, self.consumer_by_id[cid])

    def _pick_tags(self, data: st.DataObject) -> tuple[int, ConsumerModel, list[int]]:
        cid = data.draw(st.sampled_from(sorted(self.consumer_by_id)), label="consumer")
        model = self.consumer_by_id[cid]
        tags = sorted(model.client.unsettled)
        chosen = [t for t in tags if data.draw(st.booleans(), label=f"tag {t}")] if len(tags) <= 8 else (
            data.draw(st.lists(st.sampled_from(tags), unique=True), label="tags")
        )
        return cid, model, chosen

    def _settle(self, data: st.DataObject, outcome: str) -> None:
        cid, model, tags = self._pick_tags(data)
        c = model.client
        copies = []
        for tag in tags:
            sub, entry = c.unsettled[tag]
            pid, tid = parse(entry.body)
            copy = (pid, tid, model.subs[sub])
            if self.fate.get(copy) == "deleted":
                event("settled a deleted queue's delivery", outcome)
                continue  # the broker still knows the tag; settling it changes nothing
            assert self.live.pop(copy) == (cid, tag)
            copies.append(copy)
            if outcome != "requeue":
                self._set_fate(copy, outcome)
        if outcome == "acked":
            c.ack(tags)
        elif outcome == "rejected":
            c.reject(tags)
        else:
            c.requeue(tags)

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        self._settle(data, "acked")

    @rule(data=st.data())
    def reject(self, data: st.DataObject) -> None:
        self._settle(data, "rejected")

    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        self._settle(data, "requeue")

    @rule(data=st.data())
    def buffer_ack(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.consumer_by_id)), label="consumer")
        model = self.consumer_by_id[cid]
        c = model.client
        opaques = [o for o, size in model.buffers.items() if size]
        if not opaques:
            return
        opaque = data.draw(st.sampled_from(opaques), label="opaque")
        delivered = c.delivered_bytes.get(opaque, 0)
        acked = c.acked_bytes.get(opaque, 0)
        # anything from a stale or duplicate acknowledgement to everything delivered so far
        total = data.draw(st.integers(max(0, acked - 50), delivered), label="acked_total")
        c.buffer_ack(opaque, total)

    @rule()
    def tick(self) -> None:
        """The shell's timers: 5 s pass, every producer's credit is re-advertised, and the flow timer
        re-evaluates the queues' time thresholds (drain time, age)."""
        self.h.advance(5)
        self.h.core.tick(self.h.now)
        for pid, p in enumerate(self.producers):
            if pid not in self.closed_producers:
                fault = p.session.fault
                if fault is not None:  # a shrink left unanswered while others wait: the shell closes it
                    # (one that fences but has not read its BUFFER_CONTROL for 10 s is such a client too)
                    assert "no BUFFER_LIMIT answered it" in str(fault), fault
                    p.fences = False  # its answers now would meet the fault: the shell is closing it
                    self._absorb_producer(pid)
                    p.close()
                    self.closed_producers.add(pid)
                    continue
                p.session.poll_credit(self.h.now)

    @rule(data=st.data())
    def change_thresholds(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.queues)), label="queue")
        model = self.queues[name]
        t = thresholds(data, model.max_count)
        self.h.core.set_queue_thresholds(name, t)
        self._set_stops(model, t)

    @rule(data=st.data())
    def purge(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.queues)), label="queue")
        ready = [parse(m.body) for m in self.h.core.queues[name].store]
        answer = self.admin.purge(name)
        assert isinstance(answer, Ok) and answer.result == {"purged": len(ready)}
        for pid, tid in ready:
            assert (pid, tid, name) not in self.live
            self._set_fate((pid, tid, name), "purged")

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """CANCEL one subscription: its unsettled deliveries go back to the queue, in order, flagged
        redelivered (as on disconnect), and the client forgets their tags."""
        cid = data.draw(st.sampled_from(sorted(self.consumer_by_id)), label="consumer")
        model = self.consumer_by_id[cid]
        subs = sorted(set(model.subs) - model.gone)
        if not subs:
            return
        sub = data.draw(st.sampled_from(subs), label="subscription")
        self._absorb(cid, model)  # what is already on its way was delivered before the CANCEL
        c = model.client
        tags = [tag for tag, (s, _) in c.unsettled.items() if s == sub]
        for tag in tags:
            _, entry = c.unsettled.pop(tag)
            pid, tid = parse(entry.body)
            assert self.live.pop((pid, tid, model.subs[sub])) == (cid, tag)
        answer = c.request(lambda rid: Cancel(rid, sub))
        assert isinstance(answer, Ok) and answer.result == {"requeued": len(tags)}, answer
        self._end_subscription(model, sub)
        self._absorb(cid, model)
        event("cancel", "requeued some" if tags else "nothing unsettled")

    @rule(data=st.data())
    def subscribe(self, data: st.DataObject) -> None:
        """A consumer subscribes once more (after a CANCEL or a queue delete it may have none left), to
        a queue it has no live subscription on (so its first deliveries from a queue stay in send order:
        two subscriptions of one connection get separate DELIVER frames)."""
        cid = data.draw(st.sampled_from(sorted(self.consumer_by_id)), label="consumer")
        model = self.consumer_by_id[cid]
        taken = {model.subs[sub] for sub in model.subs if sub not in model.gone}
        free = sorted(set(self.queues) - taken)
        if free:
            self._subscribe(data, model, data.draw(st.sampled_from(free), label="queue"))
            self._absorb(cid, model)

    @rule(data=st.data())
    def delete_queue(self, data: st.DataObject) -> None:
        """DELETE_QUEUE: every copy in the queue, ready or unsettled, ends with it; its subscribers
        hear NOT_FOUND once per subscription; a new queue takes its place in the run."""
        name = data.draw(st.sampled_from(sorted(self.queues)), label="queue")
        self._collect_all()  # refusals and deliveries already on their way are known first
        copies = [(pid, tid, name) for (pid, tid), qs in self.targets.items()
                  if name in qs and (pid, tid, name) not in self.fate]
        answer = self.admin.request(lambda rid: DeleteQueue(rid, name))
        assert isinstance(answer, Ok) and answer.result == {"deleted": len(copies)}, (answer, copies)
        event("delete queue", "with unsettled" if any(c in self.live for c in copies) else
              "with ready" if copies else "empty")
        for copy in copies:
            self.live.pop(copy, None)
            self._set_fate(copy, "deleted")
        self.deleted.add(name)
        del self.queues[name]
        if name in self.fan:
            self.fan.remove(name)
        self.topic = {(q, key) for q, key in self.topic if q != name}
        for model in self.consumer_by_id.values():
            for sub, queue in model.subs.items():
                if queue == name and sub not in model.gone:
                    self._end_subscription(model, sub)
                    model.expected_errors += 1
        self._declare_queue(data)
        self._collect_all()
        for model in self.consumer_by_id.values():
            assert len(model.client.errors) == model.expected_errors, model.client.errors

    @rule(data=st.data())
    def bind_topic(self, data: st.DataObject) -> None:
        queue = data.draw(st.sampled_from(sorted(self.queues)), label="queue")
        key = data.draw(BINDING_KEYS, label="binding key")
        answer = self.admin.bind(queue, "top", key)
        assert isinstance(answer, Ok) and answer.result == {"created": (queue, key) not in self.topic}, answer
        self.topic.add((queue, key))
        event("topic binding", "#" if "#" in key else "*" if "*" in key else "words")

    @rule(data=st.data())
    def unbind_topic(self, data: st.DataObject) -> None:
        if not self.topic:
            return
        queue, key = data.draw(st.sampled_from(sorted(self.topic)), label="binding")
        answer = self.admin.unbind(queue, "top", key)
        assert isinstance(answer, Ok) and answer.result == {"removed": True}, answer
        self.topic.discard((queue, key))
        event("topic unbind")

    @rule(data=st.data())
    def resize_consumer_buffer(self, data: st.DataObject) -> None:
        """BUFFER_CONTROL from a consumer: its connection buffer (opaque 0) or a subscription's, to a
        new size or off (0); deliveries follow the new size from now on."""
        cid = data.draw(st.sampled_from(sorted(self.consumer_by_id)), label="consumer")
        model = self.consumer_by_id[cid]
        opaque = data.draw(st.sampled_from(sorted(model.buffers)), label="opaque")
        size = data.draw(st.sampled_from(CONSUMER_BUFFERS + [7 * TYPICAL]), label="new buffer size")
        self._absorb(cid, model)  # deliveries already made were paced by the old size
        old = model.buffers[opaque]
        model.client.set_buffer(opaque, size)
        model.buffers[opaque] = size
        model.in_force[opaque].append(size)
        self._absorb(cid, model)
        event("consumer buffer resize", "connection" if opaque == 0 else "subscription")
        event("consumer buffer resize", "off" if not size else "on" if not old else "shrink" if size < old else "grow")

    @rule(data=st.data())
    def change_credit_policy(self, data: st.DataObject) -> None:
        """The admin's PUT /api/policy (broker/admin.py calls `set_credit_policy` with its body): every
        producer's buffer is recomputed and pushed with BUFFER_CONTROL. Policy `none` (no pacing) is
        left out: this machine's size bound needs every producer paced."""
        policy = data.draw(st.sampled_from(["aggressive", "static", "dynamic"]), label="policy")
        settings: dict[str, Any] = {"policy": policy}
        if policy == "static":
            settings["static_size"] = data.draw(st.integers(MIN_BUFFER, MAX_BUFFER), label="static_size")
        elif policy == "aggressive":
            settings["aggressive_percent"] = data.draw(st.sampled_from([0.1, 0.05, 0.2]), label="aggressive_percent")
        else:  # a pool of 0.1 % of the quota, 1/8 of it per producer (clamped), first come first served
            settings |= {"dynamic_threshold_percent": 0.1, "dynamic_percent": 0.0125}
        if data.draw(st.booleans(), label="new bounds"):
            low = data.draw(st.integers(MIN_BUFFER // 2, MAX_BUFFER), label="min_size")
            settings |= {"min_size": low, "max_size": data.draw(st.integers(low, MAX_BUFFER), label="max_size")}
        before = [p.session.buffer_size for p in self.producers]
        self.h.core.set_credit_policy(**settings)
        self.policy_changes += 1
        credit = self.h.core.credit
        event("credit pool after a policy change", "over" if credit.total_committed() > credit.pool else "within")
        after = [p.session.buffer_size for p in self.producers]
        event("credit policy change", policy if before == after else f"{policy}, resized")

    @rule(data=st.data())
    def disconnect_consumer(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.consumer_by_id)), label="consumer")
        model = self.consumer_by_id.pop(cid)
        self.consumers.remove(model)
        self._absorb(cid, model)  # what was already on its way counts as delivered
        model.client.close()
        for copy, (owner, _) in list(self.live.items()):
            if owner == cid:
                del self.live[copy]  # requeued by the broker
        if data.draw(st.booleans(), label="replace it") or not self.consumer_by_id:
            self._open_consumer(data)

    @rule(data=st.data())
    def producer_joins(self, data: st.DataObject) -> None:
        if len(self.producers) - len(self.closed_producers) < 4:
            self._open_producer(data)

    @rule()
    def stop_all_producers(self) -> None:
        self.h.core.stop_all_producers()

    @rule()
    def start_all_producers(self) -> None:
        self.h.core.start_all_producers()

    @rule(data=st.data())
    def disconnect_producer(self, data: st.DataObject) -> None:
        """A producer goes away; its messages stay queued, its held transfers are simply dropped."""
        live = [i for i in range(len(self.producers)) if i not in self.closed_producers]
        if len(live) < 2:
            return
        pid = data.draw(st.sampled_from(live), label="producer")
        self._absorb_producer(pid)
        self.producers[pid].close()
        self.closed_producers.add(pid)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def queue_accounting(self) -> None:
        self.steps += 1
        core = self.h.core
        unsettled: dict[str, list[Message]] = {q: [] for q in self.queues}
        for s in core.sessions.values():
            for sub, msg in s.unsettled.values():
                if not sub.queue.deleted:  # a deleted queue's deliveries are no queue's any more
                    unsettled[sub.queue.name].append(msg)
        for name, q in core.queues.items():
            members = list(q.store) + unsettled[name]
            assert q.count == len(members) >= 0, (name, q.count, len(members))
            assert q.size == sum(m.size for m in members) >= 0, (name, q.size)
            assert len({id(m) for m in members}) == len(members), f"{name}: a message is in it twice"
            # held messages are in the queue and the queue is saturated while it holds any
            ids = {id(m) for m in members}
            assert all(id(m) in ids for m in q.held), f"{name} holds a message it no longer has"
            assert not q.held or q.saturated, f"{name} holds transfers but is not saturated"

    @invariant()
    def memory_meter_counts_every_queue_and_alarms_over_the_watermark(self) -> None:
        core = self.h.core
        memory = core.memory
        assert memory.subscriptions == sum(len(q.subscriptions) for q in core.queues.values())
        assert memory.saturated_queues == {name: q for name, q in core.queues.items() if q.saturated}
        assert memory.held == sum(q.size for q in core.queues.values())
        assert memory.held < memory.watermark or memory.alarm, "over the memory watermark without the alarm"
        assert not memory.alarm or memory.held >= memory.resume, "the alarm outlived its resume level"
        alarmed = memory.alarm or core.producers_stopped
        for p in self.producers:
            if p.session.open:
                assert ("*" in p.session.flow_stopped_on) is alarmed

    @invariant()
    def held_transfers_are_held_by_a_saturated_destination(self) -> None:
        core = self.h.core
        held: dict[str, set[tuple[int, int]]] = {
            name: {parse(m.body) for m in q.held} for name, q in core.queues.items()
        }
        admin_held: dict[int, set[int]] = {pid: set() for pid in range(len(self.producers))}
        sessions = {p.session: pid for pid, p in enumerate(self.producers)}
        for transfer in core._broker_held:
            if transfer.owner.session in sessions:
                admin_held[sessions[transfer.owner.session]].add(transfer.transfer_id)
        assert not core._broker_held or core.producers_stopped or core.memory.alarm
        for pid, p in enumerate(self.producers):
            if pid in self.closed_producers:
                continue
            done = p.session.completed
            for tid in range(1, p.next_id):
                if tid in done or tid in self.parked.get(pid, ()):  # (parked: not routed yet)
                    continue
                assert tid in admin_held[pid] or any((pid, tid) in held.get(q, ()) for q in self.targets[(pid, tid)]), (
                    f"p{pid} transfer {tid} is not complete, yet no destination holds it"
                )

    @invariant()
    def credit_is_sane(self) -> None:
        for pid, p in enumerate(self.producers):
            if pid in self.closed_producers:
                continue
            s = p.session
            sched = s.receiver_window
            assert s.receiver_window.position == p.credit.position
            assert 0 <= p.credit.acked_position <= sched.acked_position <= sched.consumed_position <= s.receiver_window.position
            assert p.credit.outstanding >= 0
            assert p.window is not None and len(p.outstanding) <= p.window

    @invariant()
    def granted_buffers_within_pool(self) -> None:
        core = self.h.core
        credit = core.credit
        live = [pid for pid in range(len(self.producers)) if pid not in self.closed_producers]
        registered = [pid for pid in live if pid in self.registered]
        # exactly the live producers that have sent are producers: consumers and idle ones are provisional
        assert set(credit.producers()) == {self.producers[pid].session.conn_id for pid in registered}
        need = credit.need()
        for pid in live:
            s = self.producers[pid].session
            assert s.buffer_size == credit.size_of(s.conn_id)
            if pid in self.registered:
                assert s.buffer_size >= need or credit.is_waiting(s.conn_id), (pid, s.buffer_size, need)
                assert s.credit_waiting == credit.is_waiting(s.conn_id)
            else:
                assert s.buffer_size == WAIT_GRANT
        flow_controlled = [s for s in core.sessions.values() if s.flow_control]
        # every grant counted, provisional and waiting ones included, within the pool; and so is
        # what a shrink left promised (each window is what the session's credit limit allows)
        assert sum(s.buffer_size for s in flow_controlled) == credit.total_granted() <= credit.pool
        for s in flow_controlled:
            assert credit.window_of(s.conn_id) == max(s.buffer_size, s.receiver_window.limit - s.receiver_window.acked_position)
        promised = sum(credit.window_of(s.conn_id) - 1 for s in flow_controlled)
        assert promised <= max(credit.shareable, self.promised), (promised, credit.shareable, self.promised)
        self.promised = promised
        if promised <= credit.shareable:
            assert credit.total_committed() <= credit.pool

    @invariant()
    def bounded_by_windows_and_buffers(self) -> None:
        # closed producers count too: their held messages stay until the queue clears
        windows = sum(p.window or 0 for p in self.producers)
        buffers = sum(self._largest_buffer(p) + BIGGEST for p in self.producers)
        for name, model in self.queues.items():
            q = self.h.core.queues[name]
            if model.stop_count:
                assert q.count <= model.base_count + windows, (
                    f"{name}: {q.count} messages, stop {model.stop_count} (base {model.base_count}) + windows {windows}"
                )
            if model.stop_size:
                assert q.size <= model.base_size + buffers, (
                    f"{name}: {q.size} bytes, stop {model.stop_size} (base {model.base_size}) + buffers {buffers}"
                )
            # What sits in the queue un-held can only shrink while it is saturated (see the module doc).
            model.base_count = max(model.stop_count, min(model.base_count, q.count))
            model.base_size = max(model.stop_size, min(model.base_size, q.size))

    @staticmethod
    def _largest_buffer(p: Producer) -> int:
        """A client sends by the largest buffer it was ever told (WELCOME or BUFFER_CONTROL)."""
        return max([p.welcome_buffer] + [b.buffer_size for b in p.buffer_controls])

    def _check_contents(self) -> None:
        """After every client has read its frames: each queue holds exactly the copies the model
        says are in it (routed, not refused, not ended)."""
        for name in self.queues:
            expected = [
                (pid, tid)
                for (pid, tid), qs in self.targets.items()
                if name in qs and (pid, tid, name) not in self.fate
            ]
            q = self.h.core.queues[name]
            assert q.count == len(expected), (name, q.count, expected)
            assert q.size == sum(self.sizes[k] for k in expected), name

    # -- the end ----------------------------------------------------------------------------------

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None or not hasattr(self, "h"):
            return  # a step failed: report that, not a consequence of it
        self.h.core.start_all_producers()
        self._collect_all()
        for cid, model in list(self.consumer_by_id.items()):
            model.client.close()
            for copy, (owner, _) in list(self.live.items()):
                if owner == cid:
                    del self.live[copy]
        self.consumer_by_id.clear()
        drain = self.h.consumer("drain")
        drain_model = ConsumerModel(drain, {}, {}, {0: 0})
        self.consumer_by_id[0] = drain_model
        for i, name in enumerate(sorted(self.queues), start=1):
            drain_model.subs[i] = name
            drain.subscribe(name, sub_id=i)
        for _ in range(100):
            self._collect_all()
            self._check_contents()
            if not drain.unsettled and all(
                not p.outstanding for i, p in enumerate(self.producers) if i not in self.closed_producers
            ) and all(q.count == 0 for q in self.h.core.queues.values()):
                break
            tags = sorted(drain.unsettled)
            for tag in tags:
                sub, entry = drain.unsettled[tag]
                pid, tid = parse(entry.body)
                copy = (pid, tid, drain_model.subs[sub])
                del self.live[copy]
                self._set_fate(copy, "acked")
            drain.ack(tags)
            self.tick()
        self.tick()  # grants below the acknowledgement threshold go out on the timer
        self._collect_all()
        # what this run exercised (see --hypothesis-show-statistics)
        for threshold in sorted({f.threshold for p in self.producers for f in p.received(FlowStopped)}):
            event("stopped by", threshold)
        stops = sum(len(p.received(FlowStopped)) for p in self.producers)
        event("flow stops", "none" if not stops else "1-3" if stops < 4 else "4+")
        event("memory alarms", self.h.core.memory.alarms_total > 0)
        event("messages", len(self.targets) // 10 * 10)
        event("steps", self.steps // 10 * 10)
        for fate in ("refused", "purged", "rejected"):
            event(f"some {fate}", any(f == fate for f in self.fate.values()))
        event("redelivered", any(e.redelivered for m in [drain] for _, e in m.deliveries))
        event("grants", sum(len(p.grants) for p in self.producers) // 5 * 5)
        event("a producer never sent (provisional)", len(self.registered) < len(self.producers))
        event("flow-controlled consumers", any(m.client.session.flow_control for m in self.consumers))
        event("buffer pushed on registration", any(p.buffer_controls for p in self.producers))
        # every copy of every message ended exactly once
        for (pid, tid), qs in self.targets.items():
            for q in qs:
                assert (pid, tid, q) in self.fate, f"{(pid, tid, q)} was lost"
        assert not self.live
        for queue in self.h.core.queues.values():
            assert (queue.count, queue.size, queue.saturated, len(queue.held), len(queue.stopped_producers)) == (
                0, 0, False, 0, 0), queue
        for pid, p in enumerate(self.producers):
            if pid in self.closed_producers:
                continue
            assert p.outstanding == {}, f"p{pid} transfers never completed: {sorted(p.outstanding)}"
            assert p.stopped == {}, f"p{pid} still flow-stopped on {sorted(p.stopped)}"
            if self.h.core.credit.is_waiting(p.session.conn_id):
                # waiting for a share (an idle producer's window holds the pool): acknowledgements
                # are withheld, so the one message it may send stays unacknowledged (docs/policies.md).
                # A policy change can make a producer wait with nothing unacknowledged, or with all
                # it sent under its old grant: still within what it was told plus one message.
                unacked = p.credit.position - p.credit.acked_position
                if self.policy_changes:
                    assert 0 <= unacked <= self._largest_buffer(p) + LARGEST_SENT, unacked
                else:
                    assert 0 < unacked <= LARGEST_SENT, unacked
                event("waiting producer at the end", "more than one message unacknowledged"
                      if unacked > LARGEST_SENT else "one message or none")
            else:
                assert p.credit.acked_position == p.credit.position, "credit was not all returned"
            credit = self.h.core.credit
            s = p.session
            if p.fences and s.buffer_size and not credit.is_waiting(s.conn_id):
                # its answers drained whatever its shrinks left promised: it is charged its grant only
                assert credit.window_of(s.conn_id) == s.buffer_size == s.transfers.promised, (
                    pid, credit.window_of(s.conn_id), s.buffer_size, s.transfers.promised)
                event("fencing producer at the end", "shrunk" if self._largest_buffer(p) > s.buffer_size else "not shrunk")
        credit = self.h.core.credit
        live = [self.producers[pid] for pid in range(len(self.producers))
                if pid not in self.closed_producers and pid in self.registered]
        if credit.config.policy.value != "none" and live and all(p.fences for p in live):
            # every producer answers its shrinks: nothing but a waiting producer's one unacknowledged
            # message is promised beyond the grants, so nobody waits while the grants leave a share
            free = credit.shareable - sum(credit.size_of(p.session.conn_id) - 1 for p in live)
            waiting = [p for p in live if credit.is_waiting(p.session.conn_id)]
            unacked = sum(credit.window_of(p.session.conn_id) - 1 for p in waiting)
            for p in waiting:
                assert free - unacked + credit.window_of(p.session.conn_id) < credit.need(), (free, unacked, credit.need())
            event("all producers answer, someone waits at the end", bool(waiting))


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(
    max_examples=200,
    stateful_step_count=100,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_model_helpers() -> None:
    assert parse(b"2:17:...") == (2, 17)
    assert BIGGEST >= message_size(b"9:999:" + b"." * MAX_MESSAGE)



def test_the_model_topic_matcher() -> None:
    """The model's regex translation on the AMQP examples (`#` zero or more words, `*` exactly one)."""
    bindings = {("q_hash", "#"), ("q_a_hash", "a.#"), ("q_star", "*"), ("q_a_star", "a.*"), ("q_star_b", "*.b"),
                ("q_ab", "a.b"), ("q_hash_b", "#.b")}
    assert topic_routes(bindings, "a") == ["q_a_hash", "q_hash", "q_star"]
    assert topic_routes(bindings, "a.b") == ["q_a_hash", "q_a_star", "q_ab", "q_hash", "q_hash_b", "q_star_b"]
    assert topic_routes(bindings, "c.a.b") == ["q_hash", "q_hash_b"]
    assert topic_routes(bindings, "b.a") == ["q_hash"]
