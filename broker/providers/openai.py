"""The OpenAI-compatible Chat Completions adapter, on the official ``openai`` SDK.

It streams ``POST {base_url}/chat/completions`` from any server that speaks the format: OpenAI,
vLLM, Ollama, llama.cpp's ``llama-server``, LiteLLM. The SDK's own retries are off: the broker
owns the retry policy, and every failure is mapped through :mod:`broker.providers.taxonomy`.

The stream: ``delta.content`` becomes :class:`TextDelta`, ``delta.tool_calls`` parts become
:class:`ToolCallChunk` (joined by ``index`` in the broker), usage is asked for with
``stream_options.include_usage`` and yielded once. A ``finish_reason`` is the model's end of
message: :class:`Finished` follows the final usage chunk (``choices: []``) or, when the server
sends none, the end of the stream (``data: [DONE]``). A stream that ends without a
``finish_reason`` yields no :class:`Finished`, so the broker treats it as cut. A chunk that carries
nothing for the broker (the role-only first chunk, reasoning text) yields an empty
:class:`TextDelta`: the broker ignores its text, but it proves the upstream is alive to the
idle timer (``BROKER_UPSTREAM_IDLE_TIMEOUT_S`` counts upstream silence, not a silent model).

``continue`` sends the delivered text as a trailing assistant message; what it becomes depends
on the server behind ``BROKER_OPENAI_BASE_URL``:

* **OpenAI** has no prefill: the trailing message is read as an earlier assistant turn and the
  model starts a new message, which may restart or repeat the sentence instead of carrying it
  on.
* **vLLM** does the same by default (the chat template opens a new assistant turn after it).
  With ``BROKER_OPENAI_CONTINUE_FINAL_MESSAGE=1`` the adapter adds
  ``continue_final_message: true, add_generation_prompt: false`` to continue attempts: the
  template leaves the final message open and the model continues it token for token. (vLLM
  rejects ``continue_final_message`` together with ``add_generation_prompt: true``, hence both.)
* **Ollama** treats a trailing assistant message as the start of the reply and continues it;
  the output holds only the new text.
* **llama.cpp** (``llama-server``) prefills a trailing assistant message by default (turned off
  by ``--no-prefill-assistant``); newer builds also accept vLLM's two flags. Some templates
  (reasoning models with thinking on) refuse a prefill with a 400, which fails the attempt.
* **LiteLLM** hands the messages to the backend it routes to, so the backend decides (Anthropic
  models continue a trailing assistant message as a prefill); the vLLM flags reach a backend
  only if LiteLLM passes extra body fields on.

``max_tokens`` is sent as is: OpenAI's newest models want ``max_completion_tokens`` and refuse it
with a 400, while the compatible servers all take ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from collections.abc import AsyncGenerator, Iterator, Mapping
from typing import Any, Final, cast

import httpx
import openai
from openai.types.chat import ChatCompletionChunk

from broker.client_tools import TOOL_PARAMS, check_tool_params, chosen_tool, offered_tools
from broker.errors import BadRequest
from broker.numbers import whole_number
from broker.providers import taxonomy
from broker.providers.base import (
    Finished,
    GenerationRequest,
    ProviderEvent,
    TextDelta,
    ToolCallChunk,
    UpstreamError,
    Usage,
    reject_unknown_params,
)
from broker.structured_output import chat_response_format

DEFAULT_BASE_URL: Final = "https://api.openai.com/v1"
# Sent when no key is configured: local servers (vLLM, Ollama, llama.cpp) ignore it unless they
# were started with a key, and the SDK refuses to build a client without one.
NO_KEY: Final = "no-key"
NUMBER_PARAMS: Final = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
PARAMS: Final = frozenset({*NUMBER_PARAMS, "max_tokens", "stop", "seed", *TOOL_PARAMS})
MESSAGE_FIELDS: Final = ("role", "content", "name")
TOOL_FINISH_REASONS: Final = frozenset({"tool_calls", "function_call"})
DONE_GRACE_S: Final = 1.0  # how long a finished stream may take to send its [DONE]


class OpenAIProvider:
    """Chat Completions over the ``openai`` SDK; ``models`` are the names turns may ask for.

    ``continue_final_message`` adds vLLM's prefill flags to ``continue`` attempts (see the
    module docstring for what each server does with a trailing assistant message).
    """

    name = "openai"

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        models: tuple[str, ...],
        continue_final_message: bool = False,
    ) -> None:
        self.base_url = (base_url or DEFAULT_BASE_URL).rstrip("/")
        self.models: tuple[str, ...] = tuple(models)
        self.continue_final_message = continue_final_message
        shown, url_secret = _strip_userinfo(self.base_url)
        extra = ", continue_final_message" if continue_final_message else ""
        self.description = f"OpenAI-compatible Chat Completions at {shown}{extra}"
        self._secrets = tuple(s for s in (api_key, url_secret) if s and len(s) >= 4)
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=api_key or NO_KEY, max_retries=0
        )
        # Resolved now: the SDK imports its chat resources on first use, a pause of a few hundred
        # milliseconds that would otherwise stall the event loop during the first turn.
        self._completions = client.chat.completions
        self._client = client

    def validate_params(self, params: dict[str, Any]) -> None:
        reject_unknown_params("openai", params, PARAMS)
        check_tool_params(params)
        for key, value in params.items():
            if value is None or key in TOOL_PARAMS:
                continue  # null: the server's default
            if key == "stop":
                what = "a string or a list of strings"
                valid = isinstance(value, str) or (
                    isinstance(value, list) and all(isinstance(s, str) for s in value)
                )
            elif key in ("max_tokens", "seed"):
                what, valid = "an integer", isinstance(value, int) and not isinstance(value, bool)
            else:
                what = "a number"
                valid = isinstance(value, int | float) and not isinstance(value, bool)
            if not valid:
                raise BadRequest(f"params.{key} must be {what}")

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[ProviderEvent, None]:
        """Stream one Chat Completions call; closing the generator closes its HTTP response."""
        params = request.params
        extra_body: dict[str, Any] | None = None
        if self.continue_final_message and _continues(request):
            extra_body = {"continue_final_message": True, "add_generation_prompt": False}
        chunks: openai.AsyncStream[ChatCompletionChunk] | None = None
        state = _StreamState()
        try:
            chunks = await self._completions.create(
                model=request.model or "",
                messages=cast(Any, render_messages(request)),
                stream=True,
                stream_options={"include_usage": True},
                tools=cast(Any, tools) if (tools := all_tools(request)) else openai.omit,
                tool_choice=tool_choice(params) if tools else openai.omit,
                parallel_tool_calls=params.get("parallel_tool_calls", openai.omit)
                if tools
                else openai.omit,
                response_format=cast(Any, chat_response_format(request.response_format))
                or openai.omit,
                temperature=params.get("temperature", openai.omit),
                top_p=params.get("top_p", openai.omit),
                max_tokens=params.get("max_tokens", openai.omit),
                stop=params.get("stop", openai.omit),
                seed=params.get("seed", openai.omit),
                presence_penalty=params.get("presence_penalty", openai.omit),
                frequency_penalty=params.get("frequency_penalty", openai.omit),
                extra_body=extra_body,
            )
            async for chunk in chunks:
                for event in state.feed(chunk):
                    yield event
                if state.complete:
                    await _read_to_done(chunks)
                    break
            for event in state.end():
                yield event
        except openai.APIStatusError as exc:
            raise self._status_error(exc) from None
        except openai.APITimeoutError as exc:
            raise taxonomy.transport_error("timeout", self._transport_message(exc)) from None
        except openai.APIConnectionError as exc:
            raise taxonomy.transport_error("connection", self._transport_message(exc)) from None
        except openai.APIError as exc:  # an error event inside the stream
            raise self._stream_error(exc) from None
        except httpx.TransportError as exc:  # defensive: the SDK maps the errors it knows
            timeout = isinstance(exc, httpx.TimeoutException)
            raise taxonomy.transport_error(
                "timeout" if timeout else "connection",
                self._redact(f"{type(exc).__name__}: {exc}"),
            ) from None
        except json.JSONDecodeError as exc:
            raise UpstreamError(
                "upstream_bad_response",
                f"the upstream sent a chunk that is not JSON: {exc}",
                retryable=True,
            ) from None
        except openai.OpenAIError as exc:  # the SDK refused the call before sending it
            raise UpstreamError(
                "upstream_client_error",
                self._redact(f"{type(exc).__name__}: {exc}"),
                retryable=False,
            ) from None
        finally:
            if chunks is not None:
                # On an abort (aclose: GeneratorExit, or a cancellation) this closes the
                # connection at once, so the upstream sees the client go and stops generating.
                await chunks.close()

    async def aclose(self) -> None:
        """Close the SDK's connection pool (for an owner that shuts down cleanly)."""
        await self._client.close()

    def _status_error(self, exc: openai.APIStatusError) -> UpstreamError:
        message = _error_message(exc.body) or exc.response.reason_phrase or "error"
        return taxonomy.status_error(
            exc.status_code, self._redact(message), _retry_after(exc.response.headers)
        )

    def _stream_error(self, exc: openai.APIError) -> UpstreamError:
        """An ``error`` object inside the stream: retryable unless its status is admission-class."""
        message = self._redact(f"error event in the stream: {_error_message(exc.body) or exc}")
        status = _status_of(exc.body)
        if status is None:
            return UpstreamError("upstream_stream_error", message[:500], retryable=True)
        code, _ = taxonomy.classify_status(status)
        retryable = status not in taxonomy.ADMISSION
        return UpstreamError(code, f"HTTP {status}: {message}"[:500], retryable=retryable)

    def _transport_message(self, exc: openai.APIConnectionError) -> str:
        cause = exc.__cause__
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        return self._redact(f"{exc.message.rstrip('.')}{detail}")

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return text


