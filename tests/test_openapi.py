"""The OpenAPI document describes the stream as the broker sends it.

``GET /v1/streams/{id}`` declares its resume point (``Last-Event-ID``, ``offset``), ``format``,
``wait`` and ``token`` with their formats, enums and bounds; its ``text/event-stream`` answer
has a schema per event type, and its JSON page the same events parsed. The events of real
turns (a complete one with a tool call, a failed one, an interrupted one) are checked against
those schemas here, and every event type the broker sends must have met its schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from jsonschema import Draft202012Validator

from broker.api.schemas import SSE_ONLY_EVENTS, STORED_EVENTS
from broker.viewer import REPLACED
from tests.conftest import BrokerFactory, RunningBroker, start_broker
from tests.helpers import bearer, start_turn, wait_final, wait_until

KEY = "key-openapi-0123456789abcdef"
STREAM = "/v1/streams/{stream_id}"


@pytest.fixture(scope="module")
def broker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    # One tool that always asks for approval (denied in the tests: its endpoint is never called).
    tools = tmp_path_factory.mktemp("openapi") / "tools.json"
    confirm = {"name": "confirm", "class": "unkeyed_write", "endpoint": "http://127.0.0.1:9/"}
    tools.write_text(json.dumps({"tools": [{**confirm, "approval": "always"}]}))
    running = start_broker(
        redis_url,
        api_keys=f"openapi={KEY}",
        simulate_max_tokens_per_s=0,
        simulate_scripting="on",
        tools=str(tools),
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def document(broker: RunningBroker) -> dict[str, Any]:
    response = httpx.get(f"{broker.base_url}/openapi.json", timeout=10)
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


def validator(document: dict[str, Any], schema: dict[str, Any]) -> Draft202012Validator:
    """A validator of ``schema`` whose ``$ref`` reach the document's components."""
    return Draft202012Validator({**schema, "components": document["components"]})


