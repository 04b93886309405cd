"""What `flowbroker publish` reports, and how `consume --json` writes a message.

A publish has three outcomes, each with its exit code, because a caller that retries must know which
one it got: every message completed by the broker (0); an error, such as a refusal, a lost connection,
or messages never sent because no credit came (1); and every message sent but not all completed when
the deadline passed (3). The last is what a flow stop looks like: the broker holds the completion of
a transfer it took (a saturated queue, `producers stop-all`, the memory alarm), and completes it when
the stop ends; the message is in the queue or will be, so sending it again would duplicate it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from flowbroker.protocol.names import ALL_DESTINATIONS

__all__ = ["EXIT_COMPLETED", "EXIT_ERROR", "EXIT_NOT_COMPLETED", "BROKER_WIDE", "PublishOutcome",
           "explain_destinations", "message_json"]

EXIT_COMPLETED = 0
EXIT_ERROR = 1
EXIT_NOT_COMPLETED = 3

BROKER_WIDE = "* (a broker-wide stop: `flowbroker producers stop-all`, or the broker's memory alarm)"
"""What destination `*` of a flow stop means, wherever the CLI shows one."""


def explain_destinations(destinations: tuple[str, ...] | list[str]) -> str:
    """The flow-stopped destinations as a person reads them: queue names, and `*` explained."""
    return ", ".join(BROKER_WIDE if d == ALL_DESTINATIONS else repr(d) for d in destinations) or "none"


@dataclass
class PublishOutcome:
    """The counts of one `flowbroker publish` and what went wrong, if anything."""

    requested: int
    sent: int = 0
    completed: int = 0
    failed: int = 0
    timeout: float | None = None  # the deadline that passed, if one did
    flow_stopped: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def outcome(self) -> str:
        if self.error is not None or self.sent < self.requested or self.failed:
            return "error"
        if self.completed + self.failed < self.sent:
            return "not_completed"
        return "completed"

    @property
    def exit_code(self) -> int:
        return {"completed": EXIT_COMPLETED, "not_completed": EXIT_NOT_COMPLETED}.get(self.outcome, EXIT_ERROR)

    @property
    def outstanding(self) -> int:
        return self.sent - self.completed - self.failed

    def as_json(self) -> str:
        return json.dumps({
            "outcome": self.outcome, "exit_code": self.exit_code, "requested": self.requested, "sent": self.sent,
            "completed": self.completed, "failed": self.failed, "not_completed": self.outstanding,
            "not_sent": self.requested - self.sent, "flow_stopped": self.flow_stopped,
            "error": self.error if self.error is not None or self.outcome != "error" else self._reason(),
        })

    def _waited_and_stopped(self) -> tuple[str, str]:
        """" after N s" when a deadline passed, "; flow-stopped on ..." when a stop was in force."""
        waited = f" after {self.timeout:g} s" if self.timeout is not None else ""
        stopped = f"; flow-stopped on {explain_destinations(self.flow_stopped)}" if self.flow_stopped else ""
        return waited, stopped

    def _reason(self) -> str:
        """What went wrong when no error was raised: credit that did not come, or refusals (the text's
        first part; `--json` had "error": null for them, a tester)."""
        waited, stopped = self._waited_and_stopped()
        return f"no credit to send{waited}{stopped}" if self.sent < self.requested else "the broker refused some"

    def text(self) -> str:
        """One line for stderr."""
        if self.outcome == "completed":
            return f"published {self.completed} message(s)"
        waited, stopped = self._waited_and_stopped()
        held = (f"{self.outstanding} message(s) sent and enqueued, not yet completed{waited}{stopped}: the broker "
                f"holds their completion and will deliver them; publishing them again would duplicate them"
                if self.flow_stopped else
                # (no stop: "the broker holds their completion" claimed one that was not there, for a
                # --timeout 0 whose completions had no time to come back, a tester)
                f"{self.outstanding} message(s) sent, not yet completed{waited} (no flow stop was reported: their "
                f"completion had not come back yet; they are most likely enqueued); publishing them again may "
                f"duplicate them")
        if self.outcome == "not_completed":
            return f"{self.completed} of {self.requested} message(s) completed; {held}"
        parts = [f"{self.error}" if self.error else self._reason(),
                 f"{self.sent} of {self.requested} message(s) sent ({self.completed} completed, {self.failed} "
                 f"refused, {self.outstanding} not yet completed), {self.requested - self.sent} not sent"]
        if self.outstanding:  # a retry of everything would duplicate these (said for exit 3 only, a tester)
            parts.append(f"the {self.outstanding} not yet completed may be enqueued: publishing them again may "
                         "duplicate them")
        return "; ".join(parts)


def message_json(body: bytes, headers: Any, exchange: str, routing_key: str, redelivered: bool) -> str:
    """One consumed message as one JSON line: the body as text when it is UTF-8, else `body_base64`."""
    doc: dict[str, Any] = {"exchange": exchange, "routing_key": routing_key, "redelivered": redelivered}
    try:
        doc["body"] = body.decode()
    except UnicodeDecodeError:
        doc["body_base64"] = base64.b64encode(body).decode()
    doc["headers"] = headers or {}
    return json.dumps(doc, default=_json_value)


def _json_value(value: object) -> object:
    """A header value JSON has no type for: bytes as `{"base64": ...}` (decoding them as text replaced
    what was not UTF-8 and made b"1" and "1" alike), anything else as its text."""
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    return str(value)
