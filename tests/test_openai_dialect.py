"""The OpenAI Responses dialect, read by the official ``openai`` SDK against a real broker.

Every event the broker sends is parsed by the SDK's own stream decoder, then validated strictly
against the SDK's ``ResponseStreamEvent`` union (the decoder alone is lenient).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn, wait_until

EVENT = TypeAdapter(ResponseStreamEvent)
KEY = "key-openai-0123456789abcdef"


def simulate(**knobs: Any) -> dict[str, Any]:
    return {"broker": {"params": {"simulate": {"seed": 7, **knobs}}}}


def client(broker: RunningBroker, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{broker.base_url}/v1", api_key=key, max_retries=0, timeout=20)


def async_client(broker: RunningBroker, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{broker.base_url}/v1", api_key=key, max_retries=0, timeout=20
    )


def checked(event: Any) -> Any:
    """The SDK's event, validated strictly against the SDK's types (fails on any mismatch)."""
    return EVENT.validate_python(event.to_dict())


def deltas(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def canonical_text(broker: RunningBroker, response_id: str) -> str:
    state = get_turn(broker.base_url, response_id)
    assert state["status"] == "complete", state
    text: str = state["canonical"]["text"]
    return text


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


def test_a_streamed_response_parses_into_the_sdk_types_and_ends_completed(
    broker: RunningBroker,
) -> None:
    with client(broker) as sdk:
        stream = sdk.responses.create(
            model="simulated",
            input="tell me",
            stream=True,
            background=True,
            extra_body=simulate(tokens=30, tokens_per_s=300),
        )
        events = [checked(e) for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") == 30
    assert [e.sequence_number for e in events] == list(range(len(events)))
    response_id = events[0].response.id
    text = canonical_text(broker, response_id)
    assert deltas(events) == text
    assert events[-4].text == text
    final = events[-1].response
    assert final.status == "completed"
    assert final.output_text == text
    assert final.usage is not None
    assert final.usage.output_tokens > 0


def test_a_reader_cut_anywhere_resumes_with_starting_after_byte_identical(
    broker: RunningBroker,
) -> None:
    rng = random.Random(15)
    with client(broker) as sdk:
        for _ in range(6):
            stream = sdk.responses.create(
                model="simulated",
                input="a long answer",
                stream=True,
                background=True,
                extra_body=simulate(tokens=60, tokens_per_s=400, seed=rng.randrange(1000)),
            )
            cut = rng.randrange(1, 66)
            first: list[Any] = []
            for event in stream:
                first.append(checked(event))
                if len(first) == cut:
                    break
            stream.close()
            response_id = first[0].response.id
            rest = [
                checked(e)
                for e in sdk.responses.retrieve(
                    response_id, stream=True, starting_after=first[-1].sequence_number
                )
            ]
            seen = [e.sequence_number for e in first + rest]
            assert seen == sorted(set(seen)), "a sequence number repeated or went back"
            assert seen == list(range(len(seen)))
            assert rest[-1].type == "response.completed"
            assert deltas(first) + deltas(rest) == canonical_text(broker, response_id)
            # A second full replay is the same events, number for number.
            again = [checked(e) for e in sdk.responses.retrieve(response_id, stream=True)]
            assert [e.to_dict() for e in again] == [e.to_dict() for e in first + rest]


async def test_the_async_client_cuts_and_resumes_too(broker: RunningBroker) -> None:
    async with async_client(broker) as sdk:
        stream = await sdk.responses.create(
            model="simulated",
            input="async",
            stream=True,
            background=True,
            extra_body=simulate(tokens=40, tokens_per_s=300),
        )
        first: list[Any] = []
        async for event in stream:
            first.append(checked(event))
            if len(first) == 17:
                break
        await stream.close()
        resumed = await sdk.responses.retrieve(
            first[0].response.id, stream=True, starting_after=first[-1].sequence_number
        )
        rest = [checked(e) async for e in resumed]
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
    text = await asyncio.to_thread(canonical_text, broker, first[0].response.id)
    assert deltas(first) + deltas(rest) == text


def test_resuming_after_the_last_event_sends_nothing_and_ends(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        events: list[Any] = list(
            sdk.responses.create(
                model="simulated",
                input="x",
                stream=True,
                extra_body=simulate(tokens=5),
            )
        )
        last = events[-1].sequence_number
        after = list(
            sdk.responses.retrieve(events[0].response.id, stream=True, starting_after=last)
        )
        middle = list(
            sdk.responses.retrieve(events[0].response.id, stream=True, starting_after=last - 2)
        )
    assert after == []
    assert [e.sequence_number for e in middle] == [last - 1, last]


def test_retrieve_returns_the_response_object_with_its_text(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        created = sdk.responses.create(
            model="simulated",
            input="poll me",
            background=True,
            extra_body=simulate(tokens=20, tokens_per_s=200),
        )
        assert isinstance(created, Response)
        assert created.status in ("queued", "in_progress")

        def done() -> Response | None:
            current = sdk.responses.retrieve(created.id)
            return current if current.status == "completed" else None

        final = wait_until(done, timeout=15, interval=0.05)
    Response.model_validate(final.to_dict())
    assert final.output_text == canonical_text(broker, created.id)
    assert final.usage is not None
    assert final.usage.total_tokens > 0


def test_a_response_without_stream_or_background_waits_for_the_answer(
    broker: RunningBroker,
) -> None:
    with client(broker) as sdk:
        response = sdk.responses.create(
            model="simulated", input="wait", extra_body=simulate(tokens=12)
        )
    assert response.status == "completed"
    assert response.output_text == canonical_text(broker, response.id)


def test_the_same_idempotency_key_attaches_and_a_different_body_is_a_conflict(
    broker: RunningBroker,
) -> None:
    key = {"Idempotency-Key": "resp-double-click-1"}
    with client(broker) as sdk:
        first = sdk.responses.create(
            model="simulated",
            input="once",
            background=True,
            extra_headers=key,
            extra_body=simulate(tokens=10),
        )
        second = sdk.responses.create(
            model="simulated",
            input="once",
            background=True,
            extra_headers=key,
            extra_body=simulate(tokens=10),
        )
        assert first.id == second.id == "resp-double-click-1"
        with pytest.raises(openai.ConflictError) as conflict:
            sdk.responses.create(
                model="simulated",
                input="twice",
                background=True,
                extra_headers=key,
                extra_body=simulate(tokens=10),
            )
        via_metadata = sdk.responses.create(
            model="simulated",
            input="meta",
            background=True,
            metadata={"turn_id": "resp-by-metadata"},
            extra_body=simulate(tokens=3),
        )
    assert conflict.value.body is not None
    assert set(conflict.value.response.json()["error"]) == {"message", "type", "param", "code"}
    assert via_metadata.id == "resp-by-metadata"
    state = wait_until(
        lambda: (s := get_turn(broker.base_url, first.id))["status"] == "complete" and s
    )
    assert len(state["attempts"]) == 1
    assert broker.metric("broker_turns_started_total") == 2.0


def test_cancel_stops_a_running_response_and_is_idempotent(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        stream = sdk.responses.create(
            model="simulated",
            input="slow",
            stream=True,
            background=True,
            extra_body=simulate(tokens=400, tokens_per_s=40),
        )
        seen: list[Any] = []
        for event in stream:
            seen.append(checked(event))
            if event.type == "response.output_text.delta":
                break
        response_id = seen[0].response.id
        cancelled = sdk.responses.cancel(response_id)
        assert cancelled.status == "cancelled"
        # The reader still on the stream gets the terminal event, with status cancelled.
        rest = [checked(e) for e in stream]
        again = sdk.responses.cancel(response_id)
    assert rest[-1].type == "response.incomplete"
    assert rest[-1].response.status == "cancelled"
    assert again.status == "cancelled"
    kept = get_turn(broker.base_url, response_id)["canonical"]
    assert again.output_text == (kept["text"] if kept else "")


def test_errors_have_openai_shape_and_name_the_parameter(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        with pytest.raises(openai.BadRequestError) as unknown:
            sdk.responses.create(model="simulated", input="x", extra_body={"frobnicate": 1})
        with pytest.raises(openai.BadRequestError) as tools:
            sdk.responses.create(
                model="simulated",
                input="x",
                tools=[{"type": "web_search"}],  # built-in tools are not served
            )
        with pytest.raises(openai.BadRequestError) as bad_knob:
            sdk.responses.create(model="simulated", input="x", extra_body=simulate(no_such_knob=1))
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve("resp_nobody")
        with pytest.raises(openai.NotFoundError):
            sdk.responses.cancel("resp_nobody")
    assert unknown.value.param == "frobnicate"
    assert tools.value.param == "tools"
    assert "no_such_knob" in bad_knob.value.message
    for raw in (b"{", b"[]", b'{"model": 3, "input": "x"}', b'{"model": "simulated"}'):
        answer = httpx.post(f"{broker.base_url}/v1/responses", content=raw, timeout=10)
        assert answer.status_code == 400, answer.text
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    answer = httpx.get(
        f"{broker.base_url}/v1/responses/x", params={"stream": "true", "starting_after": "z"}
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "starting_after"


def test_auth_and_tenants_hold_on_the_responses_routes(broker_factory: BrokerFactory) -> None:
    other = "key-other-0123456789abcdef"
    broker = broker_factory(api_keys=f"a={KEY},b={other}")
    with client(broker, KEY) as mine, client(broker, other) as theirs:
        created = mine.responses.create(
            model="simulated", input="mine", extra_body=simulate(tokens=4)
        )
        assert created.status == "completed"
        with pytest.raises(openai.NotFoundError):
            theirs.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.cancel(created.id)
        with pytest.raises(openai.NotFoundError):
            list(theirs.responses.retrieve(created.id, stream=True))
        with pytest.raises(openai.BadRequestError):
            theirs.responses.create(model="simulated", input="x", previous_response_id=created.id)
    with client(broker, "wrong-key") as nobody, pytest.raises(openai.AuthenticationError) as exc:
        nobody.responses.retrieve(created.id)
    assert exc.value.response.json()["error"]["type"] == "authentication_error"
    paths = httpx.get(f"{broker.base_url}/openapi.json").json()["paths"]
    for path in (
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
    ):
        assert path in paths


def test_previous_response_id_sends_the_canonical_history_plus_the_new_input(
    broker: RunningBroker,
) -> None:
    with client(broker) as sdk:
        first = sdk.responses.create(
            model="simulated", input="first question", extra_body=simulate(tokens=6)
        )
        second = sdk.responses.create(
            model="simulated",
            input=[{"role": "user", "content": "second question"}],
            previous_response_id=first.id,
            extra_body=simulate(tokens=6),
        )
    assert second.status == "completed"
    history = httpx.get(f"{broker.base_url}/v1/conversations/{first.id}/messages").json()
    assert history["messages"] == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": second.output_text},
    ]
    assert [t["turn_id"] for t in history["turns"]] == [first.id, second.id]


def _item_text(events: list[Any], output_index: int) -> str:
    return "".join(
        e.delta
        for e in events
        if e.type == "response.output_text.delta" and e.output_index == output_index
    )


@pytest.mark.parametrize("strategy", ["regenerate", "continue"])
def test_an_interrupted_response_and_its_next_attempt_never_double_the_text(
    broker: RunningBroker, strategy: str
) -> None:
    with client(broker) as sdk:
        stream = sdk.responses.create(
            model="simulated",
            input="break",
            stream=True,
            background=True,
            extra_body=simulate(tokens=30, fail_after_deltas=8),
        )
        first = [checked(e) for e in stream]
        response_id = first[0].response.id
        assert first[-1].type == "response.incomplete"
        assert first[-1].response.status == "incomplete"
        partial = _item_text(first, 0)
        assert len([e for e in first if e.type == "response.output_text.delta"]) == 8
        assert first[-1].response.output_text == partial
        started = httpx.post(
            f"{broker.base_url}/v1/turns/{response_id}/attempts", json={"strategy": strategy}
        )
        assert started.status_code == 201, started.text
        rest = [
            checked(e)
            for e in sdk.responses.retrieve(
                response_id, stream=True, starting_after=first[-1].sequence_number
            )
        ]
        replay = [checked(e) for e in sdk.responses.retrieve(response_id, stream=True)]
        final = sdk.responses.retrieve(response_id)
    text = canonical_text(broker, response_id)
    assert rest[0].type == "response.in_progress"
    assert rest[1].type == "response.output_item.added"
    assert rest[1].output_index == 1
    assert rest[-1].type == "response.completed"
    seen = [e.sequence_number for e in first + rest]
    assert seen == list(range(len(seen)))
    assert [e.to_dict() for e in replay] == [e.to_dict() for e in first + rest]
    second = _item_text(rest, 1)
    done = [e for e in rest if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [second]
    if strategy == "regenerate":
        assert second == text  # a second message, whole: the partial is not prefixed to it
    else:
        assert partial + second == text  # the continuation only
    assert rest[-1].response.output_text == text
    assert final.output_text == text
    assert final.status == "completed"


def test_resuming_at_any_point_of_a_long_response_sends_exactly_what_follows(
    broker: RunningBroker, raw_redis: Any
) -> None:
    """Regression guard for the seek's checkpoints: walks that start from one are exact too."""
    rng = random.Random(1500)
    with client(broker) as sdk:
        created = sdk.responses.create(
            model="simulated", input="long", extra_body=simulate(tokens=700, tokens_per_s=0)
        )
        full = [checked(e).to_dict() for e in sdk.responses.retrieve(created.id, stream=True)]
        assert [e["sequence_number"] for e in full] == list(range(len(full)))
        points = [*rng.sample(range(len(full)), 25), 0, 1, 2, 3, len(full) - 2, len(full) - 1]
        for after in points:
            got = [
                e.to_dict()
                for e in sdk.responses.retrieve(created.id, stream=True, starting_after=after)
            ]
            assert got == full[after + 1 :], after
    key = broker.runtime.keys.responses_seq(created.id, created.id)
    assert raw_redis.zcard(key) >= 700 // 64 - 1  # the walks left checkpoints behind
    assert raw_redis.pttl(key) > 0  # and they expire


