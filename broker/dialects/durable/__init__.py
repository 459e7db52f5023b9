"""The Durable Streams protocol: streams of its own in Redis, and generations read-only."""

from fastapi import APIRouter

from broker.dialects.durable import routes, subscriptions

# The reserved subscription paths first: the streams' routes take any other path.
router = APIRouter()
router.include_router(subscriptions.router)
router.include_router(routes.router)

__all__ = ["router"]
