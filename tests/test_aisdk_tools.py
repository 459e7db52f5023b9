"""Client tools through the AI SDK door, as tables: a chat request's ``tools`` and the tool parts
of its messages in, the core's turn request (or the 400 naming the field) out. No socket."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from broker.api.errors import describe_validation
from broker.dialects.aisdk.messages import ChatRequest
from broker.dialects.aisdk.tools import (
    ANSWERS,
    PRELUDE_PARTS,
    follow_up_turn_id,
    prelude,
    renamed,
    reply_id,
)
from broker.errors import BadRequest

QUESTION = {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "Oslo?"}]}
WEATHER = {"description": "The weather in a city", "inputSchema": {"type": "object"}}


def weather(state: str = "output-available", **fields: Any) -> dict[str, Any]:
    return {
        "type": "tool-get_weather",
        "toolCallId": "call_w",
        "state": state,
        "input": {"city": "Oslo"},
        **fields,
    }


def reply(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"id": "u1-reply", "role": "assistant", "parts": [{"type": "step-start"}, *parts]}


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "trigger": "submit-message", "messages": list(messages), **extra}


CALL_W = {"id": "call_w", "name": "get_weather", "arguments": '{"city":"Oslo"}'}
USER = {"role": "user", "content": "Oslo?"}


@pytest.mark.parametrize(
    ("body", "messages"),
    [
        (chat(QUESTION), [USER]),
        (  # the outputs of two calls: one assistant message with both, then each result
            chat(
                QUESTION,
                reply(
                    {"type": "text", "text": "Looking.", "state": "done"},
                    weather(output={"sky": "clear"}),
                    {
                        "type": "tool-get_time",
                        "toolCallId": "call_t",
                        "state": "output-available",
                        "input": {},
                        "output": "12:00",
                    },
                ),
            ),
            [
                USER,
                {
                    "role": "assistant",
                    "content": "Looking.",
                    "tool_calls": [
                        CALL_W,
                        {"id": "call_t", "name": "get_time", "arguments": "{}"},
                    ],
                },
                {"role": "tool", "content": '{"sky":"clear"}', "tool_call_id": "call_w"},
                {"role": "tool", "content": "12:00", "tool_call_id": "call_t"},
            ],
        ),
        (  # an error output is the result the model sees
            chat(QUESTION, reply(weather("output-error", errorText="no network"))),
            [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL_W]},
                {"role": "tool", "content": "no network", "tool_call_id": "call_w"},
            ],
        ),
        (  # a dynamic tool part names its tool
            chat(
                QUESTION,
                reply(
                    {
                        "type": "dynamic-tool",
                        "toolName": "get_weather",
                        "toolCallId": "call_w",
                        "state": "output-available",
                        "input": {"city": "Oslo"},
                        "output": 1,
                    }
                ),
            ),
            [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL_W]},
                {"role": "tool", "content": "1", "tool_call_id": "call_w"},
            ],
        ),
        (  # an answered round, then the answer, then a new question: text after results
            chat(
                QUESTION,
                reply(
                    weather(output="clear"),
                    {"type": "step-start"},
                    {"type": "text", "text": "It is clear."},
                    {"type": "data-broker", "id": "broker", "data": {}},
                ),
                {"id": "u2", "role": "user", "parts": [{"type": "text", "text": "Thanks"}]},
            ),
            [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL_W]},
                {"role": "tool", "content": "clear", "tool_call_id": "call_w"},
                {"role": "assistant", "content": "It is clear."},
                {"role": "user", "content": "Thanks"},
            ],
        ),
        (  # the broker's own calls (ledger, refused) and a call never answered are left out
            chat(
                QUESTION,
                reply(
                    {"type": "text", "text": "Hm."},
                    weather(output="x", providerExecuted=True),
                    weather("output-error", errorText="not_run", providerExecuted=True),
                    weather("input-available", toolCallId="call_later"),
                ),
                {"id": "u2", "role": "user", "parts": [{"type": "text", "text": "Never mind"}]},
            ),
            [
                USER,
                {"role": "assistant", "content": "Hm."},
                {"role": "user", "content": "Never mind"},
            ],
        ),
    ],
    ids=["text", "two outputs", "an error output", "a dynamic tool", "later turns", "skipped"],
)
def test_tool_parts_become_calls_and_results(
    body: dict[str, Any], messages: list[dict[str, Any]]
) -> None:
    request = ChatRequest.model_validate(body).turn_request()
    assert [m.model_dump(exclude_none=True) for m in request.messages] == messages


def test_tools_are_the_turns_client_tools() -> None:
    body = chat(QUESTION, tools={"get_weather": WEATHER, "get_time": {}})
    request = ChatRequest.model_validate(body).turn_request()
    assert [t.model_dump(exclude_none=True) for t in request.client_tools] == [
        {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object"},
        },
        {"name": "get_time"},
    ]
    assert request.turn_id == "u1"


def test_the_outputs_start_a_follow_up_turn_in_the_same_message() -> None:
    body = chat(QUESTION, reply(weather(output="clear")))
    request = ChatRequest.model_validate(body).turn_request()
    again = ChatRequest.model_validate(body).turn_request()
    assert request.turn_id == again.turn_id, "the same request is the same turn"
    assert request.turn_id is not None
    assert request.turn_id.startswith("u1-reply.tools-")
    assert reply_id(request.turn_id) == "u1-reply"
    assert reply_id("u1") == "u1-reply"
    other = ChatRequest.model_validate(chat(QUESTION, reply(weather(output="rain"))))
    assert other.turn_request().turn_id != request.turn_id, "other outputs: another turn"
    facts = {"type": "data-broker", "id": "broker", "data": {"turnId": "u1", "attempt": 2}}
    regenerated = ChatRequest.model_validate(chat(QUESTION, reply(facts, weather(output="clear"))))
    assert regenerated.turn_request().turn_id != request.turn_id, "another attempt's calls"


def turn_request(body: dict[str, Any]) -> None:
    try:
        chat_request = ChatRequest.model_validate(body)
    except ValidationError as exc:  # as the door's body parser words it
        raise BadRequest(describe_validation(exc.errors())) from None
    chat_request.turn_request()


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("a bad tool name", chat(QUESTION, tools={"get weather": {}}), "tools: 'get weather'"),
    (
        "an unknown tool field",
        chat(QUESTION, tools={"f": {"parameters": {}}}),
        "tools.f.parameters",
    ),
    (
        "a schema not an object",
        chat(QUESTION, tools={"f": {"inputSchema": 1}}),
        "tools.f.inputSchema",
    ),
    (
        "a call without its output, last",
        chat(QUESTION, reply(weather("input-available"))),
        "messages[1].parts[1]: tool call 'call_w' has no output yet",
    ),
    (
        "a part without its call id",
        chat(QUESTION, reply({"type": "tool-f", "state": "output-available"})),
        "messages[1].parts[1]: toolCallId",
    ),
    (
        "a state the door does not take",
        chat(QUESTION, reply(weather("approval-requested"))),
        "messages[1].parts[1].state 'approval-requested'",
    ),
    (
        "a dynamic part without its name",
        chat(QUESTION, reply({**weather(output=1), "type": "dynamic-tool"})),
        "messages[1].parts[1]",
    ),
    (
        "an assistant message last with nothing to answer",
        chat(QUESTION, reply({"type": "text", "text": "done"})),
        "the last message must be the user's",
    ),
    (
        "a regenerate of an assistant message",
        {**chat(QUESTION, reply(weather(output=1))), "trigger": "regenerate-message"},
        "the last message must be the user's",
    ),
]


@pytest.mark.parametrize(("case", "body", "message"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_tool_fields_are_a_400_naming_them(
    case: str, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        turn_request(body)
    assert message in caught.value.message, case


def test_a_long_assistant_message_id_cannot_name_a_follow_up() -> None:
    with pytest.raises(BadRequest) as caught:
        follow_up_turn_id("c1", "r" * 110, [])
    assert caught.value.code == "bad_message_id"


@pytest.mark.parametrize(
    ("core", "door"),
    [
        (
            "client_tools[1].name 'f' is a server tool of this broker (BROKER_TOOLS): x",
            "tools.f is a server tool of this broker (BROKER_TOOLS): x",
        ),
        ("client_tools has 129 tools, more than 128", "tools has 129 tools, more than 128"),
        (
            "messages[2].tool_call_id 'x' answers no tool call",
            "messages[2].tool_call_id 'x' answers no tool call",
        ),
    ],
)
def test_the_cores_tool_checks_speak_of_tools(core: str, door: str) -> None:
    assert renamed(BadRequest(core)).message == door


def test_a_follow_up_keeps_the_parts_its_replay_shows_again() -> None:
    body = chat(
        QUESTION,
        reply(
            {"type": "text", "text": "Looking.", "state": "done", "providerMetadata": {"x": 1}},
            {"type": "data-broker", "id": "broker", "data": {"turnId": "u1"}},
            {"type": "reasoning", "text": "hm"},
            weather(output={"sky": "clear"}, rawInput=None, title="Weather"),
        ),
    )
    request = ChatRequest.model_validate(body).turn_request()
    assert request.echo == {
        PRELUDE_PARTS: [
            {"type": "step-start"},
            {"type": "text", "text": "Looking."},
            {
                "type": "tool-get_weather",
                "toolCallId": "call_w",
                "state": "output-available",
                "input": {"city": "Oslo"},
                "output": {"sky": "clear"},
                "providerExecuted": False,
            },
        ],
        ANSWERS: "u1",  # the turn the data-broker part names: a resume looks for it
    }
    assert ChatRequest.model_validate(chat(QUESTION)).turn_request().echo is None


TOOL = {"toolCallId": "call_w", "toolName": "get_weather"}
STEP, END_STEP = {"type": "start-step"}, {"type": "finish-step"}


@pytest.mark.parametrize(
    ("parts", "chunks"),
    [
        ([], []),
        (  # a client call is rebuilt from its input, never made available again (onToolCall)
            [
                {"type": "step-start"},
                {"type": "text", "text": "Looking."},
                {
                    "type": "tool-get_weather",
                    "toolCallId": "call_w",
                    "state": "output-available",
                    "input": {"city": "Oslo"},
                    "output": {"sky": "clear"},
                    "providerExecuted": False,
                },
            ],
            [
                STEP,
                {"type": "text-start", "id": "0-1"},
                {"type": "text-delta", "id": "0-1", "delta": "Looking."},
                {"type": "text-end", "id": "0-1"},
                {"type": "tool-input-start", **TOOL},
                {
                    "type": "tool-input-delta",
                    "toolCallId": "call_w",
                    "inputTextDelta": '{"city":"Oslo"}',
                },
                {
                    "type": "tool-output-available",
                    "toolCallId": "call_w",
                    "output": {"sky": "clear"},
                },
                END_STEP,
            ],
        ),
        (  # the broker's own call, an error output, a dynamic tool, two steps
            [
                {
                    "type": "tool-get_weather",
                    "toolCallId": "call_s",
                    "state": "output-available",
                    "input": {},
                    "output": 1,
                    "providerExecuted": True,
                },
                {"type": "step-start"},
                {
                    "type": "dynamic-tool",
                    "toolName": "get_weather",
                    "toolCallId": "call_w",
                    "state": "output-error",
                    "errorText": "offline",
                    "providerExecuted": False,
                },
            ],
            [
                STEP,
                {
                    "type": "tool-input-available",
                    "toolCallId": "call_s",
                    "toolName": "get_weather",
                    "input": {},
                    "providerExecuted": True,
                },
                {
                    "type": "tool-output-available",
                    "toolCallId": "call_s",
                    "output": 1,
                    "providerExecuted": True,
                },
                END_STEP,
                STEP,
                {"type": "tool-input-start", **TOOL, "dynamic": True},
                {"type": "tool-input-delta", "toolCallId": "call_w", "inputTextDelta": "{}"},
                {"type": "tool-output-error", "toolCallId": "call_w", "errorText": "offline"},
                END_STEP,
            ],
        ),
    ],
    ids=["nothing", "a client call", "the broker's call and a dynamic one"],
)
def test_the_prelude_rebuilds_the_steps_before_a_follow_up(
    parts: list[dict[str, Any]], chunks: list[dict[str, Any]]
) -> None:
    assert prelude(parts) == chunks


def test_a_call_met_twice_in_a_message_is_one_call() -> None:
    again = weather(output="clear")
    body = chat(QUESTION, reply(again, {"type": "step-start"}, again))
    request = ChatRequest.model_validate(body).turn_request()
    assert [m.model_dump(exclude_none=True) for m in request.messages] == [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [CALL_W]},
        {"role": "tool", "content": "clear", "tool_call_id": "call_w"},
    ]


# Image files of a user message become the core's image parts; other files are a 400.
PNG_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGA"
    "WjR9awAAAABJRU5ErkJggg=="
)


def asked(*parts: dict[str, Any], role: str = "user") -> dict[str, Any]:
    return {
        "id": "c1",
        "messages": [{"id": "u1", "role": role, "parts": list(parts)}],
        "trigger": "submit-message",
    }


@pytest.mark.parametrize(
    ("parts", "content"),
    [
        ([{"type": "text", "text": "Oslo?"}], "Oslo?"),
        (
            [
                {"type": "text", "text": "What is this?"},
                {"type": "file", "mediaType": "image/png", "url": PNG_URL, "filename": "a.png"},
            ],
            [{"type": "text", "text": "What is this?"}, {"type": "image", "url": PNG_URL}],
        ),
        (
            [
                {"type": "file", "mediaType": "image/jpeg", "url": "https://example.com/c.jpg"},
                {"type": "data-note", "data": {}},
                {"type": "text", "text": "and this?"},
            ],
            [
                {"type": "image", "url": "https://example.com/c.jpg"},
                {"type": "text", "text": "and this?"},
            ],
        ),
    ],
)
def test_image_files_become_image_parts_in_their_order(
    parts: list[dict[str, Any]], content: Any
) -> None:
    request = ChatRequest.model_validate(asked(*parts)).turn_request()
    got = request.messages[0].model_dump(exclude_none=True)["content"]
    assert got == content


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            asked({"type": "file", "mediaType": "application/pdf", "url": "https://x.org/a.pdf"}),
            "messages[0].parts[0]: a file part of media type 'application/pdf' is not taken",
        ),
        (asked({"type": "file", "url": "https://x.org/a"}), "of media type 'None' is not taken"),
        (
            asked({"type": "file", "mediaType": "image/png", "url": "ftp://x.org/a.png"}),
            "an image URL must be an http(s) URL",
        ),
        (
            asked({"type": "file", "mediaType": "image/png", "url": PNG_URL}, role="system"),
            "messages[0].parts[0]: images are for user messages only",
        ),
    ],
)
def test_files_the_model_cannot_take_are_a_400_naming_them(
    body: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        ChatRequest.model_validate(body).turn_request()
    assert message in str(refused.value)


APR = "apr_0123456789abcdef01234567"


def pay(state: str, **fields: Any) -> dict[str, Any]:
    """The broker's own call that waited for a person, as the client keeps it."""
    return {
        "type": "tool-send_payment",
        "toolCallId": "call_p",
        "state": state,
        "input": {"amount": 500},
        "providerExecuted": True,
        **fields,
    }


