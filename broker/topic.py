"""Topic matching for a whole exchange at once: every binding key compiled into one bit-parallel NFA.

AMQP topic keys are dot-separated words; in a binding key `*` matches exactly one word and `#` zero or
more. Matching each binding in turn costs bindings x words x pattern steps in Python: the fuzzer found
that 50-100 '#'-heavy bindings made one 128-word routing key cost 0.4 s. Here every binding key is a run
of states in one integer bit vector (state i of a key: its first i words matched), and a routing key is
read one word at a time with a handful of integer operations over the whole vector, whatever the number
of bindings (Python's big-integer operations are C loops over 64-bit words: ~1 us for 1,000 bindings).
A match costs O(words x total pattern words / 64) machine steps; keys are at most 129 words
(MAX_KEY_BYTES), bindings at most `max_bindings`.

Per word w, with `cur` the states reached so far:
    next = ((cur & (star | literal[w])) << 1) | (cur & hash)   # consume w: advance, or stay on a '#'
    next |= (next & hash) << 1                                 # a '#' may also match no word
Consecutive '#'s are one '#' (the same language), so one closure step suffices. A key's last state has
no word after it, so it is in none of the masks and never shifts into the next key's first state.
Removed keys leave their bits cleared until the dead bits outnumber the live ones; then the vector is
rebuilt, so adding and removing bindings costs amortized O(key) each.

A literal word's mask is kept from its lowest bit up (offset, mask): a dense integer per word costs
bits up to the word's highest state, so N keys of distinct words cost O(N x states) memory (100,000
two-word keys held 2 GB, a tester). Shifted into place as the match reads the word, it costs the same
order as the match's own operations. Words spread far apart still make long masks: their bits together
are bounded (MAX_LITERAL_BITS, over every topic exchange of the broker together: a `TopicBudget` they
share), each word's own entry counted as WORD_BITS more, and a key beyond is refused (TopicIndexFull),
not a broker out of memory.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_LITERAL_BITS", "TopicBudget", "TopicIndex", "TopicIndexFull", "compile_words"]

MAX_LITERAL_BITS: Final = 1 << 29

WORD_BITS: Final = 2048
"""What a literal word's own entry costs the budget beside its mask's bits: its dict slot, string, tuple and
integers, about 250 bytes. Charged one bit, distinct words were outside the bound: 60,000 bindings of 51 new
words each took a broker to 707 MiB (~11 KiB a binding, a tester); so MAX_LITERAL_BITS holds about 260,000
distinct words in all."""
"""Bits of literal-word masks of all a broker's topic exchanges together (64 MiB): what a BIND may not
take them past. Bounded per exchange, 30 exchanges of one user held 1.3 GB in 7 s (a tester)."""


class TopicBudget:
    """The literal-mask bits every topic exchange of one broker holds together (`TopicIndex.literal_bits`
    summed), against MAX_LITERAL_BITS."""

    __slots__ = ("used", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.used = 0
        self.limit = limit if limit is not None else MAX_LITERAL_BITS


class TopicIndexFull(Exception):
    """A binding key would take the topic exchanges' word masks together past their budget (MAX_LITERAL_BITS)."""


def compile_words(binding_key: str) -> list[str]:
    """The words of a binding key with runs of '#' collapsed to one (they match the same keys)."""
    words: list[str] = []
    for word in binding_key.split("."):
        if word == "#" and words and words[-1] == "#":
            continue
        words.append(word)
    return words


