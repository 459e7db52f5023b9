"""Approval rules and the approval events' shapes, as pure tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.approval_rules import (
    ApprovalRule,
    RuleError,
    decision_event,
    declined_error,
    now_ms,
    request_event,
    set_clock,
)
from broker.tools import ToolConfigError, ToolRegistry

OVER_100 = {"when": {"properties": {"amount": {"exclusiveMinimum": 100}}}}


@pytest.mark.parametrize(
    ("rule", "arguments", "needed"),
    [
        (None, {"amount": 500}, False),
        ("never", {"amount": 500}, False),
        ("always", {}, True),
        ("always", {"amount": 1}, True),
        (OVER_100, {"amount": 500}, True),
        (OVER_100, {"amount": 100}, False),
        (OVER_100, {"amount": 10}, False),
        (OVER_100, {"to": "bob"}, True),  # the schema is JSON Schema: absent is not excluded
        ({"when": {"required": ["amount"], **OVER_100["when"]}}, {"to": "bob"}, False),
        ({"when": {"properties": {"to": {"const": "mallory"}}}}, {"to": "mallory"}, True),
        ({"when": {"properties": {"to": {"const": "mallory"}}}}, {"to": "bob"}, False),
    ],
)
def test_a_rule_says_which_calls_wait_for_a_person(rule: Any, arguments: Any, needed: bool) -> None:
    assert ApprovalRule.parse(rule).needs_approval(arguments) is needed


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("sometimes", 'approval must be "never", "always"'),
        (True, 'approval must be "never", "always"'),
        ({"if": {}}, '{"when": <a JSON Schema object>}'),
        ({"when": {}, "also": 1}, '{"when": <a JSON Schema object>}'),
        ({"when": "amount > 100"}, '{"when": <a JSON Schema object>}'),
        ({"when": {"type": "nonsense"}}, "approval.when is not a valid schema"),
    ],
)
def test_a_malformed_rule_is_refused_clearly(rule: Any, message: str) -> None:
    with pytest.raises(RuleError, match=message.replace("(", r"\(").replace("{", r"\{")):
        ApprovalRule.parse(rule)


@pytest.mark.parametrize(
    ("rule", "described"),
    [
        (None, "never"),
        ("always", "always"),
        (OVER_100, 'when {"properties":{"amount":{"exclusiveMinimum":100}}}'),
    ],
)
def test_the_audit_describes_each_rule(rule: Any, described: str) -> None:
    assert ApprovalRule.parse(rule).describe() == described


def tools(tmp_path: Path, **fields: Any) -> Path:
    path = tmp_path / "tools.json"
    tool = {"name": "send_payment", "class": "unkeyed_write", "endpoint": "http://x/pay"}
    path.write_text(json.dumps({"tools": [{**tool, **fields}]}))
    return path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"approval": "maybe"}, "tool 'send_payment': approval must be"),
        ({"approval": {"when": {"type": 3}}}, "approval.when is not a valid schema"),
        ({"approval": "always", "approval_ttl_s": 0}, "approval_ttl_s must be positive"),
        ({"approval": "always", "approval_ttl_s": "1h"}, "approval_ttl_s must be a number"),
        ({"approval_ttl_s": 60}, 'approval_ttl_s is set but its approval is "never"'),
    ],
)
def test_a_tools_file_with_a_bad_rule_fails_at_load(
    tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ToolConfigError, match=message.replace("(", r"\(")):
        ToolRegistry.from_file(tools(tmp_path, **fields))


def test_the_audit_shows_each_tool_s_rule(tmp_path: Path) -> None:
    registry = ToolRegistry.from_file(tools(tmp_path, approval=OVER_100, approval_ttl_s=600))
    (tool,) = registry
    assert tool.approval_ttl_s == 600
    header, row = registry.audit().splitlines()
    assert header.split()[:5] == ["tool", "class", "can", "double-fire", "approval"]
    assert 'when {"properties":{"amount":{"exclusiveMinimum":100}}}' in row


@pytest.mark.parametrize(
    ("reason", "by", "expected"),
    [
        ("too much", "person", "the user declined this call: too much; it was not run"),
        (None, "person", "the user declined this call; it was not run"),
        ("expired", "expiry", "the call was not approved in time and was not run"),
    ],
)
def test_what_the_model_is_told_of_a_declined_call(
    reason: str | None, by: str, expected: str
) -> None:
    error = declined_error(reason, by)
    assert error == {"code": "approval_denied", "message": expected, "reason": reason}


def test_the_events_shapes() -> None:
    assert request_event(2, "apr_1", "call_a", "send_payment", 0, {"amount": 5}, 1_500) == (
        "approval_request",
        {
            "attempt": 2,
            "approval_id": "apr_1",
            "call_id": "call_a",
            "name": "send_payment",
            "ordinal": 0,
            "args": {"amount": 5},
            "expires_at": 1.5,
        },
    )
    assert decision_event(1, "apr_1", "deny", "expired", "expiry") == {
        "attempt": 1,
        "approval_id": "apr_1",
        "decision": "deny",
        "reason": "expired",
        "by": "expiry",
    }


def test_the_clock_is_a_seam_that_restores_itself() -> None:
    with set_clock(lambda: 12.5):
        assert now_ms() == 12_500
    assert now_ms() > 1_700_000_000_000
