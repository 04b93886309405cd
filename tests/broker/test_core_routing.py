"""Routing in the core: default, direct, fanout and topic exchanges through BIND/UNBIND frames."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.broker.coreharness import Harness, Producer

from flowbroker.broker.exchange import topic_matches
from flowbroker.broker.topic import WORD_BITS, TopicIndex
from flowbroker.protocol.errors import ErrorCode
from flowbroker.protocol.frames import Error, Ok


def setup(*queues: str) -> tuple[Harness, Producer]:
    h = Harness()
    p = h.producer()
    for q in queues:
        assert isinstance(p.declare_queue(q), Ok)
    return h, p


def contents(h: Harness) -> dict[str, list[bytes]]:
    return {name: [m.body for m in q.store] for name, q in h.core.queues.items()}


@pytest.mark.parametrize(
    "pattern, key, match",
    [
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.c", False),
        ("a.*.c", "a.b.b.c", False),
        ("a.#", "a", True),
        ("a.#", "a.b.c", True),
        ("#.c", "c", True),
        ("#", "", True),
        ("#", "x.y", True),
        ("a.#.c", "a.c", True),
        ("a.#.c", "a.x.y.c", True),
        ("a.#.c", "a.x.y.d", False),
        ("*", "a", True),
        ("*", "a.b", False),
        ("*.#", "a.b", True),
        ("a.b", "a.b", True),
        ("a.b", "a.bb", False),
    ],
)
def test_topic_matches(pattern: str, key: str, match: bool) -> None:
    assert topic_matches(pattern, key) is match


def test_topic_exchange_routes_through_bindings_and_unbind() -> None:
    h, p = setup("stars", "hashes", "exact")
    assert isinstance(p.declare_exchange("t", "topic"), Ok)
    for queue, key in (("stars", "stock.*.nyse"), ("hashes", "stock.#"), ("exact", "stock.ibm")):
        answer = p.bind(queue, "t", key)
        assert isinstance(answer, Ok) and answer.result == {"created": True}
    again = p.bind("exact", "t", "stock.ibm")
    assert isinstance(again, Ok) and again.result == {"created": False}
    for key in ("stock.ibm.nyse", "stock.ibm", "stock", "bond.ibm", "stock.x.y.nyse"):
        p.send("t", key, key.encode())
    p.pump()
    assert contents(h) == {
        "stars": [b"stock.ibm.nyse"],
        "hashes": [b"stock.ibm.nyse", b"stock.ibm", b"stock", b"stock.x.y.nyse"],
        "exact": [b"stock.ibm"],
    }
    assert p.errors == [] and p.outstanding == {}
    assert h.core.unroutable == 1  # bond.ibm: completed, counted, no error
    removed = p.unbind("hashes", "t", "stock.#")
    assert isinstance(removed, Ok) and removed.result == {"removed": True}
    again = p.unbind("hashes", "t", "stock.#")
    assert isinstance(again, Ok) and again.result == {"removed": False}
    p.send("t", "stock.ibm", b"after")
    assert contents(h)["hashes"][-1] == b"stock.x.y.nyse"
    assert contents(h)["exact"][-1] == b"after"


def test_queue_bound_twice_to_topic_gets_one_copy() -> None:
    h, p = setup("q")
    p.declare_exchange("t", "topic")
    p.bind("q", "t", "a.*")
    p.bind("q", "t", "#")
    p.send("t", "a.b", b"once")
    assert contents(h)["q"] == [b"once"]


def test_fanout_ignores_key_and_direct_matches_exactly() -> None:
    h, p = setup("a", "b")
    p.declare_exchange("f", "fanout")
    p.declare_exchange("d", "direct")
    p.bind("a", "f", "whatever")
    p.bind("b", "f", "")
    p.bind("a", "d", "k")
    p.send("f", "anything", b"fan")
    p.send("d", "k", b"direct")
    p.send("d", "K", b"nowhere")
    assert contents(h) == {"a": [b"fan", b"direct"], "b": [b"fan"]}
    p.unbind("b", "f", "")
    p.send("f", "", b"fan2")
    assert contents(h) == {"a": [b"fan", b"direct", b"fan2"], "b": [b"fan"]}


def test_builtin_exchanges_and_default_exchange() -> None:
    h, p = setup("q")
    p.bind("q", "amq.topic", "x.#")
    p.send("amq.topic", "x.y", b"t")
    p.send("", "q", b"default")
    assert contents(h)["q"] == [b"t", b"default"]


def test_declare_and_bind_errors() -> None:
    h, p = setup("q")
    bad_kind = p.declare_exchange("e", "headers")
    assert isinstance(bad_kind, Error) and bad_kind.code is ErrorCode.INVALID_ARGUMENT
    p.declare_exchange("e", "direct")
    clash = p.declare_exchange("e", "topic")
    assert isinstance(clash, Error) and (clash.code, clash.destination) == (ErrorCode.ALREADY_EXISTS, "e")
    same = p.declare_exchange("e", "direct")
    assert isinstance(same, Ok)
    no_exchange = p.bind("q", "nope", "k")
    assert isinstance(no_exchange, Error) and (no_exchange.code, no_exchange.destination) == (ErrorCode.NOT_FOUND, "nope")
    default = p.bind("q", "", "k")  # it exists, and takes no bindings: the error says so (a tester)
    assert isinstance(default, Error) and default.code is ErrorCode.NOT_FOUND and "takes no bindings" in default.text
    no_queue = p.bind("missing", "e", "k")
    assert isinstance(no_queue, Error) and no_queue.destination == "missing"
    bad_arg = p.declare_queue("r", flow_stop_cont=3)
    assert isinstance(bad_arg, Error) and bad_arg.code is ErrorCode.INVALID_ARGUMENT and "flow_stop_cont" in bad_arg.text
    bad_pair = p.declare_queue("r", flow_stop_count=3, flow_resume_count=5)
    assert isinstance(bad_pair, Error) and bad_pair.code is ErrorCode.INVALID_ARGUMENT
    assert "r" not in h.core.queues
    p.declare_queue("r", flow_stop_count=3)
    redeclare = p.declare_queue("r", flow_stop_count=4)
    assert isinstance(redeclare, Error) and redeclare.code is ErrorCode.ALREADY_EXISTS
    assert isinstance(p.declare_queue("r"), Ok)  # no arguments: just checks it exists


def test_deleted_queue_is_unbound() -> None:
    h, p = setup("a", "b")
    p.declare_exchange("f", "fanout")
    p.bind("a", "f")
    p.bind("b", "f")
    h.core.delete_queue("a")
    p.send("f", "", b"m")
    p.pump()
    assert p.errors == [] and contents(h) == {"b": [b"m"]}


def _reference_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """The recursive definition of AMQP topic matching (the matcher the broker used to run)."""
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return _reference_match(rest, words) or (bool(words) and _reference_match(pattern, words[1:]))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _reference_match(rest, words[1:])


_word = st.sampled_from(["a", "b", "c", ""])


@given(
    pattern=st.lists(st.one_of(_word, st.sampled_from(["*", "#"])), min_size=1, max_size=7),
    key=st.lists(_word, min_size=1, max_size=8),
)
def test_iterative_topic_match_agrees_with_the_recursive_definition(pattern: list[str], key: list[str]) -> None:
    assert topic_matches(".".join(pattern), ".".join(key)) is _reference_match(tuple(pattern), tuple(key))


def test_a_routing_key_of_thousands_of_words_is_matched_without_recursion() -> None:
    """5,000 words raised RecursionError in the recursive matcher and stopped the broker."""
    key = ".".join(["w"] * 5000)
    assert topic_matches("#.w", key)
    assert topic_matches("#", key)
    assert not topic_matches("#.x.#.y", key)


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "remove"]),
            st.lists(st.one_of(_word, st.sampled_from(["*", "#"])), min_size=1, max_size=6).map(".".join),
        ),
        max_size=40,
    ),
    keys=st.lists(st.lists(_word, min_size=1, max_size=7).map(".".join), min_size=1, max_size=5),
)
def test_one_index_of_many_bindings_matches_as_each_binding_would(ops: list[tuple[str, str]], keys: list[str]) -> None:
    """Adds and removes (enough to trigger rebuilds), then every routing key matches exactly the live
    binding keys the recursive definition says it matches."""
    index = TopicIndex()
    live: set[str] = set()
    for op, pattern in ops * 30:
        if op == "add":
            index.add(pattern)
            live.add(pattern)
        else:
            index.remove(pattern)
            live.discard(pattern)
    assert len(index) == len(live)
    assert index.literal_bits == sum(mask.bit_length() + WORD_BITS for _, mask in index._literal.values())
    for key in keys:
        expected = {p for p in live if _reference_match(tuple(p.split(".")), tuple(key.split(".")))}
        assert set(index.match(key.split("."))) == expected


@given(
    patterns=st.lists(st.lists(st.one_of(_word, st.sampled_from(["*", "#"])), min_size=1, max_size=6).map(".".join),
                      min_size=1, max_size=12),
    removed=st.one_of(st.sets(st.integers(0, 199)),  # (few: one by one)
                      st.integers(2, 5).map(lambda k: {i for i in range(200) if i % k})),  # many: one rebuild
    keys=st.lists(st.lists(_word, min_size=1, max_size=7).map(".".join), min_size=1, max_size=5),
)
def test_keys_removed_together_leave_an_index_that_matches_as_each_binding_would(
        patterns: list[str], removed: set[int], keys: list[str]) -> None:
    """A deleted queue's bindings leave together (`remove_many`: one rebuild past 64 keys), and the rebuild
    makes each vector from its list of bits: what is left matches exactly as before, and the word masks'
    bits are counted in the budget as they are held."""
    index = TopicIndex()
    bound = [f"{pattern}.n{i}" if i % 3 else pattern for i, pattern in enumerate(patterns * 17)][:200]
    for key in bound:
        index.add(key)
    gone = [bound[i] for i in sorted(removed) if i < len(bound)]
    index.remove_many(gone)
    live = set(bound) - set(gone)
    assert len(index) == len(live)
    assert (index.literal_bits == sum(mask.bit_length() + WORD_BITS for _, mask in index._literal.values())
            == index.budget.used)
    for key in keys + [f"{k}.n{i}" for i, k in enumerate(keys, 1)]:
        expected = {p for p in live if _reference_match(tuple(p.split(".")), tuple(key.split(".")))}
        assert set(index.match(key.split("."))) == expected


def test_keys_of_distinct_words_cost_memory_in_proportion_to_their_number() -> None:
    """A dense mask per word spanned every state below the word's: 100,000 two-word keys of distinct words
    held 2 GB (a tester). From its lowest state up, each distinct word's mask is one bit."""
    index = TopicIndex()
    for i in range(20_000):
        index.add(f"w{i}.v{i}")
    assert index.literal_bits == 40_000 * (1 + WORD_BITS)  # each word: a one-bit mask and its entry
    assert index.match(["w19999", "v19999"]) == ["w19999.v19999"] and index.match(["w1", "v2"]) == []


