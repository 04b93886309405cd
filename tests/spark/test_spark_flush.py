"""The writer's last wait (spark/writer.py `_flush`): docs/spark.md says a task fails only when the broker
has granted nothing for `timeout` seconds. A slow consumer that completes the task's messages a few at a
time keeps it waiting; a broker that completes nothing for `timeout` fails it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flowbroker.client import FlowControlTimeout
from flowbroker.spark.writer import _flush


@dataclass
class _Statistics:
    completed: int


class _SlowlyCompleted:
    """A producer whose flush times out `stalls` times, completing `per_wait` transfers during each wait
    (or none when `per_wait` is 0), then succeeds."""

    def __init__(self, stalls: int, per_wait: int) -> None:
        self.stalls, self.per_wait, self.completed, self.flushes = stalls, per_wait, 0, 0

    def statistics(self) -> _Statistics:
        return _Statistics(self.completed)

    def flush(self, timeout: float | None = None) -> None:
        self.flushes += 1
        if self.flushes <= self.stalls:
            self.completed += self.per_wait
            raise FlowControlTimeout(f"flush timed out after {timeout} s", ("q",), "completions", timeout or 0.0)


def test_a_flush_goes_on_waiting_while_completions_come() -> None:
    producer = _SlowlyCompleted(stalls=5, per_wait=100)
    _flush(producer, 5.0)  # type: ignore[arg-type]
    assert producer.flushes == 6 and producer.completed == 500


def test_a_flush_that_sees_no_completion_for_timeout_fails() -> None:
    producer = _SlowlyCompleted(stalls=5, per_wait=0)
    with pytest.raises(FlowControlTimeout):
        _flush(producer, 5.0)  # type: ignore[arg-type]
    assert producer.flushes == 1
