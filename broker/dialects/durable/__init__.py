"""The Durable Streams protocol: streams of its own in Redis, and generations read-only."""

from broker.dialects.durable.routes import router

__all__ = ["router"]
