"""Request bodies: an integer is an integer within its bounds, a boolean is true or false.

Regression for issue 19: ``ttl_s: true``, ``"5"`` and ``0.5`` were accepted when minting an
attach token, and minted one. Every body model of the broker and its dialects is strict now: a
bad body is a 400 in the route's error shape, and nothing is created.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import RunningBroker, start_broker
from tests.helpers import bearer, start_turn

KEY = "key-strict-0123456789abcdef"
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def broker(redis_url: str) -> Iterator[RunningBroker]:
    running = start_broker(redis_url, api_keys=f"strict={KEY}", simulate_max_tokens_per_s=0)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def turn(broker: RunningBroker) -> dict[str, Any]:
    return start_turn(broker.base_url, "strict-conv", auth=KEY, tokens=2, tokens_per_s=0)


def post(broker: RunningBroker, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{broker.base_url}{path}", json=body, headers=bearer(KEY), timeout=10)


def native_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"code", "message"}, error
    return error


@pytest.mark.parametrize(
    "body",
    [
        {"ttl_s": True},
        {"ttl_s": "5"},
        {"ttl_s": 0.5},
        {"ttl_s": 0},
        {"ttl_s": 31_536_001},
        {"one_viewer": 1},
        {"one_viewer": "true"},
    ],
)
def test_an_attach_token_is_not_minted_from_a_lifetime_or_flag_of_the_wrong_type(
    broker: RunningBroker, turn: dict[str, Any], body: dict[str, Any]
) -> None:
    response = post(broker, f"/v1/turns/{turn['turn_id']}/attach-tokens", body)
    error = native_error(response)
    assert error["code"] == "bad_request"
    assert next(iter(body)) in error["message"]
    assert "token" not in response.json()


@pytest.mark.parametrize("ttl_s", [60, 60.0])
def test_an_attach_token_takes_whole_seconds_and_a_real_boolean(
    broker: RunningBroker, turn: dict[str, Any], ttl_s: float
) -> None:
    # 60.0 is a whole number: JSON has one kind of number, and JSON Schema calls it an integer.
    response = post(
        broker, f"/v1/turns/{turn['turn_id']}/attach-tokens", {"ttl_s": ttl_s, "one_viewer": True}
    )
    assert response.status_code == 201, response.text
    minted = response.json()
    assert minted["one_viewer"] is True
    assert minted["token"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/turns", {"conversation_id": "c", "messages": [{**USER[0], "partial": "no"}]}),
        ("/v1/turns", {"conversation_id": "c", "messages": [{"role": "user", "content": 5}]}),
        ("/v1/turns/{turn_id}/canonical", {"attempt": True}),
        ("/v1/turns/{turn_id}/canonical", {"attempt": 1.5}),
        ("/v1/turns/{turn_id}/canonical", {"attempt": "1"}),
        ("/v1/turns/{turn_id}/canonical", {"attempt": 1, "expected": False}),
    ],
)
def test_native_bodies_refuse_numbers_and_booleans_of_the_wrong_type(
    broker: RunningBroker, turn: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    response = post(broker, path.format(turn_id=turn["turn_id"]), body)
    assert native_error(response)["code"] == "bad_request"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"model": "simulated", "input": "hi", "stream": "true"}, "stream"),
        ("/v1/responses", {"model": "simulated", "input": "hi", "background": 1}, "background"),
        (
            "/v1/responses",
            {"model": "simulated", "input": "hi", "max_output_tokens": 5.5},
            "max_output_tokens",
        ),
        (
            "/v1/responses",
            {"model": "simulated", "input": "hi", "max_output_tokens": True},
            "max_output_tokens",
        ),
        ("/v1/chat/completions", {"model": "simulated", "messages": USER, "n": True}, "n"),
        ("/v1/chat/completions", {"model": "simulated", "messages": USER, "seed": "4"}, "seed"),
        (
            "/v1/chat/completions",
            {"model": "simulated", "messages": USER, "temperature": "0.5"},
            "temperature",
        ),
    ],
)
def test_openai_bodies_refuse_numbers_and_booleans_of_the_wrong_type(
    broker: RunningBroker, path: str, body: dict[str, Any], param: str
) -> None:
    response = post(broker, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_an_integer_temperature_is_still_a_number(broker: RunningBroker) -> None:
    body = {"model": "simulated", "messages": USER, "temperature": 1, "max_tokens": 5}
    response = post(broker, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text


def test_an_ai_sdk_message_needs_string_text(broker: RunningBroker) -> None:
    body = {
        "id": "strict-chat",
        "trigger": "submit-message",
        "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": 7}]}],
    }
    assert native_error(post(broker, "/v1/ui/chat", body))["code"] == "bad_request"


def test_the_document_bounds_integers_as_json_schema_spells_bounds(broker: RunningBroker) -> None:
    # pydantic wrote the bounds of a validated integer as `ge`/`le`, which JSON Schema ignores.
    document = httpx.get(f"{broker.base_url}/openapi.json", timeout=10).json()
    body = document["paths"]["/v1/turns/{turn_id}/attach-tokens"]["post"]["requestBody"]
    ttl = body["content"]["application/json"]["schema"]["properties"]["ttl_s"]["anyOf"][0]
    assert ttl == {"type": "integer", "minimum": 1, "maximum": 31_536_000}
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    n = chat["application/json"]["schema"]["properties"]["n"]["anyOf"][0]
    assert (n["minimum"], n["maximum"]) == (1, 1)
    canonical = document["paths"]["/v1/turns/{turn_id}/canonical"]["post"]["requestBody"]
    attempt = canonical["content"]["application/json"]["schema"]["properties"]["attempt"]
    assert attempt["minimum"] == 1
    assert '"ge"' not in orjson.dumps(document).decode()


@pytest.mark.parametrize(
    "offset",
    [
        "0001796045845245-0000000000\n",  # Python's `$` let a final newline through
        "\u0661" * 16 + "-" + "\u0662" * 10,  # and `\d` the digits of other scripts
    ],
)
def test_an_offset_is_ascii_digits_and_nothing_after(
    broker: RunningBroker, turn: dict[str, Any], offset: str
) -> None:
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    for params in ({"offset": offset}, {"format": "json", "offset": offset}):
        response = httpx.get(url, params=params, headers=bearer(KEY), timeout=10)
        assert native_error(response)["code"] == "bad_offset"


def test_an_id_with_a_final_newline_is_not_an_id(broker: RunningBroker) -> None:
    response = post(
        broker,
        "/v1/ui/chat",
        {
            "id": "chat\n",
            "trigger": "submit-message",
            "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}],
        },
    )
    assert native_error(response)["code"] == "bad_chat_id"
    stream = httpx.get(
        f"{broker.base_url}/v1/streams/st_{'0' * 32}%0A", headers=bearer(KEY), timeout=10
    )
    assert stream.status_code == 404
