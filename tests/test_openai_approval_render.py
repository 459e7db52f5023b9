"""The Responses door's approvals as tables: where a turn's responses are cut (``chain``), and
the events the renderer makes of the core's events, each checked against OpenAI's published
document and the official SDK's types. No socket, no Redis."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from broker.dialects.openai.approvals import (
    Span,
    chain,
    continuation_id,
    continuation_of,
    request_item,
)
from broker.dialects.openai.events import AttemptEnd, Head
from broker.dialects.openai.render import ApprovalsRenderer
from broker.frames import ORIGIN, Cursor, Entry
from tests.openai_spec import event_errors, sdk_extras, spec_errors

EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
A = "apr_" + "a" * 24
B = "apr_" + "b" * 24
HEAD = Head("t1", "simulated", 7, None, None, None, None, None, False)


def stored(n: int, kind: str, **data: Any) -> dict[str, Any]:
    return {"id": f"{n:016d}-0000000000", "event": kind, "data": {"attempt": 1, **data}}


def before(n: int) -> Cursor:
    return ORIGIN if n == 0 else Cursor.after_offset(f"{n - 1:016d}-0000000000")


REQUEST_A = {"approval_id": A, "name": "pay", "args": {"amount": 5}}
REQUEST_B = {"approval_id": B, "name": "pay", "args": {"amount": 7}}


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([stored(0, "attempt"), stored(1, "delta", text="a")], []),
        (
            [
                stored(0, "approval_request", **REQUEST_A),
                stored(1, "approval_decision", approval_id=A),
            ],
            [Span(f"t1:{A}", before(1), "t1")],
        ),
        (  # two requests of one message: the first decision cuts, the second is in the next
            [
                stored(0, "approval_request", **REQUEST_A),
                stored(1, "approval_request", **REQUEST_B),
                stored(2, "approval_decision", approval_id=B),
                stored(3, "approval_decision", approval_id=A),
            ],
            [Span(f"t1:{B}", before(2), "t1")],
        ),
        (  # a continuation that asks again
            [
                stored(0, "approval_request", **REQUEST_A),
                stored(1, "approval_decision", approval_id=A),
                stored(2, "delta", text="x"),
                stored(3, "approval_request", **REQUEST_B),
                stored(4, "approval_decision", approval_id=B),
            ],
            [Span(f"t1:{A}", before(1), "t1"), Span(f"t1:{B}", before(4), f"t1:{A}")],
        ),
        (  # a stop's decision cuts nothing; nor does a decision nothing asked for here
            [
                stored(0, "approval_decision", approval_id=B),
                stored(1, "approval_request", **REQUEST_A),
                stored(2, "approval_decision", approval_id=A, by="stop"),
            ],
            [],
        ),
    ],
)
def test_chain_cuts_a_turn_at_the_first_decision_after_a_request(
    events: list[dict[str, Any]], expected: list[Span]
) -> None:
    assert chain("t1", events) == [Span("t1", ORIGIN, None), *expected]


def test_a_continuation_s_id_reads_back_and_stays_an_id() -> None:
    assert continuation_of(continuation_id("resp_1", A)) == ("resp_1", A)
    assert continuation_of("resp_1") is None
    assert continuation_of(f":{A}") is None
    assert continuation_of("t:apr_short") is None
    assert len(continuation_id("x" * 99, A)) == 128


def entry(n: int, kind: str, **data: Any) -> Entry:
    fields = ["e", kind, "d", orjson.dumps({"attempt": 1, **data}).decode()]
    return Entry.from_redis(f"{n}-0", fields)


ATTEMPT = entry(1, "attempt", strategy="initial")
HELLO = entry(2, "delta", text="Hello")
CALL = entry(3, "tool_call", name="pay", args={"amount": 5}, ordinal=0, status="dispatched")
ASKED = entry(4, "approval_request", **REQUEST_A)
USAGE = entry(5, "usage", input_tokens=3, output_tokens=1)
DECIDED = entry(6, "approval_decision", approval_id=A, decision="approve", by="person")
RESULT = entry(7, "tool_result", name="pay", ordinal=0, source="ran", status="ok", result={})
MORE = entry(8, "delta", text=" paid")
DONE = entry(9, "end", status="complete", reason=None)
STOPPED = entry(6, "approval_decision", approval_id=A, decision="deny", by="stop")
CANCELLED = entry(7, "end", status="cancelled", reason="cancelled")
WHOLE = AttemptEnd("Hello paid", "Hello paid", {"input_tokens": 3, "output_tokens": 2}, None)
AT_PARK = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
OPENED = ["response.output_item.added", "response.content_part.added"]
SHOWN = ["response.output_item.added", "response.output_item.done"]


def render(renderer: ApprovalsRenderer, entries: list[Entry], end: AttemptEnd | None) -> list[Any]:
    facts = {e.offset: end for e in entries if e.kind == "end"}
    raw = renderer.render(entries, facts) + renderer.closing()
    return [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize(
    ("entries", "continued", "types", "output"),
    [
        (  # live, at the park: the read ends with the requests
            [ATTEMPT, HELLO, CALL, ASKED, USAGE],
            False,
            [*OPENED, "response.output_text.delta", *SHOWN, *AT_PARK],
            [("message", "Hello"), ("mcp_approval_request", A)],
        ),
        (  # read later: the same response, cut at the decision
            [ATTEMPT, HELLO, CALL, ASKED, USAGE, DECIDED, RESULT, MORE, DONE],
            False,
            [*OPENED, "response.output_text.delta", *SHOWN, *AT_PARK],
            [("message", "Hello"), ("mcp_approval_request", A)],
        ),
        (  # the continuation: its own message, from its first event
            [DECIDED, RESULT, MORE, DONE],
            True,
            [*OPENED, "response.output_text.delta", *AT_PARK],
            [("message", " paid")],
        ),
        (  # a stop while it waits: the response ends cancelled, its request shown
            [ATTEMPT, HELLO, ASKED, STOPPED, CANCELLED],
            False,
            [
                *OPENED,
                "response.output_text.delta",
                *SHOWN,
                *AT_PARK[:3],
                "response.incomplete",
            ],
            [("message", "Hello"), ("mcp_approval_request", A)],
        ),
    ],
)
def test_the_renderer_ends_a_response_at_its_approval_requests(
    entries: list[Entry],
    continued: bool,
    types: list[str],
    output: list[tuple[str, str]],
) -> None:
    renderer = ApprovalsRenderer(HEAD, -1, continued=continued)
    events = render(
        renderer, entries, WHOLE if continued else AttemptEnd("Hello", "Hello", None, None)
    )
    assert [e["type"] for e in events] == types
    assert [e["sequence_number"] for e in events] == list(range(2, 2 + len(events)))
    for event in events:
        assert event_errors(event) == [], event
        assert sdk_extras(EVENT.validate_python(event)) == []
    final = events[-1]["response"]
    assert spec_errors("Response", final) == []
    assert sdk_extras(Response.model_validate(final)) == []
    shown = [
        (item["type"], item["content"][0]["text"] if item["type"] == "message" else item["id"])
        for item in final["output"]
    ]
    assert shown == output
    assert renderer.snapshot() == final
    assert renderer.render([MORE], {}) == b""  # over: nothing more


def test_a_request_item_is_the_approval_as_the_api_names_it() -> None:
    item = request_item({"approval_id": A, "name": "pay", "args": {"amount": 5}})
    assert item == {
        "id": A,
        "type": "mcp_approval_request",
        "server_label": "broker",
        "name": "pay",
        "arguments": '{"amount":5}',
    }
    assert spec_errors("MCPApprovalRequest", item) == []


def test_a_response_still_running_is_in_progress_with_what_it_showed() -> None:
    renderer = ApprovalsRenderer(HEAD, -1)
    render(renderer, [ATTEMPT, HELLO], None)
    snapshot = renderer.snapshot()
    assert snapshot["status"] == "in_progress"
    assert [item["status"] for item in snapshot["output"]] == ["in_progress"]
    assert spec_errors("Response", snapshot) == []
