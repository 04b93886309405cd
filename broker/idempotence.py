"""Idempotent producers, broker side: which sequences of which producer ids the broker has taken.

A producer that sets `producer_id` and `sequence` on its TRANSFER entries numbers its messages 0, 1,
2, ... per producer id (Kafka's model). The broker keeps, per producer id, the highest sequence it has
taken, and the rule is the same on every connection: the next sequence is taken, a sequence at or
below the last one is a *duplicate* (completed at once, not enqueued, counted), and one above the next
is a *gap* (refused with SEQUENCE_GAP naming the expected sequence; the connection stays). So a batch
resent after a lost connection, a retried task or two connections racing with the same messages land
once each, in order, whatever the interleaving: no fencing is needed for the queue to be right.

A sequence is taken when the broker *decides* about its message (routes it, holds it, or refuses it
with an error), not when the message completes: a completion held by a saturated queue says nothing
about whether the message is in the queue (it is), so its duplicate must not enqueue it again. A
refusal is kept (the newest REFUSALS_KEPT): the duplicate of a refused message gets the same ERRORs,
since the first may have been lost with the connection and a bare completion would say it landed.

The state is split in two so that the durable-queue work can persist it: `ProducerStateStore` is the
storage (what a journal must record: `accept` of a producer id's sequence), `ProducerSequences` the
rules over it. `MemoryProducerStates` is the bounded in-memory store: at most `max_producer_ids` ids,
and at most `max_producer_ids_per_user` of one user's (so one tenant cannot take every place and refuse
the others' new producers), each kept `ttl_ns` after its last taken message: the broker's flow timer
forgets ids idle that long (`expire`, about once a second) unless the connection that sent an id's last
message is still open and the id is among the last PROTECTED_IDS_PER_CONNECTION it took up (its producer
may send again at any time: forgetting its id refused all it sent after an idle hour, a tester; a
connection that makes a new producer, with a new random id, per request lets the older ones go), and a
new id beyond the bound evicts them at once; if none is, the new id is refused (RESOURCE_EXHAUSTED), never admitted by
forgetting one that may still resend. An evicted id is unknown again: it must start at sequence 0, so
its resent messages above 0 are gaps, and only a resend of its whole stream from 0, later than the
TTL, could land twice (docs/protocol.md, "Idempotent producers").

Sans-IO: time arrives as `now_ns`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol, TypeAlias

from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.limits import MAX_ERROR_TEXT

__all__ = [
    "ProducerStateStore",
    "Holder",
    "PROTECTED_IDS_PER_CONNECTION",
    "MemoryProducerStates",
    "ProducerIdsExhausted",
    "ProducerSequences",
    "scoped",
    "IdempotenceStatistics",
    "DUPLICATE",
    "Refused",
    "Refusal",
    "REFUSALS_KEPT",
    "MAX_PRODUCER_ID_LENGTH",
]

MAX_PRODUCER_ID_LENGTH: Final = 255
"""Characters in a producer id (a *name*, as queues and exchanges), so the store's bound in ids is one in bytes."""


class ProducerIdsExhausted(Exception):
    """A new producer id finds the store full of ids that are not idle for their TTL yet."""


class ProducerStateStore(Protocol):
    """Where the highest taken sequence of each producer id lives. The memory store is bounded; a
    durable one records every `accept` (and may drop what `expire` drops) so that a restarted broker
    still recognises the duplicates of what it took before."""

    def last_accepted(self, producer_id: str) -> int | None:
        """The highest sequence taken from `producer_id`, None if the id is unknown (never seen or evicted)."""
        ...

    def accept(self, producer_id: str, sequence: int, now_ns: int, holder: Holder | None = None) -> None:
        """Record `sequence` as taken from `producer_id` at `now_ns` (the rules guarantee it is the
        next one), sent by `holder`'s connection. Raises ProducerIdsExhausted, recording nothing, for a new
        id the store has no room for."""
        ...

    def expire(self, now_ns: int) -> int:
        """Forget the ids whose last taken message is older than the TTL and whose holder's connection
        has closed; returns how many."""
        ...

    def hold(self, producer_id: str, holder: Holder | None) -> None:
        """`holder`'s connection sent a duplicate of `producer_id`'s: the id is that connection's now."""
        ...

    def closed(self, holder: Holder, now_ns: int) -> None:
        """`holder`'s connection closed at `now_ns`: the ids it holds are kept a TTL from now."""
        ...

    def epoch(self, producer_id: str) -> int | None:
        """Which life of `producer_id` the store holds (a new number each time the id is taken anew
        after being unknown), None if unknown: what a refusal recorded under the id belongs to."""
        ...

    def __len__(self) -> int: ...


