"""The simulated provider: deterministic text at a chosen pace, with fault injection.

It is the default provider, the demo and the test bench. Its behaviour is chosen per turn in
``params.simulate`` (see ``KNOBS``); the text is a pure function of ``seed`` and the prompt, so the
same turn run twice gives the same bytes, and a continued attempt ends with the same text an
uninterrupted one would have had. A prose answer to images opens by naming them
(:func:`image_echo`); the simulator never fetches an image.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from broker.canonical import canonical_json
from broker.client_tools import TOOL_PARAMS, check_tool_params, chosen_tool
from broker.content import Image, images_of
from broker.errors import BadRequest
from broker.providers.base import (
    Finished,
    GenerationRequest,
    ProviderEvent,
    TextDelta,
    ToolCallChunk,
    ToolCallEnd,
    UpstreamError,
    Usage,
    reject_unknown_params,
)

log = logging.getLogger("broker.providers.simulated")

KNOBS = {
    "seed": "int or string; the text is a function of seed and prompt",
    "tokens": "how many deltas the answer has (1..100000, default 48)",
    "tokens_per_s": "pace of deltas, 0 = as fast as possible (default 25)",
    "fail_before_first": "the first K upstream calls of the turn fail before any delta",
    "fail_after_deltas": "the first attempt's upstream call breaks after N deltas",
    "stall_after_deltas": "the first attempt's upstream call goes silent after N deltas",
    "first_delta_after_ms": "the turn's first upstream call waits this long before its first "
    "delta (a slow time to first token)",
    "error": "'retryable' (default) or 'fatal': the kind of the injected failures",
    "tool_calls": "a script of tool calls: [{name, args, after}], `after` deltas in; calls with "
    "the same `after` are one message; the calls the history already made (in assistant "
    "messages since the last user message) are not made again; "
    "params.tool_choice and parallel_tool_calls: false are honoured",
    "fail_after_tool_calls": "the first attempt's call breaks right after its Nth tool call ran",
    "cut_during_tool_args": "true: the first attempt's call breaks while a call's args arrive",
    "json": "true: emit a JSON document (the default for response_format json and json_schema), "
    "false: prose, any other JSON value: that value, as compact JSON over `tokens` deltas",
    "stamp": "true: each delta starts with the wall-clock time it was emitted, in microseconds "
    "since the epoch, and a space (to measure the live tail from the model's emit; the text is "
    "then not deterministic, and a continued attempt starts its answer over)",
}
# The knobs that script what happens to a turn (failures, stalls, delays, tool calls with
# arguments of the caller's choosing): a broker with credentials refuses them unless
# BROKER_SIMULATE_SCRIPTING is on. The others shape harmless text.
SCRIPTING_KNOBS = frozenset(
    {
        "fail_before_first",
        "fail_after_deltas",
        "stall_after_deltas",
        "first_delta_after_ms",
        "error",
        "tool_calls",
        "fail_after_tool_calls",
        "cut_during_tool_args",
    }
)
GENERIC_PARAMS = frozenset(
    {"simulate", "temperature", "top_p", "max_tokens", "stop", "seed", *TOOL_PARAMS}
)
DEFAULT_TOKENS = 48
IMAGE_TOKENS = 85  # what the simulator counts an image as (OpenAI's price of a low-detail one)
DEFAULT_TOKENS_PER_S = 25.0
MAX_TOKENS = 100_000

# A vocabulary with multi-byte characters, so byte-exact reassembly is tested for real.
_WORDS = (
    "the stream",
    "broker",
    "keeps",
    "every",
    "token",
    "in",
    "Redis",
    "so",
    "a",
    "reader",
    "can",
    "come",
    "back",
    "later",
    "and",
    "find",
    "its",
    "place",
    "offset",
    "after",
    "tunnel",
    "naïve",
    "café",
    "über",
    "façade",
    "日本語",
    "Ωmega",
    "emoji 🚀",
    "résumé",
    "smörgåsbord",
    "lease",
    "fenced",
    "writer",
    "turn",
    "attempt",
    "answer",
    "second",
    "tab",
    "watches",
    "live",
)


def _int_knob(knobs: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = knobs.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"params.simulate.{name} must be an integer from {low} to {high}")
    return value


class SimulatedProvider:
    """Deterministic fake model; ``max_tokens_per_s`` (0 = none) caps every turn's pace, and
    ``scripting`` says whether turns may use the :data:`SCRIPTING_KNOBS`."""

    name = "simulated"
    models: tuple[str, ...] = ("simulated",)

    def __init__(self, *, max_tokens_per_s: float = 0.0, scripting: bool = True) -> None:
        self.max_tokens_per_s = max_tokens_per_s
        self.scripting = scripting
        self.description = "built in: deterministic text, " + (
            "fault and tool scripting on" if scripting else "fault and tool scripting off"
        )
        self.aborted_calls = 0  # calls the broker closed before their end (stop, shutdown)

    async def aclose(self) -> None:
        """Nothing to release: the simulated provider holds no connection."""

    def validate_params(self, params: dict[str, Any]) -> None:
        reject_unknown_params("simulated", params, GENERIC_PARAMS)
        check_tool_params(params)
        knobs = params.get("simulate", {})
        if not isinstance(knobs, dict):
            raise BadRequest("params.simulate must be an object")
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise BadRequest(
                f"unknown params.simulate knobs: {', '.join(unknown)}; known: {', '.join(KNOBS)}"
            )
        scripted = sorted(SCRIPTING_KNOBS.intersection(knobs))
        if scripted and not self.scripting:
            raise BadRequest(
                f"params.simulate.{scripted[0]} scripts the simulator's faults or tool calls, "
                "which this broker does not take from callers (BROKER_SIMULATE_SCRIPTING is "
                "off on a broker with credentials); harmless knobs: seed, tokens, "
                "tokens_per_s, json, stamp",
                code="simulate_scripting_off",
            )
        seed = knobs.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | str)):
            raise BadRequest("params.simulate.seed must be an integer or a string")
        _int_knob(knobs, "tokens", 1, MAX_TOKENS)
        _int_knob(knobs, "fail_before_first", 0, 1000)
        _int_knob(knobs, "fail_after_deltas", 0, MAX_TOKENS)
        _int_knob(knobs, "stall_after_deltas", 0, MAX_TOKENS)
        _int_knob(knobs, "first_delta_after_ms", 0, 600_000)
        pace = knobs.get("tokens_per_s")
        if pace is not None and (
            isinstance(pace, bool) or not isinstance(pace, int | float) or not 0 <= pace <= 1e6
        ):
            raise BadRequest("params.simulate.tokens_per_s must be a number from 0 to 1000000")
        if knobs.get("error", "retryable") not in ("retryable", "fatal"):
            raise BadRequest("params.simulate.error must be 'retryable' or 'fatal'")
        _validate_tool_script(knobs.get("tool_calls", []))
        _int_knob(knobs, "fail_after_tool_calls", 1, 16)
        for flag in ("cut_during_tool_args", "stamp"):
            if not isinstance(knobs.get(flag, False), bool):
                raise BadRequest(f"params.simulate.{flag} must be true or false")

    def pace(self, knobs: dict[str, Any]) -> float:
        """Deltas per second for a turn, 0 meaning no pause; the cap applies to both."""
        wanted = float(knobs.get("tokens_per_s", DEFAULT_TOKENS_PER_S))
        cap = self.max_tokens_per_s
        if cap > 0 and (wanted == 0 or wanted > cap):
            return cap
        return wanted

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[ProviderEvent, None]:
        knobs: dict[str, Any] = request.params.get("simulate", {})
        if not self.scripting and SCRIPTING_KNOBS.intersection(knobs):
            # A turn stored while scripting was on, run after it was turned off: not run.
            raise UpstreamError(
                "upstream_bad_request",
                "the turn scripts the simulator, which BROKER_SIMULATE_SCRIPTING turned off",
                retryable=False,
            )
        retryable = knobs.get("error", "retryable") == "retryable"
        if request.upstream_call < int(knobs.get("fail_before_first", 0)):
            raise _injected(retryable, "before the first delta")
        prompt, prefill = _split_prefill(request.messages)
        if "json" not in knobs:
            knobs = {**knobs, "json": request.response_format != "text"}
        echoes = _image_echo(request.messages, knobs) + _tool_echo(request.messages, knobs)
        pieces = echoes + full_answer(prompt, knobs)
        start = _continued_from(pieces, prefill)
        first_attempt = request.attempt == 1
        wait_ms = int(knobs.get("first_delta_after_ms", 0))
        if wait_ms and first_attempt and request.upstream_call == 0:
            await asyncio.sleep(wait_ms / 1000)
        break_after = knobs.get("fail_after_deltas") if first_attempt else None
        stall_after = knobs.get("stall_after_deltas") if first_attempt else None
        step = len(request.tool_steps)
        script = _chosen_calls(_unmade(knobs.get("tool_calls", []), request.messages), request)
        messages = _script_messages(script, request.params.get("parallel_tool_calls", True))
        low, high, calls = _step_window(messages, step, start, len(pieces))
        pace = self.pace(knobs)
        stamp = bool(knobs.get("stamp", False))
        began = time.monotonic()
        sent = 0
        done = False
        try:
            for index in range(low, min(high, len(pieces))):
                if break_after is not None and sent >= break_after:
                    raise _injected(retryable, f"after {sent} deltas")
                if stall_after is not None and sent >= stall_after:
                    await asyncio.Event().wait()  # silent until the broker gives up on us
                if pace > 0:
                    delay = began + sent / pace - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                elif sent % 64 == 63:
                    await asyncio.sleep(0)  # let other turns run between bursts
                yield TextDelta(_stamped(pieces[index]) if stamp else pieces[index])
                sent += 1
            if calls:
                before = sum(len(message) for message in messages[:step])
                async for event in _scripted_calls(request, knobs, calls, before, retryable):
                    yield event
            yield Usage(input_tokens=input_tokens(prompt, request.messages), output_tokens=sent)
            done = True
            yield Finished("tool_calls" if calls else "stop")
        except (GeneratorExit, asyncio.CancelledError):
            if not done:
                # The upstream side of an abort: the call ends here and produces nothing more.
                self.aborted_calls += 1
                log.info("simulated call of turn %s aborted after %d deltas", request.turn_id, sent)
            raise


def _stamped(piece: str) -> str:
    """A delta that says when it was emitted (``params.simulate.stamp``)."""
    return f"{time.time_ns() // 1000} {piece}"


def _tool_echo(messages: list[dict[str, Any]], knobs: dict[str, Any]) -> list[str]:
    """A prose answer to tool results (the request ends with ``tool`` messages) opens by
    saying how many it saw and their length: proof the results reached the model."""
    results = []
    for message in reversed(messages):
        if message.get("role") != "tool":
            break
        results.append(str(message.get("content", "")))
    if not results or knobs.get("json"):
        return []
    size = sum(len(result) for result in results)
    return [f"({len(results)} tool results, {size} characters) "]


def input_tokens(prompt: bytes, messages: list[dict[str, Any]]) -> int:
    """The simulator's count of a prompt's tokens: a quarter of its characters, and
    :data:`IMAGE_TOKENS` for each image in place of its URL (a data URL is not text)."""
    images = [image for message in messages for image in images_of(message.get("content"))]
    chars = len(prompt) - sum(len(image.url) for image in images)
    return chars // 4 + 1 + IMAGE_TOKENS * len(images)


def image_echo(images: list[Image]) -> str:
    """What the simulator says about the images it was shown: how many, and each one's media
    type (a data URL) or host (a URL it never fetches)."""
    what = ", ".join(image.media_type or image.host for image in images)
    return f"(shown {len(images)} image{'s' if len(images) != 1 else ''}: {what}) "


def _image_echo(messages: list[dict[str, Any]], knobs: dict[str, Any]) -> list[str]:
    """A prose answer to a request with images opens with :func:`image_echo`: proof the images
    reached the model."""
    images = [image for message in messages for image in images_of(message.get("content"))]
    if not images or knobs.get("json"):
        return []
    return [image_echo(images)]


def _unmade(script: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scripted calls the request's history has not made yet: a call of an assistant
    message since the last user message (a client ran it and sends its result in this turn)
    with a scripted call's name and arguments made that one, so that an agent loop that sends
    the same script every turn goes on to the next call, then to the answer, as a model would."""
    made: list[tuple[str, Any]] = []
    for message in reversed(messages):
        if message.get("role") == "user":
            break
        for call in message.get("tool_calls") or () if message.get("role") == "assistant" else ():
            try:
                made.append((str(call.get("name")), orjson.loads(call.get("arguments") or "{}")))
            except orjson.JSONDecodeError:
                continue  # not a call of the script's
    left = []
    for call in script:
        key = (call["name"], call.get("args", {}))
        if key in made:
            made.remove(key)
        else:
            left.append(call)
    return left


