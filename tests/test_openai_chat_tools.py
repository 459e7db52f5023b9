"""Function tools through Chat Completions: the renderer's ``tool_calls`` chunks as a table, the
request's translation, and an agent loop of the official `openai` SDK against a real broker
whose simulated provider scripts the calls (cut mid-call and resumed, regenerated)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk

from broker.dialects.openai.render import ChatRenderer
from broker.dialects.openai.requests import ChatRequest, ParamError, chat_messages, tool_params
from broker.dialects.openai.tools import chat_client_tools
from broker.frames import Entry
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn
from tests.openai_spec import spec_errors
from tests.test_openai_contract import check_chunk
from tests.test_openai_dialect import client

# --- the renderer, as a table -------------------------------------------------------------------


def entry(entry_id: str, kind: str, data: dict[str, Any]) -> Entry:
    return Entry.from_redis(entry_id, ["e", kind, "d", orjson.dumps(data).decode()])


def chunks_of(raw: bytes) -> list[dict[str, Any]]:
    lines = [line for line in raw.decode().splitlines() if line.startswith("data: {")]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def piece(call_id: str, name: str, delta: str) -> dict[str, Any]:
    return {"attempt": 1, "call_id": call_id, "name": name, "ordinal": 0, "delta": delta}


def client_call(call_id: str, name: str, args: dict[str, Any], status: str = "client") -> Any:
    return {
        "attempt": 1,
        "call_id": call_id,
        "name": name,
        "ordinal": 0,
        "args": args,
        "status": status,
    }


STREAM = [
    entry("1-0", "attempt", {"attempt": 1, "strategy": "initial"}),
    entry("1-1", "tool_input_delta", piece("call_a", "get_weather", '{"city":')),
    entry("1-2", "tool_input_delta", piece("call_b", "get_time", "{}")),
    entry("1-3", "tool_input_delta", piece("call_a", "get_weather", '"Oslo"}')),
    entry("1-4", "tool_call", client_call("call_a", "get_weather", {"city": "Oslo"})),
    entry("1-5", "tool_call", client_call("call_b", "get_time", {})),
    entry("1-6", "tool_call", client_call("call_c", "get_date", {"z": 1})),  # no pieces came
    entry("1-7", "tool_call", {"attempt": 1, "name": "pay", "ordinal": 0, "status": "dispatched"}),
    entry("2-0", "end", {"attempt": 1, "status": "requires_action", "reason": "tool_calls"}),
]


def start(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": function}]
    }


EXPECTED = [
    ("1-0", {"role": "assistant", "content": ""}, None),
    ("1-1", start(0, "call_a", "get_weather", '{"city":'), None),
    ("1-2", start(1, "call_b", "get_time", "{}"), None),
    ("1-3", {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, None),
    ("1-6", start(2, "call_c", "get_date", '{"z":1}'), None),
    ("2-0", {}, "tool_calls"),
]


def offset(entry_id: str) -> str:
    return entry(entry_id, "delta", {}).offset


def test_client_calls_become_tool_calls_chunks_indexed_by_first_appearance() -> None:
    chunks = chunks_of(ChatRenderer("c", "m", 1, False).render(STREAM, {}))
    got = [
        (c["broker_offset"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
        for c in chunks
    ]
    assert got == [(offset(i), delta, finish) for i, delta, finish in EXPECTED]
    for chunk in chunks:
        assert spec_errors("CreateChatCompletionStreamResponse", chunk) == []
        ChatCompletionChunk.model_validate(chunk)


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_a_read_resumed_after_any_event_keeps_each_calls_index(cut: int) -> None:
    renderer = ChatRenderer("c", "m", 1, False, skip_through=STREAM[cut - 1].offset)
    chunks = chunks_of(renderer.render(STREAM, {}))
    rest = [(c["broker_offset"], c["choices"][0]["delta"]) for c in chunks]
    assert rest == [(offset(i), d) for i, d, _ in EXPECTED if offset(i) > STREAM[cut - 1].offset]


def test_a_call_not_run_is_never_a_complete_call() -> None:
    stream = [
        STREAM[0],
        STREAM[1],
        entry("1-4", "tool_call", client_call("call_a", "get_weather", {}, "not_run")),
        entry("2-0", "end", {"attempt": 1, "status": "interrupted", "reason": "connection_lost"}),
    ]
    chunks = chunks_of(ChatRenderer("c", "m", 1, False).render(stream, {}))
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


# --- the request, as a table --------------------------------------------------------------------


def test_tools_and_tool_messages_become_the_native_fields() -> None:
    body = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "w", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "w", "parameters": {"type": "object"}, "strict": True},
                }
            ],
        }
    )
    assert chat_messages(body)[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "w", "arguments": "{}"}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    assert chat_client_tools(body.tools, "auto") == [
        {"name": "w", "parameters": {"type": "object"}}
    ]
    assert chat_client_tools(body.tools, "none") == []
    assert chat_client_tools([], None) == []


NAMED_CHAT = {"type": "function", "function": {"name": "w"}}
NAMED_RESPONSES = {"type": "function", "name": "w"}


@pytest.mark.parametrize(
    ("choice", "parallel", "params"),
    [
        (None, None, {}),
        ("auto", True, {}),
        ("none", None, {}),
        ("required", None, {"tool_choice": "required"}),
        (NAMED_CHAT, None, {"tool_choice": {"name": "w"}}),
        (NAMED_RESPONSES, None, {"tool_choice": {"name": "w"}}),
        ("auto", False, {"parallel_tool_calls": False}),
        ("required", False, {"tool_choice": "required", "parallel_tool_calls": False}),
    ],
)
def test_tool_choice_and_parallel_tool_calls_become_the_turns_params(
    choice: Any, parallel: Any, params: dict[str, Any]
) -> None:
    assert tool_params(choice, parallel, ["w", "t"]) == params


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", []),  # nothing to call
        ({"type": "function", "function": {"name": "x"}}, ["w"]),  # not among tools
        ({"type": "function", "name": "x"}, ["w"]),
        ({"type": "allowed_tools", "mode": "auto", "tools": []}, ["w"]),
        ({"type": "custom", "name": "w"}, ["w"]),
        ({"type": "function", "function": {"name": "w", "strict": True}}, ["w"]),
        ({"type": "function", "name": "w", "extra": 1}, ["w"]),
    ],
)
def test_a_tool_choice_the_broker_cannot_honour_is_a_400_naming_it(
    choice: Any, names: list[str]
) -> None:
    with pytest.raises(ParamError) as caught:
        tool_params(choice, None, names)
    assert caught.value.param == "tool_choice"


# --- an agent loop through the SDK ----------------------------------------------------------------

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCRIPT = [
    {"name": "get_weather", "args": {"city": "Oslo"}, "after": 2},
    {"name": "get_time", "args": {"zone": "Europe/Oslo"}, "after": 2},
]
QUESTION: list[Any] = [{"role": "user", "content": "Weather and time in Oslo?"}]
RESULTS = {"get_weather": '{"sky": "clear"}', "get_time": "14:05"}


def simulate(**knobs: Any) -> dict[str, Any]:
    return {"broker": {"params": {"simulate": {"tokens": 6, "tokens_per_s": 0, **knobs}}}}


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


def merged(chunks: list[ChatCompletionChunk]) -> dict[int, dict[str, str]]:
    """The calls of a stream as a client builds them: by index, the id and name once each."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            into = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            assert call.function is not None
            if call.id is not None:
                assert not into["id"], f"call {call.index} was started twice"
                into["id"], into["name"] = call.id, call.function.name or ""
            into["arguments"] += call.function.arguments or ""
    return calls


