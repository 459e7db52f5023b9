"""Hypothesis bodies against the OpenAI routes: never a 5xx, every error in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import RunningBroker, start_broker
from tests.helpers import answers_at_full_speed, bearer

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

KEY = "key-openai-fuzz-0123456789"
FAST = {"params": {"simulate": {"tokens": 2, "tokens_per_s": 0}}}

scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
RESPONSES_KEYS = [
    "model",
    "input",
    "instructions",
    "stream",
    "background",
    "metadata",
    "temperature",
    "top_p",
    "max_output_tokens",
    "previous_response_id",
    "store",
]
CHAT_KEYS = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "metadata",
    "n",
    "user",
]
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
        "content": st.text(max_size=10) | json_values,
    },
)


GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system"]), "content": st.text(min_size=1, max_size=10)}
)
# Values the routes take, so that some generated bodies are valid and start real turns.
SANE: dict[str, st.SearchStrategy[Any]] = {
    "stream": st.booleans(),
    "background": st.booleans(),
    "store": st.just(True),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "max_output_tokens": st.integers(1, 50),
    "max_tokens": st.integers(1, 50),
    "max_completion_tokens": st.integers(1, 50),
    "seed": st.integers(0, 99),
    "n": st.just(1),
    "instructions": st.text(max_size=8),
    "user": st.text(max_size=8),
    "stop": st.text(max_size=3),
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    "stream_options": st.just({"include_usage": True}),
}


def bodies(keys: list[str], messages_key: str) -> st.SearchStrategy[Any]:
    """Mostly near-valid objects (the real keys, plausible and wild values), some garbage."""
    plausible: dict[str, st.SearchStrategy[Any]] = {
        "model": st.sampled_from(["simulated", "simulated/simulated", "nope", ""]) | json_values,
        messages_key: st.lists(GOOD_MESSAGE, min_size=1, max_size=2)
        | st.lists(MESSAGE, max_size=3)
        | st.text(max_size=10)
        | json_values,
    }
    value = {
        k: (SANE[k] | json_values) if k in SANE else plausible.get(k, json_values) for k in keys
    }
    near = st.fixed_dictionaries(
        {"model": value["model"], messages_key: value[messages_key]},
        optional={
            **{k: v for k, v in value.items() if k not in ("model", messages_key)},
            "broker": st.just(FAST) | json_values,
            "extra_thing": json_values,
        },
    )
    return near | json_values


@pytest.fixture(scope="module")
def fuzzed(redis_url: str) -> Iterator[RunningBroker]:
    broker = start_broker(redis_url, api_keys=f"fuzz={KEY}", simulate_max_tokens_per_s=0)
    with answers_at_full_speed():  # shapes are checked, not pace
        try:
            yield broker
        finally:
            broker.stop()


def send(broker: RunningBroker, path: str, body: Any, headers: dict[str, str]) -> int:
    raw = json.dumps(body).encode()  # (big integers and NaN too: the server must refuse them)
    with httpx.stream(
        "POST",
        f"{broker.base_url}{path}",
        content=raw,
        timeout=30,
        headers={**bearer(KEY), "Content-Type": "application/json", **headers},
    ) as answer:
        assert answer.status_code < 500, (body, answer.read())
        if answer.status_code >= 400:
            error = orjson.loads(answer.read())["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert isinstance(error["message"], str)
            assert isinstance(error["type"], str)
        return answer.status_code


HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "Idempotency-Key": st.sampled_from(["k1", "k 2", "", "x" * 200, "k3"]),
        "Last-Event-ID": st.sampled_from(["-1", "now", "bad", "0-0"]),
    },
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("path", "keys", "messages_key"),
    [("/v1/responses", RESPONSES_KEYS, "input"), ("/v1/chat/completions", CHAT_KEYS, "messages")],
)
def test_generated_bodies_never_get_a_5xx_and_errors_have_openai_shape(
    fuzzed: RunningBroker, path: str, keys: list[str], messages_key: str
) -> None:
    @settings(
        max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(body=bodies(keys, messages_key), headers=HEADERS)
    def run(body: Any, headers: dict[str, str]) -> None:
        statuses.add(send(fuzzed, path, body, headers))

    statuses: set[int] = set()
    run()
    assert {200, 400} <= statuses, statuses  # both valid and refused bodies were sent
