"""A scripted in-memory broker for the client's HTTP tests: replies in order, requests recorded."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from broker_client import AttachPolicy

BASE = "http://broker.test"
FAST = AttachPolicy(max_retries=3, base_delay=0.0001, max_delay=0.001)

Reply = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class Body(httpx.AsyncByteStream):
    """A response body that yields chunks, then fails, hangs, or ends cleanly."""

    def __init__(
        self,
        chunks: list[str],
        fail: Exception | None = None,
        hang: bool = False,
        delay: float = 0.0,
    ) -> None:
        self.chunks = chunks
        self.fail = fail
        self.hang = hang
        self.delay = delay
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.delay:
            await asyncio.sleep(self.delay)
        for chunk in self.chunks:
            yield chunk.encode()
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed = True


class Broker:
    """Serves scripted replies in order and records every request."""

    def __init__(self, *replies: Reply) -> None:
        self.replies: deque[Reply] = deque(replies)
        self.requests: list[httpx.Request] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not self.replies:
            raise AssertionError(f"unexpected request {request.method} {request.url}")
        reply = self.replies.popleft()
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, httpx.Response):
            return reply
        return reply(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def eid(n: int) -> str:
    return f"{1764512345678 + n:016d}-0000000000"


def frame(n: int, type: str, attempt: int = 1, **data: Any) -> str:
    payload = json.dumps({"attempt": attempt, **data})
    return f"id: {eid(n)}\nevent: {type}\ndata: {payload}\n\n"


def sse(
    *chunks: str, fail: Exception | None = None, hang: bool = False, delay: float = 0.0
) -> httpx.Response:
    return httpx.Response(
        200,
        headers={"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-store"},
        stream=Body(list(chunks), fail, hang, delay),
    )


def error(
    status: int, code: str, message: str = "nope", headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"code": code, "message": message}}, headers=headers
    )


def drop() -> httpx.ReadError:
    return httpx.ReadError("connection reset by peer")
