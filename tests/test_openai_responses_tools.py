"""Function tools through the Responses door: the renderer's ``function_call`` items and events
as a table (checked against OpenAI's spec and the SDK's types), and an agent loop of the
official `openai` SDK against a real broker whose simulated provider scripts the calls: cut
mid-call and resumed with ``starting_after``, regenerated, and continued by
``previous_response_id`` or by the whole history."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from broker.dialects.openai.calls import Calls
from broker.dialects.openai.events import AttemptEnd, Head
from broker.dialects.openai.render import ResponsesRenderer
from broker.frames import Entry
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn
from tests.openai_spec import event_errors, sdk_extras
from tests.test_openai_contract import EVENT, check_response, data_lines, streamed
from tests.test_openai_dialect import client


def check_event(event: dict[str, Any]) -> None:
    """As the contract's check, but for ``name`` on ``function_call_arguments.done``: the
    spec requires it, and the SDK's type (of the pinned version) does not declare it."""
    assert event_errors(event) == []
    extras = sdk_extras(EVENT.validate_python(event))
    allowed = ["name"] if event["type"] == "response.function_call_arguments.done" else []
    assert extras == allowed


# --- the renderer, as a table -------------------------------------------------------------------


def entry(entry_id: str, kind: str, data: dict[str, Any]) -> Entry:
    return Entry.from_redis(entry_id, ["e", kind, "d", orjson.dumps(data).decode()])


def piece(call_id: str, name: str, delta: str) -> dict[str, Any]:
    return {"attempt": 1, "call_id": call_id, "name": name, "ordinal": 0, "delta": delta}


def called(call_id: str, name: str, args: Any, status: str = "client") -> dict[str, Any]:
    return {
        "attempt": 1,
        "call_id": call_id,
        "name": name,
        "ordinal": 0,
        "args": args,
        "status": status,
    }


TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": None,
    "parameters": None,
    "strict": None,
}
HEAD = Head("resp_1", "m", 7, None, None, None, None, None, False, {}, tools=[TOOL])
STREAM = [
    entry("1-0", "attempt", {"attempt": 1, "strategy": "initial"}),
    entry("1-1", "delta", {"attempt": 1, "text": "Let me look."}),
    entry("1-2", "tool_input_delta", piece("call_a", "get_weather", '{"city":')),
    entry("1-3", "tool_input_delta", piece("call_a", "get_weather", '"Oslo"}')),
    entry("1-4", "tool_call", called("call_a", "get_weather", {"city": "Oslo"})),
    entry("1-5", "tool_call", called("call_b", "get_time", {})),  # its arguments came whole
    entry("1-6", "tool_call", {"attempt": 1, "name": "pay", "ordinal": 0, "status": "dispatched"}),
    entry("2-0", "end", {"attempt": 1, "status": "requires_action", "reason": "tool_calls"}),
]
END = AttemptEnd(
    "Let me look.", "Let me look.", {"input_tokens": 3, "output_tokens": 2}, "tool_calls"
)


def events_of(raw: bytes) -> list[dict[str, Any]]:
    return data_lines(raw)


def render(starting_after: int = -1, stream: list[Entry] = STREAM) -> list[dict[str, Any]]:
    renderer = ResponsesRenderer(HEAD, starting_after, calls=Calls())
    raw = renderer.opening() + renderer.render(stream, {stream[-1].offset: END})
    return events_of(raw)


