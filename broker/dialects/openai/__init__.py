"""The OpenAI dialect: ``/v1/responses`` and ``/v1/chat/completions`` over the same turns."""

from broker.dialects.openai.routes import router

__all__ = ["router"]