def run(calls: dict[int, dict[str, str]]) -> list[Any]:
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ],
    }
    answers = [
        {"role": "tool", "tool_call_id": c["id"], "content": RESULTS[c["name"]]}
        for _, c in sorted(calls.items())
    ]
    return [assistant, *answers]


def test_an_agent_loop_with_two_tools_runs_to_its_answer(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        raw = sdk.chat.completions.with_raw_response.create(
            model="simulated",
            messages=QUESTION,
            tools=[WEATHER, TIME],
            tool_choice="auto",
            parallel_tool_calls=True,
            stream=True,
            extra_body=simulate(tool_calls=SCRIPT),
        )
        chunks = list(raw.parse())
        for chunk in chunks:  # OpenAI's spec and the SDK's types, as every chunk of the door
            check_chunk(chunk.to_dict())
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = merged(chunks)
        turn = get_turn(broker.base_url, raw.headers["x-broker-turn-id"])
        assert [(c["id"], c["name"]) for _, c in sorted(calls.items())] == [
            (p["call_id"], p["name"]) for p in turn["tool_calls"]
        ]
        assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
        second = sdk.chat.completions.create(
            model="simulated",
            messages=[*QUESTION, *run(calls)],
            tools=[WEATHER, TIME],
            extra_body=simulate(),
        )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    assert (second.choices[0].message.content or "").startswith("(2 tool results")


def test_a_completion_without_stream_lists_the_calls(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        done = sdk.chat.completions.create(
            model="simulated",
            messages=QUESTION,
            tools=[WEATHER, TIME],
            extra_body=simulate(tool_calls=SCRIPT),
            extra_headers={"Idempotency-Key": "chat-tools-whole"},
        )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    state = get_turn(broker.base_url, "chat-tools-whole")
    assert choice.message.content == (state["canonical"]["text"] or None)
    pending = state["tool_calls"]
    calls = [c.to_dict() for c in choice.message.tool_calls or []]
    assert calls == [
        {
            "id": p["call_id"],
            "type": "function",
            "function": {"name": p["name"], "arguments": p["arguments"]},
        }
        for p in pending
    ]
    assert spec_errors("CreateChatCompletionResponse", done.to_dict()) == []


def test_a_stream_cut_mid_call_resumes_with_the_same_calls_once(broker: RunningBroker) -> None:
    ask: dict[str, Any] = {
        "model": "simulated",
        "messages": QUESTION,
        "tools": [WEATHER, TIME],
        "stream": True,
        "extra_body": simulate(tool_calls=SCRIPT),
    }
    with client(broker) as sdk:
        whole = list(sdk.chat.completions.create(**ask, extra_headers={"Idempotency-Key": "ct-w"}))
        starts = [i for i, c in enumerate(whole) if c.choices and c.choices[0].delta.tool_calls]
        for cut in range(starts[0] + 1, starts[-1] + 1):
            key = f"ct-cut-{cut}"
            stream = sdk.chat.completions.create(**ask, extra_headers={"Idempotency-Key": key})
            first: list[ChatCompletionChunk] = []
            for chunk in stream:
                first.append(chunk)
                if len(first) == cut:
                    break
            stream.close()
            at = getattr(first[-1], "broker_offset")  # noqa: B009  (an extension field)
            rest = list(
                sdk.chat.completions.create(
                    **ask, extra_headers={"Idempotency-Key": key, "Last-Event-ID": at}
                )
            )
            calls = merged(first + rest)
            pending = get_turn(broker.base_url, key)["tool_calls"]
            assert [
                (c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())
            ] == [(p["call_id"], p["name"], json.loads(p["arguments"])) for p in pending]
            assert rest[-1].choices[0].finish_reason == "tool_calls"


def test_a_regenerated_turn_hands_the_same_call_ids(broker: RunningBroker) -> None:
    script = [{"name": "get_weather", "args": {"city": "Oslo"}, "after": 2}]
    ask: dict[str, Any] = {
        "model": "simulated",
        "messages": QUESTION,
        "tools": [WEATHER],
        "stream": True,
        "extra_body": simulate(tool_calls=script, fail_after_tool_calls=1),
    }
    key = {"Idempotency-Key": "ct-regen"}
    with client(broker) as sdk:
        first = list(sdk.chat.completions.create(**ask, extra_headers=key))
        assert first[-1].choices[0].finish_reason == "length"  # the upstream broke after the call
        (before,) = merged(first).values()
        answer = httpx.post(
            f"{broker.base_url}/v1/turns/ct-regen/attempts", json={"strategy": "regenerate"}
        )
        assert answer.status_code == 201, answer.text
        at = getattr(first[-1], "broker_offset")  # noqa: B009
        rest = list(sdk.chat.completions.create(**ask, extra_headers={**key, "Last-Event-ID": at}))
    assert rest[-1].choices[0].finish_reason == "tool_calls"
    (after,) = merged(rest).values()
    assert (
        after["id"]
        == before["id"]
        == get_turn(broker.base_url, "ct-regen")["tool_calls"][0]["call_id"]
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "1bad"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        (
            {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ],
)
def test_bad_tool_fields_are_a_400_naming_them(
    broker: RunningBroker, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "simulated", "messages": QUESTION, **simulate(), **fields}
    answer = httpx.post(f"{broker.base_url}/v1/chat/completions", json=body, timeout=10)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_empty_tools_are_as_if_absent(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        done = sdk.chat.completions.create(
            model="simulated",
            messages=QUESTION,
            tools=[],
            tool_choice="none",
            extra_body=simulate(),
        )
    assert done.choices[0].finish_reason == "stop"
