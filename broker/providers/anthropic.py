"""The Anthropic Messages adapter, on the official ``anthropic`` SDK (its own retries off).

How a broker request becomes a Messages call, where the two models differ:

* ``system`` messages become the ``system`` parameter (joined by blank lines). Anthropic has no
  ``tool`` role: a ``tool`` message answering a client tool call (``tool_call_id``) becomes a
  user ``tool_result`` block, and an assistant message's ``tool_calls`` its ``tool_use``
  blocks; a ``tool`` message without a call id to pair it with is sent as user text. ``name``
  (unsupported) and the broker-only ``partial`` flag are dropped, as are empty messages.
  Consecutive messages of one role are merged into one message of several content blocks: the
  API wants user and assistant to alternate.
* Images (a user message's image parts, :mod:`broker.content`) become ``image`` blocks: a URL
  as a ``url`` source (Anthropic fetches it), a data URL as a ``base64`` source with its media
  type. ``detail`` has no Anthropic counterpart and is not sent.
* ``continue``: the broker appends the delivered text as a trailing assistant message, which is
  Anthropic's native prefill: the model carries on from its last character. The API rejects a
  final assistant message that ends in whitespace, so the prefill is sent right-stripped, and
  the same whitespace is dropped if the model starts its continuation with it (the delivered
  text already has it).
* ``response_format`` ``json`` and the ``json_schema`` form: Anthropic has no JSON mode; an
  instruction is appended to the system prompt (for a schema, with the schema itself), and the
  broker checks that the answer parses and validates.
* ``tools`` in OpenAI function format are converted (``parameters`` → ``input_schema``); tools
  in Anthropic's format pass through; the turn's client tools follow them, converted alike.
  Each tool step is an assistant message (its text, then its ``tool_use`` blocks) followed by
  a user message of ``tool_result`` blocks. ``params.tool_choice`` ``required`` is ``any``, a
  named tool is ``tool``, and ``parallel_tool_calls: false`` is ``disable_parallel_tool_use``.
* ``max_tokens`` is required by the API: ``params.max_tokens``, else the constructor's default
  (``BROKER_ANTHROPIC_MAX_TOKENS``). ``stop`` becomes ``stop_sequences``. ``temperature``,
  ``top_p`` and ``top_k`` are sent in the body as the API defines them; SDK 2.x no longer types
  them as arguments, so they travel as ``extra_body``.
* Errors follow :mod:`broker.providers.taxonomy`. An ``error`` event inside a 200 stream is
  classified by its error type (``overloaded_error`` as 529, retryable). A stream that ends
  without ``message_stop`` yields no ``Finished``: the broker treats it as cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.parse
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import anthropic
import httpx2
import orjson
from anthropic.types import (
    InputJSONDelta,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    RawMessageStreamEvent,
    ToolUseBlock,
)
from anthropic.types import TextDelta as AnthropicTextDelta

from broker.client_tools import TOOL_PARAMS, check_tool_params, chosen_tool, offered_tools
from broker.content import images_of
from broker.errors import BadRequest
from broker.providers import taxonomy
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
from broker.structured_output import schema_instruction

log = logging.getLogger("broker.providers.anthropic")

DEFAULT_BASE_URL = "https://api.anthropic.com"
DRAIN_S = 0.5  # how long the end of a body may take to come after message_stop
PARAMS = ("max_tokens", "stop", "temperature", "top_k", "top_p", *TOOL_PARAMS)
SAMPLING = ("temperature", "top_p", "top_k")  # sent as extra_body (see the module docstring)
JSON_INSTRUCTION = (
    "Answer with a single valid JSON value and nothing else: no text before or after it and "
    "no Markdown code fences."
)
# The HTTP status that goes with each API error type, for errors that arrive inside a stream.
ERROR_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
_USAGE_FIELDS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


class AnthropicProvider:
    """Streams turns from the Anthropic Messages API (or a server that speaks it).

    The SDK client is made on first use, for the event loop that runs the generations.
    """

    name = "anthropic"

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        models: tuple[str, ...],
        max_tokens: int = 4096,
    ) -> None:
        if not models:
            raise ValueError("the anthropic provider needs at least one model")
        self.models: tuple[str, ...] = tuple(models)
        self.max_tokens = max_tokens
        self._base_url = base_url or DEFAULT_BASE_URL
        self._api_key = api_key
        self._client: anthropic.AsyncAnthropic | None = None
        self.description = f"Anthropic Messages API at {_without_userinfo(self._base_url)}"

    def validate_params(self, params: dict[str, Any]) -> None:
        reject_unknown_params("anthropic", params, PARAMS)
        check_tool_params(params)
        _check_number(params, "temperature", 0.0, 1.0)
        _check_number(params, "top_p", 0.0, 1.0)
        _check_integer(params, "top_k", 1, 1_000_000)
        _check_integer(params, "max_tokens", 1, 10_000_000)
        stop = params.get("stop")
        if stop is not None and not (
            isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop))
        ):
            raise BadRequest("params.stop must be a string or a list of non-empty strings")

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[ProviderEvent, None]:
        if not self._api_key:
            raise UpstreamError(
                "upstream_unauthorized",
                "no API key is configured for the anthropic provider (BROKER_ANTHROPIC_API_KEY)",
                retryable=False,
            )
        body, stripped = build_body(request, self.max_tokens)
        log.debug(
            "turn %s: %s with %d messages", request.turn_id, body["model"], len(body["messages"])
        )
        client = await self._get_client()
        translator = _Translator(stripped)
        upstream: anthropic.AsyncStream[RawMessageStreamEvent] | None = None
        try:
            with self._mapped_errors():
                upstream = await client.messages.create(
                    model=body["model"],
                    max_tokens=body["max_tokens"],
                    messages=body["messages"],
                    system=body.get("system", anthropic.omit),
                    stop_sequences=body.get("stop_sequences", anthropic.omit),
                    tools=body.get("tools", anthropic.omit),
                    tool_choice=body.get("tool_choice", anthropic.omit),
                    extra_body={k: body[k] for k in SAMPLING if k in body} or None,
                    stream=True,
                )
            while not translator.finished:
                with self._mapped_errors():
                    event = await anext(upstream, None)
                if event is None:
                    return  # no message_stop: the broker counts the stream as cut
                events = translator.feed(event)
                if translator.finished:
                    await _drain(upstream)
                for out in events:
                    yield out
        finally:
            # Closing the response closes its connection, so an abort (stop, idle timeout,
            # shutdown) reaches the upstream at once instead of when the answer would end.
            if upstream is not None:
                with contextlib.suppress(Exception):
                    await upstream.close()

    async def aclose(self) -> None:
        """Close the SDK client's connections (for an owner that shuts providers down)."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _get_client(self) -> anthropic.AsyncAnthropic:
        """The SDK client, made on first use in a thread: making one takes a fifth of a
        second (TLS setup), which would stall every stream on this loop."""
        if self._client is None:
            client = await asyncio.to_thread(
                anthropic.AsyncAnthropic,
                base_url=self._base_url,
                api_key=self._api_key,
                max_retries=0,
            )
            if self._client is None:
                self._client = client
            else:  # another turn made one meanwhile
                await client.close()
        return self._client

    @contextlib.contextmanager
    def _mapped_errors(self) -> Iterator[None]:
        """SDK and transport exceptions to the taxonomy's UpstreamError, without the key."""
        try:
            yield
        except anthropic.APIStatusError as exc:
            raise self._status_error(exc) from None
        except (anthropic.APITimeoutError, httpx2.TimeoutException):
            raise taxonomy.transport_error("timeout", "timed out talking to Anthropic") from None
        except (anthropic.APIConnectionError, httpx2.TransportError) as exc:
            cause = exc.__cause__ if isinstance(exc, anthropic.APIConnectionError) else exc
            detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
            raise taxonomy.transport_error(
                "connection", self._redact(f"connection to Anthropic failed: {detail}")
            ) from None
        except json.JSONDecodeError as exc:
            raise taxonomy.transport_error(
                "protocol", f"Anthropic sent an event that is not JSON: {exc}"
            ) from None

    def _status_error(self, exc: anthropic.APIStatusError) -> UpstreamError:
        kind = str(exc.type or "error")
        detail = exc.api_message or (exc.body if isinstance(exc.body, str) else "") or "no message"
        if exc.status_code < 400:  # an ``error`` event inside a stream that began with 200
            code, retryable = taxonomy.classify_status(ERROR_TYPE_STATUS.get(kind, 500))
            message = self._redact(f"{kind} in the stream: {detail}")[:500]
            return UpstreamError(code, message, retryable=retryable)
        return taxonomy.status_error(
            exc.status_code,
            self._redact(f"{kind}: {detail}"),
            exc.response.headers.get("retry-after"),
        )

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "[redacted]") if self._api_key else text