def test_a_response_past_retention_is_a_clear_error_not_a_hang(
    broker: RunningBroker, raw_redis: Any
) -> None:
    with client(broker) as sdk:
        created = sdk.responses.create(
            model="simulated", input="old", extra_body=simulate(tokens=3)
        )
        keys = broker.runtime.keys
        # What the retention clock does: the turn and its stream go, the tombstone stays.
        raw_redis.delete(keys.turn(created.id, created.id), keys.events(created.id, created.id))
        for call in (
            lambda: sdk.responses.retrieve(created.id),
            lambda: list(sdk.responses.retrieve(created.id, stream=True, starting_after=3)),
            lambda: sdk.responses.cancel(created.id),
        ):
            with pytest.raises(openai.APIStatusError) as gone:
                call()
            assert gone.value.status_code == 410
            assert gone.value.code == "expired"


def test_input_text_parts_and_model_errors(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        response = sdk.responses.create(
            model="simulated",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "in parts"}]}],
            instructions="be brief",
            extra_body=simulate(tokens=4),
        )
        with pytest.raises(openai.BadRequestError) as unknown_model:
            sdk.responses.create(model="no-such-model", input="x")
        with pytest.raises(openai.BadRequestError) as unknown_provider:
            sdk.responses.create(model="nobody/thing", input="x")
    assert response.status == "completed"
    sent = httpx.get(f"{broker.base_url}/v1/conversations/{response.id}/messages").json()
    assert sent["messages"][:2] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "in parts"},
    ]
    assert unknown_model.value.param == "model"
    assert unknown_provider.value.param == "model"


