"""Responses events and objects, rendered from a turn's stored events and state.

Sequence numbers follow from the stored events alone. A read opens with ``response.created``
(0) and ``response.in_progress`` (1); then each stored event, in stream order, expands to a fixed
number of Responses events decided by its type (the table :data:`EXPANSION`, the one
definition: ``seek_sequence.lua``, which finds a resume point inside Redis, receives it with
every call):

==========  ===  ==============================================================================
stored      n    Responses events
==========  ===  ==============================================================================
attempt 1   2    ``response.output_item.added``, ``response.content_part.added``
attempt k   3    ``response.in_progress``, then the two above (a continue or regenerate)
delta       1    ``response.output_text.delta``
end         4    ``output_text.done``, ``content_part.done``, ``output_item.done``, terminal
others      0    ``usage``, ``error``, ``tool_call``, ``tool_result``: folded into the terminal
                 response (usage, error); tool calls run by the broker's ledger are not shown
==========  ===  ==============================================================================

Each attempt of the turn is its own output message, at ``output_index`` = attempt - 1, so a
regenerate is a second message, never text appended to the first. A continue's message streams
the continuation only; the terminal response (like ``GET``) holds the whole answer, the partial
plus the continuation. The terminal event is
``response.completed`` (complete), ``response.incomplete`` (interrupted, or cancelled with status
``cancelled``) or ``response.failed``.

A turn that may wait for a person is read by the ``ApprovalsRenderer`` of
:mod:`broker.dialects.openai.render` instead, numbered by what is read (see
:mod:`broker.dialects.openai.approvals`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import orjson

from broker.vocabulary import TurnStatus

OPENING: Final = 2  # response.created, response.in_progress

TERMINAL: Final = {
    "complete": ("response.completed", "completed"),
    "interrupted": ("response.incomplete", "incomplete"),
    "cancelled": ("response.incomplete", "cancelled"),
    "failed": ("response.failed", "failed"),
    # the model called client tools: the response is complete, its calls are output items
    "requires_action": ("response.completed", "completed"),
}

# The statuses of an attempt whose message is whole (with client tool calls or without).
WHOLE: Final = frozenset({"complete", "requires_action"})

# The broker's turn status as a Responses status.
STATUS: Final = {
    TurnStatus.QUEUED: "queued",
    TurnStatus.STREAMING: "in_progress",
    # A person decides; the answer goes on after (a response with function tools: the others
    # end at their approval requests, see broker/dialects/openai/approvals.py).
    TurnStatus.AWAITING_APPROVAL: "in_progress",
    TurnStatus.COMPLETE: "completed",
    TurnStatus.INTERRUPTED: "incomplete",
    TurnStatus.CANCELLED: "cancelled",
    TurnStatus.FAILED: "failed",
    TurnStatus.REQUIRES_ACTION: "completed",
}


# How many Responses events a stored event becomes, by its type, or by its type and attempt
# (``attempt:1`` wins over ``attempt`` for attempt 1); a type not named becomes none. The seek
# script receives this table as it is (see broker/sequence_index.py).
EXPANSION: Final = {"attempt:1": 2, "attempt": 3, "delta": 1, "end": 4}
# The types whose count depends on the attempt.
_BY_ATTEMPT: Final = frozenset(name.partition(":")[0] for name in EXPANSION if ":" in name)


def expansion(kind: str, data: dict[str, Any]) -> int:
    """How many Responses events one stored event becomes (:data:`EXPANSION`)."""
    count = EXPANSION.get(kind, 0)
    if kind in _BY_ATTEMPT:
        count = EXPANSION.get(f"{kind}:{data.get('attempt')}", count)
    return count


def item_id(response_id: str, attempt: int) -> str:
    return f"msg_{attempt}_{response_id}"


def usage_object(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The broker's usage record as Responses usage (None while unknown)."""
    if not usage:
        return None
    inp = int(usage.get("input_tokens") or 0)
    out = int(usage.get("output_tokens") or 0)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def message_item(response_id: str, attempt: int, text: str, status: str) -> dict[str, Any]:
    """One attempt as an output message (``status``: in_progress, completed or incomplete)."""
    return {
        "id": item_id(response_id, attempt),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if text
        else [],
    }


def incomplete_details(reason: str | None) -> dict[str, str]:
    """Why a response is incomplete, in OpenAI's two words: ``content_filter`` when the upstream
    filtered the answer, else ``max_output_tokens`` (the answer ended before the model finished
    it: cut by the upstream, a lost worker, a timeout, a stop, or the token limit)."""
    if reason and "content_filter" in reason:
        return {"reason": "content_filter"}
    return {"reason": "max_output_tokens"}