def answer_chat(*parts: dict[str, Any], message_id: str = "u1-reply") -> ChatRequest:
    message = {"id": message_id, "role": "assistant", "parts": [{"type": "step-start"}, *parts]}
    return ChatRequest.model_validate(
        {"id": "chat1", "trigger": "submit-message", "messages": [QUESTION, message]}
    )


BROKER_PART = {"type": "data-broker", "id": "broker", "data": {"turnId": "t9", "attempt": 1}}


@pytest.mark.parametrize(
    ("parts", "message_id", "expected"),
    [
        (  # addToolApprovalResponse({approved: true}): the turn its id names
            [pay("approval-responded", approval={"id": APR, "approved": True})],
            "u1-reply",
            ("u1", [(APR, True, None)]),
        ),
        (  # a deny with its reason, the turn its data-broker part names
            [
                BROKER_PART,
                pay("approval-responded", approval={"id": APR, "approved": False, "reason": "no"}),
            ],
            "m7",
            ("t9", [(APR, False, "no")]),
        ),
        ([pay("approval-requested", approval={"id": APR})], "u1-reply", None),  # not answered
        ([weather()], "u1-reply", None),  # client tool outputs: a follow-up turn
    ],
    ids=["approve", "deny, named by its facts part", "not answered yet", "no approvals"],
)
def test_approval_responses_are_decisions_on_the_turn_they_answer(
    parts: list[dict[str, Any]], message_id: str, expected: Any
) -> None:
    found = answer_chat(*parts, message_id=message_id).approvals()
    if expected is None:
        assert found is None
        return
    assert found is not None
    turn_id, answers = found
    assert (turn_id, [(a.id, a.approved, a.reason) for a in answers]) == expected


@pytest.mark.parametrize(
    ("approval", "names"),
    [
        ({"id": APR}, "messages[1].parts[1].approval: approved"),
        ({"id": APR, "approved": "yes"}, "messages[1].parts[1].approval: approved"),
        ({"id": APR, "approved": True, "reason": "x" * 1001}, "approval: reason"),
        (None, "messages[1].parts[1].approval"),
    ],
    ids=["no approved", "not a boolean", "a reason too long", "no approval"],
)
def test_a_bad_approval_response_is_a_400_naming_it(approval: Any, names: str) -> None:
    chat = answer_chat(pay("approval-responded", approval=approval))
    with pytest.raises(BadRequest) as raised:
        chat.approvals()
    assert names in raised.value.message
