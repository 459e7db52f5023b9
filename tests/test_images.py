"""Images in a question: the native content parts, their translation at each door and to each
upstream (as tables), and an image question through the official SDK reaching the fake
OpenAI upstream, the fake Anthropic upstream and the simulator."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from broker.canonical import canonical_json, fingerprint
from broker.content import MAX_IMAGES, Image, parse_image_url
from broker.dialects.openai.requests import (
    ChatRequest,
    ParamError,
    ResponsesRequest,
    as_message,
    chat_messages,
    input_items,
)
from broker.providers.anthropic import build_body
from broker.providers.base import GenerationRequest
from broker.providers.openai import render_messages
from broker.providers.simulated import IMAGE_TOKENS, image_echo, input_tokens
from broker.turn_requests import stored_request
from broker.turns import TurnRequest
from tests.conftest import BrokerFactory, RunningBroker
from tests.fake_anthropic import FakeAnthropic
from tests.fake_openai import FakeOpenAI
from tests.helpers import get_turn, read_sse, text_of
from tests.test_openai_dialect import client
from tests.test_openai_fidelity import sent_messages

PNG_DATA = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9aw"
    "AAAABJRU5ErkJggg=="
)
PNG = f"data:image/png;base64,{PNG_DATA}"
JPEG = "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xe0" + bytes(12)).decode()
CAT = "https://images.example.com/cat.jpg"
QUESTION = "What is in these pictures?"

# --- the native parts, as a table ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "media_type", "host"),
    [
        (PNG, "image/png", ""),
        (JPEG, "image/jpeg", ""),
        (
            "data:image/gif;base64," + base64.b64encode(b"GIF89a" + bytes(6)).decode(),
            "image/gif",
            "",
        ),
        (
            "data:image/webp;base64," + base64.b64encode(b"RIFF\0\0\0\0WEBPVP8 ").decode(),
            "image/webp",
            "",
        ),
        (CAT, None, "images.example.com"),
        ("http://10.0.0.1:8080/a.png?x=1", None, "10.0.0.1"),
    ],
)
def test_image_urls_the_broker_takes(url: str, media_type: str | None, host: str) -> None:
    image = parse_image_url(url)
    assert (image.media_type, image.host) == (media_type, host)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://example.com/a.png", "http(s) URL with a host"),
        ("https:///a.png", "http(s) URL with a host"),
        ("cat.png", "http(s) URL with a host"),
        ("https://example.com/" + "a" * 9000, "at most 8192"),
        ("data:image/tiff;base64,AAAA", "'image/tiff' is not supported"),
        ("data:text/plain;base64,AAAA", "'text/plain' is not supported"),
        ("data:image/png,rawbytes", "data:<media type>;base64"),
        ("data:image/png;base64", "data:<media type>;base64"),
        ("data:image/png;base64,not*base64", "not valid base64"),
        ("data:image/png;base64," + PNG_DATA[:-3], "not valid base64"),
        (JPEG.replace("jpeg", "png", 1), "bytes are not image/png"),
        (
            "data:image/webp;base64," + base64.b64encode(b"RIFF\0\0\0\0WAVE").decode(),
            "not image/webp",
        ),
    ],
)
def test_image_urls_the_broker_refuses_say_why(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_image_url(url)


def native(content: Any, role: str = "user") -> TurnRequest:
    return TurnRequest.model_validate(
        {"conversation_id": "c", "messages": [{"role": role, "content": content}]}
    )


@pytest.mark.parametrize(
    ("content", "role", "where", "says"),
    [
        ([], "user", "messages.0", "at least one part"),
        ([{"type": "text", "text": "x"}], "system", "messages.0", "user messages only"),
        ([{"type": "image", "url": PNG}], "assistant", "messages.0", "user messages only"),
        (
            [{"type": "image", "url": "ftp://x"}],
            "user",
            "messages.0.content.parts.0.image.url",
            "http(s)",
        ),
        ([{"type": "image", "url": PNG, "detail": "max"}], "user", "detail", "'auto'"),
        ([{"type": "image", "url": PNG, "alt": "x"}], "user", "alt", "Extra inputs"),
        ([{"type": "video", "url": PNG}], "user", "messages.0.content.parts.0", "'video'"),
        ([{"type": "text"}], "user", "text", "Field required"),
        (7, "user", "messages.0.content.parts", "valid list"),
    ],
)
def test_bad_native_parts_are_refused_naming_the_field(
    content: Any, role: str, where: str, says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        native(content, role)
    error = caught.value.errors()[0]
    assert where in ".".join(str(p) for p in error["loc"])
    assert says in error["msg"]


def test_a_plain_request_keeps_the_fingerprint_it_had_before_parts() -> None:
    """Turns stored before content parts must still match their idempotency fingerprints."""
    request = TurnRequest.model_validate(
        {
            "conversation_id": "c-plain",
            "turn_id": "t1",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi", "name": "ann"},
                {"role": "assistant", "content": "Half", "partial": True},
                {"role": "user", "content": "More?"},
            ],
            "params": {"simulate": {"seed": 3}},
        }
    )
    # The fingerprint the broker took of this request before content could be parts.
    before = "0d135a30899b33c3728ad450fbd49a43f27861694a016c3ab5ce7e2b7a1acbe0"
    assert fingerprint(stored_request(request, "simulated")) == before


def test_a_plain_message_dumps_as_it_always_did() -> None:
    assert native("hi").model_dump()["messages"][0]["content"] == "hi"
    parts = native([{"type": "text", "text": "hi"}, {"type": "image", "url": CAT}])
    assert parts.model_dump()["messages"][0]["content"] == [
        {"type": "text", "text": "hi"},
        {"type": "image", "url": CAT, "detail": None},
    ]


# --- the doors' bodies as native messages, as tables ---------------------------------------------


def chat(*messages: Any) -> list[dict[str, Any]]:
    return chat_messages(ChatRequest.model_validate({"model": "m", "messages": list(messages)}))


def test_chat_image_url_parts_become_native_image_parts() -> None:
    got = chat(
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": CAT, "detail": "low"}},
                {"type": "image_url", "image_url": {"url": PNG}},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    )
    assert got == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "url": CAT, "detail": "low"},
                {"type": "image", "url": PNG},
            ],
        },
        {"role": "user", "content": "ab"},  # text parts alone stay one string, as before
    ]


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "nope"}}]},
            "messages[0].content[0].image_url: an image URL must be",
        ),
        (
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": CAT}}]},
            "messages[0]: images are for user messages only",
        ),
        (
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/bmp;base64,Qk0="}}
                ],
            },
            "'image/bmp' is not supported",
        ),
    ],
)
def test_chat_bad_images_are_a_400_naming_messages(message: Any, says: str) -> None:
    with pytest.raises(ParamError) as caught:
        chat(message)
    assert caught.value.param == "messages"
    assert says in caught.value.message


def responses_input(*content: Any, role: str = "user") -> list[dict[str, Any]]:
    body = ResponsesRequest.model_validate(
        {"model": "m", "input": [{"role": role, "content": list(content)}]}
    )
    return [as_message(item, n) for n, item in enumerate(input_items(body))]  # type: ignore[arg-type]


def test_responses_input_image_parts_become_native_image_parts() -> None:
    got = responses_input(
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": PNG, "detail": "high"},
        {"type": "input_image", "image_url": CAT, "detail": "auto"},
    )
    assert got == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "url": PNG, "detail": "high"},
                {"type": "image", "url": CAT, "detail": "auto"},
            ],
        }
    ]
    assert responses_input({"type": "input_text", "text": "x"}) == [
        {"role": "user", "content": "x"}
    ]


@pytest.mark.parametrize(
    ("parts", "role", "says"),
    [
        ([{"type": "input_image", "file_id": "file-1"}], "user", "file_id is not supported"),
        ([{"type": "input_image"}], "user", "an image URL is required"),
        ([{"type": "input_image", "image_url": "data:image/png;base64,@@"}], "user", "base64"),
        ([{"type": "input_image", "image_url": CAT}], "developer", "user messages only"),
        ([{"type": "input_file", "file_id": "f"}], "user", "'input_file' are not supported"),
    ],
)
def test_responses_bad_images_are_a_400_naming_input(parts: Any, role: str, says: str) -> None:
    with pytest.raises(ParamError) as caught:
        responses_input(*parts, role=role)
    assert caught.value.param == "input"
    assert says in caught.value.message


# --- native messages as the upstreams' bodies, as tables -----------------------------------------

PARTS: list[dict[str, Any]] = [
    {"type": "text", "text": QUESTION},
    {"type": "image", "url": CAT, "detail": "low"},
    {"type": "image", "url": PNG},
]


def generation(messages: list[dict[str, Any]]) -> GenerationRequest:
    return GenerationRequest(
        conversation_id="c",
        turn_id="t",
        attempt=1,
        strategy="initial",
        messages=messages,
        model="m",
        params={},
        response_format="text",
        upstream_call=0,
    )


def test_openai_upstream_gets_image_url_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": PARTS},
    ]
    assert render_messages(generation(messages)) == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": CAT, "detail": "low"}},
                {"type": "image_url", "image_url": {"url": PNG}},
            ],
        },
    ]


def test_anthropic_upstream_gets_image_blocks() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": " "}, *PARTS]},
    ]
    body, _ = build_body(generation(messages), 100)
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hello"},  # blank text parts are dropped
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "url", "url": CAT}},  # no `detail` there
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": PNG_DATA},
                },
            ],
        }
    ]


def test_the_simulator_names_the_images_it_was_shown() -> None:
    images = [parse_image_url(url) for url in (PNG, CAT, JPEG)]
    assert image_echo(images) == "(shown 3 images: image/png, images.example.com, image/jpeg) "
    assert image_echo(images[:1]) == "(shown 1 image: image/png) "


# --- through a broker ----------------------------------------------------------------------------


@pytest.fixture
def simulated(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


def turn(broker: RunningBroker, turn_id: str, content: Any, **fields: Any) -> httpx.Response:
    body = {
        "conversation_id": f"conv-{turn_id}",
        "turn_id": turn_id,
        "messages": [{"role": "user", "content": content}],
        "params": {"simulate": {"tokens": 4, "tokens_per_s": 0}},
        **fields,
    }
    return httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10)


def test_a_native_image_turn_is_answered_and_stays_idempotent(simulated: RunningBroker) -> None:
    parts = [{"type": "text", "text": QUESTION}, {"type": "image", "url": PNG, "detail": "low"}]
    created = turn(simulated, "img-native", parts)
    assert created.status_code == 201, created.text
    events = read_sse(simulated.base_url, created.json()["stream_id"]).events
    assert text_of(events).startswith("(shown 1 image: image/png) ")
    assert turn(simulated, "img-native", parts).status_code == 200  # the same request
    other = [parts[0], {**parts[1], "detail": "high"}]
    assert turn(simulated, "img-native", other).status_code == 409
    history = httpx.get(f"{simulated.base_url}/v1/conversations/conv-img-native/messages").json()
    assert history["messages"][0] == {"role": "user", "content": parts}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ([], "at least one part"),
        ([{"type": "image", "url": "data:image/png;base64,AAAA"}], "bytes are not image/png"),
        ([{"type": "image", "url": CAT}] * (MAX_IMAGES + 1), f"({MAX_IMAGES})"),
    ],
)
def test_a_bad_native_image_turn_is_a_400(
    simulated: RunningBroker, content: Any, says: str
) -> None:
    response = turn(simulated, "img-bad", content)
    assert response.status_code == 400
    assert says in response.json()["error"]["message"]


def test_the_simulator_answers_an_image_question_on_both_openai_doors(
    simulated: RunningBroker,
) -> None:
    knobs = {"broker": {"params": {"simulate": {"tokens": 4, "tokens_per_s": 0}}}}
    with client(simulated) as sdk:
        completion = sdk.chat.completions.create(
            model="simulated",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {"type": "image_url", "image_url": {"url": CAT, "detail": "low"}},
                    ],
                }
            ],
            extra_body=knobs,
        )
        response = sdk.responses.create(
            model="simulated",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": QUESTION},
                        {"type": "input_image", "image_url": PNG, "detail": "auto"},
                        {"type": "input_image", "image_url": JPEG, "detail": "auto"},
                    ],
                }
            ],
            extra_body=knobs,
        )
    assert (completion.choices[0].message.content or "").startswith(
        "(shown 1 image: images.example.com) "
    )
    assert response.output_text.startswith("(shown 2 images: image/png, image/jpeg) ")


def test_a_file_id_is_a_400_naming_input_through_the_sdk(simulated: RunningBroker) -> None:
    with client(simulated) as sdk, pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(
            model="simulated",
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "file_id": "file-abc", "detail": "auto"}],
                }
            ],
        )
    error: Any = caught.value.body
    assert error["param"] == "input"
    assert "file_id" in error["message"]


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


def test_an_image_question_reaches_the_openai_upstream_from_both_doors(
    broker_factory: BrokerFactory, fake_openai: FakeOpenAI
) -> None:
    broker = broker_factory(
        openai_base_url=fake_openai.url + "/v1", openai_api_key="sk-x", openai_models="gpt-test"
    )
    fake_openai.respond_text(["A cat."])
    fake_openai.respond_text(["A dot."])
    with client(broker) as sdk:
        completion = sdk.chat.completions.create(
            model="gpt-test",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {"type": "image_url", "image_url": {"url": CAT, "detail": "high"}},
                    ],
                }
            ],
        )
        response = sdk.responses.create(
            model="gpt-test",
            instructions="Be brief.",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": PNG, "detail": "low"},
                        {"type": "input_text", "text": QUESTION},
                    ],
                }
            ],
        )
    assert completion.choices[0].message.content == "A cat."
    assert response.output_text == "A dot."
    first, second = fake_openai.bodies
    assert first["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": CAT, "detail": "high"}},
            ],
        }
    ]
    assert second["messages"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
                {"type": "text", "text": QUESTION},
            ],
        },
    ]


@pytest.fixture
def fake_anthropic() -> Iterator[FakeAnthropic]:
    server = FakeAnthropic(api_key="sk-ant-x").start()
    yield server
    server.stop()


def test_an_image_question_reaches_the_anthropic_upstream(
    broker_factory: BrokerFactory, fake_anthropic: FakeAnthropic
) -> None:
    broker = broker_factory(
        anthropic_base_url=fake_anthropic.url,
        anthropic_api_key="sk-ant-x",
        anthropic_models="claude-test",
        sse_heartbeat_s=1.0,
    )
    fake_anthropic.text("A", " cat.")
    with client(broker) as sdk:
        completion = sdk.chat.completions.create(
            model="claude-test",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {"type": "image_url", "image_url": {"url": PNG}},
                        {"type": "image_url", "image_url": {"url": CAT, "detail": "low"}},
                    ],
                }
            ],
        )
    assert completion.choices[0].message.content == "A cat."
    (call,) = fake_anthropic.calls
    assert call.body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": PNG_DATA},
                },
                {"type": "image", "source": {"type": "url", "url": CAT}},
            ],
        }
    ]
    state = get_turn(broker.base_url, completion.id)
    assert state["status"] == "complete"


def test_an_image_input_carries_over_previous_response_id_and_item_reference(
    simulated: RunningBroker,
) -> None:
    knobs = {"broker": {"params": {"simulate": {"tokens": 4, "tokens_per_s": 0}}}}
    asked: Any = {
        "type": "message",
        "id": "in_img",
        "role": "user",
        "content": [
            {"type": "input_text", "text": QUESTION},
            {"type": "input_image", "image_url": PNG, "detail": "low"},
        ],
    }
    with client(simulated) as sdk:
        first = sdk.responses.create(model="simulated", input=[asked], extra_body=knobs)
        again = sdk.responses.create(
            model="simulated",
            previous_response_id=first.id,
            input=[{"type": "item_reference", "id": "in_img"}],
            extra_body=knobs,
        )
    assert first.output_text.startswith("(shown 1 image: image/png) ")
    # The earlier question (with its image), its answer, then the same question by reference.
    assert again.output_text.startswith("(shown 2 images: image/png, image/png) ")
    sent = sent_messages(simulated, again.id)
    image = {"type": "image", "url": PNG, "detail": "low"}
    question = {"role": "user", "content": [{"type": "text", "text": QUESTION}, image]}
    assert sent == [
        question,
        {"role": "assistant", "content": first.output_text},
        question,
    ]


def test_the_simulator_counts_an_image_as_a_fixed_number_of_tokens_not_its_bytes() -> None:
    plain: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    big = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(3000)).decode()
    with_image: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": QUESTION}, {"type": "image", "url": big}],
        }
    ]
    assert input_tokens(canonical_json(plain), plain) == len(canonical_json(plain)) // 4 + 1
    counted = input_tokens(canonical_json(with_image), with_image)
    assert IMAGE_TOKENS < counted < IMAGE_TOKENS + 40


@given(
    st.one_of(
        st.text(max_size=40),
        st.builds(lambda s: "data:" + s, st.text(max_size=40)),
        st.builds(lambda s: "data:image/png;base64," + s, st.text(max_size=40)),
        st.builds(lambda s: "https://" + s, st.text(max_size=40)),
        st.builds(lambda s: "http://[" + s, st.text(max_size=40)),
    )
)
def test_any_image_url_is_taken_or_refused_with_a_reason_never_an_error(url: str) -> None:
    outcome: Image | str
    try:
        outcome = parse_image_url(url)
    except ValueError as exc:
        outcome = str(exc)
    if isinstance(outcome, str):
        assert outcome  # the reason, for the 400
    else:
        assert outcome.media_type is not None or outcome.host
