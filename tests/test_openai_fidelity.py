"""The Responses door says what the request said, and takes what OpenAI's clients send.

Each test pins a gap that made a real client misbehave (regressions of the old door):
``background`` always true, ``incomplete_details`` null on an incomplete response, ``include: []``
/ ``tools: []`` / ``store: false`` / ``item_reference`` refused, earlier ``instructions`` carried
over ``previous_response_id``, ``instructions`` and ``metadata`` never echoed.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.conftest import BrokerFactory, RunningBroker
from tests.test_openai_dialect import checked, client, simulate


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


def sent_messages(broker: RunningBroker, response_id: str) -> list[dict[str, Any]]:
    """The messages the broker sent the model for ``response_id`` (its stored request)."""
    turns = broker.runtime.turns

    async def read() -> list[dict[str, Any]]:
        conversation_id = await turns.locate(response_id, None)
        request = await turns.request(conversation_id, response_id)
        return [{"role": m["role"], "content": m["content"]} for m in request.messages]

    result: list[dict[str, Any]] = broker.call(read())
    return result


def items(*raw: dict[str, Any]) -> Any:
    """Input items as sent on the wire (some on purpose not of the SDK's types)."""
    return list(raw)


def test_background_is_echoed_as_sent(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        foreground = [
            checked(e)
            for e in sdk.responses.create(
                model="simulated", input="hi", stream=True, extra_body=simulate(tokens=3)
            )
        ]
        waited = sdk.responses.create(model="simulated", input="hi", extra_body=simulate(tokens=3))
        background = sdk.responses.create(
            model="simulated", input="hi", background=True, extra_body=simulate(tokens=3)
        )
        responses = [e.response for e in foreground if hasattr(e, "response")]
        assert responses
        assert all(r.background is False for r in responses)
        assert waited.background is False
        assert sdk.responses.retrieve(waited.id).background is False
        assert background.background is True
        assert sdk.responses.retrieve(background.id).background is True


def test_every_incomplete_response_says_why(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        events = [
            checked(e)
            for e in sdk.responses.create(
                model="simulated",
                input="hi",
                stream=True,
                extra_body=simulate(tokens=20, fail_after_deltas=4),
            )
        ]
        final = events[-1]
        assert final.type == "response.incomplete"
        assert final.response.incomplete_details is not None
        assert final.response.incomplete_details.reason == "max_output_tokens"
        again = sdk.responses.retrieve(final.response.id)
        assert again.status == "incomplete"
        assert again.incomplete_details is not None
        assert again.incomplete_details.reason == "max_output_tokens"
        story = sdk.responses.create(
            model="simulated",
            input="a long story",
            background=True,
            extra_body=simulate(tokens=500, tokens_per_s=50),
        )
        stopped = sdk.responses.cancel(story.id)
        assert stopped.status == "cancelled"
        assert stopped.incomplete_details is not None
        done = sdk.responses.create(model="simulated", input="hi", extra_body=simulate(tokens=3))
        assert done.incomplete_details is None


def test_empty_include_and_tools_and_harmless_include_values_are_taken(
    broker: RunningBroker,
) -> None:
    with client(broker) as sdk:
        extra: dict[str, Any]
        for extra in (
            {"include": [], "tools": []},
            {"include": ["reasoning.encrypted_content", "file_search_call.results"]},
            {"truncation": "disabled"},
        ):
            done = sdk.responses.create(
                model="simulated", input="hi", **extra, extra_body=simulate(tokens=3)
            )
            assert done.status == "completed"
        include: Any
        for include in (["message.output_text.logprobs"], ["no.such.value"]):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.responses.create(model="simulated", input="hi", include=include)
            assert refused.value.param == "include"
            assert include[0] in refused.value.message
        with pytest.raises(openai.BadRequestError) as truncating:
            sdk.responses.create(model="simulated", input="hi", truncation="auto")
        assert truncating.value.param == "truncation"
        # The same rule on retrieve, where the SDK sends include[]=... (once ignored silently).
        got = sdk.responses.retrieve(done.id, include=["reasoning.encrypted_content"])
        assert got.id == done.id
        with pytest.raises(openai.BadRequestError) as on_retrieve:
            sdk.responses.retrieve(done.id, include=["message.output_text.logprobs"])
        assert on_retrieve.value.param == "include"


def test_store_false_is_taken_and_cannot_be_continued(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        unstored = sdk.responses.create(
            model="simulated", input="hi", store=False, extra_body=simulate(tokens=3)
        )
        assert unstored.status == "completed"
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model="simulated", input="more", previous_response_id=unstored.id)
        with pytest.raises(openai.BadRequestError) as unknown:
            sdk.responses.create(model="simulated", input="more", previous_response_id="resp_no")
    for error in (refused.value, unknown.value):
        assert error.param == "previous_response_id"
        assert error.code == "previous_response_not_found"


def test_item_references_resolve_to_the_brokers_own_items(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        first = sdk.responses.create(
            model="simulated",
            input=items({"type": "message", "role": "user", "content": "remember", "id": "in_1"}),
            extra_body=simulate(tokens=4),
        )
        answer_id = first.output[0].id
        referring = sdk.responses.create(
            model="simulated",
            input=items(
                {"type": "item_reference", "id": answer_id}, {"role": "user", "content": "go on"}
            ),
            extra_body=simulate(tokens=3),
        )
        assert sent_messages(broker, referring.id) == [
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "go on"},
        ]
        # An input item the previous response was sent with, by its id.
        chained = sdk.responses.create(
            model="simulated",
            previous_response_id=first.id,
            input=items(
                {"type": "item_reference", "id": "in_1"}, {"role": "user", "content": "again"}
            ),
            extra_body=simulate(tokens=3),
        )
        assert sent_messages(broker, chained.id)[-2:] == [
            {"role": "user", "content": "remember"},
            {"role": "user", "content": "again"},
        ]
        # ...and of any response before it in the chain, whatever instructions came and went.
        later = sdk.responses.create(
            model="simulated",
            previous_response_id=chained.id,
            instructions="now terse",
            input=items({"type": "item_reference", "id": "in_1"}),
            extra_body=simulate(tokens=3),
        )
        assert sent_messages(broker, later.id)[-1] == {"role": "user", "content": "remember"}
        with pytest.raises(openai.BadRequestError) as unknown:
            sdk.responses.create(
                model="simulated", input=items({"type": "item_reference", "id": "msg_9_nobody"})
            )
        with pytest.raises(openai.BadRequestError) as unsupported:
            sdk.responses.create(
                model="simulated",
                input=items({"type": "computer_call_output", "call_id": "c", "output": "x"}),
            )
        with pytest.raises(openai.BadRequestError) as approval:  # decided on the native route
            sdk.responses.create(
                model="simulated",
                input=items(
                    {
                        "type": "mcp_approval_response",
                        "approval_request_id": "apr_x",
                        "approve": True,
                    }
                ),
            )
        with pytest.raises(openai.BadRequestError) as image:
            sdk.responses.create(
                model="simulated",
                input=items(
                    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
                ),
            )
        with pytest.raises(openai.BadRequestError) as malformed:
            sdk.responses.create(model="simulated", input=items({"role": "user", "content": 3}))
    assert unknown.value.param == "input"
    assert "msg_9_nobody" in unknown.value.message
    assert "input.str" not in unknown.value.message
    assert unsupported.value.param == "input"
    assert "computer_call_output" in unsupported.value.message
    # An answer to approval requests needs the response that asked (tests/test_openai_approvals.py).
    assert approval.value.param == "previous_response_id"
    assert "mcp_approval_response" in approval.value.message
    assert image.value.param == "input"
    assert "input_image" in image.value.message
    assert malformed.value.param == "input"
    assert ".str" not in malformed.value.message
    assert "message item" in malformed.value.message


def test_instructions_replace_the_previous_ones_and_are_echoed(broker: RunningBroker) -> None:
    with client(broker) as sdk:
        first = sdk.responses.create(
            model="simulated", input="one", instructions="A", extra_body=simulate(tokens=3)
        )
        second = sdk.responses.create(
            model="simulated",
            input="two",
            instructions="B",
            previous_response_id=first.id,
            extra_body=simulate(tokens=3),
        )
        third = sdk.responses.create(
            model="simulated", input="three", previous_response_id=second.id
        )
        assert first.instructions == "A"
        assert second.instructions == "B"
        assert third.instructions is None
        assert sdk.responses.retrieve(second.id).instructions == "B"
        assert second.previous_response_id == first.id
    assert sent_messages(broker, second.id) == [
        {"role": "system", "content": "B"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "two"},
    ]
    assert [m["role"] for m in sent_messages(broker, third.id)] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]


def test_metadata_is_echoed(broker: RunningBroker) -> None:
    metadata = {"team": "blue", "ticket": "42"}
    with client(broker) as sdk:
        made = sdk.responses.create(
            model="simulated", input="hi", metadata=metadata, extra_body=simulate(tokens=3)
        )
        events = [
            checked(e)
            for e in sdk.responses.create(
                model="simulated",
                input="hi",
                metadata=metadata,
                stream=True,
                extra_body=simulate(tokens=3),
            )
        ]
        assert made.metadata == metadata
        assert sdk.responses.retrieve(made.id).metadata == metadata
        assert all(e.response.metadata == metadata for e in events if hasattr(e, "response"))