def test_calls_are_function_call_items_with_their_argument_events() -> None:
    events = render()
    assert [(e["sequence_number"], e["type"], e.get("output_index")) for e in events] == [
        (0, "response.created", None),
        (1, "response.in_progress", None),
        (2, "response.output_item.added", 0),
        (3, "response.content_part.added", 0),
        (4, "response.output_text.delta", 0),
        (5, "response.output_item.added", 1),
        (6, "response.function_call_arguments.delta", 1),
        (7, "response.function_call_arguments.delta", 1),
        (8, "response.function_call_arguments.done", 1),
        (9, "response.output_item.done", 1),
        (10, "response.output_item.added", 2),
        (11, "response.function_call_arguments.delta", 2),
        (12, "response.function_call_arguments.done", 2),
        (13, "response.output_item.done", 2),
        (14, "response.output_text.done", 0),
        (15, "response.content_part.done", 0),
        (16, "response.output_item.done", 0),
        (17, "response.completed", None),
    ]
    assert events[5]["item"] == {
        "id": "fc_1_a",
        "type": "function_call",
        "call_id": "call_a",
        "name": "get_weather",
        "arguments": "",
        "status": "in_progress",
    }
    assert events[8]["arguments"] == '{"city":"Oslo"}'
    assert events[12]["arguments"] == "{}"
    output = events[-1]["response"]["output"]
    assert [(o["type"], o.get("call_id"), o["status"]) for o in output] == [
        ("message", None, "completed"),
        ("function_call", "call_a", "completed"),
        ("function_call", "call_b", "completed"),
    ]
    assert events[-1]["response"]["tools"] == [TOOL]
    for event in events:
        check_event(event)
    check_response(events[-1]["response"])


@pytest.mark.parametrize("after", range(-1, 17))
def test_a_read_resumed_after_any_number_is_the_rest_of_the_same_events(after: int) -> None:
    assert render(after) == [e for e in render() if e["sequence_number"] > after]


def test_a_call_cut_off_is_an_incomplete_item_and_never_in_the_response() -> None:
    stream = [
        *STREAM[:3],
        entry("1-4", "tool_call", called("call_a", "get_weather", {}, "not_run")),
        entry("2-0", "end", {"attempt": 1, "status": "interrupted", "reason": "connection_lost"}),
    ]
    events = render(stream=stream)
    done = [
        e for e in events if e["type"] == "response.output_item.done" and e["output_index"] == 1
    ]
    assert [e["item"]["status"] for e in done] == ["incomplete"]
    assert "response.function_call_arguments.done" not in [e["type"] for e in events]
    assert events[-1]["type"] == "response.incomplete"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["message"]
    for event in events:
        check_event(event)


# --- an agent loop through the SDK ----------------------------------------------------------------

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
TIME: Any = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
SCRIPT = [
    {"name": "get_weather", "args": {"city": "Oslo"}, "after": 2},
    {"name": "get_time", "args": {"zone": "Europe/Oslo"}, "after": 2},
]
RESULTS = {"get_weather": '{"sky": "clear"}', "get_time": "14:05"}


def simulate(**knobs: Any) -> dict[str, Any]:
    return {"broker": {"params": {"simulate": {"tokens": 6, "tokens_per_s": 0, **knobs}}}}


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


def calls_of(output: list[Any]) -> list[dict[str, Any]]:
    items = [o if isinstance(o, dict) else o.to_dict() for o in output]
    return [
        {k: v for k, v in o.items() if k != "parsed_arguments"}  # the SDK's helper's own
        for o in items
        if o["type"] == "function_call"
    ]