class _StreamState:
    """Turns chunks into broker events; holds the finish reason and usage until the end."""

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.saw_tool_calls = False
        self.complete = False  # the finish reason and the final usage chunk both arrived
        self.finished = False

    def feed(self, chunk: ChatCompletionChunk) -> Iterator[ProviderEvent]:
        produced = False
        for choice in chunk.choices or []:
            if choice.index not in (0, None):
                continue  # n > 1 is never asked for
            delta = choice.delta
            if delta is not None and delta.content:
                produced = True
                yield TextDelta(delta.content)
            for position, call in enumerate((delta.tool_calls if delta else None) or []):
                produced = self.saw_tool_calls = True
                function = call.function
                yield ToolCallChunk(
                    index=call.index if call.index is not None else position,
                    call_id=call.id or None,
                    name=(function.name if function else None) or None,
                    arguments=(function.arguments if function else None) or "",
                )
            if choice.finish_reason:
                self.finish_reason = str(choice.finish_reason)
        if chunk.usage is not None:
            self.usage = Usage(
                input_tokens=int(chunk.usage.prompt_tokens or 0),
                output_tokens=int(chunk.usage.completion_tokens or 0),
            )
            # The final usage chunk: nothing follows but [DONE].
            self.complete = not chunk.choices and self.finish_reason is not None
        if not produced:
            yield TextDelta("")  # upstream activity without text (see the module docstring)

    def end(self) -> Iterator[ProviderEvent]:
        """The events due when the stream is over: usage, then Finished if the model finished."""
        if self.usage is not None:
            yield self.usage
            self.usage = None
        if self.finish_reason is not None and not self.finished:
            self.finished = True
            wants_tools = self.finish_reason in TOOL_FINISH_REASONS or self.saw_tool_calls
            yield Finished("tool_calls" if wants_tools else "stop")


