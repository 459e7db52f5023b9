"""``tool_choice`` (``required``, a named function) and ``parallel_tool_calls: false``: the
turn's params as each provider sends them upstream (pure tables), the simulator honouring them,
and the doors through the official SDK (agent frameworks send them: the Agents SDK's
``ModelSettings(tool_choice=...)``, LangChain's ``bind_tools(tool_choice=...)``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import openai
import pytest

from broker.client_tools import check_tool_params
from broker.errors import BadRequest
from broker.providers import anthropic as anthropic_provider
from broker.providers import openai as openai_provider
from broker.providers.base import GenerationRequest
from broker.providers.simulated import SimulatedProvider, _chosen_calls, _script_messages, _unmade
from tests.conftest import BrokerFactory, RunningBroker
from tests.fake_openai import FakeOpenAI
from tests.test_openai_contract import check_completion, check_response
from tests.test_openai_dialect import client
from tests.test_provider_openai import openai_broker

NAMED = {"tool_choice": {"name": "get_time"}}
ONE = {"parallel_tool_calls": False}


@pytest.mark.parametrize(
    ("params", "openai_choice", "anthropic_choice"),
    [
        ({}, openai.omit, None),
        ({"tool_choice": "auto"}, "auto", {"type": "auto"}),
        ({"tool_choice": "none"}, "none", {"type": "none"}),
        ({"tool_choice": "required"}, "required", {"type": "any"}),
        (
            NAMED,
            {"type": "function", "function": {"name": "get_time"}},
            {"type": "tool", "name": "get_time"},
        ),
        (ONE, openai.omit, {"type": "auto", "disable_parallel_tool_use": True}),
        (
            {"tool_choice": "required", **ONE},
            "required",
            {"type": "any", "disable_parallel_tool_use": True},
        ),
        (
            {**NAMED, **ONE},
            {"type": "function", "function": {"name": "get_time"}},
            {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        ),
        ({"tool_choice": "none", **ONE}, "none", {"type": "none"}),
    ],
)
def test_each_provider_sends_the_choice_as_its_upstream_takes_it(
    params: dict[str, Any], openai_choice: Any, anthropic_choice: Any
) -> None:
    check_tool_params(params)
    assert openai_provider.tool_choice(params) == openai_choice
    assert anthropic_provider.tool_choice(params) == anthropic_choice


@pytest.mark.parametrize(
    "params",
    [
        {"tool_choice": "any"},
        {"tool_choice": {"name": "1bad"}},
        {"tool_choice": {"name": "f", "type": "function"}},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"parallel_tool_calls": "no"},
    ],
)
def test_a_malformed_choice_is_a_400_naming_it(params: dict[str, Any]) -> None:
    with pytest.raises(BadRequest, match=f"params.{next(iter(params))}"):
        check_tool_params(params)
    for provider in (
        SimulatedProvider(),
        openai_provider.OpenAIProvider(base_url="http://127.0.0.1:9", api_key=None, models=()),
    ):
        with pytest.raises(BadRequest):
            provider.validate_params(params)


def request(params: dict[str, Any], client_tools: list[str]) -> GenerationRequest:
    return GenerationRequest(
        "c",
        "t",
        1,
        "initial",
        [],
        None,
        params,
        "text",
        0,
        client_tools=[{"name": n} for n in client_tools],
    )


SCRIPT = [
    {"name": "get_weather", "args": {"city": "Oslo"}, "after": 2},
    {"name": "get_time", "args": {"zone": "Europe/Oslo"}, "after": 2},
]
TOOLS = ["get_weather", "get_time"]


@pytest.mark.parametrize(
    ("script", "params", "messages"),
    [
        (SCRIPT, {}, [SCRIPT]),
        (SCRIPT, ONE, [[SCRIPT[0]], [SCRIPT[1]]]),
        (SCRIPT, NAMED, [[SCRIPT[1]]]),
        (SCRIPT, {"tool_choice": "none"}, []),
        (SCRIPT, {"tool_choice": "required"}, [SCRIPT]),
        ([], {"tool_choice": "required"}, [[{"name": "get_weather"}]]),
        ([], NAMED, [[{"name": "get_time"}]]),
        ([SCRIPT[0]], NAMED, [[{"name": "get_time"}]]),
        ([], {}, []),
    ],
)
def test_the_simulator_makes_the_calls_the_choice_lets_it(
    script: list[dict[str, Any]], params: dict[str, Any], messages: list[Any]
) -> None:
    chosen = _chosen_calls(script, request(params, TOOLS))
    assert _script_messages(chosen, params.get("parallel_tool_calls", True)) == messages


def made(*calls: tuple[str, str]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"c{i}", "name": n, "arguments": a} for i, (n, a) in enumerate(calls)
        ],
    }


USER = {"role": "user", "content": "Weather and time?"}
WEATHER_MADE = ("get_weather", '{"city": "Oslo"}')
TIME_MADE = ("get_time", '{"zone":"Europe/Oslo"}')


@pytest.mark.parametrize(
    ("history", "left"),
    [
        ([USER], SCRIPT),
        ([USER, made(WEATHER_MADE)], [SCRIPT[1]]),
        ([USER, made(TIME_MADE)], [SCRIPT[0]]),
        ([USER, made(WEATHER_MADE, TIME_MADE)], []),
        ([USER, made(WEATHER_MADE), USER], SCRIPT),  # a new question: the script again
        ([USER, made(("get_weather", '{"city": "Rome"}'))], SCRIPT),  # other arguments
        ([USER, made(("get_weather", "not json"))], SCRIPT),
    ],
)
def test_the_simulator_does_not_make_again_the_calls_the_history_made(
    history: list[dict[str, Any]], left: list[dict[str, Any]]
) -> None:
    assert _unmade(SCRIPT, history) == left


# --- the doors, through the SDK -----------------------------------------------------------------

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME: Any = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


def simulate(**knobs: Any) -> dict[str, Any]:
    return {"broker": {"params": {"simulate": {"tokens": 6, "tokens_per_s": 0, **knobs}}}}


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


def names_of(output: list[Any]) -> list[str]:
    return [o.name for o in output if o.type == "function_call"]


def test_responses_honours_a_named_function_and_echoes_it(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        response = sdk.responses.create(
            model="simulated",
            input="Time?",
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "name": "get_time"},
            extra_body=simulate(tool_calls=SCRIPT),
        )
    assert names_of(response.output) == ["get_time"]
    body = response.to_dict()
    assert body["tool_choice"] == {"type": "function", "name": "get_time"}
    check_response(body)


def test_responses_makes_one_call_per_response_without_parallel_calls(
    broker: RunningBroker,
) -> None:
    with client(broker) as sdk:
        ask: Any = {
            "model": "simulated",
            "tools": [WEATHER, TIME],
            "parallel_tool_calls": False,
            "extra_body": simulate(tool_calls=SCRIPT),
        }
        first = sdk.responses.create(input="Weather and time?", **ask)
        assert names_of(first.output) == ["get_weather"]
        assert first.parallel_tool_calls is False
        check_response(first.to_dict())
        results: Any = [
            {"type": "function_call_output", "call_id": o.call_id, "output": "1"}
            for o in first.output
            if o.type == "function_call"
        ]
        second = sdk.responses.create(previous_response_id=first.id, input=results, **ask)
        assert names_of(second.output) == ["get_time"]
        results = [
            {"type": "function_call_output", "call_id": o.call_id, "output": "2"}
            for o in second.output
            if o.type == "function_call"
        ]
        third = sdk.responses.create(previous_response_id=second.id, input=results, **ask)
    assert names_of(third.output) == []
    assert third.output_text.startswith("(1 tool results")


CHAT_TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.mark.parametrize(
    ("choice", "called"),
    [
        ("required", ["get_weather"]),  # no script: the first tool, as a model must call one
        ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
    ],
)
def test_chat_completions_honours_required_and_a_named_function(
    broker: RunningBroker, choice: Any, called: list[str]
) -> None:
    with client(broker) as sdk:
        done = sdk.chat.completions.create(
            model="simulated",
            messages=[{"role": "user", "content": "Time?"}],
            tools=CHAT_TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            extra_body=simulate(),
        )
    check_completion(done.to_dict())
    assert done.choices[0].finish_reason == "tool_calls"
    calls = done.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls if c.type == "function"] == called


# --- an OpenAI-compatible upstream gets them --------------------------------------------------


def test_an_openai_compatible_upstream_gets_the_choice(broker_factory: BrokerFactory) -> None:
    """The Chat Completions door through the ``openai`` provider: the upstream is asked for a
    call of the named function, one at most, and the broker hands the client that call."""
    fake = FakeOpenAI().start()
    try:
        fake.respond_tool_call("get_time", ['{"zone":', '"UTC"}'], call_id="call_up")
        broker = openai_broker(broker_factory, fake)
        with client(broker) as sdk:
            done = sdk.chat.completions.create(
                model="openai/gpt-test",
                messages=[{"role": "user", "content": "Time?"}],
                tools=CHAT_TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                parallel_tool_calls=False,
            )
        (sent,) = fake.bodies
    finally:
        fake.stop()
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert sent["parallel_tool_calls"] is False
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "get_time"]
    (call,) = done.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_time"
    assert call.id != "call_up"  # the broker's id, from the call's slot


def test_without_tools_nothing_about_them_goes_upstream(broker_factory: BrokerFactory) -> None:
    fake = FakeOpenAI().start()
    try:
        fake.respond_text(["Hi"])
        broker = openai_broker(broker_factory, fake)
        with client(broker) as sdk:
            sdk.chat.completions.create(
                model="openai/gpt-test",
                messages=[{"role": "user", "content": "Hi?"}],
                parallel_tool_calls=False,
            )
        (sent,) = fake.bodies
    finally:
        fake.stop()
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(sent)


def test_anthropic_gets_the_choice_in_its_body() -> None:
    tools = [{"name": "get_weather"}, {"name": "get_time"}]
    asked = GenerationRequest(
        "c",
        "t",
        1,
        "initial",
        [{"role": "user", "content": "Time?"}],
        "m",
        {"tool_choice": "required", "parallel_tool_calls": False},
        "text",
        0,
        client_tools=tools,
    )
    body, _ = anthropic_provider.build_body(asked, 1024)
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert [t["name"] for t in body["tools"]] == ["get_weather", "get_time"]
    bare = dataclasses.replace(asked, client_tools=[])
    assert "tool_choice" not in anthropic_provider.build_body(bare, 1024)[0]
