"""What a provider adapter is: a request in, an async stream of text and a terminal event out."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any, Protocol


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
    response_format: str
    upstream_call: int  # 0 for the turn's first upstream call, counted across attempts


@dataclasses.dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    """The upstream's own terminal event. A stream that ends without it was cut, not finished."""

    reason: str = "stop"


ProviderEvent = TextDelta | Usage | Finished


class UpstreamError(Exception):
    """The upstream call failed; ``retryable`` says whether the same call may succeed later."""

    def __init__(self, code: str, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


class Provider(Protocol):
    """An upstream model adapter."""

    name: str

    def validate_params(self, params: dict[str, Any]) -> None:
        """Raise ``BadRequest`` for parameters this provider does not understand."""

    def stream(self, request: GenerationRequest) -> AsyncGenerator[ProviderEvent, None]:
        """Call the model and yield its events; raise ``UpstreamError`` when the call fails.

        Closing the generator (``aclose``) aborts the upstream call.
        """
        ...
