"""Client tools through the native API: the model's calls stream to the client, end the attempt
``requires_action``, keep their ids across a retry, and the next turn carries the results."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.client_tools import (
    ClientTool,
    check_client_tools,
    check_tool_messages,
    client_call_id,
    offered_tools,
)
from broker.errors import BadRequest
from broker_client import BrokerClient
from tests.conftest import BrokerFactory, RunningBroker
from tests.fake_anthropic import FakeAnthropic
from tests.fake_openai import FakeOpenAI
from tests.helpers import SSEEvent, ToolEndpoint, get_turn, read_sse, text_of, wait_final
from tests.test_provider_anthropic import KEY as ANTHROPIC_KEY
from tests.test_provider_anthropic import claude_broker
from tests.test_provider_openai import openai_broker

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {"name": "get_time"}
CLIENT_TOOLS = [WEATHER, TIME]
TWO_CALLS = [
    {"name": "get_weather", "args": {"city": "Oslo", "unit": "celsius"}, "after": 2},
    {"name": "get_time", "args": {"zone": "Europe/Oslo"}, "after": 2},
]


def post_turn(
    broker: RunningBroker,
    turn_id: str,
    *,
    messages: list[dict[str, Any]] | None = None,
    expect: int = 201,
    conversation_id: str = "conv-ct",
    **fields: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "conversation_id": conversation_id,
        "turn_id": turn_id,
        "messages": messages or [{"role": "user", "content": "Weather and time in Oslo?"}],
        **fields,
    }
    response = httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10)
    assert response.status_code == expect, response.text
    result: dict[str, Any] = response.json()
    return result


def simulate(**knobs: Any) -> dict[str, Any]:
    return {"simulate": {"tokens": 6, "tokens_per_s": 0, **knobs}}


def of_kind(events: list[SSEEvent], kind: str) -> list[dict[str, Any]]:
    return [e.data for e in events if e.event == kind]


def post_attempt(broker: RunningBroker, turn_id: str, strategy: str) -> int:
    return httpx.post(
        f"{broker.base_url}/v1/turns/{turn_id}/attempts", json={"strategy": strategy}, timeout=5
    ).status_code


# --- pure logic --------------------------------------------------------------------------------


def expected_id(conversation: str, turn: str, name: str, ordinal: int) -> str:
    slot = f"{conversation}\x00{turn}\x00{name}\x00{ordinal}".encode()
    return "call_" + hashlib.sha256(slot).hexdigest()[:24]


@pytest.mark.parametrize(
    ("slot", "other"),
    [
        (("c", "t", "f", 0), ("c", "t", "f", 1)),
        (("c", "t", "f", 0), ("c", "t", "g", 0)),
        (("c", "t", "f", 0), ("c", "u", "f", 0)),
        (("c", "t", "f", 0), ("d", "t", "f", 0)),
        (("a\x00b", "t", "f", 0), ("a", "b\x00t", "f", 0)),  # the separator is in the hash
        (("tenant/c", "t", "f", 0), ("c", "t", "f", 0)),  # conversations are the broker's
    ],
)
def test_a_call_id_is_its_slot_and_another_slot_is_another_id(
    slot: tuple[str, str, str, int], other: tuple[str, str, str, int]
) -> None:
    assert client_call_id(*slot) == client_call_id(*slot) == expected_id(*slot)
    assert len(client_call_id(*slot)) == len("call_") + 24
    if slot[0].count("\x00") == 0:
        assert client_call_id(*slot) != client_call_id(*other)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "user", "content": "hi"}], None),
        (
            [
                {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "f"}]},
                {"role": "tool", "content": "1", "tool_call_id": "a"},
                {"role": "tool", "content": "1", "tool_call_id": "a"},  # answered twice: kept
            ],
            None,
        ),
        (
            [{"role": "tool", "content": "1", "tool_call_id": "a"}],
            "messages[0].tool_call_id 'a' answers no tool call of an assistant message before it",
        ),
        (
            [
                {"role": "tool", "content": "1", "tool_call_id": "a"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "f"}]},
            ],
            "messages[0].tool_call_id 'a' answers no tool call",
        ),
        ([{"role": "tool", "content": "1"}], "messages[0].tool_call_id is required"),
        (
            [{"role": "user", "content": "1", "tool_call_id": "a"}],
            "messages[0].tool_call_id is only for tool messages",
        ),
        (
            [{"role": "user", "content": "", "tool_calls": []}],
            "messages[0].tool_calls is only for assistant messages",
        ),
    ],
)
def test_tool_messages_answer_an_earlier_call(
    messages: list[dict[str, Any]], error: str | None
) -> None:
    if error is None:
        check_tool_messages(messages)
        return
    with pytest.raises(BadRequest, match=error.replace("[", r"\[").replace("]", r"\]")):
        check_tool_messages(messages)


@pytest.mark.parametrize(
    ("names", "error"),
    [
        (["a", "b"], None),
        (["a", "a"], "client_tools\\[1\\].name 'a' is defined twice"),
        (["a", "pay"], "client_tools\\[1\\].name 'pay' is a server tool"),
        ([f"f{i}" for i in range(129)], "client_tools has 129 tools, more than 128"),
    ],
)
def test_client_tool_names_are_unique_and_not_the_servers(
    names: list[str], error: str | None
) -> None:
    tools = [ClientTool(name=name) for name in names]
    if error is None:
        check_client_tools(tools, {"pay"})
    else:
        with pytest.raises(BadRequest, match=error):
            check_client_tools(tools, {"pay"})


def test_client_tools_are_offered_as_function_tools() -> None:
    assert offered_tools([WEATHER, TIME]) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER["parameters"],
            },
        },
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        },
    ]


# --- through the broker ------------------------------------------------------------------------


def test_a_two_tool_loop_ends_requires_action_then_the_results_complete_it(
    broker: RunningBroker,
) -> None:
    turn = post_turn(
        broker, "loop-1", client_tools=CLIENT_TOOLS, params=simulate(tool_calls=TWO_CALLS)
    )
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert events[-1].data == {"attempt": 1, "status": "requires_action", "reason": "tool_calls"}
    calls = of_kind(events, "tool_call")
    assert [(c["name"], c["status"], c["ordinal"]) for c in calls] == [
        ("get_weather", "client", 0),
        ("get_time", "client", 0),
    ]
    assert calls[0]["args"] == {"city": "Oslo", "unit": "celsius"}
    ids = [expected_id("conv-ct", "loop-1", c["name"], 0) for c in calls]
    assert [c["call_id"] for c in calls] == ids
    assert "tool_result" not in [e.event for e in events]  # the broker ran nothing
    for call in calls:
        deltas = [d for d in of_kind(events, "tool_input_delta") if d["call_id"] == call["call_id"]]
        assert len(deltas) >= 2, "the arguments arrive in pieces"
        assert json.loads("".join(d["delta"] for d in deltas)) == call["args"]
        assert {(d["name"], d["ordinal"]) for d in deltas} == {(call["name"], 0)}
    state = get_turn(broker.base_url, "loop-1")
    assert state["status"] == "requires_action"
    assert state["attempts"][0]["status"] == "requires_action"
    assert state["canonical"]["attempt"] == 1
    pending = state["tool_calls"]
    assert [(p["call_id"], p["name"]) for p in pending] == list(
        zip(ids, ["get_weather", "get_time"], strict=True)
    )
    assert json.loads(pending[1]["arguments"]) == {"zone": "Europe/Oslo"}
    # The client runs both and sends the results with the history.
    history = httpx.get(f"{broker.base_url}/v1/conversations/conv-ct/messages", timeout=5).json()
    assistant = history["messages"][-1]
    assert assistant["tool_calls"] == [
        {"id": p["call_id"], "name": p["name"], "arguments": p["arguments"]} for p in pending
    ]
    assert "partial" not in assistant
    results = [
        {"role": "tool", "tool_call_id": ids[0], "content": '{"sky": "clear"}'},
        {"role": "tool", "tool_call_id": ids[1], "content": "14:05"},
    ]
    second = post_turn(
        broker,
        "loop-2",
        messages=[*history["messages"], *results],
        client_tools=CLIENT_TOOLS,
        params=simulate(),
    )
    rest = read_sse(broker.base_url, second["stream_id"]).events
    assert rest[-1].data == {"attempt": 1, "status": "complete", "reason": None}
    assert "tool_call" not in [e.event for e in rest]
    size = len('{"sky": "clear"}') + len("14:05")
    assert text_of(rest).startswith(f"(2 tool results, {size} characters) ")
    assert get_turn(broker.base_url, "loop-2").get("tool_calls") is None
    after = httpx.get(f"{broker.base_url}/v1/conversations/conv-ct/messages", timeout=5).json()
    roles = [m["role"] for m in after["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "assistant"]
    assert [t["status"] for t in after["turns"]] == ["requires_action", "complete"]


def test_a_regenerated_call_carries_the_same_id(broker: RunningBroker) -> None:
    script = [{"name": "get_weather", "args": {"city": "Oslo"}, "after": 2}]
    turn = post_turn(
        broker,
        "retry",
        client_tools=[WEATHER],
        params=simulate(tool_calls=script, fail_after_tool_calls=1),
    )
    first = read_sse(broker.base_url, turn["stream_id"]).events
    # The call was streamed whole, then the upstream broke before the message ended.
    assert first[-1].data["status"] == "interrupted"
    (call,) = of_kind(first, "tool_call")
    assert call["status"] == "client"
    assert get_turn(broker.base_url, "retry").get("tool_calls") is None  # not the outcome
    assert post_attempt(broker, "retry", "regenerate") == 201
    rest = read_sse(broker.base_url, turn["stream_id"], last_event_id=first[-1].id).events
    assert rest[-1].data == {"attempt": 2, "status": "requires_action", "reason": "tool_calls"}
    (again,) = of_kind(rest, "tool_call")
    assert (again["attempt"], again["status"]) == (2, "client")
    assert again["call_id"] == call["call_id"] == expected_id("conv-ct", "retry", "get_weather", 0)
    deltas = of_kind(rest, "tool_input_delta")
    assert {d["call_id"] for d in deltas} == {call["call_id"]}
    (pending,) = get_turn(broker.base_url, "retry")["tool_calls"]
    assert pending["call_id"] == call["call_id"]


def test_arguments_cut_off_are_not_run_and_never_handed_over(broker: RunningBroker) -> None:
    script = [{"name": "get_weather", "args": {"city": "Oslo"}, "after": 2}]
    turn = post_turn(
        broker,
        "cut",
        client_tools=[WEATHER],
        params=simulate(tool_calls=script, cut_during_tool_args=True),
    )
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert events[-1].data["status"] == "interrupted"
    (call,) = of_kind(events, "tool_call")
    assert (call["status"], call["reason"]) == ("not_run", "connection_lost")
    assert call["call_id"] == expected_id("conv-ct", "cut", "get_weather", 0)
    assert call["ordinal"] == 0
    (delta,) = of_kind(events, "tool_input_delta")  # the piece that arrived before the cut
    assert delta["call_id"] == call["call_id"]
    assert "client" not in [c["status"] for c in of_kind(events, "tool_call")]
    assert get_turn(broker.base_url, "cut").get("tool_calls") is None
    assert post_attempt(broker, "cut", "regenerate") == 201
    assert wait_final(broker.base_url, "cut")["status"] == "requires_action"


def test_a_reader_cut_mid_call_resumes_and_sees_each_event_once(broker: RunningBroker) -> None:
    turn = post_turn(
        broker, "resume", client_tools=CLIENT_TOOLS, params=simulate(tool_calls=TWO_CALLS)
    )
    whole = read_sse(broker.base_url, turn["stream_id"]).events
    first_delta = [e.event for e in whole].index("tool_input_delta")
    head = read_sse(broker.base_url, turn["stream_id"], stop_after=first_delta + 2).events
    assert head[-1].event == "tool_input_delta"  # cut between two pieces of one call
    tail = read_sse(broker.base_url, turn["stream_id"], last_event_id=head[-1].id).events
    joined = head + tail
    assert [(e.id, e.event, e.data) for e in joined] == [(e.id, e.event, e.data) for e in whole]
    assert len(of_kind(joined, "tool_call")) == 2
    assert joined[-1].data["status"] == "requires_action"


@pytest.fixture
def server_tools(tmp_path: Path, payments: ToolEndpoint) -> str:
    path = tmp_path / "tools.json"
    tool = {"name": "send_payment", "class": "unkeyed_write", "endpoint": payments.url}
    path.write_text(json.dumps({"tools": [tool]}))
    return str(path)


def test_server_and_client_calls_mix_in_one_message(
    broker_factory: BrokerFactory, server_tools: str, payments: ToolEndpoint
) -> None:
    broker = broker_factory(tools=server_tools)
    script = [
        {"name": "send_payment", "args": {"to": "bob", "amount": 10}, "after": 2},
        {"name": "get_weather", "args": {"city": "Oslo"}, "after": 2},
    ]
    turn = post_turn(broker, "mixed", client_tools=[WEATHER], params=simulate(tool_calls=script))
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert events[-1].data["status"] == "requires_action"
    calls = of_kind(events, "tool_call")
    assert [(c["name"], c["status"]) for c in calls] == [
        ("send_payment", "dispatched"),
        ("get_weather", "client"),
    ]
    (result,) = of_kind(events, "tool_result")
    assert (result["name"], result["source"], result["result"]) == (
        "send_payment",
        "ran",
        {"payment_id": "pay_1"},
    )
    assert len(payments.requests) == 1
    assert {d["name"] for d in of_kind(events, "tool_input_delta")} == {"get_weather"}
    (pending,) = get_turn(broker.base_url, "mixed")["tool_calls"]
    assert pending["name"] == "get_weather"
    # A client tool may not take a server tool's name.
    clash = post_turn(
        broker,
        "clash",
        client_tools=[{"name": "send_payment"}],
        params=simulate(),
        expect=400,
    )
    assert "client_tools[0].name 'send_payment' is a server tool" in clash["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"client_tools": [{"name": "1bad"}]}, "client_tools"),
        ({"client_tools": [{"name": "f"}, {"name": "f"}]}, "client_tools[1].name 'f'"),
        ({"client_tools": [{"name": "f", "parameters": []}]}, "client_tools"),
        ({"client_tools": [{"name": "f", "strict": True}]}, "client_tools"),
        ({"client_tools": [{"name": f"f{i}"} for i in range(129)]}, "more than 128"),
        (
            {"messages": [{"role": "tool", "content": "1", "tool_call_id": "nope"}]},
            "messages[0].tool_call_id 'nope'",
        ),
        ({"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "f"}]}
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_them(
    broker: RunningBroker, fields: dict[str, Any], named: str
) -> None:
    answer = post_turn(broker, "bad", expect=400, params=simulate(), **fields)
    assert named in answer["error"]["message"]


def test_other_client_tools_for_the_same_turn_id_are_a_conflict(broker: RunningBroker) -> None:
    post_turn(broker, "same", client_tools=[WEATHER], params=simulate())
    assert post_turn(broker, "same", client_tools=[WEATHER], params=simulate(), expect=200)
    post_turn(broker, "same", client_tools=[TIME], params=simulate(), expect=409)


async def test_the_python_client_starts_a_turn_with_client_tools(broker: RunningBroker) -> None:
    script = [{"name": "get_time", "args": {}, "after": 1}]
    async with BrokerClient(broker.base_url) as client:
        turn = await client.start_turn(
            "conv-py",
            [{"role": "user", "content": "What time is it?"}],
            turn_id="py-1",
            client_tools=[TIME],
            params=simulate(tool_calls=script),
        )
    state = await asyncio.to_thread(wait_final, broker.base_url, turn.turn_id)
    assert state["status"] == "requires_action"
    (pending,) = state["tool_calls"]
    assert (pending["name"], pending["arguments"]) == ("get_time", "{}")


# --- the OpenAI-compatible adapter -------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


def test_the_openai_adapter_offers_client_tools_and_sends_their_results(
    broker_factory: BrokerFactory, fake: FakeOpenAI
) -> None:
    broker = openai_broker(broker_factory, fake)
    fake.respond_tool_call("get_weather", ['{"city":', ' "Oslo"}'], call_id="call_upstream_1")
    first = post_turn(broker, "oa-1", provider="openai", client_tools=[WEATHER])
    events = read_sse(broker.base_url, first["stream_id"]).events
    assert events[-1].data["status"] == "requires_action"
    assert [d["delta"] for d in of_kind(events, "tool_input_delta")] == ['{"city":', ' "Oslo"}']
    (call,) = of_kind(events, "tool_call")
    assert call["call_id"] == expected_id("conv-ct", "oa-1", "get_weather", 0)
    assert "call_upstream_1" not in json.dumps([e.data for e in events])
    assert fake.bodies[0]["tools"] == offered_tools([WEATHER])
    fake.respond_text(["Clear", "."])
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call["call_id"], "name": "get_weather", "arguments": '{"city": "Oslo"}'}
            ],
        },
        {"role": "tool", "tool_call_id": call["call_id"], "content": '{"sky": "clear"}'},
    ]
    second = post_turn(broker, "oa-2", provider="openai", client_tools=[WEATHER], messages=history)
    rest = read_sse(broker.base_url, second["stream_id"]).events
    assert rest[-1].data["status"] == "complete"
    assert fake.bodies[1]["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["call_id"], "content": '{"sky": "clear"}'},
    ]


def test_arguments_that_are_not_json_are_not_run_and_the_model_is_told(
    broker_factory: BrokerFactory, fake: FakeOpenAI
) -> None:
    broker = openai_broker(broker_factory, fake)
    fake.respond_tool_call("get_weather", ['{"city":', " Oslo"])
    fake.respond_text(["Sorry", "."])
    turn = post_turn(broker, "oa-bad", provider="openai", client_tools=[WEATHER])
    events = read_sse(broker.base_url, turn["stream_id"]).events
    (call,) = of_kind(events, "tool_call")
    assert (call["status"], call["reason"], call["args"]) == (
        "not_run",
        "bad_arguments",
        '{"city": Oslo',
    )
    assert events[-1].data["status"] == "complete"  # the model answered the refusal
    told = fake.bodies[1]["messages"][-1]
    assert (told["role"], told["tool_call_id"]) == ("tool", call["call_id"])
    assert json.loads(told["content"])["code"] == "bad_arguments"


# --- the Anthropic adapter ---------------------------------------------------------------------


@pytest.fixture
def claude_fake() -> Iterator[FakeAnthropic]:
    server = FakeAnthropic(api_key=ANTHROPIC_KEY).start()
    yield server
    server.stop()


def test_the_anthropic_adapter_offers_client_tools_and_sends_tool_use_and_result(
    broker_factory: BrokerFactory, claude_fake: FakeAnthropic
) -> None:
    broker = claude_broker(broker_factory, claude_fake)
    claude_fake.tool_use("get_weather", ['{"city":', ' "Oslo"}'], tool_id="toolu_upstream")
    first = post_turn(broker, "an-1", provider="anthropic", client_tools=[WEATHER])
    events = read_sse(broker.base_url, first["stream_id"]).events
    assert events[-1].data["status"] == "requires_action"
    (call,) = of_kind(events, "tool_call")
    assert (call["status"], call["args"]) == ("client", {"city": "Oslo"})
    assert "toolu_upstream" not in json.dumps([e.data for e in events])
    assert claude_fake.calls[0].body["tools"] == [
        {
            "name": "get_weather",
            "input_schema": WEATHER["parameters"],
            "description": "The weather in a city",
        }
    ]
    claude_fake.text("Clear", ".")
    (pending,) = get_turn(broker.base_url, "an-1")["tool_calls"]
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": pending["call_id"], "name": "get_weather", "arguments": pending["arguments"]}
            ],
        },
        {"role": "tool", "tool_call_id": pending["call_id"], "content": '{"sky": "clear"}'},
    ]
    second = post_turn(
        broker, "an-2", provider="anthropic", client_tools=[WEATHER], messages=history
    )
    assert read_sse(broker.base_url, second["stream_id"]).events[-1].data["status"] == "complete"
    assert claude_fake.calls[1].messages == [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": pending["call_id"],
                    "name": "get_weather",
                    "input": {"city": "Oslo"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": pending["call_id"],
                    "content": '{"sky": "clear"}',
                }
            ],
        },
    ]
