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
"""

from __future__ import annotations

__all__ = ["TopicIndex", "compile_words"]


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

    __slots__ = ("_spans", "_accepting", "_start", "_hash", "_star", "_literal", "_accept", "_bits", "_dead")

    def __init__(self) -> None:
        self._spans: dict[str, tuple[int, list[str]]] = {}  # binding key -> (first state, its words)
        self._accepting: dict[int, str] = {}  # last state -> binding key
        self._start = self._hash = self._star = self._accept = 0
        self._literal: dict[str, int] = {}
        self._bits = 0  # states allocated
        self._dead = 0  # states of removed keys, not reused until a rebuild

    def __len__(self) -> int:
        return len(self._spans)

    def __contains__(self, binding_key: object) -> bool:
        return binding_key in self._spans

    def add(self, binding_key: str) -> None:
        if binding_key in self._spans:
            return
        words = compile_words(binding_key)
        first = self._bits
        self._bits += len(words) + 1
        self._spans[binding_key] = (first, words)
        self._start |= 1 << first
        literal = self._literal
        for i, word in enumerate(words):
            bit = 1 << (first + i)
            if word == "#":
                self._hash |= bit
            elif word == "*":
                self._star |= bit
            else:
                literal[word] = literal.get(word, 0) | bit
        last = first + len(words)
        self._accept |= 1 << last
        self._accepting[last] = binding_key

    def remove(self, binding_key: str) -> None:
        span = self._spans.pop(binding_key, None)
        if span is None:
            return
        first, words = span
        keep = ~(((1 << (len(words) + 1)) - 1) << first)
        self._start &= keep
        self._hash &= keep
        self._star &= keep
        self._accept &= keep
        literal = self._literal
        for word in set(words) - {"#", "*"}:
            bits = literal[word] & keep
            if bits:
                literal[word] = bits
            else:
                del literal[word]
        del self._accepting[first + len(words)]
        self._dead += len(words) + 1
        if self._dead > self._bits - self._dead + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        keys = list(self._spans)
        self.__init__()  # type: ignore[misc]
        for key in keys:
            self.add(key)

    def match(self, words: list[str]) -> list[str]:
        """The binding keys that match a routing key already split into words, in no special order."""
        hash_, star, literal = self._hash, self._star, self._literal
        cur = self._start
        cur |= (cur & hash_) << 1
        for word in words:
            cur = ((cur & (star | literal.get(word, 0))) << 1) | (cur & hash_)
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