PROTECTED_IDS_PER_CONNECTION: Final = 64
"""How many of the ids an open connection took up last are kept past their TTL while it is open."""


class Holder(Protocol):
    """The connection that sent an id's last taken message, as the core's SessionRef shows it: `session`
    is None once that connection has closed; `ids_taken` counts the ids it took up (new to the store,
    or last sent by another connection), so an id's rank says how many it took up after."""

    @property
    def session(self) -> object | None: ...

    ids_taken: int


class _State:
    __slots__ = ("sequence", "last_ns", "epoch", "holder", "rank")
    # (`holder` is the store's `_held` key of this id: MemoryProducerStates._bind moves both together)

    def __init__(self, sequence: int, last_ns: int, epoch: int):
        self.sequence = sequence
        self.last_ns = last_ns
        self.epoch = epoch  # which life of the id this is: an id forgotten and taken anew gets a new one
        self.holder: Holder | None = None
        self.rank = 0  # the holder's `ids_taken` when it took this id up

    def take_up(self, holder: Holder | None) -> None:
        """`holder` sent this id's last message: the id ranks as its newest."""
        self.holder = holder
        if holder is not None:
            holder.ids_taken += 1
            self.rank = holder.ids_taken

    def protected(self) -> bool:
        """Its connection is open and took up few ids since: its producer may still send."""
        holder = self.holder
        return (holder is not None and holder.session is not None
                and holder.ids_taken - self.rank < PROTECTED_IDS_PER_CONNECTION)