def _continued_from(pieces: list[str], prefill: str) -> int:
    """Where a continued attempt carries on: the index past the pieces its prefill (what was
    delivered) covers, or 0 when the prefill is not this answer's own text."""
    start = 0
    delivered = ""
    while prefill and start < len(pieces) and len(delivered) < len(prefill):
        delivered += pieces[start]
        start += 1
    return start if delivered == prefill else 0


def _chosen_calls(script: list[dict[str, Any]], request: GenerationRequest) -> list[dict[str, Any]]:
    """The scripted calls ``params.tool_choice`` lets the model make: none for ``none``; for a
    named tool, its calls, else one call of it (arguments ``{}``); for ``required``, the
    script, else one call of the first client tool."""
    choice = request.params.get("tool_choice")
    name = chosen_tool(request.params)
    if choice == "none":
        return []
    if name is not None:
        return [c for c in script if c["name"] == name] or [{"name": name}]
    if choice == "required" and not script and request.client_tools:
        return [{"name": request.client_tools[0]["name"]}]
    return script


def _script_messages(
    script: list[dict[str, Any]], parallel: bool = True
) -> list[list[dict[str, Any]]]:
    """The scripted calls grouped into model messages: consecutive calls at the same ``after``
    are one message's calls (each call its own message when not ``parallel``)."""
    messages: list[list[dict[str, Any]]] = []
    for call in script:
        if parallel and messages and messages[-1][0].get("after", 0) == call.get("after", 0):
            messages[-1].append(call)
        else:
            messages.append([call])
    return messages