def test_a_key_of_many_words_keeps_no_list_of_them_in_the_index() -> None:
    """Keys of 85 words drawn from two ("aa.ab.aa...") cost 8.6 KiB a binding in a broker, against the
    documented ~2.5 KiB: the index kept each key's list of word strings (a tester). It keeps the key's
    first state only and splits the key again when it is removed."""
    import random
    import tracemalloc

    rng = random.Random(7)
    keys = [".".join(rng.choice(("aa", "ab")) for _ in range(85)) for _ in range(2_000)]
    index = TopicIndex()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in keys:
            index.add(key)
        per_binding = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    finally:
        tracemalloc.stop()
    assert per_binding < 1_000, per_binding  # (5,300 bytes with the word lists, the keys' own strings aside)
    index.remove_many(keys[:1_000])
    for key in keys[1_000:1_010]:
        index.remove(key)
    live = set(keys[1_010:])
    assert len(index) == len(live) and set(index.match(keys[-1].split("."))) == {keys[-1]}
    assert index.literal_bits == sum(mask.bit_length() + WORD_BITS for _, mask in index._literal.values())


def test_distinct_words_count_against_the_bound_by_their_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Charged one bit each, distinct words were outside the bound: 60,000 bindings of 51 new words each
    took a broker to 707 MiB (a tester). Each word's entry counts WORD_BITS."""
    import flowbroker.broker.topic as topic

    monkeypatch.setattr(topic, "MAX_LITERAL_BITS", 1000 * (WORD_BITS + 1))
    index = TopicIndex()
    added = 0
    with pytest.raises(topic.TopicIndexFull):
        for i in range(100):
            index.add(".".join(f"k{i}w{j}" for j in range(51)))
            added += 1
    assert added == 1000 // 51 and index.budget.used <= 1000 * (WORD_BITS + 1)
    index.remove_many([k for k in list(index._spans)])
    assert index.budget.used == 0