def all_tools(request: GenerationRequest) -> list[dict[str, Any]]:
    """The tools offered to the model: the request's ``tools`` (already in this format), then
    its client tools as function tools."""
    return [*request.tools, *offered_tools(request.client_tools)]


def tool_choice(params: dict[str, Any]) -> Any:
    """``params.tool_choice`` as Chat Completions takes it (a named tool is a function)."""
    name = chosen_tool(params)
    if name is not None:
        return {"type": "function", "function": {"name": name}}
    return params.get("tool_choice", openai.omit)


def render_messages(request: GenerationRequest) -> list[dict[str, Any]]:
    """The request's messages in Chat Completions form, its tool steps after them.

    Only ``role``, ``content`` and ``name`` of a message are sent (``partial`` is the broker's);
    a user message's content parts become ``text`` and ``image_url`` parts;
    an assistant message's client ``tool_calls`` and a ``tool`` message's ``tool_call_id`` go
    in this format's shape. Each tool step is the assistant message with its ``tool_calls``,
    then one ``tool`` message per result.
    """
    messages = [_message(message) for message in request.messages]
    for step in request.tool_steps:
        messages.append(
            {"role": "assistant", "content": step.text or None, "tool_calls": _calls(step.calls)}
        )
        messages.extend(
            {"role": "tool", "tool_call_id": result["id"], "content": result["content"]}
            for result in step.results
        )
    return messages


