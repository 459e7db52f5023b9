"""The AI SDK's UI message stream dialect: ``useChat({ resume: true })`` on broker turns."""

from broker.dialects.aisdk.routes import router

__all__ = ["router"]
