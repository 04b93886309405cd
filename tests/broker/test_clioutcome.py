"""`flowbroker publish`'s outcome and exit code from its counts (issue 10.3), without a broker."""

from __future__ import annotations

import json

from flowbroker.broker.clioutcome import BROKER_WIDE, PublishOutcome, explain_destinations, message_json


def test_every_message_completed_is_exit_0() -> None:
    outcome = PublishOutcome(requested=2, sent=2, completed=2)
    assert (outcome.outcome, outcome.exit_code, outcome.text()) == ("completed", 0, "published 2 message(s)")


def test_all_sent_some_held_by_a_flow_stop_is_exit_3_and_names_the_stop() -> None:
    outcome = PublishOutcome(requested=3, sent=3, completed=1, timeout=2.0, flow_stopped=["*", "orders"])
    assert (outcome.outcome, outcome.exit_code, outcome.outstanding) == ("not_completed", 3, 2)
    text = outcome.text()
    assert text.startswith("1 of 3 message(s) completed; 2 message(s) sent and enqueued, not yet completed after 2 s")
    assert f"flow-stopped on {BROKER_WIDE}, 'orders'" in text and "would duplicate them" in text
    assert json.loads(outcome.as_json())["not_completed"] == 2


def test_messages_never_sent_refused_or_an_error_are_exit_1() -> None:
    unsent = PublishOutcome(requested=5, sent=3, completed=0, timeout=1.0, flow_stopped=["*"])
    assert (unsent.outcome, unsent.exit_code) == ("error", 1)
    assert unsent.text().startswith(f"no credit to send after 1 s; flow-stopped on {BROKER_WIDE}; 3 of 5 message(s) sent")
    assert unsent.text().endswith("3 not yet completed), 2 not sent; the 3 not yet completed may be enqueued: "
                                  "publishing them again may duplicate them")
    # --json gives the same reason ("error": null for it before, a tester)
    assert json.loads(unsent.as_json())["error"] == f"no credit to send after 1 s; flow-stopped on {BROKER_WIDE}"
    refused = PublishOutcome(requested=2, sent=2, completed=1, failed=1)
    assert (refused.outcome, refused.exit_code) == ("error", 1)
    assert json.loads(refused.as_json())["error"] == "the broker refused some"
    assert json.loads(PublishOutcome(requested=1, sent=1, completed=1).as_json())["error"] is None
    failed = PublishOutcome(requested=1, error="HandshakeError: cannot connect")
    assert failed.exit_code == 1 and failed.text().startswith("HandshakeError: cannot connect; 0 of 1 message(s) sent")


def test_explained_destinations_and_consumed_messages_as_json() -> None:
    assert explain_destinations(["*"]) == BROKER_WIDE and explain_destinations([]) == "none"
    assert "stop-all" in BROKER_WIDE and "memory alarm" in BROKER_WIDE
    line = json.loads(message_json(b"\xff\x00", {"k": b"v\xff", "n": 1, "l": [b"1", "1"]}, "ex", "key", True))
    assert line == {"exchange": "ex", "routing_key": "key", "redelivered": True, "body_base64": "/wA=",
                    "headers": {"k": {"base64": "dv8="}, "n": 1, "l": [{"base64": "MQ=="}, "1"]}}
    assert json.loads(message_json(b"text", None, "", "q", False))["body"] == "text"


def test_a_deadline_passed_without_a_stop_does_not_claim_one() -> None:
    """`publish --timeout 0` said "the broker holds their completion" with no stop in force (a tester)."""
    text = PublishOutcome(requested=1, sent=1, completed=0, timeout=0.0, flow_stopped=[]).text()
    assert "holds their completion" not in text and "no flow stop was reported" in text
    assert text.startswith("0 of 1 message(s) completed; 1 message(s) sent, not yet completed after 0 s")