async def _drain(upstream: anthropic.AsyncStream[RawMessageStreamEvent]) -> None:
    """Read a finished stream to the end of its body, briefly, so that closing it returns the
    connection to the pool (closed unread, it is dropped, and the next turn pays a handshake)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(DRAIN_S):
            while await anext(upstream, None) is not None:
                pass


class _Translator:
    """Anthropic's raw stream events for one message, as the broker's provider events."""

    def __init__(self, stripped: str) -> None:
        self.finished = False
        self._echo = stripped  # whitespace cut from the prefill, not to be repeated
        self._tool_blocks: set[int] = set()
        self._usage = dict.fromkeys(_USAGE_FIELDS, 0)
        self._output_tokens = 0
        self._usage_sent = False
        self._stop_reason: str | None = None

    def feed(self, event: RawMessageStreamEvent) -> list[ProviderEvent]:
        if isinstance(event, RawContentBlockDeltaEvent):
            delta = event.delta
            if isinstance(delta, AnthropicTextDelta):
                text = self._without_echo(delta.text)
                return [TextDelta(text)] if text else []
            if isinstance(delta, InputJSONDelta) and event.index in self._tool_blocks:
                return [ToolCallChunk(event.index, arguments=delta.partial_json)]
            return []  # thinking, signatures, citations: not part of the answer text
        if isinstance(event, RawContentBlockStartEvent):
            block = event.content_block
            if not isinstance(block, ToolUseBlock):
                return []
            self._tool_blocks.add(event.index)
            # The streamed block starts with an empty input; its JSON arrives as deltas.
            arguments = orjson.dumps(block.input).decode() if block.input else ""
            return [ToolCallChunk(event.index, block.id, block.name, arguments)]
        if isinstance(event, RawContentBlockStopEvent):
            if event.index in self._tool_blocks:
                self._tool_blocks.discard(event.index)
                return [ToolCallEnd(event.index)]
            return []
        if isinstance(event, RawMessageStartEvent):
            self._count(event.message.usage)
            self._stop_reason = event.message.stop_reason
            return []
        if isinstance(event, RawMessageDeltaEvent):
            self._count(event.usage)
            self._stop_reason = event.delta.stop_reason or self._stop_reason
            if self._usage_sent:
                return []
            self._usage_sent = True
            return [Usage(sum(self._usage.values()), self._output_tokens)]
        if isinstance(event, RawMessageStopEvent):
            self.finished = True
            return [Finished("tool_calls" if self._stop_reason == "tool_use" else "stop")]
        return []

    def _count(self, usage: Any) -> None:
        """Take the counts an event reports (cumulative; absent fields keep their value)."""
        for field in _USAGE_FIELDS:
            value = getattr(usage, field, None)
            if value is not None:
                self._usage[field] = int(value)
        output = getattr(usage, "output_tokens", None)
        if output is not None:
            self._output_tokens = int(output)

    def _without_echo(self, text: str) -> str:
        """``text`` minus a start that repeats the whitespace stripped from the prefill."""
        if not self._echo:
            return text
        n = 0
        while n < len(text) and n < len(self._echo) and text[n] == self._echo[n]:
            n += 1
        self._echo = self._echo[n:] if n == len(text) else ""
        return text[n:]


def build_body(request: GenerationRequest, default_max_tokens: int) -> tuple[dict[str, Any], str]:
    """The Messages API body for ``request`` (without ``stream``), and the whitespace that was
    stripped from the end of a final assistant prefill ("" when none)."""
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for message in request.messages:
        _add_message(message, system, messages)
    for step in request.tool_steps:
        _append(messages, "assistant", _blocks(step.text) + _uses(step.calls))
        results = [
            {"type": "tool_result", "tool_use_id": result["id"], "content": result["content"]}
            for result in step.results
        ]
        _append(messages, "user", results)
    stripped = _strip_prefill(messages)
    for message in messages:
        blocks = message["content"]
        if len(blocks) == 1 and set(blocks[0]) == {"type", "text"} and blocks[0]["type"] == "text":
            message["content"] = blocks[0]["text"]  # the plain form, for one plain text block
    if request.response_format != "text":
        system.append(JSON_INSTRUCTION + schema_instruction(request.response_format))
    params = request.params
    body: dict[str, Any] = {
        "model": request.model,
        "max_tokens": params.get("max_tokens") or default_max_tokens,
        "messages": messages,
    }
    if system:
        body["system"] = "\n\n".join(system)
    stop = params.get("stop")
    if stop is not None:
        body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    for key in SAMPLING:
        if params.get(key) is not None:
            body[key] = params[key]
    tools = [*request.tools, *offered_tools(request.client_tools)]
    if tools:
        body["tools"] = [_tool(tool) for tool in tools]
        if (choice := tool_choice(params)) is not None:
            body["tool_choice"] = choice
    return body, stripped


def tool_choice(params: dict[str, Any]) -> dict[str, Any] | None:
    """``params.tool_choice`` and ``parallel_tool_calls`` as Anthropic's ``tool_choice``:
    ``required`` is ``any``, a named tool is ``tool``, and one call at most is
    ``disable_parallel_tool_use`` (None: the API's default, ``auto``)."""
    choice = params.get("tool_choice")
    name = chosen_tool(params)
    if name is not None:
        mapped: dict[str, Any] = {"type": "tool", "name": name}
    elif choice is not None:
        mapped = {"type": "any" if choice == "required" else choice}
    elif params.get("parallel_tool_calls") is False:
        mapped = {"type": "auto"}
    else:
        return None
    if params.get("parallel_tool_calls") is False and mapped["type"] != "none":
        mapped["disable_parallel_tool_use"] = True
    return mapped


def _add_message(
    message: dict[str, Any], system: list[str], messages: list[dict[str, Any]]
) -> None:
    """One broker message into the system prompt or the Messages API's messages."""
    role, content = message.get("role"), message.get("content")
    if role == "system":
        if content is not None and str(content).strip():
            system.append(str(content))
    elif role == "tool" and message.get("tool_call_id") is not None:
        result = {"type": "tool_result", "tool_use_id": message["tool_call_id"]}
        _append(messages, "user", [{**result, "content": str(content or "")}])
    elif role == "tool":
        name = message.get("name")
        label = f"[result of the tool {name}]" if name else "[tool result]"
        _append(messages, "user", _blocks(f"{label}\n{content}" if content else ""))
    elif role in ("user", "assistant"):
        _append(messages, str(role), _blocks(content) + _uses(message.get("tool_calls") or []))


def _uses(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls ({"id", "name", "arguments"}) as ``tool_use`` blocks."""
    return [
        {
            "type": "tool_use",
            "id": call["id"],
            "name": call["name"],
            "input": _tool_input(call.get("arguments", "")),
        }
        for call in calls
    ]


def _blocks(content: Any) -> list[dict[str, Any]]:
    """Content blocks for a message's content (a string, or the broker's text and image
    parts); blank text has none (the API rejects it)."""
    if isinstance(content, list):
        return [block for part in content for block in _part_blocks(part)]
    text = "" if content is None else str(content)
    return [{"type": "text", "text": text}] if text.strip() else []


def _part_blocks(part: dict[str, Any]) -> list[dict[str, Any]]:
    """One content part as Messages API blocks: an image as an ``image`` block whose source is
    its URL or its base64 data (Anthropic has no ``detail``: it is not sent)."""
    if part.get("type") != "image":
        return _blocks(str(part.get("text", "")))
    (image,) = images_of([part])
    if image.data is None:
        return [{"type": "image", "source": {"type": "url", "url": image.url}}]
    source = {"type": "base64", "media_type": image.media_type, "data": image.data}
    return [{"type": "image", "source": source}]


def _append(messages: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if not blocks:
        return
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"].extend(blocks)
    else:
        messages.append({"role": role, "content": list(blocks)})


def _strip_prefill(messages: list[dict[str, Any]]) -> str:
    """Right-strip a final assistant message (the API rejects trailing whitespace there)."""
    if not messages or messages[-1]["role"] != "assistant":
        return ""
    last = messages[-1]["content"][-1]
    if last.get("type") != "text":
        return ""
    text = str(last.get("text", ""))
    kept = text.rstrip()
    last["text"] = kept  # never empty: blank text blocks were dropped
    return text[len(kept) :]


def _tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as the object ``tool_use.input`` must be ({} if not one)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool definition from OpenAI function format; others pass through."""
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, dict):
        return dict(tool)
    converted: dict[str, Any] = {
        "name": function.get("name"),
        "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
    }
    if function.get("description"):
        converted["description"] = function["description"]
    return converted


def _check_number(params: dict[str, Any], name: str, low: float, high: float) -> None:
    value = params.get(name)
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high
    ):
        raise BadRequest(f"params.{name} must be a number from {low:g} to {high:g}")


def _check_integer(params: dict[str, Any], name: str, low: int, high: int) -> None:
    value = params.get(name)
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high
    ):
        raise BadRequest(f"params.{name} must be an integer from {low} to {high}")


def _without_userinfo(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
