"""The OpenAI dialect's routes: the Responses API and Chat Completions, one router."""

from fastapi import APIRouter

from broker.dialects.openai import chat, responses

router = APIRouter()
router.include_router(responses.router)
router.include_router(chat.router)