class MemoryProducerStates:
    """The bounded in-memory `ProducerStateStore`: ids in order of their last taken message (oldest
    first), so expiry looks only at the front and costs what it removes.

    An id idle for the TTL whose connection is open (`_State.protected`) is not forgotten but set aside
    (`_kept`, oldest first, and per owner). They still count against the bounds, but a new id that finds
    the store (or its owner's share) full makes room by forgetting the oldest of them, as it would have
    before they were set aside: open connections cannot pin the store (a tester: 100 ids of two quiet
    connections refused every new id of their user). When a connection closes (`closed`), each id it
    holds, set aside or not, goes to the end of the main order as if its last message were then, so it is
    kept a TTL after the close: a resend 2 s after a close 2 s before the TTL was taken again (a tester).
    The ids of each open connection are indexed (`_held`) for that, so a close costs what it held."""

    __slots__ = ("max_ids", "max_ids_per_owner", "ttl_ns", "_states", "_kept", "_kept_by_owner", "_owned",
                 "evicted", "_epochs", "forget", "_held")

    def __init__(self, max_ids: int, ttl_ns: int, max_ids_per_owner: int | None = None):
        if max_ids < 1 or ttl_ns < 0 or (max_ids_per_owner is not None and max_ids_per_owner < 1):
            raise ValueError(f"max_ids and max_ids_per_owner must be >= 1 and ttl_ns >= 0, got {max_ids}, "
                             f"{max_ids_per_owner}, {ttl_ns}")
        self.max_ids = max_ids
        self.max_ids_per_owner = max_ids if max_ids_per_owner is None else min(max_ids_per_owner, max_ids)
        self.ttl_ns = ttl_ns
        self._states: OrderedDict[str, _State] = OrderedDict()
        self._kept: OrderedDict[str, _State] = OrderedDict()  # idle past the TTL, their connections open
        self._kept_by_owner: dict[str, OrderedDict[str, _State]] = {}
        # Ids held per owner (the user part of a `scoped` key); unscoped keys (no authentication, or a
        # journal from before ids were scoped) have no owner and only the store's own bound.
        self._owned: dict[str, int] = {}
        self.evicted = 0
        self._epochs = 0
        self.forget: Callable[[str], None] = lambda producer_id: None
        """Told of each id `expire` forgets (the core drops it from the journal's too)."""
        self._held: dict[Holder, set[str]] = {}
        """The ids each open connection holds (sent its last message or duplicate), for `closed`."""

    def _find(self, producer_id: str) -> _State | None:
        state = self._states.get(producer_id)
        if state is None and self._kept:
            state = self._kept.get(producer_id)
        return state

    def last_accepted(self, producer_id: str) -> int | None:
        state = self._find(producer_id)
        return None if state is None else state.sequence

    def hold(self, producer_id: str, holder: Holder | None) -> None:
        """`holder`'s connection sent a message of `producer_id` again (a duplicate: a resend after a
        reconnect): the id is that connection's now."""
        state = self._find(producer_id)
        if state is not None and holder is not None and holder is not state.holder:
            self._bind(producer_id, state, holder)

    def closed(self, holder: Holder, now_ns: int) -> None:
        states = self._states
        for producer_id in self._held.pop(holder, ()):
            state = states.get(producer_id)
            if state is None:
                state = self._unkeep(producer_id)  # (every id in `_held` is in one of the two)
            state.holder = None
            state.last_ns = now_ns  # >= every other id's: the order stays by last_ns
            states[producer_id] = state
            states.move_to_end(producer_id)

    def _bind(self, producer_id: str, state: _State, holder: Holder | None) -> None:
        """`state.take_up(holder)`, keeping `_held` in step."""
        old = state.holder
        if old is not holder:
            if old is not None:
                mine = self._held[old]
                mine.discard(producer_id)
                if not mine:
                    del self._held[old]
            if holder is not None:
                self._held.setdefault(holder, set()).add(producer_id)
        state.take_up(holder)

    def accept(self, producer_id: str, sequence: int, now_ns: int, holder: Holder | None = None) -> None:
        states = self._states
        state = states.get(producer_id)
        if state is None and self._kept and producer_id in self._kept:  # set aside: in use again
            state = self._unkeep(producer_id)
            states[producer_id] = state
        if state is not None:
            state.sequence = sequence
            state.last_ns = now_ns
            # ranked again when it changes connection, or when half the protected ids were taken up since
            # (an id in use stays among its connection's last ones): two steps per message, not a new rank
            if holder is not state.holder or (holder is not None
                                              and holder.ids_taken - state.rank >= PROTECTED_IDS_PER_CONNECTION // 2):
                self._bind(producer_id, state, holder)
            states.move_to_end(producer_id)
            return
        if len(self) >= self.max_ids:
            self.expire(now_ns)
            if len(self) >= self.max_ids and self._kept:
                self._drop(next(iter(self._kept)))
            if len(self) >= self.max_ids:
                oldest = next(iter(states.values()))
                idle_s = (now_ns - oldest.last_ns) / 1e9
                raise ProducerIdsExhausted(
                    f"the broker tracks max_producer_ids {self.max_ids} producer ids and none has been idle for "
                    f"producer_id_ttl {self.ttl_ns / 1e9:g} s (the longest idle: {idle_s:.3g} s); producer id "
                    f"{_unscoped(producer_id)!r} is refused rather than forgetting one that may still resend"
                )
        owner = _owner(producer_id)
        if owner and self._owned.get(owner, 0) >= self.max_ids_per_owner:
            self.expire(now_ns)
            kept = self._kept_by_owner.get(owner)
            if self._owned.get(owner, 0) >= self.max_ids_per_owner and kept:
                self._drop(next(iter(kept)))
            if self._owned.get(owner, 0) >= self.max_ids_per_owner:
                raise ProducerIdsExhausted(
                    f"user {owner!r} holds max_producer_ids_per_user {self.max_ids_per_owner} producer ids, none "
                    f"idle for producer_id_ttl {self.ttl_ns / 1e9:g} s; producer id "
                    f"{_unscoped(producer_id)!r} is refused rather than forgetting one that may still resend"
                )
        self._epochs += 1
        state = states[producer_id] = _State(sequence, now_ns, self._epochs)
        self._bind(producer_id, state, holder)
        if owner:
            self._owned[owner] = self._owned.get(owner, 0) + 1

    def expire(self, now_ns: int) -> int:
        """Forget the ids idle for the TTL, setting aside those whose connection is open (a closed
        connection's come back to the main order at `closed`). Costs what it forgets or sets aside."""
        states = self._states
        horizon = now_ns - self.ttl_ns
        removed = 0
        while states:
            producer_id, state = next(iter(states.items()))
            if state.last_ns > horizon:
                break
            if state.holder is not None and state.protected():
                del states[producer_id]
                self._keep(producer_id, state)
                continue
            self._drop(producer_id)
            removed += 1
        return removed

    def _keep(self, producer_id: str, state: _State) -> None:
        self._kept[producer_id] = state
        owner = _owner(producer_id)
        if owner:
            self._kept_by_owner.setdefault(owner, OrderedDict())[producer_id] = state

    def _unkeep(self, producer_id: str) -> _State:
        state = self._kept.pop(producer_id)
        owner = _owner(producer_id)
        if owner:
            mine = self._kept_by_owner[owner]
            del mine[producer_id]
            if not mine:
                del self._kept_by_owner[owner]
        return state

    def _drop(self, producer_id: str) -> None:
        """Forget `producer_id` (in the main order or set aside)."""
        state = self._states.pop(producer_id, None)
        if state is None:
            state = self._unkeep(producer_id)
        if state.holder is not None:
            self._bind(producer_id, state, None)
        self.forget(producer_id)
        owner = _owner(producer_id)
        if owner:
            left = self._owned[owner] - 1
            if left:
                self._owned[owner] = left
            else:
                del self._owned[owner]
        self.evicted += 1

    def __len__(self) -> int:
        return len(self._states) + len(self._kept)

    def epoch(self, producer_id: str) -> int | None:
        state = self._find(producer_id)
        return None if state is None else state.epoch

    def owned(self, owner: str) -> int:
        """How many ids `owner` holds now."""
        return self._owned.get(owner, 0)

    def items(self) -> list[tuple[str, int, int]]:
        """(producer id, last taken sequence, last_ns), oldest first, then those set aside: for tests and views."""
        return ([(pid, s.sequence, s.last_ns) for pid, s in self._states.items()]
                + [(pid, s.sequence, s.last_ns) for pid, s in self._kept.items()])


@dataclass(frozen=True, slots=True)
class IdempotenceStatistics:
    """Counters since the broker started, and the producer ids tracked now."""

    producer_ids: int
    accepted: int
    """Messages with a producer id whose sequence was the next one (then routed, held or refused)."""
    duplicates: int
    """Messages completed at once as duplicates, not enqueued."""
    gaps: int
    """Messages refused SEQUENCE_GAP."""
    refused: int
    """Messages refused because their producer id could not be tracked (store full, or invalid)."""
    evicted: int
    """Producer ids forgotten after their TTL."""


class _Duplicate:
    """The verdict on a duplicate: complete it at once, enqueue nothing."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DUPLICATE"


DUPLICATE: Final = _Duplicate()

Refusal: TypeAlias = tuple[ErrorCode, str, "str | None"]
"""One ERROR the broker sent about a message: code, text, destination."""

REFUSALS_KEPT: Final = 4096
"""Refusals of taken sequences the broker keeps per user (the newest), so that the resend of a refused
message is refused again rather than completed as a duplicate: the first ERROR may have been lost with
the connection, and the resend's completion would then say a message the broker never enqueued had
landed. Per user, so that one user's refusals cannot push out another's (a tester's user without write
permission did, with 5,000 refused messages). One ERROR is kept of each (`_kept`), its text and
destination cut as the ERROR's are (MAX_ERROR_TEXT), so they cost at most a few MiB per user that has them."""


def _kept(errors: tuple[Refusal, ...]) -> Refusal:
    """What is kept of a refusal: its first ERROR, saying how many more there were. Every ERROR was kept
    (one per queue that refused it), and one user's 600 messages to a fanout over 2,000 full queues held
    232 MiB, REFUSALS_KEPT of them about 1.6 GB (a tester): one is enough to refuse the resend."""
    code, text, destination = errors[0]
    if len(errors) > 1:
        text = f"{text} (and {len(errors) - 1} more ERROR(s) about this message)"
    return code, text[:MAX_ERROR_TEXT], destination[:MAX_ERROR_TEXT] if destination is not None else None


class Refused:
    """The verdict on a duplicate of a message the broker refused: refuse it again, with the same
    ERRORs (then complete it, as the original was)."""

    __slots__ = ("errors",)

    def __init__(self, errors: tuple[Refusal, ...]) -> None:
        self.errors = errors

    def __repr__(self) -> str:
        return f"Refused({self.errors!r})"


Verdict: TypeAlias = None | _Duplicate | Refused | tuple[ErrorCode, str]
"""None: the message is taken (route it); DUPLICATE: complete it now; Refused: refuse it again as its
original was refused; (code, text): refuse it."""


def _owner(key: str) -> str:
    """The user part of a `scoped` key ('' for an unscoped one)."""
    return key.partition("\x00")[0] if "\x00" in key else ""


def _unscoped(key: str) -> str:
    """The producer id a `scoped` key was built from, as its producer named it (for error texts)."""
    return key.partition("\x00")[2] if "\x00" in key else key


def scoped(owner: str, producer_id: str) -> str:
    """The store's key for `owner`'s `producer_id` (and what the journal records with a message): the
    user's name and the id, NUL between (a user name has no control characters, broker/users.py)."""
    return f"{owner}\x00{producer_id}" if owner else producer_id


class ProducerSequences:
    """The rules over a `ProducerStateStore`: `check` says what to do with one message of an
    idempotent producer. Called only for entries with a producer id, so a plain message costs the
    broker one `is not None` test."""

    __slots__ = ("store", "accepted", "duplicates", "gaps", "refused", "refusals")

    def __init__(self, store: ProducerStateStore):
        self.store = store
        self.accepted = 0
        self.duplicates = 0
        self.gaps = 0
        self.refused = 0
        # per user: (key, sequence) -> (the id's epoch, the ERRORs its message got), oldest first, at most
        # REFUSALS_KEPT each
        self.refusals: dict[str, OrderedDict[tuple[str, int], tuple[int, tuple[Refusal, ...]]]] = {}

    def was_refused(self, key: str, sequence: int, errors: tuple[Refusal, ...]) -> None:
        """The message `sequence` of `key`, taken, got `errors` (not enqueued, or not everywhere): a
        resend of it is refused again the same way (`check` answers Refused) while it is kept."""
        epoch = self.store.epoch(key)
        if epoch is None:
            return
        refusals = self.refusals.setdefault(_owner(key), OrderedDict())
        refusals[(key, sequence)] = (epoch, (_kept(errors),))
        refusals.move_to_end((key, sequence))
        if len(refusals) > REFUSALS_KEPT:
            refusals.popitem(last=False)

    def check(self, producer_id: str, sequence: int | None, now_ns: int, key: str | None = None,
              holder: Holder | None = None) -> Verdict:
        """What to do with `sequence` of `producer_id`, kept in the store under `key` (the id itself when
        None), sent by `holder`'s connection (its id is not forgotten while that is open). The broker passes `scoped(user, producer_id)`: each user's producer ids are its own, so a
        user who names another's id can make the other's messages neither duplicates nor gaps. The
        caller builds the key, since it also records it with the message (the journal's key)."""
        if sequence is None or not producer_id or len(producer_id) > MAX_PRODUCER_ID_LENGTH:
            self.refused += 1
            if sequence is None:
                return (ErrorCode.INVALID_ARGUMENT,
                        f"producer id {producer_id[:MAX_PRODUCER_ID_LENGTH]!r} without a sequence: an idempotent "
                        "producer numbers every message")
            return (ErrorCode.INVALID_ARGUMENT,
                    f"producer id of {len(producer_id)} characters: must be 1 to {MAX_PRODUCER_ID_LENGTH}")
        store = self.store
        if key is None:
            key = producer_id
        last = store.last_accepted(key)
        expected = 0 if last is None else last + 1
        if sequence == expected:
            try:
                store.accept(key, sequence, now_ns, holder)
            except ProducerIdsExhausted as exc:
                self.refused += 1
                return (ErrorCode.RESOURCE_EXHAUSTED, str(exc))
            self.accepted += 1
            return None
        if sequence < expected:
            self.duplicates += 1
            if holder is not None:
                store.hold(key, holder)
            if self.refusals:
                mine = self.refusals.get(_owner(key))
                refusal = mine.get((key, sequence)) if mine is not None else None
                if refusal is not None and refusal[0] == store.epoch(key):  # not an earlier life's
                    return Refused(refusal[1])
            return DUPLICATE
        self.gaps += 1
        known = "unknown (never seen, or forgotten after producer_id_ttl)" if last is None else f"at sequence {last}"
        return (ErrorCode.SEQUENCE_GAP,
                f"producer id {producer_id!r} sent sequence {sequence}, expected sequence {expected}: the producer "
                f"is {known}; sequences must arrive in order from 0")

    def statistics(self) -> IdempotenceStatistics:
        store = self.store
        evicted = store.evicted if isinstance(store, MemoryProducerStates) else 0
        return IdempotenceStatistics(len(store), self.accepted, self.duplicates, self.gaps, self.refused, evicted)