def test_the_dialect_package_exports_its_router_only(broker: RunningBroker) -> None:
    import broker.dialects.openai as dialect

    assert dialect.__all__ == ["router"]
    paths = httpx.get(f"{broker.base_url}/openapi.json").json()["paths"]
    mine = {
        (path, method)
        for path, item in paths.items()
        for method in item
        if path.startswith(("/v1/responses", "/v1/chat"))
    }
    assert mine == {
        ("/v1/responses", "post"),
        ("/v1/responses/{response_id}", "get"),
        ("/v1/responses/{response_id}/cancel", "post"),
        ("/v1/chat/completions", "post"),
    }


def test_concurrent_creates_with_one_key_start_one_generation(broker: RunningBroker) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def create(_: int) -> str:
        with client(broker) as sdk:
            return sdk.responses.create(
                model="simulated",
                input="same",
                background=True,
                extra_headers={"Idempotency-Key": "resp-concurrent"},
                extra_body=simulate(tokens=5),
            ).id

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(create, range(8)))
    assert ids == ["resp-concurrent"] * 8
    assert broker.metric("broker_turns_started_total") == 1.0


def test_a_repeated_follow_up_with_its_key_attaches_instead_of_conflicting(
    broker: RunningBroker,
) -> None:
    """Regression: the repeat met a history that already held the follow-up's own input."""
    with client(broker) as sdk:
        first = sdk.responses.create(
            model="simulated", input="first", extra_body=simulate(tokens=4)
        )
        ask: dict[str, Any] = {
            "model": "simulated",
            "input": "second",
            "previous_response_id": first.id,
            "extra_headers": {"Idempotency-Key": "resp-follow-up"},
            "extra_body": simulate(tokens=4),
        }
        one = sdk.responses.create(**ask)
        two = sdk.responses.create(**ask)
        with pytest.raises(openai.ConflictError):
            sdk.responses.create(**{**ask, "input": "something else"})
    assert one.id == two.id == "resp-follow-up"
    assert two.output_text == one.output_text
    assert broker.metric("broker_turns_started_total") == 2.0
