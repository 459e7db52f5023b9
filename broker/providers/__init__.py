"""Upstream model adapters, looked up by name."""

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
from broker.providers.registry import Providers
from broker.providers.simulated import SimulatedProvider

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