def _step_window(
    messages: list[list[dict[str, Any]]], step: int, start: int, count: int
) -> tuple[int, int, list[dict[str, Any]]]:
    """The pieces a tool step writes, ``[low, high)``, and the scripted calls that end it (none
    for the last step): each scripted message is one step, the text up to its position, then
    its calls."""
    previous = messages[step - 1][0] if 0 < step <= len(messages) else None
    low = max(start, int(previous.get("after", 0)) if previous is not None else 0)
    calls = messages[step] if step < len(messages) else []
    high = max(low, int(calls[0].get("after", 0))) if calls else count
    return low, high, calls


async def _scripted_calls(
    request: GenerationRequest,
    knobs: dict[str, Any],
    calls: list[dict[str, Any]],
    before: int,
    retryable: bool,
) -> AsyncGenerator[ProviderEvent, None]:
    """A scripted message's tool calls, each one's arguments in several pieces, with the faults
    the knobs inject around them on a first attempt (``before``: calls of earlier steps)."""
    first_attempt = request.attempt == 1
    fail_after = knobs.get("fail_after_tool_calls")
    for index, call in enumerate(calls):
        arguments = orjson.dumps(call.get("args", {})).decode()
        size = max(1, -(-len(arguments) // 3))
        parts = [arguments[i : i + size] for i in range(0, len(arguments), size)] or [""]
        call_id = f"call_{request.turn_id[-8:]}_{before + index}"
        yield ToolCallChunk(index, call_id, str(call["name"]), parts[0])
        if first_attempt and knobs.get("cut_during_tool_args"):
            raise _injected(retryable, "while a tool call's arguments arrived")
        for part in parts[1:]:
            yield ToolCallChunk(index, arguments=part)
        yield ToolCallEnd(index)
        ran = before + index + 1
        if first_attempt and fail_after is not None and ran >= fail_after:
            raise _injected(retryable, f"after tool call {ran} ran")


def _validate_tool_script(script: Any) -> None:
    if not isinstance(script, list) or len(script) > 16:
        raise BadRequest("params.simulate.tool_calls must be a list of at most 16 calls")
    previous = 0
    for entry in script:
        if not isinstance(entry, dict) or set(entry) - {"name", "args", "after"}:
            raise BadRequest("each params.simulate.tool_calls entry is {name, args, after}")
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("args", {}), dict):
            raise BadRequest("a scripted tool call needs a string name and object args")
        after = entry.get("after", 0)
        if isinstance(after, bool) or not isinstance(after, int) or after < previous:
            raise BadRequest("tool_calls[].after must be integers in increasing order")
        previous = after


def _injected(retryable: bool, where: str) -> UpstreamError:
    if retryable:
        return UpstreamError("upstream_unavailable", f"simulated 503 {where}", retryable=True)
    return UpstreamError("upstream_bad_request", f"simulated 400 {where}", retryable=False)


def _split_prefill(messages: list[dict[str, Any]]) -> tuple[bytes, str]:
    """The prompt that seeds the text, and a trailing assistant message used as a prefill."""
    prefill = ""
    if messages and messages[-1].get("role") == "assistant":
        prefill = str(messages[-1].get("content", ""))
        messages = messages[:-1]
    return canonical_json(messages), prefill


def full_answer(prompt: bytes, knobs: dict[str, Any]) -> list[str]:
    """The deltas of the uninterrupted answer for ``prompt`` under ``knobs``."""
    seed = knobs.get("seed", 0)
    digest = hashlib.sha256(f"{seed!r}".encode() + b"\x00" + prompt).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    count = int(knobs.get("tokens", DEFAULT_TOKENS))
    value = knobs.get("json", False)
    if value is not False:
        if value is True:
            words = [rng.choice(_WORDS) for _ in range(max(count, 4))]
            value = {"answer": " ".join(words), "words": len(words), "seed": seed}
        text = orjson.dumps(value).decode()
        size = max(1, -(-len(text) // count))
        return [text[i : i + size] for i in range(0, len(text), size)]
    pieces: list[str] = []
    for i in range(count):
        word = rng.choice(_WORDS)
        if i == 0:
            piece = word.capitalize()
        elif rng.random() < 0.08:
            piece = ".\n\n" + word.capitalize()
        elif rng.random() < 0.1:
            piece = ", " + word
        else:
            piece = " " + word
        pieces.append(piece)
    pieces[-1] += "."
    return pieces
