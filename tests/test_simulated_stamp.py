"""The simulator's ``stamp`` knob: each delta says when the model emitted it, so a benchmark
measures the live tail from the emit, not from the append."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from broker.errors import BadRequest
from broker.providers.base import GenerationRequest, TextDelta
from broker.providers.simulated import SimulatedProvider


def _request(knobs: dict[str, Any]) -> GenerationRequest:
    return GenerationRequest(
        conversation_id="c",
        turn_id="t",
        attempt=1,
        strategy="initial",
        messages=[{"role": "user", "content": "hello"}],
        model="simulated",
        params={"simulate": knobs},
        response_format="text",
        upstream_call=0,
    )


async def _deltas(knobs: dict[str, Any]) -> list[str]:
    provider = SimulatedProvider()
    request = _request(knobs)
    provider.validate_params(request.params)
    return [e.text async for e in provider.stream(request) if isinstance(e, TextDelta)]


def test_stamped_deltas_carry_their_emit_time_then_the_same_text() -> None:
    before = time.time_ns() // 1000
    stamped = asyncio.run(_deltas({"tokens": 6, "tokens_per_s": 0, "stamp": True}))
    after = time.time_ns() // 1000
    plain = asyncio.run(_deltas({"tokens": 6, "tokens_per_s": 0}))
    assert len(stamped) == len(plain) == 6
    stamps = [int(delta.split(" ", 1)[0]) for delta in stamped]
    assert all(before <= s <= after for s in stamps)
    assert stamps == sorted(stamps)
    assert [delta.split(" ", 1)[1] for delta in stamped] == plain


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_stamp_is_a_boolean(value: Any) -> None:
    with pytest.raises(BadRequest, match=r"params\.simulate\.stamp must be true or false"):
        SimulatedProvider().validate_params({"simulate": {"stamp": value}})
