"""Property-based fuzzing of every operation in the broker's own OpenAPI document.

Requests are generated from ``/openapi.json`` (valid and invalid ones) and sent over HTTP to a
real broker with authentication on. No answer may be a 5xx, and every answer must match the
document: a declared status, the declared content type, a body of the declared shape. Then the
broker must still serve a normal turn. ``BROKER_FUZZ_EXAMPLES`` sets the examples per operation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import RunningBroker, start_broker
from tests.helpers import answers_at_full_speed, bearer, read_sse, text_of, wait_final, wait_until

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

KEY = "key-fuzz-0123456789abcdef"
EXAMPLES = int(os.environ.get("BROKER_FUZZ_EXAMPLES", "50"))


def not_a_server_error(ctx: Any, response: Any, case: Any) -> bool:
    """Never a 5xx (503 is allowed only when Redis is down, and it is not here)."""
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.text}"
    return True


@pytest.fixture(scope="module")
def fuzzed(redis_url: str) -> Iterator[RunningBroker]:
    # Limits on and small, so that the fuzzer also meets 429s and the admission code.
    broker = start_broker(
        redis_url,
        api_keys=f"fuzz={KEY}",
        max_body_bytes=65_536,
        turn_rate_per_s=20,
        turn_burst=20,
        max_streams_per_tenant=4,
        simulate_max_tokens_per_s=0,
    )
    # The answers' shapes are checked, not their pace (at 25 deltas/s the blocking creates of
    # one operation took 40 s).
    with answers_at_full_speed():
        try:
            yield broker
        finally:
            broker.stop()


def operations(broker: RunningBroker) -> list[Any]:
    document = httpx.get(f"{broker.base_url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(document)
    found = [cast(Any, result).ok() for result in schema.get_all_operations()]
    assert len(found) >= 12, [f"{op.method} {op.path}" for op in found]
    return found


def fuzz(
    operation: Any,
    mode: GenerationMode,
    base_url: str,
    checked: dict[str, int],
    credential: str | None = KEY,
    examples: int = EXAMPLES,
) -> None:
    """Run the generated cases of one operation (valid ones, or invalid ones) against the broker."""
    label = f"{mode.value} {operation.method.upper()} {operation.path}"

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, headers=bearer(credential), timeout=15)
        case.validate_response(
            response,
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
            ],
        )
        checked[label] = checked.get(label, 0) + 1

    try:
        run()
    except Unsatisfiable:
        # Nothing in this operation can be made invalid (no parameters, no body).
        assert mode is GenerationMode.NEGATIVE, label


# The operations are fuzzed in this many parts for each mode, one test each, so that workers
# share them out.
PARTS = 8


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("part", range(PARTS))
def test_no_generated_request_gets_a_5xx_or_an_undocumented_answer_and_then_a_turn_is_served(
    fuzzed: RunningBroker, part: int, mode: GenerationMode
) -> None:
    mine = operations(fuzzed)[part::PARTS]
    checked: dict[str, int] = {}
    for operation in mine:
        fuzz(operation, mode, fuzzed.base_url, checked)
    if mode is GenerationMode.POSITIVE:
        assert len(checked) == len(mine), checked
    # Then the broker still serves a normal turn. The fuzzing may have used the tenant's
    # stream slots: wait for them.
    name = f"{part}-{mode.value}"
    turn = wait_until(lambda: _try_start(fuzzed.base_url, name), timeout=60, interval=0.2)
    assert wait_final(fuzzed.base_url, turn["turn_id"], auth=KEY)["status"] == "complete"
    read = read_sse(fuzzed.base_url, turn["stream_id"], auth=KEY)
    assert len([e for e in read.events if e.event == "delta"]) == 25
    assert text_of(read.events)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("credential", [None, "not-a-key", "e30.e30.e30"])
def test_without_good_credentials_every_answer_is_documented_too(
    fuzzed: RunningBroker, credential: str | None
) -> None:
    checked: dict[str, int] = {}
    for operation in operations(fuzzed):
        fuzz(operation, GenerationMode.POSITIVE, fuzzed.base_url, checked, credential, 10)
    assert len(checked) >= 12, checked


def _try_start(base_url: str, part: str) -> dict[str, Any] | None:
    response = httpx.post(
        f"{base_url}/v1/turns",
        headers=bearer(KEY),
        timeout=10,
        json={
            "conversation_id": f"after-fuzz-{part}",
            "turn_id": f"after-fuzz-turn-{part}",
            "messages": [{"role": "user", "content": "hello"}],
            "params": {"simulate": {"tokens": 25, "seed": 4}},
        },
    )
    assert response.status_code in (200, 201, 429), response.text
    return response.json() if response.status_code != 429 else None