def test_an_agent_loop_with_two_tools_runs_to_its_answer(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        with sdk.responses.stream(
            model="simulated",
            input="Weather and time in Oslo?",
            tools=[WEATHER, TIME],
            extra_body=simulate(tool_calls=SCRIPT),
        ) as stream:
            events = list(stream)
            first = stream.get_final_response()
        # (the raw events are checked against the spec below; the helper adds fields of its own)
        assert "response.function_call_arguments.done" in [e.type for e in events]
        calls = calls_of(first.output)
        pending = get_turn(broker.base_url, first.id)["tool_calls"]
        assert [(c["call_id"], c["name"], c["arguments"]) for c in calls] == [
            (p["call_id"], p["name"], p["arguments"]) for p in pending
        ]
        assert first.status == "completed"
        outputs: Any = [
            {"type": "function_call_output", "call_id": c["call_id"], "output": RESULTS[c["name"]]}
            for c in calls
        ]
        second = sdk.responses.create(
            model="simulated",
            previous_response_id=first.id,
            input=outputs,
            tools=[WEATHER, TIME],
            extra_body=simulate(),
        )
        # The same loop without previous_response_id: the whole history, calls included.
        history: Any = [{"role": "user", "content": "Weather and time in Oslo?"}, *calls, *outputs]
        third = sdk.responses.create(
            model="simulated", input=history, tools=[WEATHER, TIME], extra_body=simulate()
        )
    for answer in (second, third):
        assert answer.status == "completed"
        assert calls_of(answer.output) == []
        assert answer.output_text.startswith("(2 tool results")
    retrieved = httpx.get(f"{broker.base_url}/v1/responses/{first.id}", timeout=10).json()
    check_response(retrieved)
    assert calls_of(retrieved["output"]) == calls


def test_a_stream_cut_mid_call_resumes_with_the_same_calls_once(broker: RunningBroker) -> None:
    body = {
        "model": "simulated",
        "input": "Weather and time?",
        "tools": [WEATHER, TIME],
        "stream": True,
    }
    raw = streamed(broker, "POST", "/v1/responses", json={**body, **simulate(tool_calls=SCRIPT)})
    whole = data_lines(raw)
    response_id = whole[0]["response"]["id"]
    deltas = [
        e["sequence_number"] for e in whole if e["type"] == "response.function_call_arguments.delta"
    ]
    for after in range(deltas[0] - 1, deltas[-1] + 1):
        rest = data_lines(
            streamed(
                broker,
                "GET",
                f"/v1/responses/{response_id}",
                params={"stream": "true", "starting_after": str(after)},
            )
        )
        joined = [e for e in whole if e["sequence_number"] <= after] + rest
        assert joined == whole
    added = [
        e["item"]["call_id"]
        for e in whole
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    ]
    assert added == [p["call_id"] for p in get_turn(broker.base_url, response_id)["tool_calls"]]


def test_a_regenerated_response_hands_the_same_call_ids(broker: RunningBroker) -> None:
    script = [{"name": "get_weather", "args": {"city": "Oslo"}, "after": 2}]
    body = {
        "model": "simulated",
        "input": "Weather?",
        "tools": [WEATHER],
        "stream": True,
        **simulate(tool_calls=script, fail_after_tool_calls=1),
    }
    first = data_lines(streamed(broker, "POST", "/v1/responses", json=body))
    assert first[-1]["type"] == "response.incomplete"
    (before,) = [
        e["item"]
        for e in first
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
    ]
    response_id = first[0]["response"]["id"]
    answer = httpx.post(
        f"{broker.base_url}/v1/turns/{response_id}/attempts", json={"strategy": "regenerate"}
    )
    assert answer.status_code == 201, answer.text
    rest = data_lines(
        streamed(
            broker,
            "GET",
            f"/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": str(first[-1]["sequence_number"])},
        )
    )
    assert rest[-1]["type"] == "response.completed"
    for event in rest:
        check_event(event)
    (after,) = calls_of(rest[-1]["response"]["output"])
    assert after["call_id"] == before["call_id"]
    assert after["id"] != before["id"]  # another attempt's item


def test_tool_choice_none_offers_no_tools_and_is_echoed(broker: RunningBroker) -> None:
    body = {"model": "simulated", "input": "x", "tools": [WEATHER], "tool_choice": "none"}
    answer = httpx.post(f"{broker.base_url}/v1/responses", json={**body, **simulate()}, timeout=10)
    assert answer.status_code == 200, answer.text
    check_response(answer.json())
    assert (answer.json()["tool_choice"], answer.json()["tools"]) == ("none", [])
    assert "client_tools" not in httpx.get(f"{broker.base_url}/v1/turns/{answer.json()['id']}").text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "1bad"}]}, "tools"),
        (
            {"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
            "tools",
        ),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "mcp", "server_label": "s"}}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
    ],
)
def test_bad_tool_fields_are_a_400_naming_them(
    broker: RunningBroker, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "simulated", "input": "x", **simulate(), **fields}
    answer = httpx.post(f"{broker.base_url}/v1/responses", json=body, timeout=10)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text
