"""What a provider adapter is: a request in, an async stream of text and a terminal event out."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Iterable
from typing import Any, Protocol

from broker.errors import BadRequest, BrokerError


@dataclasses.dataclass(frozen=True, slots=True)
class ToolStep:
    """One round of tool use earlier in this attempt: what the model said and called, and what
    the tools answered. Adapters render it in their provider's wire format."""

    text: str
    calls: list[dict[str, Any]]  # {"id", "name", "arguments"} (arguments as JSON text)
    results: list[dict[str, Any]]  # {"id", "name", "content"} (content as JSON text)


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One upstream call for one attempt of a turn."""

    conversation_id: str
    turn_id: str
    attempt: int
    strategy: str
    messages: list[dict[str, Any]]
    model: str | None
    params: dict[str, Any]
    response_format: str | dict[str, Any]  # text | json | the json_schema form
    upstream_call: int  # 0 for the attempt's first upstream call, counted across retries
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tool_steps: list[ToolStep] = dataclasses.field(default_factory=list)
    # The turn's client tools ({"name", "description"?, "parameters"?}): offered beside
    # ``tools``; the broker does not run their calls (see broker.client_tools.offered_tools).
    client_tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallChunk:
    """Part of a tool call, as models stream them: ``index`` ties the parts of one call
    together; ``call_id`` and ``name`` come with the first part, ``arguments`` is JSON text
    arriving piece by piece."""

    index: int
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """The call at ``index`` has all its arguments (adapters whose wire format says so)."""

    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    """The upstream's own terminal event. A stream that ends without it was cut, not finished."""

    reason: str = "stop"  # "tool_calls": the model waits for its calls' results


ProviderEvent = TextDelta | Usage | ToolCallChunk | ToolCallEnd | Finished


class UpstreamError(BrokerError):
    """The upstream call failed; ``retryable`` says whether the same call may succeed later.

    ``code`` names the failure for the ``error`` event (``upstream_timeout``, a provider's
    status class, ...).
    """

    def __init__(
        self, code: str, message: str, *, retryable: bool, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.retryable = retryable
        self.retry_after_s = retry_after_s  # the upstream's Retry-After, when it sent one


def reject_unknown_params(provider: str, params: dict[str, Any], known: Iterable[str]) -> None:
    """400 naming the ``params`` keys a provider does not take, and the ones it does."""
    allowed = sorted(known)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise BadRequest(
            f"unknown params for the {provider} provider: {', '.join(unknown)}; "
            f"known: {', '.join(allowed)}"
        )


class Provider(Protocol):
    """An upstream model adapter."""

    name: str
    models: tuple[str, ...]  # the first is the default; empty: any model name is passed through
    description: str  # for `broker providers`: where it points (never a key)

    def validate_params(self, params: dict[str, Any]) -> None:
        """Raise ``BadRequest`` for parameters this provider does not understand."""

    def stream(self, request: GenerationRequest) -> AsyncGenerator[ProviderEvent, None]:
        """Call the model and yield its events; raise ``UpstreamError`` when the call fails.

        Closing the generator (``aclose``) aborts the upstream call.
        """
        ...

    async def aclose(self) -> None:
        """Release what the provider holds (its HTTP client); called once, at shutdown."""
