"""A body-size guard that answers 413 before a large body is read into memory."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    """Raised from ``receive`` when the body passes the limit mid-stream."""


class BodySizeLimit:
    """Refuse request bodies over ``limit`` bytes, by Content-Length or by counting."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
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
                await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        await self._reply(
            send, 413, "too_large",
            f"request body is larger than BROKER_MAX_BODY_BYTES={self.limit}",
        )  # fmt: skip

    @staticmethod
    async def _reply(send: Send, status: int, code: str, message: str) -> None:
        body = orjson.dumps({"error": {"code": code, "message": message}})
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})
