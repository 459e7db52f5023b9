"""The Anthropic adapter end to end: a real broker streaming from a fake Messages API on loopback.

Text, usage and tool calls as the broker's events; the taxonomy's silent retries and immediate
failures; interruptions by an error event, a cut or a silent upstream; stop reaching the
upstream; ``continue`` as Anthropic's native prefill.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.errors import BadRequest
from broker.providers.anthropic import JSON_INSTRUCTION, AnthropicProvider, build_body
from broker.providers.base import Finished, GenerationRequest, ToolStep, UpstreamError
from tests.conftest import BrokerFactory, RunningBroker
from tests.fake_anthropic import FakeAnthropic, words
from tests.helpers import (
    SSEEvent,
    ToolEndpoint,
    get_turn,
    read_sse,
    text_of,
    wait_final,
    wait_until,
)

KEY = "sk-ant-test-secret"
MODELS = "claude-test,claude-other"
WEATHER_SCHEMA = {
    "type": "object",
    "required": ["city"],
    "properties": {"city": {"type": "string"}},
}
WEATHER = {"temp_c": 21, "sky": "clear"}


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    server = FakeAnthropic(api_key=KEY).start()
    yield server
    server.stop()


def claude_broker(factory: BrokerFactory, fake: FakeAnthropic, **overrides: Any) -> RunningBroker:
    """A broker whose ``anthropic`` provider points at ``fake``.

    The short heartbeat bounds a live read that misses its ``end`` event: a stream feed that
    starts after a burst of events (the whole answer, when the upstream is fast) delivers them
    only with a later event, and a final turn has none, so the read waits for the heartbeat's
    re-check.
    """
    settings: dict[str, Any] = {
        "anthropic_base_url": fake.url,
        "anthropic_api_key": KEY,
        "anthropic_models": MODELS,
        "retry_backoff_min_ms": 1,
        "retry_backoff_max_ms": 5,
        "sse_heartbeat_s": 1.0,
    }
    return factory(**{**settings, **overrides})


@pytest.fixture
def claude(broker_factory: BrokerFactory, fake: FakeAnthropic) -> RunningBroker:
    return claude_broker(broker_factory, fake)


def post_turn(broker: RunningBroker, turn_id: str, **fields: Any) -> httpx.Response:
    body: dict[str, Any] = {
        "conversation_id": f"conv-{turn_id}",
        "turn_id": turn_id,
        "provider": "anthropic",
        "messages": [{"role": "user", "content": "Tell me about tunnels"}],
        **fields,
    }
    return httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10)


def run_turn(broker: RunningBroker, turn_id: str, **fields: Any) -> list[SSEEvent]:
    """Start a turn and read its stream to the ``end`` event."""
    response = post_turn(broker, turn_id, **fields)
    assert response.status_code == 201, response.text
    return read_sse(broker.base_url, response.json()["stream_id"]).events


def kinds(events: list[SSEEvent]) -> list[str]:
    return [e.event for e in events]


# --- a normal answer ---------------------------------------------------------------------------


def test_a_turn_streams_text_and_usage(claude: RunningBroker, fake: FakeAnthropic) -> None:
    fake.text("Tunnels", " are", " dug.", input_tokens=12, output_tokens=3)
    events = run_turn(
        claude,
        "plain",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about tunnels", "name": "ana"},
        ],
    )
    assert kinds(events) == ["attempt", "delta", "delta", "delta", "usage", "end"]
    assert text_of(events) == "Tunnels are dug."
    assert events[4].data == {"attempt": 1, "input_tokens": 12, "output_tokens": 3}
    assert events[-1].data == {"attempt": 1, "status": "complete", "reason": None}
    assert get_turn(claude.base_url, "plain")["canonical"] == {
        "attempt": 1,
        "text": "Tunnels are dug.",
    }
    (call,) = fake.calls
    assert call.body == {
        "model": "claude-test",
        "max_tokens": 4096,
        "stream": True,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Tell me about tunnels"}],
    }
    assert call.headers["authorization"] == f"Bearer {KEY}"
    assert call.headers["anthropic-version"]


def test_params_model_and_json_mode_shape_the_request(
    claude: RunningBroker, fake: FakeAnthropic
) -> None:
    fake.text('{"tunnels":', " 3}")
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "a partial answer", "partial": True},
        {"role": "user", "content": "two"},
        {"role": "user", "content": "   "},
        {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "three"},
    ]
    params = {"temperature": 0.2, "top_p": 0.9, "top_k": 5, "max_tokens": 64, "stop": "END"}
    events = run_turn(
        claude,
        "shaped",
        messages=history,
        model="claude-other",
        params=params,
        response_format="json",
    )
    assert events[-1].data["status"] == "complete"
    assert json.loads(text_of(events)) == {"tunnels": 3}
    (call,) = fake.calls
    assert call.body["model"] == "claude-other"
    assert call.body["system"] == f"Be brief.\n\nUse metric units.\n\n{JSON_INSTRUCTION}"
    assert call.messages == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "a partial answer"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "three"}],
        },
    ]
    assert {k: call.body[k] for k in ("temperature", "top_p", "top_k", "max_tokens")} == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 5,
        "max_tokens": 64,
    }
    assert call.body["stop_sequences"] == ["END"]


def test_a_json_schema_format_is_told_in_the_system_prompt_and_checked(
    claude: RunningBroker, fake: FakeAnthropic
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    form = {"type": "json_schema", "name": "count", "schema": schema, "description": "a count"}
    fake.text('{"n":', " 3}")
    fake.text('{"m":', " 3}")
    good = run_turn(claude, "schema-good", response_format=form)
    bad = run_turn(claude, "schema-bad", response_format=form)
    assert good[-1].data["status"] == "complete"
    assert bad[-1].data["status"] == "failed"
    assert bad[-1].data["reason"] == "invalid_output"
    (error,) = [e.data for e in bad if e.event == "error"]
    assert "at $: 'n' is a required property" in error["message"]
    system = fake.calls[0].body["system"]
    assert system.startswith(JSON_INSTRUCTION)
    assert "JSON Schema, named count (a count): " in system
    assert json.loads(system.split("(a count): ", 1)[1]) == schema


def test_unknown_params_and_models_are_refused_before_any_call(
    claude: RunningBroker, fake: FakeAnthropic
) -> None:
    unknown = post_turn(claude, "knob", params={"simulate": {"tokens": 3}, "seed": 1})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["code"] == "bad_request"
    assert "seed, simulate" in unknown.json()["error"]["message"]
    model = post_turn(claude, "model", model="claude-nope")
    assert model.status_code == 400
    assert model.json()["error"]["code"] == "unknown_model"
    assert post_turn(claude, "temp", params={"temperature": 3}).status_code == 400
    assert fake.calls == []


# --- tool calls --------------------------------------------------------------------------------


@pytest.fixture
def weather() -> Iterator[ToolEndpoint]:
    """A tool endpoint that answers every call with the same weather."""
    endpoint = ToolEndpoint("/weather", lambda _: WEATHER)
    yield endpoint
    endpoint.close()


def test_a_tool_call_runs_and_the_next_request_carries_use_and_result(
    broker_factory: BrokerFactory, fake: FakeAnthropic, weather: ToolEndpoint, tmp_path: Path
) -> None:
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(
        json.dumps(
            {
                "tools": [
                    {
                        "name": "get_weather",
                        "class": "read",
                        "schema": WEATHER_SCHEMA,
                        "endpoint": weather.url,
                    }
                ]
            }
        )
    )
    broker = claude_broker(broker_factory, fake, tools=str(tools_file))
    fake.tool_use(
        "get_weather",
        ['{"city": ', '"Par', 'is"}'],
        tool_id="toolu_01A",
        text=["Let me check", "."],
    )
    fake.text("It is 21 °C", " and clear.")
    function = {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_SCHEMA}
    events = run_turn(broker, "tools", tools=[{"type": "function", "function": function}])
    assert kinds(events) == [
        "attempt",
        "delta",
        "delta",
        "tool_call",
        "tool_result",
        "usage",
        "delta",
        "delta",
        "usage",
        "end",
    ]
    call_event, result_event = events[3].data, events[4].data
    assert call_event == {
        "attempt": 1,
        "call_id": "toolu_01A",
        "name": "get_weather",
        "args": {"city": "Paris"},
        "ordinal": 0,
        "status": "dispatched",
    }
    assert (result_event["source"], result_event["result"]) == ("ran", WEATHER)
    assert events[-1].data["status"] == "complete"
    assert text_of(events) == "Let me check.It is 21 °C and clear."
    assert weather.bodies == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    first, follow_up = fake.calls
    anthropic_tool = {
        "name": "get_weather",
        "description": "Weather now",
        "input_schema": WEATHER_SCHEMA,
    }
    assert first.body["tools"] == follow_up.body["tools"] == [anthropic_tool]
    assert follow_up.messages[:-2] == first.messages
    assistant, user = follow_up.messages[-2:]
    assert assistant == {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {
                "type": "tool_use",
                "id": "toolu_01A",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    }
    (result,) = user["content"]
    assert user["role"] == "user"
    assert (result["type"], result["tool_use_id"]) == ("tool_result", "toolu_01A")
    assert json.loads(result["content"]) == WEATHER


# --- retries and failures before the first delta -----------------------------------------------


def test_a_429_is_retried_silently(claude: RunningBroker, fake: FakeAnthropic) -> None:
    fake.fail_status(429, retry_after="30")  # held within the 1..5 ms window
    fake.text("After", " the", " wait.")
    began = time.monotonic()
    events = run_turn(claude, "limited")
    assert time.monotonic() - began < 20  # not the 30 s the upstream asked (a loaded machine)
    assert kinds(events).count("attempt") == 1
    assert "error" not in kinds(events)
    assert events[-1].data == {"attempt": 1, "status": "complete", "reason": None}
    assert text_of(events) == "After the wait."
    assert [call.status for call in fake.calls] == [429, 200]
    assert fake.calls[1].body == fake.calls[0].body
    assert (
        claude.metric(
            "broker_retries_total", '{code="upstream_rate_limited",reason="upstream_error"}'
        )
        == 1
    )


@pytest.mark.parametrize("where", ["status", "event", "truncated"])
def test_overloaded_or_cut_before_the_first_delta_is_retried(
    claude: RunningBroker, fake: FakeAnthropic, where: str
) -> None:
    if where == "status":
        fake.fail_status(529, message="Overloaded")
    elif where == "event":
        fake.error_event_after(0)
    else:
        fake.truncate_after(0)
    fake.text("Fine", " now.")
    events = run_turn(claude, f"busy-{where}")
    assert kinds(events) == ["attempt", "delta", "delta", "usage", "end"]
    assert events[-1].data["status"] == "complete"
    assert len(fake.calls) == 2


def test_a_401_fails_at_once_and_never_shows_the_key(
    claude: RunningBroker, fake: FakeAnthropic
) -> None:
    # An upstream (or a proxy in front of it) that echoes the key it refused.
    fake.fail_status(401, message=f"invalid x-api-key: {KEY}")
    events = run_turn(claude, "denied")
    assert kinds(events) == ["attempt", "error", "end"]
    error = events[1].data
    assert (error["code"], error["retryable"]) == ("upstream_unauthorized", False)
    assert "authentication_error" in error["message"]
    assert events[-1].data == {"attempt": 1, "status": "failed", "reason": "upstream_unauthorized"}
    turn = wait_final(claude.base_url, "denied")
    assert turn["status"] == "failed"
    assert turn["attempts"][0]["reason"] == "upstream_unauthorized"
    assert len(fake.calls) == 1
    stream_id = turn["stream_id"]
    texts = [
        httpx.get(f"{claude.base_url}/v1/streams/{stream_id}", timeout=10).text,
        httpx.get(f"{claude.base_url}/v1/streams/{stream_id}?format=json", timeout=10).text,
        httpx.get(f"{claude.base_url}/v1/turns/denied", timeout=10).text,
        httpx.get(f"{claude.base_url}/v1/conversations/conv-denied/messages", timeout=10).text,
    ]
    assert all("upstream_unauthorized" in text for text in texts[:3])
    assert not any(KEY in text for text in texts)


# --- after the first delta: interruptions ---------------------------------------------------


def test_an_error_event_after_100_deltas_interrupts(
    claude: RunningBroker, fake: FakeAnthropic
) -> None:
    fake.error_event_after(100)
    events = run_turn(claude, "overloaded")
    assert kinds(events).count("delta") == 100
    assert events[-2].event == "error"
    assert events[-2].data["code"] == "upstream_overloaded"
    assert events[-2].data["retryable"] is True
    assert events[-1].data == {"attempt": 1, "status": "interrupted", "reason": "upstream_error"}
    turn = get_turn(claude.base_url, "overloaded")
    assert turn["canonical"] == {"attempt": 1, "text": "".join(words(100))}
    assert len(fake.calls) == 1


@pytest.mark.parametrize(
    ("cut", "code"), [("truncate", "upstream_incomplete"), ("drop", "upstream_connection")]
)
def test_a_stream_cut_before_message_stop_interrupts(
    claude: RunningBroker, fake: FakeAnthropic, cut: str, code: str
) -> None:
    if cut == "truncate":
        fake.truncate_after(5)  # a clean end of the body, without message_stop
    else:
        fake.drop_after(5)  # the socket closes inside the chunked body
    events = run_turn(claude, f"cut-{cut}")
    assert kinds(events).count("delta") == 5
    assert events[-2].data["code"] == code
    assert events[-1].data == {"attempt": 1, "status": "interrupted", "reason": "upstream_error"}
    assert get_turn(claude.base_url, f"cut-{cut}")["canonical"]["text"] == "".join(words(5))
    assert len(fake.calls) == 1


def test_a_silent_upstream_times_out_and_is_hung_up_on(
    broker_factory: BrokerFactory, fake: FakeAnthropic
) -> None:
    broker = claude_broker(broker_factory, fake, upstream_idle_timeout_s=0.3)
    fake.stall_after(3)
    events = run_turn(broker, "stalled")
    assert kinds(events).count("delta") == 3
    assert events[-1].data == {"attempt": 1, "status": "interrupted", "reason": "upstream_timeout"}
    wait_until(lambda: fake.calls[0].disconnected_at is not None, timeout=2)
    assert not fake.calls[0].completed


# --- stop and continue ---------------------------------------------------------------------------


def test_stop_closes_the_upstream_connection_within_a_second(
    claude: RunningBroker, fake: FakeAnthropic
) -> None:
    fake.slow(400, interval=0.02)
    response = post_turn(claude, "stopped")
    assert response.status_code == 201
    seen = read_sse(claude.base_url, response.json()["stream_id"], stop_after=4).events
    assert kinds(seen) == ["attempt", "delta", "delta", "delta"]
    began = time.monotonic()
    cancel = httpx.post(f"{claude.base_url}/v1/turns/stopped/cancel", timeout=10)
    assert cancel.status_code == 200
    left = wait_until(lambda: fake.calls[0].disconnected_at, timeout=1.0)
    assert left - began < 1.0
    assert fake.calls[0].deltas_sent < 400
    final = wait_final(claude.base_url, "stopped")
    assert final["status"] == "cancelled"
    assert final["canonical"]["text"].startswith("word0 word1 word2")
    assert len(fake.calls) == 1


def test_continue_sends_the_partial_as_a_native_prefill(
    claude: RunningBroker, fake: FakeAnthropic
) -> None:
    fake.error_event_after(4, pieces=["Once", " upon", " a", " time, ", "there", " was"])
    first = run_turn(claude, "story")
    partial = text_of(first)
    assert partial == "Once upon a time, "
    assert first[-1].data["status"] == "interrupted"
    fake.text(" there", " was", " a broker.")
    response = httpx.post(
        f"{claude.base_url}/v1/turns/story/attempts", json={"strategy": "continue"}, timeout=10
    )
    assert response.status_code == 201
    stream_id = get_turn(claude.base_url, "story")["stream_id"]
    rest = read_sse(claude.base_url, stream_id, last_event_id=first[-1].id).events
    assert rest[0].data == {"attempt": 2, "strategy": "continue"}
    assert rest[-1].data == {"attempt": 2, "status": "complete", "reason": None}
    initial, continued = fake.calls
    # The API refuses a final assistant message ending in whitespace: the prefill is stripped,
    # and the model's repeat of that space is not shown twice.
    assert continued.messages == [
        *initial.messages,
        {"role": "assistant", "content": "Once upon a time,"},
    ]
    assert text_of(rest) == "there was a broker."
    assert get_turn(claude.base_url, "story")["canonical"] == {
        "attempt": 2,
        "text": "Once upon a time, there was a broker.",
    }


# --- the adapter on its own ----------------------------------------------------------------------


def request(**fields: Any) -> GenerationRequest:
    values: dict[str, Any] = {
        "conversation_id": "c",
        "turn_id": "t",
        "attempt": 1,
        "strategy": "initial",
        "messages": [{"role": "user", "content": "hi"}],
        "model": "claude-test",
        "params": {},
        "response_format": "text",
        "upstream_call": 0,
    }
    return GenerationRequest(**{**values, **fields})


async def test_retry_after_reaches_the_broker(fake: FakeAnthropic) -> None:
    provider = AnthropicProvider(base_url=fake.url, api_key=KEY, models=("claude-test",))
    fake.fail_status(429, retry_after="7")
    with pytest.raises(UpstreamError) as caught:
        async for _event in provider.stream(request()):
            pass
    assert (caught.value.code, caught.value.retryable) == ("upstream_rate_limited", True)
    assert caught.value.retry_after_s == 7.0
    await provider.aclose()


async def test_a_finished_answer_leaves_its_connection_for_the_next(fake: FakeAnthropic) -> None:
    provider = AnthropicProvider(base_url=fake.url, api_key=KEY, models=("claude-test",))
    for _ in range(2):
        fake.text("Hi", " there.")
        stream = provider.stream(request())
        async for event in stream:
            if isinstance(event, Finished):
                break  # as the broker does: it closes the generator at the terminal event
        await stream.aclose()
    first, second = fake.calls
    assert [first.completed, second.completed] == [True, True]
    assert first.peer == second.peer  # the body was read to its end, the connection kept
    await provider.aclose()


def test_tool_formats_steps_and_tool_messages_map_to_anthropic_blocks() -> None:
    native = {"name": "lookup", "description": "Find", "input_schema": {"type": "object"}}
    step = ToolStep(
        "",
        [{"id": "toolu_1", "name": "lookup", "arguments": '{"q": "x"}'}],
        [{"id": "toolu_1", "name": "lookup", "content": '{"hits": 2}'}],
    )
    body, stripped = build_body(
        request(
            messages=[
                {"role": "user", "content": "find x"},
                {"role": "tool", "name": "lookup", "content": "earlier result"},
                {"role": "assistant", "content": "Looking "},
            ],
            tools=[native, {"type": "function", "function": {"name": "plain"}}],
            tool_steps=[step],
        ),
        100,
    )
    assert stripped == ""  # the last message is the tool results, not a prefill
    assert body["tools"] == [
        native,
        {"name": "plain", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "find x"},
                {"type": "text", "text": "[result of the tool lookup]\nearlier result"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking "},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"hits": 2}'}
            ],
        },
    ]
    assert body["max_tokens"] == 100


def test_the_description_shows_where_but_never_the_key() -> None:
    provider = AnthropicProvider(
        base_url="https://user:pw@llm.example:8443/", api_key=KEY, models=("claude-test",)
    )
    assert provider.description == "Anthropic Messages API at https://llm.example:8443/"
    assert KEY not in provider.description
    with pytest.raises(BadRequest, match="simulate"):
        provider.validate_params({"simulate": {}})
    provider.validate_params({"stop": ["a", "b"], "max_tokens": 5})
