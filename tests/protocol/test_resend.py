"""`ResendLedger` (protocol/resend.py), an idempotent producer's kept messages, against a model.

A hypothesis state machine sends messages on a simulated connection (transfer ids from 1), completes
them as a broker would (a cumulative id, possibly behind held ones), loses the connection (then every
kept message is sent again in order on the next, before anything new) and checks that the ledger keeps
exactly the messages whose completion the producer has not seen through a cumulative id, in sequence
order, so that a resend after a loss covers every unconfirmed message and nothing is lost or reordered.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowbroker.protocol.resend import UNSENT, ResendLedger


class ResendMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger: ResendLedger[str] = ResendLedger("p")
        self.next_id = 1  # the connection's next transfer id
        self.cumulative = 0  # the broker's cumulative id on this connection
        self.on_wire: dict[int, int] = {}  # transfer id -> sequence, this connection
        self.confirmed: set[int] = set()  # sequences whose completion the producer saw
        self.sent = 0

    def _send(self, sequence: int) -> int:
        tid = self.next_id
        self.next_id += 1
        self.on_wire[tid] = sequence
        return tid

    @rule(count=st.integers(1, 4))
    def send_new(self, count: int) -> None:
        for _ in range(count):
            sequence = self.ledger.take_sequence()
            assert sequence == self.sent
            self.sent += 1
            self.ledger.sent(sequence, self._send(sequence), f"m{sequence}", 10)

    @precondition(lambda self: self.next_id - 1 > self.cumulative)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        cumulative = data.draw(st.integers(self.cumulative + 1, self.next_id - 1))
        retired = self.ledger.retire(cumulative)
        newly = {self.on_wire[t] for t in range(self.cumulative + 1, cumulative + 1)} - self.confirmed
        assert retired == len(newly)
        self.confirmed |= newly
        self.cumulative = cumulative

    @rule()
    def lose_connection(self) -> None:
        again = self.ledger.lost()
        assert [s for s, _, _ in again] == sorted(set(range(self.sent)) - self.confirmed)
        assert all(entry == f"m{s}" and size == 10 for s, entry, size in again)
        assert self.ledger.retire(UNSENT - 1) == 0  # nothing unsent is ever retired
        self.next_id, self.cumulative, self.on_wire = 1, 0, {}
        for sequence, _, _ in again:
            self.ledger.resent(sequence, self._send(sequence))

    @invariant()
    def keeps_every_unconfirmed_message_in_order(self) -> None:
        assert self.ledger.sequences() == sorted(set(range(self.sent)) - self.confirmed)
        assert len(self.ledger) == self.sent - len(self.confirmed)


TestResendMachine = ResendMachine.TestCase
TestResendMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_an_empty_producer_id_is_refused() -> None:
    with pytest.raises(ValueError):
        ResendLedger("")


def test_the_resend_ledger_is_sans_io() -> None:
    import flowbroker.protocol.resend as module
    from pathlib import Path

    from tests.transport.test_sans_io import IO_MODULES, imported

    assert imported(Path(module.__file__)) & IO_MODULES == set()
