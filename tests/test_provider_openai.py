"""The OpenAI-compatible adapter against a fake Chat Completions server on loopback: through a
real broker end to end, and the adapter alone where the exact error matters."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from broker.errors import BadRequest
from broker.providers.base import (
    Finished,
    GenerationRequest,
    ProviderEvent,
    TextDelta,
    ToolCallChunk,
    ToolStep,
    UpstreamError,
    Usage,
)
from broker.providers.openai import OpenAIProvider, render_messages
from tests.conftest import BrokerFactory, RunningBroker, free_port
from tests.fake_openai import FakeOpenAI, scripted_text
from tests.helpers import (
    SSEEvent,
    ToolEndpoint,
    get_turn,
    read_sse,
    text_of,
    wait_final,
    wait_until,
)

KEY = "sk-test-secret"
PROMPT = [{"role": "user", "content": "Tell me about tunnels"}]


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


def openai_broker(
    broker_factory: BrokerFactory, fake: FakeOpenAI, **overrides: Any
) -> RunningBroker:
    settings: dict[str, Any] = {
        "openai_base_url": fake.url + "/v1",
        "openai_api_key": KEY,
        "openai_models": "gpt-test,gpt-other",
        "retry_backoff_min_ms": 1,
        "retry_backoff_max_ms": 5,
    }
    return broker_factory(**{**settings, **overrides})


@pytest.fixture
def broker(broker_factory: BrokerFactory, fake: FakeOpenAI) -> RunningBroker:
    return openai_broker(broker_factory, fake)


def post_turn(
    broker: RunningBroker, turn_id: str, *, expect: int = 201, **fields: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "conversation_id": "conv-oa",
        "turn_id": turn_id,
        "provider": "openai",
        "messages": PROMPT,
        **fields,
    }
    response = httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10)
    assert response.status_code == expect, response.text
    result: dict[str, Any] = response.json()
    return result


def run_turn(broker: RunningBroker, turn_id: str, **fields: Any) -> list[SSEEvent]:
    """Start a turn and read its stream to the end."""
    turn = post_turn(broker, turn_id, **fields)
    return read_sse(broker.base_url, turn["stream_id"]).events


def kinds(events: list[SSEEvent]) -> list[str]:
    return [e.event for e in events]


def end_of(events: list[SSEEvent]) -> dict[str, Any]:
    assert events[-1].event == "end"
    return events[-1].data


def error_of(events: list[SSEEvent]) -> dict[str, Any]:
    (error,) = [e.data for e in events if e.event == "error"]
    return error


# --- through the broker ----------------------------------------------------------------------


def test_a_turn_streams_text_then_usage(broker: RunningBroker, fake: FakeOpenAI) -> None:
    fake.respond_text(["Hello", ",", " wörld", " 🚀"], usage=(17, 4))
    events = run_turn(broker, "plain")
    assert kinds(events) == ["attempt", "delta", "delta", "delta", "delta", "usage", "end"]
    assert text_of(events) == "Hello, wörld 🚀"
    usage = events[-2].data
    assert (usage["input_tokens"], usage["output_tokens"]) == (17, 4)
    assert end_of(events) == {"attempt": 1, "status": "complete", "reason": None}
    assert get_turn(broker.base_url, "plain")["canonical"]["text"] == "Hello, wörld 🚀"
    (request,) = fake.requests
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body == {
        "model": "gpt-test",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": PROMPT,
    }


def test_params_model_format_and_messages_reach_the_upstream(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    fake.respond_text(['{"answer"', ": 42}"])
    params = {
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 64,
        "stop": ["\n\n"],
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": -0.5,
    }
    messages = [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Half an ans", "partial": True},
        {"role": "user", "content": "The meaning of life?"},
    ]
    events = run_turn(
        broker,
        "params",
        model="gpt-other",
        params=params,
        messages=messages,
        response_format="json",
    )
    assert end_of(events)["status"] == "complete"
    body = fake.bodies[0]
    assert body["model"] == "gpt-other"
    assert {key: body[key] for key in params} == params
    assert body["response_format"] == {"type": "json_object"}
    assert body["messages"] == [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Half an ans"},  # the broker's `partial` stays home
        {"role": "user", "content": "The meaning of life?"},
    ]
    assert "continue_final_message" not in body


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
}


def test_a_json_schema_format_reaches_the_upstream_and_its_answer_is_validated(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    fake.respond_text(['{"answer"', ": 42}"])
    fake.respond_text(['{"answer"', ': "many"}'])
    form = {"type": "json_schema", "name": "life", "schema": SCHEMA, "strict": True}
    events = run_turn(broker, "schema-good", response_format=form)
    assert end_of(events)["status"] == "complete"
    assert fake.bodies[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "life", "schema": SCHEMA, "strict": True},
    }
    events = run_turn(broker, "schema-bad", response_format={**form, "strict": None})
    assert end_of(events)["status"] == "failed"
    assert end_of(events)["reason"] == "invalid_output"
    assert "at $.answer: 'many' is not of type 'integer'" in error_of(events)["message"]
    assert fake.bodies[1]["response_format"]["json_schema"] == {"name": "life", "schema": SCHEMA}


@pytest.fixture
def weather() -> Iterator[ToolEndpoint]:
    """A tool endpoint that answers every call with the same weather."""
    endpoint = ToolEndpoint("/weather", lambda _: {"sky": "clear", "celsius": 21})
    yield endpoint
    endpoint.close()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_calls_run_and_their_results_go_back_to_the_model(
    broker_factory: BrokerFactory, fake: FakeOpenAI, weather: ToolEndpoint, tmp_path: Path
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(
        json.dumps(
            {
                "tools": [
                    {
                        "name": "get_weather",
                        "class": "read",
                        "schema": {"type": "object"},
                        "endpoint": weather.url,
                    },
                ]
            }
        )
    )
    broker = openai_broker(broker_factory, fake, tools=str(tools))
    fake.respond_tool_call(
        "get_weather", ['{"city":', ' "Par', 'is"}'], call_id="call_w1", text=["Let me look."]
    )
    fake.respond_text(["Clear", " and 21 °C."])
    events = run_turn(broker, "tools", tools=[WEATHER_TOOL])
    assert kinds(events) == [
        "attempt",
        "delta",
        "usage",
        "tool_call",
        "tool_result",
        "delta",
        "delta",
        "usage",
        "end",
    ]
    call, result = events[3].data, events[4].data
    assert (call["call_id"], call["name"], call["args"]) == (
        "call_w1",
        "get_weather",
        {"city": "Paris"},
    )
    assert (result["source"], result["result"]) == ("ran", {"sky": "clear", "celsius": 21})
    assert weather.bodies == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert end_of(events) == {"attempt": 1, "status": "complete", "reason": None}
    first, second = fake.bodies
    assert first["tools"] == second["tools"] == [WEATHER_TOOL]
    assert second["messages"] == [
        *PROMPT,
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_w1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_w1", "content": '{"sky":"clear","celsius":21}'},
    ]


def test_a_rate_limit_before_the_first_delta_is_retried_silently(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    fake.fail_status(429, retry_after="1")
    fake.respond_text(["After", " the", " wait"])
    events = run_turn(broker, "limited")
    assert kinds(events).count("attempt") == 1
    assert "error" not in kinds(events)
    assert text_of(events) == "After the wait"
    assert end_of(events) == {"attempt": 1, "status": "complete", "reason": None}
    assert len(fake.requests) == 2
    assert (
        broker.metric(
            "broker_retries_total", '{code="upstream_rate_limited",reason="upstream_error"}'
        )
        == 1
    )


def retries(broker: RunningBroker, code: str) -> float:
    return broker.metric("broker_retries_total", f'{{code="{code}",reason="upstream_error"}}')


def test_a_rate_limit_and_an_outage_count_as_retries_of_their_own_codes(
    broker_factory: BrokerFactory, fake: FakeOpenAI
) -> None:
    """Issue 34, finding 11: a 429 and a 500 were both counted as reason="upstream_error",
    so a retry dashboard could not tell rate limiting from an outage."""
    broker = openai_broker(broker_factory, fake, max_attempts_per_turn=3)
    fake.fail_status(429)
    fake.fail_status(500)
    fake.respond_text(["Third", " time"])
    events = run_turn(broker, "limited-then-down")
    assert end_of(events) == {"attempt": 1, "status": "complete", "reason": None}
    assert [
        retries(broker, code) for code in ("upstream_rate_limited", "upstream_unavailable")
    ] == [
        1,
        1,
    ]
    assert (
        broker.metric("broker_retries_total", '{code="upstream_other",reason="upstream_error"}')
        == 0
    )

    # Every allowed call rate limited: the exhausted attempt carries the last call's code.
    fake.fail_status(429)
    fake.fail_status(429)
    fake.fail_status(429)
    events = run_turn(broker, "limited-throughout")
    assert end_of(events) == {"attempt": 1, "status": "failed", "reason": "attempts_exhausted"}
    error = error_of(events)
    assert (error["code"], error["upstream_code"]) == (
        "attempts_exhausted",
        "upstream_rate_limited",
    )
    assert retries(broker, "upstream_rate_limited") == 3
    exhausted = "broker_attempts_exhausted_total"
    assert broker.metric(exhausted, '{code="upstream_rate_limited"}') == 1
    assert broker.metric(exhausted, '{code="upstream_unavailable"}') == 0


def test_unauthorized_fails_at_once_and_the_key_stays_secret(
    broker: RunningBroker, fake: FakeOpenAI, raw_redis: redis.Redis
) -> None:
    fake.fail_status(401)  # its message quotes the key it got, in full
    turn = post_turn(broker, "denied")
    response = httpx.get(f"{broker.base_url}/v1/streams/{turn['stream_id']}", timeout=10)
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert end_of(events) == {"attempt": 1, "status": "failed", "reason": "upstream_unauthorized"}
    error = error_of(events)
    assert (error["code"], error["retryable"]) == ("upstream_unauthorized", False)
    assert error["message"] == "HTTP 401: Incorrect API key provided: [redacted]"
    assert len(fake.requests) == 1
    state = get_turn(broker.base_url, "denied")
    assert state["status"] == "failed"
    seen = [response.text, json.dumps(state), *redis_values(raw_redis, broker)]
    assert not [text for text in seen if KEY in text]


def redis_values(client: redis.Redis, broker: RunningBroker) -> Iterator[str]:
    """Every string the broker keeps in Redis under its prefix."""
    for key in client.scan_iter(f"{broker.settings.key_prefix}:*"):
        kind = client.type(key)
        if kind == "string":
            yield str(client.get(key))
        elif kind == "hash":
            yield json.dumps(client.hgetall(key))
        elif kind == "stream":
            yield json.dumps(client.xrange(key))
        elif kind == "zset":
            yield json.dumps(client.zrange(key, 0, -1))
        elif kind == "set":
            yield json.dumps(sorted(client.smembers(key)))
        elif kind == "list":
            yield json.dumps(client.lrange(key, 0, -1))


def test_an_error_event_after_deltas_interrupts_the_turn(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    fake.error_event_after(100)
    events = run_turn(broker, "broken")
    assert kinds(events).count("delta") == 100
    assert text_of(events) == scripted_text(100)
    error = error_of(events)
    assert (error["code"], error["retryable"]) == ("upstream_stream_error", True)
    assert "the model crashed" in error["message"]
    assert end_of(events) == {"attempt": 1, "status": "interrupted", "reason": "upstream_error"}
    assert len(fake.requests) == 1, "nothing is retried after the first delta"
    interruptions = '{code="upstream_stream_error",reason="upstream_error"}'
    assert broker.metric("broker_interruptions_total", interruptions) == 1
    assert get_turn(broker.base_url, "broken")["canonical"]["text"] == scripted_text(100)


def test_an_admission_error_event_before_any_delta_fails_at_once(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    fake.error_event_after(0, status=400, message="messages: too long for this model")
    events = run_turn(broker, "refused")
    assert end_of(events) == {"attempt": 1, "status": "failed", "reason": "upstream_bad_request"}
    assert error_of(events)["retryable"] is False
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    ("abrupt", "code"), [(False, "upstream_incomplete"), (True, "upstream_connection")]
)
def test_a_stream_cut_after_deltas_is_interrupted(
    broker: RunningBroker, fake: FakeOpenAI, abrupt: bool, code: str
) -> None:
    fake.truncate_after(5, abrupt=abrupt)
    events = run_turn(broker, "cut")
    assert text_of(events) == scripted_text(5)
    assert error_of(events)["code"] == code
    assert end_of(events) == {"attempt": 1, "status": "interrupted", "reason": "upstream_error"}
    assert len(fake.requests) == 1


def test_a_stream_cut_before_its_first_delta_is_retried_silently(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    fake.truncate_after(0)
    fake.respond_text(["Second", " time"])
    events = run_turn(broker, "cut-early")
    assert kinds(events) == ["attempt", "delta", "delta", "usage", "end"]
    assert end_of(events)["status"] == "complete"
    assert len(fake.requests) == 2


def test_a_stalled_upstream_times_out_and_is_let_go(
    broker_factory: BrokerFactory, fake: FakeOpenAI
) -> None:
    broker = openai_broker(broker_factory, fake, upstream_idle_timeout_s=0.3)
    fake.stall_after(3)
    events = run_turn(broker, "stalled")
    assert text_of(events) == scripted_text(3)
    assert error_of(events)["code"] == "upstream_timeout"
    assert end_of(events) == {"attempt": 1, "status": "interrupted", "reason": "upstream_timeout"}
    assert fake.wait_disconnect(2).deltas_sent == 3


def test_cancel_closes_the_upstream_connection_within_a_second(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    fake.respond_text(["tick "] * 500, interval_s=0.02)
    post_turn(broker, "stop-me")
    wait_until(lambda: fake.requests and fake.requests[0].deltas_sent >= 3)
    pressed = time.monotonic()
    response = httpx.post(f"{broker.base_url}/v1/turns/stop-me/cancel", timeout=10)
    assert response.status_code == 200, response.text
    request = fake.wait_disconnect(1.0)
    assert request.disconnected_at is not None
    assert request.disconnected_at - pressed < 1.0
    assert request.deltas_sent < 500
    state = wait_final(broker.base_url, "stop-me")
    assert state["status"] == "cancelled"
    assert state["canonical"]["text"].startswith("tick tick tick ")


def interrupt_then_continue(broker: RunningBroker, fake: FakeOpenAI, turn_id: str) -> list[str]:
    """Interrupt a turn after four deltas, continue it, and return the texts of both attempts."""
    fake.truncate_after(4)
    fake.respond_text([" there", " was", " a", " broker."])
    first = run_turn(broker, turn_id)
    assert end_of(first)["status"] == "interrupted"
    response = httpx.post(
        f"{broker.base_url}/v1/turns/{turn_id}/attempts", json={"strategy": "continue"}, timeout=10
    )
    assert response.status_code == 201, response.text
    turn = get_turn(broker.base_url, turn_id)
    rest = read_sse(broker.base_url, turn["stream_id"], last_event_id=first[-1].id).events
    assert rest[0].data == {"attempt": 2, "strategy": "continue"}
    assert end_of(rest) == {"attempt": 2, "status": "complete", "reason": None}
    return [text_of(first), text_of(rest)]


def test_continue_sends_the_partial_text_as_a_trailing_assistant_message(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    partial, continuation = interrupt_then_continue(broker, fake, "go-on")
    assert partial == scripted_text(4) == "Once upon a time"
    assert continuation == " there was a broker."
    second = fake.bodies[1]
    assert second["messages"] == [*PROMPT, {"role": "assistant", "content": partial}]
    assert "continue_final_message" not in second
    assert "add_generation_prompt" not in second
    canonical = get_turn(broker.base_url, "go-on")["canonical"]
    assert canonical == {"attempt": 2, "text": partial + continuation}


def test_continue_final_message_asks_vllm_to_carry_the_message_on(
    broker_factory: BrokerFactory, fake: FakeOpenAI
) -> None:
    broker = openai_broker(broker_factory, fake, openai_continue_final_message=1)
    partial, _ = interrupt_then_continue(broker, fake, "go-on-vllm")
    first, second = fake.bodies
    assert "continue_final_message" not in first, "only a continue attempt asks for it"
    assert second["messages"][-1] == {"role": "assistant", "content": partial}
    assert (second["continue_final_message"], second["add_generation_prompt"]) == (True, False)


def test_an_unknown_model_is_refused_before_any_call(
    broker: RunningBroker, fake: FakeOpenAI
) -> None:
    error = post_turn(broker, "no-model", expect=400, model="gpt-nope")["error"]
    assert error["code"] == "unknown_model"
    assert "gpt-test, gpt-other" in error["message"]
    assert fake.requests == []


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"simulate": {"tokens": 3}, "logit_bias": {}}, "logit_bias, simulate"),
        ({"temperature": "warm"}, "params.temperature must be a number"),
        ({"max_tokens": 1.5}, "params.max_tokens must be an integer"),
        ({"stop": [1]}, "params.stop must be a string or a list of strings"),
    ],
)
def test_unknown_or_malformed_params_are_refused(
    broker: RunningBroker, fake: FakeOpenAI, params: dict[str, Any], named: str
) -> None:
    error = post_turn(broker, "bad-params", expect=400, params=params)["error"]
    assert error["code"] == "bad_request"
    assert named in error["message"]
    assert fake.requests == []


# --- the adapter alone -----------------------------------------------------------------------


def request_for(**fields: Any) -> GenerationRequest:
    values: dict[str, Any] = {
        "conversation_id": "c",
        "turn_id": "t",
        "attempt": 1,
        "strategy": "initial",
        "messages": list(PROMPT),
        "model": "gpt-test",
        "params": {},
        "response_format": "text",
        "upstream_call": 0,
    }
    return GenerationRequest(**{**values, **fields})


@pytest.fixture
async def provider(fake: FakeOpenAI) -> AsyncIterator[OpenAIProvider]:
    adapter = OpenAIProvider(base_url=fake.url + "/v1", api_key=KEY, models=("gpt-test",))
    yield adapter
    await adapter.aclose()


async def collect(provider: OpenAIProvider, request: GenerationRequest) -> list[ProviderEvent]:
    return [event async for event in provider.stream(request)]


async def failure(provider: OpenAIProvider, request: GenerationRequest) -> UpstreamError:
    with pytest.raises(UpstreamError) as caught:
        await collect(provider, request)
    return caught.value


async def test_tool_call_parts_and_the_terminal_event(
    provider: OpenAIProvider, fake: FakeOpenAI
) -> None:
    fake.respond_tool_call("get_weather", ['{"ci', 'ty": "Oslo"}'], call_id="call_9")
    events = [e for e in await collect(provider, request_for()) if e != TextDelta("")]
    assert events == [
        ToolCallChunk(0, "call_9", "get_weather", ""),
        ToolCallChunk(0, None, None, '{"ci'),
        ToolCallChunk(0, None, None, 'ty": "Oslo"}'),
        Usage(input_tokens=11, output_tokens=2),
        Finished("tool_calls"),
    ]


async def test_a_finished_stream_leaves_its_connection_for_the_next_call(
    provider: OpenAIProvider, fake: FakeOpenAI
) -> None:
    fake.respond_text(["one"])
    fake.respond_text(["two"])
    for _ in range(2):
        assert (await collect(provider, request_for()))[-1] == Finished("stop")
    first, second = fake.requests
    assert first.client_port == second.client_port, "read up to [DONE], then reused"


async def test_a_stream_without_its_terminal_event_does_not_finish(
    provider: OpenAIProvider, fake: FakeOpenAI
) -> None:
    fake.truncate_after(3)
    events = await collect(provider, request_for())
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == scripted_text(3)
    assert not [e for e in events if isinstance(e, Finished | Usage)]


@pytest.mark.parametrize(
    ("status", "retry_after", "code", "retryable", "wait"),
    [
        (429, "2", "upstream_rate_limited", True, 2.0),
        (503, None, "upstream_unavailable", True, None),
        (529, "0.5", "upstream_overloaded", True, 0.5),
        (400, None, "upstream_bad_request", False, None),
        (404, None, "upstream_not_found", False, None),
    ],
)
async def test_status_answers_follow_the_taxonomy(
    provider: OpenAIProvider,
    fake: FakeOpenAI,
    status: int,
    retry_after: str | None,
    code: str,
    retryable: bool,
    wait: float | None,
) -> None:
    fake.fail_status(status, retry_after=retry_after)
    error = await failure(provider, request_for())
    assert (error.code, error.retryable, error.retry_after_s) == (code, retryable, wait)
    assert error.message.startswith(f"HTTP {status}: ")


async def test_retry_after_ms_is_preferred(provider: OpenAIProvider, fake: FakeOpenAI) -> None:
    fake.fail_status(429, retry_after="5", retry_after_ms="250")
    assert (await failure(provider, request_for())).retry_after_s == 0.25


async def test_an_error_event_with_an_admission_status_is_not_retryable(
    provider: OpenAIProvider, fake: FakeOpenAI
) -> None:
    fake.error_event_after(2, status=401, message=f"bad key {KEY}")
    error = await failure(provider, request_for())
    assert (error.code, error.retryable) == ("upstream_unauthorized", False)
    assert KEY not in error.message
    fake.error_event_after(2, status=503)
    error = await failure(provider, request_for())
    assert (error.code, error.retryable) == ("upstream_unavailable", True)


async def test_an_unreachable_upstream_is_a_retryable_connection_error() -> None:
    adapter = OpenAIProvider(
        base_url=f"http://127.0.0.1:{free_port()}/v1", api_key=KEY, models=("gpt-test",)
    )
    error = await failure(adapter, request_for())
    await adapter.aclose()
    assert (error.code, error.retryable) == ("upstream_connection", True)


async def test_closing_the_generator_closes_the_connection(
    provider: OpenAIProvider, fake: FakeOpenAI
) -> None:
    fake.respond_text(["tick "] * 500, interval_s=0.02)
    stream = provider.stream(request_for())
    seen = 0
    async for event in stream:
        seen += isinstance(event, TextDelta) and bool(event.text)
        if seen == 3:
            break
    closed = time.monotonic()
    await stream.aclose()
    request = fake.wait_disconnect(1.0)
    assert request.disconnected_at is not None
    assert request.disconnected_at - closed < 1.0


def test_tool_steps_render_as_assistant_calls_and_tool_results() -> None:
    steps = [
        ToolStep(
            "",
            [
                {"id": "c1", "name": "a", "arguments": "{}"},
                {"id": "c2", "name": "b", "arguments": '{"x":1}'},
            ],
            [
                {"id": "c1", "name": "a", "content": "1"},
                {"id": "c2", "name": "b", "content": '{"error":"no"}'},
            ],
        ),
        ToolStep(
            "Then",
            [{"id": "c3", "name": "a", "arguments": "{}"}],
            [{"id": "c3", "name": "a", "content": "3"}],
        ),
    ]
    messages = [{"role": "user", "content": "go", "name": None, "partial": None}]
    rendered = render_messages(request_for(messages=messages, tool_steps=steps))
    call = {"type": "function"}
    assert rendered == [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", **call, "function": {"name": "a", "arguments": "{}"}},
                {"id": "c2", **call, "function": {"name": "b", "arguments": '{"x":1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": '{"error":"no"}'},
        {
            "role": "assistant",
            "content": "Then",
            "tool_calls": [
                {"id": "c3", **call, "function": {"name": "a", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "3"},
    ]


def test_the_description_names_the_url_but_never_a_secret() -> None:
    provider = OpenAIProvider(
        base_url="https://proxy:hunter22@llm.example:8443/v1/", api_key=KEY, models=("m",)
    )
    assert provider.description.endswith(" at https://llm.example:8443/v1")
    assert "hunter22" not in provider.description
    with pytest.raises(BadRequest, match="unknown params for the openai provider: simulate"):
        provider.validate_params({"simulate": {}})
    provider.validate_params({"temperature": 1, "stop": "\n", "seed": None})
