"""Size guards: 413 before a large body is read into memory, 431 for oversized headers; and a
tenant's share of the process's connections (:func:`hold_share`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.errors import BrokerError, TooManyRequests
from broker.fastpath.limits import CALLER_REFUSAL, CALLER_RETRY_AFTER_S, SHARE, Share


def hold_share(scope: Scope, tenant: str | None) -> None:
    """Count the request against its tenant's share; 429 when the tenant has no more.

    Every door calls it once the caller is known (``routes.authenticate``). An open broker's
    callers have no tenant: only the share of their address applies to them. Without the
    broker's own server (no ``scope[SHARE]``) nothing is counted.
    """
    share: Share | None = scope.get(SHARE)
    if share is None or tenant is None or share.hold(tenant):
        return
    refusal = TooManyRequests(
        "this tenant has as many requests in flight on this broker process as it may "
        "(BROKER_MAX_CONNECTIONS_PER_TENANT); retry when one has ended",
        retry_after_s=CALLER_RETRY_AFTER_S,
        code=CALLER_REFUSAL,
    )
    refusal.headers["Connection"] = "close"  # its connection goes too: no idle slot is kept
    raise refusal


class HeaderSizeLimit:
    """Refuse requests whose headers (names, values, and the query string) pass ``limit`` bytes.

    uvicorn's own parser limit is set above this one, so the client gets our JSON error.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and header_bytes(scope) > self.limit:
            await BodySizeLimit._reply(
                send,
                431,
                "headers_too_large",
                f"request headers are larger than BROKER_MAX_HEADER_BYTES={self.limit}",
            )
            return
        await self.app(scope, receive, send)


def header_bytes(scope: Scope) -> int:
    """What :class:`HeaderSizeLimit` counts of a request: its headers, path and query."""
    size = len(scope.get("query_string", b"")) + len(scope.get("raw_path") or b"")
    return size + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


class BodyTooLarge(BrokerError):
    """Raised from ``receive`` when the body passes the limit mid-stream (answered here, 413)."""

    code = "too_large"
    status = 413

    def __init__(self) -> None:
        super().__init__("the request body is larger than BROKER_MAX_BODY_BYTES")


DRAIN_MAX: Final = 64 * 1024 * 1024  # the most of a refused body read (and dropped) before the 413
DRAIN_S: Final = 10.0  # and the longest it is waited for (a client that sends slowly gets the 413)


class BodySizeLimit:
    """Refuse request bodies over ``limit`` bytes, by Content-Length or by counting.

    The rest of a refused body is read and dropped (up to ``DRAIN_MAX`` bytes) before the 413
    goes out: a connection closed with unread bytes is reset, and a client still sending its
    body would see the reset instead of the answer. The drain waits ``DRAIN_S`` at most.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            # No route reads a body here: no counting, and nothing wrapped around the
            # response (a stream's every write would pass through the wrapper).
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._reply(send, 400, "bad_request", "malformed Content-Length")
                    return
                if declared > self.limit:
                    if declared <= DRAIN_MAX:
                        await _drain(receive, DRAIN_MAX)
                    await self._too_large(send)
                    return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _drain(receive, DRAIN_MAX - received)
                await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        await self._reply(
            send,
            413,
            "too_large",
            f"request body is larger than BROKER_MAX_BODY_BYTES={self.limit}",
        )

    @staticmethod
    async def _reply(send: Send, status: int, code: str, message: str) -> None:
        body = orjson.dumps({"error": {"code": code, "message": message}})
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a request body, up to ``budget`` bytes and ``DRAIN_S``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            await _drop(receive, budget)


async def _drop(receive: Receive, budget: int) -> None:
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return  # the client left
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return