# The response object's ``text`` when the request sent no format.
TEXT_FORMAT: Final[dict[str, Any]] = {"format": {"type": "text"}}


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """What every rendering of one response repeats: from the turn's stored request (the
    fields the request echoes, as the client sent them)."""

    response_id: str
    model: str
    created_at: int
    instructions: str | None
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    background: bool
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    text: dict[str, Any] = dataclasses.field(default_factory=lambda: TEXT_FORMAT)
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # function tools
    tool_choice: str | dict[str, Any] = "auto"  # as sent
    parallel_tool_calls: bool = True

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """The response object in ``status`` with ``output`` (``reason``: why it ended, for
        an incomplete or cancelled one; ``usage`` absent until known)."""
        incomplete = status in ("incomplete", "cancelled")
        body = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": self.background,
            "model": self.model,
            "instructions": self.instructions,
            "output": output,
            "parallel_tool_calls": bool(self.tools) and self.parallel_tool_calls,
            "tool_choice": self.tool_choice,
            "tools": list(self.tools),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_output_tokens": self.max_output_tokens,
            "previous_response_id": self.previous_response_id,
            "metadata": dict(self.metadata),
            "text": orjson.loads(orjson.dumps(self.text)),  # a copy: the format as sent
            "truncation": "disabled",
            "error": error,
            "incomplete_details": incomplete_details(reason) if incomplete else None,
        }
        counted = usage_object(usage)
        if counted is not None:  # the spec's usage is an object or absent, never null
            body["usage"] = counted
        return body


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptEnd:
    """What the terminal events of an attempt need beyond its ``end`` event (its stored state)."""

    text: str  # the attempt's own text: for a continue, the continuation only
    answer: str  # the whole answer: for a continue, the partial plus the continuation
    usage: dict[str, Any] | None
    reason: str | None
    error: str | None = None  # a failed attempt's message


def failure_message(reason: str | None, error: str | None) -> str:
    """Why an attempt failed, in words: its reason code, then its message when it has one."""
    if error:
        return f"{reason}: {error}" if reason else error
    return reason or "the generation failed"


def frame(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


# The last frame of a one-viewer read whose token a newer connection took over: an ``error``
# event without a sequence number (it is no event of the response, and no resume point).
REPLACED: Final = frame(
    {
        "type": "error",
        "code": "viewer_replaced",
        "message": "a newer connection of this one-viewer token took over; do not reconnect",
        "param": None,
    }
)


def opening(head: Head) -> list[dict[str, Any]]:
    """Events 0 and 1."""
    return [
        {"type": "response.created", "sequence_number": 0, "response": head.response("queued", [])},
        {
            "type": "response.in_progress",
            "sequence_number": 1,
            "response": head.response("in_progress", []),
        },
    ]


def expand(
    head: Head,
    kind: str,
    data: dict[str, Any],
    base: int,
    end: AttemptEnd | None = None,
    *,
    index: int | None = None,
    calls: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The Responses events of one stored event, numbered from ``base``.

    An ``end`` needs ``end``: the attempt's stored text and usage (its deltas may precede the
    point this read started from). A response with function calls gives the message's
    ``index`` among the output items, and the attempt's completed ``calls``, which follow its
    message in the terminal response (see :mod:`broker.dialects.openai.calls`).
    """
    attempt = int(data.get("attempt") or 0)
    common = {
        "item_id": item_id(head.response_id, attempt),
        "output_index": max(attempt - 1, 0) if index is None else index,
        "content_index": 0,
    }
    events: list[dict[str, Any]] = []
    if kind == "attempt":
        if attempt != 1:
            events.append(
                {"type": "response.in_progress", "response": head.response("in_progress", [])}
            )
        item = message_item(head.response_id, attempt, "", "in_progress")
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": common["output_index"],
                "item": item,
            }
        )
        events.append(
            {
                "type": "response.content_part.added",
                **common,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            }
        )
    elif kind == "delta":
        events.append(
            {
                "type": "response.output_text.delta",
                **common,
                "delta": str(data.get("text", "")),
                "logprobs": [],
            }
        )
    elif kind == "end":
        assert end is not None
        status = str(data.get("status") or "failed")
        terminal, response_status = TERMINAL.get(status, TERMINAL["failed"])
        item_status = "completed" if status in WHOLE else "incomplete"
        item = message_item(head.response_id, attempt, end.text, item_status)
        # The response holds the whole answer; a continue's item streamed the rest of it only.
        answer = message_item(head.response_id, attempt, end.answer, item_status)
        error = None
        if terminal == "response.failed":
            error = {"code": "server_error", "message": failure_message(end.reason, end.error)}
        events += [
            {"type": "response.output_text.done", **common, "text": end.text, "logprobs": []},
            {
                "type": "response.content_part.done",
                **common,
                "part": {
                    "type": "output_text",
                    "text": end.text,
                    "annotations": [],
                    "logprobs": [],
                },
            },
            {
                "type": "response.output_item.done",
                "output_index": common["output_index"],
                "item": item,
            },
            {
                "type": terminal,
                "response": head.response(
                    response_status,
                    [answer, *(calls or ())],
                    usage=end.usage,
                    error=error,
                    reason=end.reason,
                ),
            },
        ]
    for n, event in enumerate(events):
        event["sequence_number"] = base + n
    return events