def test_a_key_beyond_the_index_bound_is_refused_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowbroker.broker.topic as topic

    monkeypatch.setattr(topic, "MAX_LITERAL_BITS", 1000)
    monkeypatch.setattr(topic, "WORD_BITS", 0)  # (the masks' own bits here)
    index = TopicIndex()
    index.add("a.b")
    for i in range(200):
        index.add(f"filler{i}.*.*")  # states between: a second "a" far away makes a long mask
    with pytest.raises(topic.TopicIndexFull, match="unbind keys or delete topic exchanges first"):
        index.add("a.x." + ".".join(f"a{j}" for j in range(3)) + ".a")
    assert len(index) == 201 and index.match(["a", "b"]) == ["a.b"]
    h = Harness()
    admin = h.producer("admin")
    admin.declare_exchange("t", "topic")
    admin.declare_queue("q")
    assert isinstance(admin.bind("q", "t", "a.b"), Ok)
    for i in range(200):
        admin.bind("q", "t", f"filler{i}.*.*")
    refused = admin.bind("q", "t", "a.x.a")
    assert isinstance(refused, Error) and refused.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "a.x.a" not in h.core.exchanges["t"].bindings


def test_a_thousand_hash_heavy_bindings_in_one_index_match_what_they_should() -> None:
    """The fuzzer's attack: '#'-heavy binding keys and 128-word routing keys (0.4 s a message with 50-100
    bindings matched one by one; one index reads each word once for all of them: about 1 ms here)."""
    index = TopicIndex()
    for i in range(1_000):
        index.add(".".join(["#", "w", "#", f"x{i}", "#"] * 12))
    assert index.match(["w"] * 128) == []
    assert index.match((["w", "x7"] * 12) + ["w"] * 100) == [".".join(["#", "w", "#", "x7", "#"] * 12)]
    assert len(index) == 1_000