def parameters(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    operation = document["paths"][STREAM]["get"]
    return {(p["in"], p["name"]): p for p in operation["parameters"]}


def sse_events(broker: RunningBroker, stream_id: str, **params: str) -> list[dict[str, str]]:
    """Every event of a read, as an SSE parser hands them on: ``event``, ``id``, ``data``."""
    events: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    data: list[str] = []
    url = f"{broker.base_url}/v1/streams/{stream_id}"
    with httpx.stream("GET", url, params=params, headers=bearer(KEY), timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line == "":
                if data:
                    events.append({**fields, "data": "\n".join(data)})
                fields, data = {}, []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    data.append(value)
                elif name in ("event", "id"):
                    fields[name] = value
    return events


def test_the_stream_declares_its_resume_point_format_wait_and_token(
    document: dict[str, Any],
) -> None:
    declared = parameters(document)
    header = declared[("header", "Last-Event-ID")]["schema"]
    offset = declared[("query", "offset")]["schema"]
    for schema in (header, offset):
        check = validator(document, schema)
        for good in ("", "-1", "now", "0001796045845245-0000000000"):
            assert check.is_valid(good), good
        for bad in ("12", "-2", "0-0", "١٢", "later"):
            assert not check.is_valid(bad), bad
    assert declared[("query", "format")]["schema"]["enum"] == ["sse", "json"]
    wait = declared[("query", "wait")]["schema"]
    assert (wait["type"], wait["minimum"], wait["maximum"]) == ("integer", 0, 25)
    assert declared[("query", "token")]["schema"]["type"] == "string"
    assert declared[("path", "stream_id")]["required"] is True
    names = [(p["in"], p["name"].lower()) for p in document["paths"][STREAM]["get"]["parameters"]]
    assert len(names) == len(set(names)), names


def test_the_wait_bound_is_the_brokers_own_setting(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(long_poll_max_s=7)
    document = httpx.get(f"{broker.base_url}/openapi.json", timeout=10).json()
    assert parameters(document)[("query", "wait")]["schema"]["maximum"] == 7


def test_the_event_stream_has_a_schema_per_event_type(document: dict[str, Any]) -> None:
    content = document["paths"][STREAM]["get"]["responses"]["200"]["content"]
    branches = content["text/event-stream"]["itemSchema"]["oneOf"]
    kinds = [branch["properties"]["event"]["const"] for branch in branches]
    assert kinds == [*STORED_EVENTS, *SSE_ONLY_EVENTS]
    assert {"attempt", "delta", "tool_call", "tool_input_delta", "tool_result", "end"} <= set(kinds)
    for branch in branches:
        data = branch["properties"]["data"]
        assert data["contentMediaType"] == "application/json"
        assert data["contentSchema"]["$ref"].startswith("#/components/schemas/")
    end = document["components"]["schemas"]["EndEvent"]
    assert end["properties"]["status"]["enum"] == [
        "complete",
        "interrupted",
        "cancelled",
        "failed",
        "requires_action",
    ]
    page = document["components"]["schemas"]["StreamPage"]
    assert set(page["required"]) == {"events", "next_offset", "up_to_date", "closed"}
    page_kinds = [
        b["properties"]["event"]["const"] for b in page["properties"]["events"]["items"]["oneOf"]
    ]
    assert page_kinds == list(STORED_EVENTS)


def test_fastapis_422_is_gone_where_the_broker_never_sends_it(document: dict[str, Any]) -> None:
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for methods in document["paths"].values():
        for operation in methods.values():
            refused = operation["responses"].get("422")
            if refused is not None:  # only where a route says so: in the broker's error shape
                assert "HTTPValidationError" not in orjson.dumps(refused).decode()


def test_providers_and_models_are_listed_as_this_broker_serves_them(
    document: dict[str, Any],
) -> None:
    body = document["paths"]["/v1/turns"]["post"]["requestBody"]["content"]["application/json"]
    properties = body["schema"]["properties"]
    assert properties["provider"]["enum"] == ["simulated", None]
    assert properties["model"]["enum"] == ["simulated", None]
    assert "x-broker-catalogue" not in orjson.dumps(document).decode()


def test_a_malformed_offset_is_refused_even_beside_a_good_last_event_id(
    broker: RunningBroker,
) -> None:
    turn = start_turn(broker.base_url, "schema-h", auth=KEY, tokens=2, tokens_per_s=0)
    wait_final(broker.base_url, turn["turn_id"], auth=KEY)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    headers = {**bearer(KEY), "Last-Event-ID": "0000000000000001-0000000000"}
    bad = httpx.get(url, params={"format": "json", "offset": "soon"}, headers=headers, timeout=10)
    assert bad.status_code == 400, bad.text
    good = httpx.get(url, params={"format": "json", "offset": "-1"}, headers=headers, timeout=10)
    assert good.status_code == 200, good.text


@pytest.mark.parametrize(
    "params",
    [{"stream": "1"}, {"stream": ""}, {"stream": "true", "starting_after": "+5"}],
)
def test_a_query_boolean_is_true_or_false_and_an_integer_digits(
    broker: RunningBroker, params: dict[str, str]
) -> None:
    turn = start_turn(broker.base_url, "schema-q", auth=KEY, tokens=2, tokens_per_s=0)
    url = f"{broker.base_url}/v1/responses/{turn['turn_id']}"
    response = httpx.get(url, params=params, headers=bearer(KEY), timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in params


def turns(broker: RunningBroker) -> list[dict[str, Any]]:
    """Turns that send every kind of stored event between them."""
    base = broker.base_url
    tools = [{"name": "lookup", "args": {"q": "x"}, "after": 2}]
    return [
        start_turn(base, "schema-c", auth=KEY, tokens=6, tokens_per_s=0, tool_calls=tools),
        start_turn(base, "schema-f", auth=KEY, tokens=4, fail_before_first=1, error="fatal"),
        start_turn(base, "schema-i", auth=KEY, tokens=8, tokens_per_s=0, fail_after_deltas=3),
        client_tool_turn(base),
        approval_turn(base),
    ]


def approval_turn(base: str) -> dict[str, Any]:
    """A turn whose tool call waits for approval and is denied (``approval_*`` events)."""
    confirm = [{"name": "confirm", "args": {"q": "x"}, "after": 1}]
    turn = start_turn(base, "schema-a", auth=KEY, tokens=4, tokens_per_s=0, tool_calls=confirm)
    url = f"{base}/v1/turns/{turn['turn_id']}"
    state = wait_until(
        lambda: (
            (t := httpx.get(url, headers=bearer(KEY), timeout=10).json())["status"]
            == "awaiting_approval"
            and t
        )
    )
    approval_id = state["approvals"][0]["approval_id"]
    denied = httpx.post(
        f"{url}/approvals/{approval_id}",
        json={"decision": "deny", "reason": "not now"},
        headers=bearer(KEY),
        timeout=10,
    )
    assert denied.status_code == 200, denied.text
    return turn


def client_tool_turn(base: str) -> dict[str, Any]:
    """A turn that ends requires_action with a client tool call (``tool_input_delta``)."""
    body = {
        "conversation_id": "conv-1",
        "turn_id": "schema-r",
        "messages": [{"role": "user", "content": "Look it up"}],
        "client_tools": [{"name": "find", "parameters": {"type": "object"}}],
        "params": {
            "simulate": {
                "tokens": 4,
                "tokens_per_s": 0,
                "tool_calls": [{"name": "find", "args": {"q": "x"}, "after": 1}],
            }
        },
    }
    response = httpx.post(f"{base}/v1/turns", json=body, headers=bearer(KEY), timeout=10)
    assert response.status_code == 201, response.text
    turn: dict[str, Any] = response.json()
    return turn


def test_the_events_of_real_turns_match_their_schemas(
    broker: RunningBroker, document: dict[str, Any]
) -> None:
    content = document["paths"][STREAM]["get"]["responses"]["200"]["content"]
    branches = {
        b["properties"]["event"]["const"]: b
        for b in content["text/event-stream"]["itemSchema"]["oneOf"]
    }
    page_check = validator(document, content["application/json"]["schema"])
    seen: set[str] = set()
    live = start_turn(broker.base_url, "schema-l", auth=KEY, tokens=40, tokens_per_s=20)
    # A read from `now` of a live stream starts with the resume point where it begins.
    opening, *rest = sse_events(broker, live["stream_id"], offset="now")
    assert opening["event"] == "resume_point"
    assert rest[-1]["event"] == "end"
    for turn in [live, *turns(broker)]:
        wait_final(broker.base_url, turn["turn_id"], auth=KEY)
        events = sse_events(broker, turn["stream_id"])
        if turn is live:
            events += [opening, *rest]
        for event in events:
            branch = branches[event["event"]]
            frame = {k: v for k, v in event.items() if k != "data"}
            shape = {**branch, "properties": {**branch["properties"], "data": {"type": "string"}}}
            validator(document, shape).validate({**frame, "data": event["data"]})
            payload = branch["properties"]["data"]["contentSchema"]
            validator(document, payload).validate(orjson.loads(event["data"]))
            seen.add(event["event"])
        url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
        page = httpx.get(url, params={"format": "json"}, headers=bearer(KEY), timeout=10)
        assert page.status_code == 200
        page_check.validate(page.json())
    assert seen == {*STORED_EVENTS, *SSE_ONLY_EVENTS} - {"replaced"}, seen
    # The last frame of a one-viewer connection taken over (tests/test_security.py sends it).
    fields = dict(line.split(": ", 1) for line in REPLACED.decode().strip().split("\n"))
    replaced = branches[fields["event"]]
    assert "id" not in replaced["required"]
    payload = replaced["properties"]["data"]["contentSchema"]
    validator(document, payload).validate(orjson.loads(fields["data"]))
