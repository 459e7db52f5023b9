"""Upstream model adapters, looked up by name."""

from __future__ import annotations

from broker.errors import BadRequest
from broker.providers.base import (
    Finished,
    GenerationRequest,
    Provider,
    ProviderEvent,
    TextDelta,
    ToolCallChunk,
    ToolCallEnd,
    ToolStep,
    UpstreamError,
    Usage,
)
from broker.providers.simulated import SimulatedProvider
from broker.settings import Settings

__all__ = [
    "Finished",
    "GenerationRequest",
    "Provider",
    "ProviderEvent",
    "Providers",
    "SimulatedProvider",
    "TextDelta",
    "ToolCallChunk",
    "ToolCallEnd",
    "ToolStep",
    "UpstreamError",
    "Usage",
]

DEFAULT_PROVIDER = "simulated"


class Providers:
    """The configured providers of one broker."""

    def __init__(self, settings: Settings) -> None:
        self._providers: dict[str, Provider] = {
            "simulated": SimulatedProvider(max_tokens_per_s=settings.simulate_max_tokens_per_s),
        }

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._providers)

    def get(self, name: str | None) -> Provider:
        """The provider called ``name`` (the default when None); 400 when unknown."""
        key = name or DEFAULT_PROVIDER
        try:
            return self._providers[key]
        except KeyError:
            raise BadRequest(
                f"unknown provider {key!r}; configured: {', '.join(self._providers)}",
                code="unknown_provider",
            ) from None