class TopicIndex:
    """The binding keys of one topic exchange; `match(words)` returns those a routing key matches."""

    __slots__ = ("_spans", "_accepting", "_start", "_hash", "_star", "_literal", "_accept", "_bits", "_dead",
                 "literal_bits", "budget")

    def __init__(self, budget: TopicBudget | None = None) -> None:
        self.budget = budget if budget is not None else TopicBudget()
        # binding key -> its first state. Its words are split again when needed (remove, rebuild): kept,
        # a list of 85 two-character words cost 5 KiB a binding, 8.6 KiB in all with the masks (a tester).
        self._spans: dict[str, int] = {}
        self._accepting: dict[int, str] = {}  # last state -> binding key
        self._start = self._hash = self._star = self._accept = 0
        self._literal: dict[str, tuple[int, int]] = {}  # word -> (its lowest state, its states from there)
        self._bits = 0  # states allocated
        self._dead = 0  # states of removed keys, not reused until a rebuild
        self.literal_bits = 0  # the literal masks' bits together (bounded by MAX_LITERAL_BITS)

    def __len__(self) -> int:
        return len(self._spans)

    def states(self) -> int:
        """States allocated (a match's operations are over this many bits, per word)."""
        return self._bits

    def __contains__(self, binding_key: object) -> bool:
        return binding_key in self._spans

    def add(self, binding_key: str) -> None:
        """O(states / 64) machine steps per distinct word of the key, not per word: a word's mask spans
        every state it is used at, so or-ing each occurrence in (a new integer each time) made a key of
        85 words drawn from two cost 7-10 ms at 30,000 such keys, every connection waiting (a tester)."""
        if binding_key in self._spans:
            return
        words = compile_words(binding_key)
        first = self._bits
        literal = self._literal
        local: dict[str, int] = {}  # word -> its states in this key, from `first` up
        hash_ = star = 0
        for i, word in enumerate(words):
            if word == "#":
                hash_ |= 1 << i
            elif word == "*":
                star |= 1 << i
            else:
                local[word] = local.get(word, 0) | 1 << i
        grown: dict[str, tuple[int, int]] = {}  # checked against the bound before anything changes
        added = 0
        for word, bits in local.items():
            known = literal.get(word)
            if known is None:
                low = (bits & -bits).bit_length() - 1
                new = (first + low, bits >> low)
                added += new[1].bit_length() + WORD_BITS
            else:
                offset, mask = known  # states only grow while adding: offset stays lowest
                new = (offset, mask | bits << (first - offset))
                added += new[1].bit_length() - mask.bit_length()
            grown[word] = new
        budget = self.budget
        if budget.used + added > budget.limit:
            raise TopicIndexFull(
                f"binding key {binding_key[:100]!r} would take the topic exchanges' indexes past "
                f"{budget.limit} bits of word masks (MAX_LITERAL_BITS, over all topic exchanges): unbind keys "
                "or delete topic exchanges first")
        self.literal_bits += added
        budget.used += added
        literal.update(grown)
        self._bits += len(words) + 1
        self._spans[binding_key] = first
        self._start |= 1 << first
        if hash_:
            self._hash |= hash_ << first
        if star:
            self._star |= star << first
        last = first + len(words)
        self._accept |= 1 << last
        self._accepting[last] = binding_key

    def remove(self, binding_key: str) -> None:
        first = self._spans.pop(binding_key, None)
        if first is None:
            return
        words = compile_words(binding_key)
        keep = ~(((1 << (len(words) + 1)) - 1) << first)
        self._start &= keep
        self._hash &= keep
        self._star &= keep
        self._accept &= keep
        literal = self._literal
        before = self.literal_bits
        for word in set(words) - {"#", "*"}:
            offset, mask = literal[word]
            self.literal_bits -= mask.bit_length() + WORD_BITS
            bits = (mask << offset) & keep
            if bits:
                low = (bits & -bits).bit_length() - 1
                mask = bits >> low
                literal[word] = (low, mask)
                self.literal_bits += mask.bit_length() + WORD_BITS
            else:
                del literal[word]
        self.budget.used += self.literal_bits - before
        del self._accepting[first + len(words)]
        self._dead += len(words) + 1
        if self._dead > self._bits - self._dead + 1024:
            self._rebuild()

    def remove_many(self, binding_keys: list[str]) -> None:
        """`remove` each of `binding_keys`; many at once (a deleted queue's bindings) in one rebuild: each
        `remove` is O(states), so 99,000 of them one by one were O(keys x states), 1.26 s of a queue's
        delete during which every connection waited (a tester)."""
        if len(binding_keys) <= 64:
            for key in binding_keys:
                self.remove(key)
            return
        for key in binding_keys:
            self._spans.pop(key, None)
        self._rebuild()

    def _rebuild(self) -> None:
        """States renumbered from 0 for the keys left, every vector and mask made once from the list of its
        bits: O(states). (Adding the keys one by one again shifted a bit into place per state, O(states^2):
        200 ms for 50,000 keys, a tester.) Never more mask bits than before: within what it held."""
        spans = list(self._spans.items())
        budget = self.budget
        self.release()
        self.__init__(budget)  # type: ignore[misc]
        starts: list[int] = []
        hashes: list[int] = []
        stars: list[int] = []
        accepts: list[int] = []
        literals: dict[str, list[int]] = {}
        first = 0
        new_spans = self._spans
        accepting = self._accepting
        for key, _ in spans:
            words = compile_words(key)
            new_spans[key] = first
            starts.append(first)
            for i, word in enumerate(words):
                if word == "#":
                    hashes.append(first + i)
                elif word == "*":
                    stars.append(first + i)
                else:
                    literals.setdefault(word, []).append(first + i)
            last = first + len(words)
            accepts.append(last)
            accepting[last] = key
            first = last + 1
        self._bits = first
        self._start, self._hash = _bit_vector(starts), _bit_vector(hashes)
        self._star, self._accept = _bit_vector(stars), _bit_vector(accepts)
        literal = self._literal
        for word, states in literals.items():
            low = states[0]  # (ascending: states are numbered in order)
            mask = 1 if len(states) == 1 else _bit_vector([state - low for state in states])
            literal[word] = (low, mask)
            self.literal_bits += mask.bit_length() + WORD_BITS
        budget.used += self.literal_bits

    def release(self) -> None:
        """Give the budget back what this index holds (its exchange is deleted, or it is rebuilt)."""
        self.budget.used -= self.literal_bits
        self.literal_bits = 0

    def match(self, words: list[str]) -> list[str]:
        """The binding keys that match a routing key already split into words, in no special order."""
        hash_, star, literal = self._hash, self._star, self._literal
        cur = self._start
        cur |= (cur & hash_) << 1
        for word in words:
            lit = literal.get(word)
            cur = ((cur & (star | (lit[1] << lit[0] if lit is not None else 0))) << 1) | (cur & hash_)
            if not cur:
                return []
            cur |= (cur & hash_) << 1
        matched = cur & self._accept
        keys = []
        accepting = self._accepting
        while matched:
            low = matched & -matched
            keys.append(accepting[low.bit_length() - 1])
            matched ^= low
        return keys


def _bit_vector(bits: list[int]) -> int:
    """The integer with exactly `bits` set, made in one pass (not one shift and or per bit)."""
    if not bits:
        return 0
    vector = bytearray(max(bits) // 8 + 1)
    for bit in bits:
        vector[bit >> 3] |= 1 << (bit & 7)
    return int.from_bytes(vector, "little")