def test_the_index_bound_is_over_every_topic_exchange_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded per exchange, one user's 30 topic exchanges held 1.3 GB of word masks in 7 s (a tester): the
    bound is the broker's, over them all, and a deleted exchange gives its share back."""
    import flowbroker.broker.topic as topic

    monkeypatch.setattr(topic, "MAX_LITERAL_BITS", 1000)
    monkeypatch.setattr(topic, "WORD_BITS", 0)  # (the masks' own bits here)
    h = Harness()
    admin = h.producer("admin")
    admin.declare_queue("q")
    bound: dict[str, int] = {}
    for name in ("t1", "t2", "t3"):
        admin.declare_exchange(name, "topic")
        admin.bind("q", name, "a.b")
        bound[name] = 1
        for i in range(200):
            answer = admin.bind("q", name, f"filler{i}.*.*.a")
            if isinstance(answer, Error):
                assert answer.code is ErrorCode.RESOURCE_EXHAUSTED and "over all topic exchanges" in answer.text
                break
            bound[name] += 1
    assert bound["t3"] < bound["t1"]  # the first exchanges took the broker's bits, not the last's own 1000
    budget = h.core.routes.topic_budget
    assert 0 < budget.used <= 1000
    used = budget.used
    h.core.delete_exchange("t1")
    assert budget.used < used
    admin.declare_exchange("t4", "topic")
    assert isinstance(admin.bind("q", "t4", "filler0.*.*.a"), Ok)
    for name in ("t2", "t3", "t4"):
        h.core.delete_exchange(name)
    assert budget.used == 0


def test_a_message_refused_by_several_queues_gets_one_error_counting_the_others() -> None:
    """One ERROR per refusing queue: a frame of 1,024 messages to a fanout over 200 full queues was 204,800
    ERRORs, and a producer reading them as fast as it could was closed as not reading (a tester)."""
    h = Harness()
    admin = h.producer("admin")
    admin.declare_exchange("fan", "fanout")
    for i in range(5):
        admin.declare_queue(f"full{i}", max_count=1, overflow="reject", flow_stop_count=0, flow_resume_count=0)
        admin.bind(f"full{i}", "fan")
    legacy = h.producer("legacy", flow_control=False)
    legacy.send("fan", "", b"first")
    legacy.send("fan", "", b"second")
    legacy.pump()
    errors = [f for f in legacy.frames if isinstance(f, Error)]
    assert len(errors) == 1 and errors[0].code is ErrorCode.QUEUE_FULL and errors[0].destination == "full0"
    assert errors[0].text.endswith("(and 4 more queue(s) refused it, the next 'full1')")


def test_no_exchange_may_be_declared_under_the_default_exchanges_permission_name() -> None:
    """`amq.default` is how permissions name the default exchange: an exchange declared so could be
    published to, and its refusals told apart from the default's by nothing (a tester)."""
    h, p = setup("q")
    refused = p.declare_exchange("amq.default", "direct")
    assert isinstance(refused, Error) and refused.code is ErrorCode.INVALID_ARGUMENT
    assert "names the default exchange" in refused.text and "amq.default" not in h.core.exchanges
