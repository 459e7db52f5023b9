"""Tool approvals through the Responses door: ``mcp_approval_request`` items, and the responses
that go on after a person's ``mcp_approval_response``.

A turn whose tool call waits for a person (see :mod:`broker.approvals`) is shown as a response
that ends there: its message so far, then one ``mcp_approval_request`` output item per request
(``id`` the approval id, ``server_label`` :data:`SERVER_LABEL`, ``name`` the tool, ``arguments``
its JSON), status ``completed``. The client answers with a new response:
``previous_response_id`` that response, ``input`` its ``mcp_approval_response`` items. Each is
decided through the core (the first decision wins, from any door), and the new response is the
**same turn's continuation**: its stream from right before the decision, the tool's result
folded in, the rest of the answer (or the next approval request).

The responses of one turn are cut from its stream by one rule, which the renderer and
:func:`chain` share: a response ends at the first ``approval_decision`` that follows an
``approval_request`` it showed, and the next one starts right before that decision. Its id is
the turn id, ``:`` and that decision's approval id (``<turn_id>:apr_<24 hex>``), so that it can
be found again without any state of its own: :func:`continuation_of` reads it back. A stop's
decision cuts nothing: the response goes on to the turn's ``end`` (cancelled). A turn id
longer than :data:`MAX_TURN_ID` leaves no room for one (a 400 says so). A client turn id that
happens to have the same shape is found as the turn it names first.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.approval_rules import MAX_REASON_CHARS
from broker.dialects.openai.requests import ParamError, describe
from broker.frames import ORIGIN, Cursor
from broker.vocabulary import ID_PATTERN

if TYPE_CHECKING:
    from broker.approvals import Decided

# The ``server_label`` of the broker's own tools (the Responses API names an MCP server there).
SERVER_LABEL: Final = "broker"
APPROVAL_ID_LENGTH: Final = 28  # apr_ and 24 hex digits (broker.approval_rules)
# The longest turn id whose continuations' ids stay within the id limit (128).
MAX_TURN_ID: Final = 128 - 1 - APPROVAL_ID_LENGTH
_CONTINUATION: Final = re.compile(r"^(.+):(apr_[0-9a-f]{24})$")


def continuation_id(turn_id: str, approval_id: str) -> str:
    """The id of the response of ``turn_id`` that starts at ``approval_id``'s decision."""
    return f"{turn_id}:{approval_id}"


def continuation_of(response_id: str) -> tuple[str, str] | None:
    """``(turn_id, approval_id)`` of a continuation's id; None for any other id."""
    match = _CONTINUATION.fullmatch(response_id)
    if match is None or not ID_PATTERN.fullmatch(match[1]):
        return None
    return match[1], match[2]


def request_item(data: dict[str, Any]) -> dict[str, Any]:
    """A stored ``approval_request`` as an ``mcp_approval_request`` output item."""
    return {
        "id": str(data.get("approval_id")),
        "type": "mcp_approval_request",
        "server_label": SERVER_LABEL,
        "name": str(data.get("name")),
        "arguments": orjson.dumps(data.get("args", {})).decode(),
    }


class ApprovalAnswer(BaseModel):
    """An ``mcp_approval_response`` input item: a person's answer to one approval request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["mcp_approval_response"]
    approval_request_id: str = Field(min_length=1, max_length=128)
    approve: bool
    reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)
    id: str | None = Field(default=None, max_length=256)

    @property
    def decision(self) -> str:
        return "approve" if self.approve else "deny"


ANSWER: Final = "mcp_approval_response"


def approval_answers(items: str | list[dict[str, Any]]) -> list[ApprovalAnswer] | None:
    """The ``mcp_approval_response`` items of ``input`` (None: it has none); 400 naming
    ``input`` when they come with other items (a continuation takes answers only: what else
    could the model be told in the middle of its message?), for a malformed one, or for two
    answers to one request that disagree."""
    if isinstance(items, str) or not any(item.get("type") == ANSWER for item in items):
        return None
    answers: dict[str, ApprovalAnswer] = {}
    for n, raw in enumerate(items):
        if raw.get("type") != ANSWER:
            raise ParamError(
                f"input[{n}]: a response that answers approval requests takes "
                "mcp_approval_response items only (send other input in the next response)",
                "input",
                code="mixed_approval_input",
            )
        try:
            item = ApprovalAnswer.model_validate(raw)
        except ValidationError as exc:
            message, _ = describe(exc)
            raise ParamError(f"input[{n}] ({ANSWER} item) {message}", "input") from None
        same = answers.setdefault(item.approval_request_id, item)
        if same.approve != item.approve:
            raise ParamError(
                f"input[{n}]: approval request {item.approval_request_id[:64]!r} is answered "
                "twice, approved and denied",
                "input",
                code="conflicting_approval_input",
            )
    return list(answers.values())


def stands(decided: Decided) -> str:
    """Why a decision was refused: the one that stands on its approval, in words."""
    why = f"by {decided.by}" + (f", reason {decided.reason!r}" if decided.reason else "")
    return (
        f"approval request {decided.approval_id!r} was already decided: {decided.decision} "
        f"({why}), and that decision stands"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One response of a turn: its id, where its read starts, and the response before it."""

    response_id: str
    after: Cursor
    previous: str | None


def chain(turn_id: str, events: Iterable[dict[str, Any]]) -> list[Span]:
    """The responses of a turn, in order, from its stored events (``id``, ``event``, ``data``
    as a page has them): the turn's own, then one per continuation (see the module)."""
    spans = [Span(turn_id, ORIGIN, None)]
    shown = False
    previous = ORIGIN
    for event in events:
        kind = event["event"]
        if kind == "approval_request":
            shown = True
        elif kind == "approval_decision" and shown and event["data"].get("by") != "stop":
            approval_id = str(event["data"].get("approval_id"))
            spans.append(
                Span(continuation_id(turn_id, approval_id), previous, spans[-1].response_id)
            )
            shown = False
        previous = Cursor.after_offset(event["id"])
    return spans
