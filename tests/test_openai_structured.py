"""Structured output through the OpenAI doors (with the official SDK) and the native API (with
the Python client) against a real broker: the simulated provider streams a JSON answer
(``params.simulate.json``) that the broker validates against the request's schema before it
becomes canonical."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httpx
import openai
import orjson
import pytest
from pydantic import BaseModel

from broker_client import BrokerClient
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import wait_final
from tests.test_openai_contract import check_completion, check_event, check_response, data_lines
from tests.test_openai_dialect import client, simulate

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "tunnels": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["city", "tunnels"],
    "additionalProperties": False,
}
GOOD: dict[str, Any] = {"city": "Bern", "tunnels": [3, 4]}
BAD: dict[str, Any] = {"city": "Bern", "tunnels": [3, "four"]}
FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "name": "tunnels",
    "schema": SCHEMA,
    "strict": True,
}


TEXT: Any = {"format": FORMAT}  # as the SDK's ``text`` parameter


class Tunnels(BaseModel):
    city: str
    tunnels: list[int]


def answer(value: Any) -> dict[str, Any]:
    """The simulator's knobs for an answer of ``value``'s JSON, streamed in several deltas."""
    return simulate(json=value, tokens=5, tokens_per_s=0)


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


def test_a_json_schema_response_validates_and_echoes_its_format(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        response = sdk.responses.create(
            model="simulated", input="tunnels?", text=TEXT, extra_body=answer(GOOD)
        )
    assert response.status == "completed"
    assert orjson.loads(response.output_text) == GOOD
    echoed = response.to_dict()["text"]
    assert echoed == {"format": FORMAT}
    check_response(response.to_dict())
    raw = httpx.get(f"{broker.base_url}/v1/responses/{response.id}", timeout=10).json()
    assert raw["text"] == {"format": FORMAT}
    check_response(raw)


def test_the_sdk_parse_helpers_extract_a_pydantic_model(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        parsed = sdk.responses.parse(
            model="simulated", input="tunnels?", text_format=Tunnels, extra_body=answer(GOOD)
        )
        chat = sdk.chat.completions.parse(
            model="simulated",
            messages=[{"role": "user", "content": "tunnels?"}],
            response_format=Tunnels,
            extra_body=answer(GOOD),
        )
    assert parsed.output_parsed == Tunnels(**GOOD)
    assert parsed.text is not None
    assert parsed.text.format is not None
    assert parsed.text.format.type == "json_schema"
    assert chat.choices[0].message.parsed == Tunnels(**GOOD)
    assert chat.choices[0].finish_reason == "stop"


def test_a_streamed_json_schema_response_meets_the_spec(broker: RunningBroker) -> None:
    body = {
        "model": "simulated",
        "input": "tunnels?",
        "stream": True,
        "text": {"format": {"type": "json_object"}},
        **answer(GOOD),
    }
    with httpx.Client(timeout=20) as http:
        raw = http.post(f"{broker.base_url}/v1/responses", json=body).content
    events = data_lines(raw)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1
    assert orjson.loads("".join(deltas)) == GOOD
    for event in events:
        check_event(event)
        if "response" in event:
            assert event["response"]["text"] == {"format": {"type": "json_object"}}
    assert events[-1]["type"] == "response.completed"


def test_an_answer_that_does_not_validate_fails_the_response_clearly(
    broker: RunningBroker,
) -> None:
    with client(broker) as sdk:
        failed = sdk.responses.create(
            model="simulated", input="tunnels?", text=TEXT, extra_body=answer(BAD)
        )
        with sdk.responses.stream(
            model="simulated", input="tunnels?", text=TEXT, extra_body=answer(BAD)
        ) as stream:
            events = list(stream)
    assert failed.status == "failed"
    assert failed.error is not None
    assert failed.error.message.startswith("invalid_output: the answer does not match the schema")
    assert "at $.tunnels[1]: 'four' is not of type 'integer'" in failed.error.message
    check_response(failed.to_dict())
    last = events[-1]
    assert last.type == "response.failed"
    assert last.response.error is not None
    assert "$.tunnels[1]" in last.response.error.message
    state = wait_final(broker.base_url, failed.id)
    assert state["canonical"] is None
    assert state["attempts"][0]["reason"] == "invalid_output"
    assert "$.tunnels[1]" in state["attempts"][0]["error"]


def test_chat_completions_take_response_format_and_fail_clearly(broker: RunningBroker) -> None:
    messages: Any = [{"role": "user", "content": "tunnels?"}]
    spec = {k: v for k, v in FORMAT.items() if k != "type"}
    chat_format: Any = {"type": "json_schema", "json_schema": spec}
    with client(broker) as sdk:
        completion = sdk.chat.completions.create(
            model="simulated",
            messages=messages,
            response_format=chat_format,
            extra_body=answer(GOOD),
        )
        with pytest.raises(openai.APIStatusError) as whole:
            sdk.chat.completions.create(
                model="simulated",
                messages=messages,
                response_format=chat_format,
                extra_body=answer(BAD),
            )
        stream = sdk.chat.completions.create(
            model="simulated",
            messages=messages,
            response_format={"type": "json_object"},
            stream=True,
            extra_body=answer(False),
        )
        with pytest.raises(openai.APIError) as streamed:
            list(stream)
    assert orjson.loads(completion.choices[0].message.content or "") == GOOD
    check_completion(completion.to_dict())
    assert whole.value.status_code == 502
    assert "invalid_output: the answer does not match the schema 'tunnels'" in whole.value.message
    assert "$.tunnels[1]" in whole.value.message
    assert "invalid_output: the answer is not valid JSON" in streamed.value.message


def test_a_bad_format_is_a_400_naming_the_parameter(broker: RunningBroker) -> None:
    broken = {**FORMAT, "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    with client(broker) as sdk:
        with pytest.raises(openai.BadRequestError) as responses:
            sdk.responses.create(model="simulated", input="x", text=cast(Any, {"format": broken}))
        with pytest.raises(openai.BadRequestError) as unnamed:
            sdk.responses.create(
                model="simulated", input="x", text=cast(Any, {"format": {"type": "json_schema"}})
            )
        with pytest.raises(openai.BadRequestError) as chat:
            sdk.chat.completions.create(
                model="simulated",
                messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_schema", "json_schema": {"name": "n"}},
            )
    assert responses.value.param == "text.format"
    assert "not a valid JSON Schema" in responses.value.message
    assert unnamed.value.param == "text.format"
    assert chat.value.param == "response_format"
    native = httpx.post(
        f"{broker.base_url}/v1/turns",
        json={
            "conversation_id": "c",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": broken,
        },
        timeout=10,
    )
    assert native.status_code == 400
    assert "response_format" in native.json()["error"]["message"]
    assert "not a valid JSON Schema" in native.json()["error"]["message"]


def test_a_json_schema_turn_is_fingerprinted_and_never_continued(broker: RunningBroker) -> None:
    def turn(turn_id: str, response_format: Any, **knobs: Any) -> httpx.Response:
        body = {
            "conversation_id": "structured",
            "turn_id": turn_id,
            "response_format": response_format,
            "messages": [{"role": "user", "content": "tunnels?"}],
            "params": {"simulate": {"tokens": 6, "tokens_per_s": 0, "json": GOOD, **knobs}},
        }
        return httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10)

    assert turn("s1", FORMAT).status_code == 201
    assert wait_final(broker.base_url, "s1")["status"] == "complete"
    assert turn("s1", FORMAT).status_code == 200  # the same request finds the same turn
    other = {**FORMAT, "schema": {**SCHEMA, "required": ["city"]}}
    assert turn("s1", other).status_code == 409
    assert turn("s2", FORMAT, fail_after_deltas=2).status_code == 201
    assert wait_final(broker.base_url, "s2")["status"] == "interrupted"
    attempts = f"{broker.base_url}/v1/turns/s2/attempts"
    refused = httpx.post(attempts, json={"strategy": "continue"}, timeout=10)
    assert refused.status_code == 422
    assert "json_schema" in refused.json()["error"]["message"]
    assert httpx.post(attempts, json={"strategy": "regenerate"}, timeout=10).status_code == 201
    done = wait_final(broker.base_url, "s2")
    assert done["status"] == "complete"
    assert orjson.loads(done["canonical"]["text"]) == GOOD


async def test_the_python_client_sends_every_form(broker: RunningBroker) -> None:
    async with BrokerClient(broker.base_url, timeout=10) as native:
        for turn_id, response_format in (("py-json", "json"), ("py-schema", FORMAT)):
            await native.start_turn(
                "py",
                [{"role": "user", "content": "tunnels?"}],
                turn_id=turn_id,
                params={"simulate": {"tokens": 3, "tokens_per_s": 0, "json": GOOD}},
                response_format=response_format,
            )
            state = await asyncio.to_thread(wait_final, broker.base_url, turn_id)
            assert orjson.loads(state["canonical"]["text"]) == GOOD