def _message(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") == "tool" and message.get("tool_call_id") is not None:
        return {
            "role": "tool",
            "tool_call_id": message["tool_call_id"],
            "content": message.get("content", ""),
        }
    rendered = {key: message[key] for key in MESSAGE_FIELDS if message.get(key) is not None}
    if isinstance(rendered.get("content"), list):
        rendered["content"] = [_part(part) for part in rendered["content"]]
    if message.get("tool_calls"):
        rendered["tool_calls"] = _calls(message["tool_calls"])
        rendered["content"] = message.get("content") or None
    return rendered


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """One of the broker's content parts as a Chat Completions content part: an image as an
    ``image_url`` part (its URL or data URL as given, and its ``detail`` when set)."""
    if part.get("type") != "image":
        return {"type": "text", "text": part.get("text", "")}
    image_url: dict[str, Any] = {"url": part["url"]}
    if part.get("detail") is not None:
        image_url["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image_url}


def _calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls ({"id", "name", "arguments"}) as an assistant message's ``tool_calls``."""
    return [
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]},
        }
        for call in calls
    ]


async def _read_to_done(chunks: openai.AsyncStream[ChatCompletionChunk]) -> None:
    """Read a finished stream up to its ``[DONE]`` for a moment, so the SDK can put the
    connection back in its pool; an answer already whole is kept whatever happens here."""
    with contextlib.suppress(TimeoutError, openai.APIError, json.JSONDecodeError):
        async with asyncio.timeout(DONE_GRACE_S):
            async for _ in chunks:
                pass


def _continues(request: GenerationRequest) -> bool:
    """Whether the request ends with the delivered text of a ``continue`` attempt."""
    return (
        request.strategy == "continue"
        and not request.tool_steps
        and bool(request.messages)
        and request.messages[-1].get("role") == "assistant"
    )


def _error_message(body: object) -> str | None:
    """The human part of an OpenAI-style error body (``{"message": ...}`` or a bare string)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        return None
    if isinstance(body, str) and body:
        return body
    return None


def _retry_after(headers: Mapping[str, str]) -> str | None:
    """The wait an error answer asks for: OpenAI's ``retry-after-ms`` first, ``Retry-After``."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return str(float(millis) / 1000)
        except ValueError:
            pass
    value: str | None = headers.get("retry-after")
    return value


def _status_of(body: object) -> int | None:
    """An HTTP status named by an error object (``code``, ``status`` or ``status_code``)."""
    if not isinstance(body, dict):
        return None
    for key in ("status_code", "status", "code"):
        value = body.get(key)
        if isinstance(value, str):
            value = whole_number(value, 400, 599)
        if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
            return value
    return None


def _strip_userinfo(url: str) -> tuple[str, str | None]:
    """The URL without ``user:password@`` (for showing), and the password it held."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), parts.password
