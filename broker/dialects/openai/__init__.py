"""The OpenAI dialect: ``/v1/responses`` and ``/v1/chat/completions`` over the same turns."""

from fastapi import APIRouter

from broker.dialects.openai import chat, responses

router = APIRouter()
router.include_router(responses.router)
router.include_router(chat.router)

__all__ = ["router"]
