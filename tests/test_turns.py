"""Turns: creation, the turn-id idempotency rule, state, and bad input."""

from __future__ import annotations

import concurrent.futures

import httpx
import orjson
import pytest

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn, read_sse, start_turn, text_of, wait_final

USER = [{"role": "user", "content": "hello"}]


def post(broker: RunningBroker, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10, **kwargs)  # type: ignore[arg-type]


def test_new_turn_is_201_and_returns_ids_and_links(broker: RunningBroker) -> None:
    response = post(broker, {"conversation_id": "c", "messages": USER})
    assert response.status_code == 201
    turn = response.json()
    assert turn["turn_id"].startswith("t_")
    assert turn["stream_id"].startswith("st_")
    assert len(turn["stream_id"]) == 35
    assert turn["status"] == "queued"
    assert turn["attempt"] == 1
    assert turn["links"] == {
        "self": f"/v1/turns/{turn['turn_id']}",
        "stream": f"/v1/streams/{turn['stream_id']}",
        "cancel": f"/v1/turns/{turn['turn_id']}/cancel",
        "attempts": f"/v1/turns/{turn['turn_id']}/attempts",
    }


def test_same_turn_id_same_request_returns_the_existing_turn(broker: RunningBroker) -> None:
    body = {
        "conversation_id": "c",
        "turn_id": "turn-a",
        "messages": USER,
        "params": {"simulate": {"seed": 3, "tokens": 5}},
    }
    first = post(broker, body)
    # Same request with other key order and whitespace: canonical JSON makes it the same.
    reordered = (
        b'{"params" : {"simulate": {"tokens": 5, "seed": 3}}, "messages": '
        b'[{"content": "hello", "role": "user"}], "turn_id": "turn-a", "conversation_id": "c"}'
    )
    second = httpx.post(
        f"{broker.base_url}/v1/turns",
        content=reordered,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert first.status_code == 201
    assert second.status_code == 200
    assert second.json()["stream_id"] == first.json()["stream_id"]


def test_same_turn_id_different_request_is_409(broker: RunningBroker) -> None:
    body = {"conversation_id": "c", "turn_id": "turn-b", "messages": USER}
    assert post(broker, body).status_code == 201
    changed = {**body, "messages": [{"role": "user", "content": "something else"}]}
    response = post(broker, changed)
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "turn_conflict"
    other_conversation = {**body, "conversation_id": "other"}
    assert post(broker, other_conversation).status_code == 409


def test_fifty_concurrent_posts_start_exactly_one_generation(broker: RunningBroker) -> None:
    body = {
        "conversation_id": "c",
        "turn_id": "turn-race",
        "messages": USER,
        "params": {"simulate": {"tokens": 5, "tokens_per_s": 0}},
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=50) as pool:
        responses = list(pool.map(lambda _: post(broker, body), range(50)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 49 + [201]
    assert len({r.json()["stream_id"] for r in responses}) == 1
    wait_final(broker.base_url, "turn-race")
    calls = broker.metric(
        "broker_upstream_requests_total", '{model="simulated",outcome="ok",provider="simulated"}'
    )
    assert calls == 1
    assert broker.metric("broker_turns_started_total") == 1
    assert broker.metric("broker_turns_deduplicated_total") == 49


def test_finished_turn_reports_status_attempts_and_canonical_text(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="turn-c", tokens=12, tokens_per_s=0)
    final = wait_final(broker.base_url, "turn-c")
    streamed = text_of(read_sse(broker.base_url, turn["stream_id"]).events)
    assert final["status"] == "complete"
    usage = next(
        e.data for e in read_sse(broker.base_url, turn["stream_id"]).events if e.event == "usage"
    )
    assert final["attempts"] == [
        {
            "n": 1,
            "strategy": "initial",
            "status": "complete",
            "reason": None,
            "canonical": True,
            "usage": {
                "input_tokens": usage["input_tokens"],
                "output_tokens": usage["output_tokens"],
            },
        }
    ]
    assert final["canonical"] == {"attempt": 1, "text": streamed}
    assert streamed


def test_simulated_text_is_a_function_of_seed_and_prompt(broker: RunningBroker) -> None:
    texts = {}
    for turn_id, seed, prompt in [("s1", 7, "p"), ("s2", 7, "p"), ("s3", 8, "p"), ("s4", 7, "q")]:
        turn = start_turn(
            broker.base_url, turn_id=turn_id, prompt=prompt, seed=seed, tokens=20, tokens_per_s=0
        )
        texts[turn_id] = text_of(read_sse(broker.base_url, turn["stream_id"]).events)
    assert texts["s1"] == texts["s2"]
    assert texts["s1"] != texts["s3"]
    assert texts["s1"] != texts["s4"]


def test_a_fatal_upstream_error_fails_the_turn_with_an_error_event(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="bad", fail_before_first=1, error="fatal")
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert [e.event for e in events] == ["attempt", "error", "end"]
    assert events[1].data["retryable"] is False
    assert events[2].data == {"attempt": 1, "status": "failed", "reason": "upstream_bad_request"}
    assert get_turn(broker.base_url, "bad")["status"] == "failed"


def test_a_break_after_deltas_interrupts_and_keeps_the_partial_text(broker: RunningBroker) -> None:
    turn = start_turn(
        broker.base_url, turn_id="cut", tokens=10, tokens_per_s=0, fail_after_deltas=4
    )
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert [e.event for e in events].count("delta") == 4
    assert events[-1].data["status"] == "interrupted"
    assert events[-1].data["reason"] == "upstream_error"
    state = get_turn(broker.base_url, "cut")
    assert state["status"] == "interrupted"
    assert state["attempts"][0]["status"] == "partial"
    # What the reader saw is the answer until the user continues or regenerates.
    assert state["canonical"] == {"attempt": 1, "text": text_of(events)}


def error_of(response: httpx.Response, status: int, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"code", "message"}
    if code is not None:
        assert error["code"] == code
    message: str = error["message"]
    assert message
    return message


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": USER}, "conversation_id"),
        ({"conversation_id": "c"}, "messages"),
        ({"conversation_id": "c", "messages": []}, "messages"),
        ({"conversation_id": "c", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"conversation_id": "c", "messages": [{"role": "user"}]}, "content"),
        ({"conversation_id": "c", "messages": USER, "surprise": 1}, "surprise"),
        ({"conversation_id": "has space", "messages": USER}, "conversation_id"),
        ({"conversation_id": "c{x}", "messages": USER}, "conversation_id"),
        ({"conversation_id": "c", "turn_id": "", "messages": USER}, "turn_id"),
        ({"conversation_id": "c", "messages": USER, "response_format": "xml"}, "response_format"),
        ({"conversation_id": "c", "messages": USER, "provider": "nope"}, "nope"),
        ({"conversation_id": "c", "messages": USER, "params": {"simulate": {"speed": 1}}}, "speed"),
        (
            {"conversation_id": "c", "messages": USER, "params": {"simulate": {"tokens": 0}}},
            "tokens",
        ),
        (
            {"conversation_id": "c", "messages": USER, "params": {"simulate": {"tokens": "9"}}},
            "tokens",
        ),
        (
            {"conversation_id": "c", "messages": USER, "params": {"simulate": {"error": "x"}}},
            "error",
        ),
        ({"conversation_id": "c", "messages": USER, "params": {"warp": 9}}, "warp"),
        ([1, 2, 3], "object"),
    ],
)
def test_invalid_bodies_are_400_with_a_message_naming_the_problem(
    broker: RunningBroker, body: object, needle: str
) -> None:
    assert needle in error_of(post(broker, body), 400)


def test_malformed_json_is_400(broker: RunningBroker) -> None:
    response = httpx.post(
        f"{broker.base_url}/v1/turns",
        content=b'{"conversation_id": ',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    error_of(response, 400, "bad_json")


def test_limits_on_messages_are_400(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(max_messages=3, max_message_chars=10)
    many = {"conversation_id": "c", "messages": USER * 4}
    long = {"conversation_id": "c", "messages": [{"role": "user", "content": "x" * 11}]}
    error_of(post(broker, many), 400, "too_many_messages")
    error_of(post(broker, long), 400, "message_too_long")


def test_oversized_bodies_are_413_declared_or_streamed(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(max_body_bytes=1000)
    big = {"conversation_id": "c", "messages": [{"role": "user", "content": "x" * 2000}]}
    error_of(post(broker, big), 413, "too_large")

    def chunks() -> object:
        payload = orjson.dumps(big)
        for i in range(0, len(payload), 100):
            yield payload[i : i + 100]

    # No Content-Length: the guard counts bytes as they arrive.
    streamed = httpx.post(
        f"{broker.base_url}/v1/turns",
        content=chunks(),  # type: ignore[arg-type]
        headers={"content-type": "application/json"},
        timeout=10,
    )
    error_of(streamed, 413, "too_large")
    # The broker still serves a normal turn afterwards.
    assert post(broker, {"conversation_id": "c", "messages": USER}).status_code == 201


def test_unknown_turns_and_routes_are_404(broker: RunningBroker) -> None:
    error_of(httpx.get(f"{broker.base_url}/v1/turns/nope", timeout=5), 404, "not_found")
    error_of(httpx.get(f"{broker.base_url}/v1/turns/bad%20id", timeout=5), 404, "not_found")
    error_of(httpx.get(f"{broker.base_url}/v2/whatever", timeout=5), 404)
    error_of(httpx.delete(f"{broker.base_url}/v1/turns/x", timeout=5), 405)
