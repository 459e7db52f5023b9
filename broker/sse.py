"""Server-sent events: the frames and an ASGI response that streams them.

The response races three things: the event source, the client's disconnect, and a per-send
timeout. Whichever ends first ends the response, and the source is always closed, so a reader's
subscription is released the moment its client goes away. Heartbeats are SSE comments, so
``EventSource`` ignores them while proxies and clients see a live connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("broker.sse")

PING = b": ping\n\n"

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
    (b"connection", b"keep-alive"),
]


def opening_frame(retry_ms: int, resume_offset: str | None) -> bytes:
    """``retry:``, and the resume point as an ``id:`` without data.

    The id moves a client's Last-Event-ID to where this read starts without dispatching an
    event, so a client that asked for ``now`` and drops before the first event resumes from
    that point instead of asking for ``now`` again and missing what came between.
    """
    if resume_offset is None:
        return f"retry: {retry_ms}\n\n".encode()
    return f"retry: {retry_ms}\nid: {resume_offset}\n\n".encode()


class EventStreamResponse(Response):
    """Streams ``source`` chunks as ``text/event-stream`` until it ends or the client leaves."""

    media_type = "text/event-stream"

    def __init__(
        self,
        source: AsyncIterator[bytes],
        *,
        send_timeout_s: float,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._source = source
        self._send_timeout_s = send_timeout_s
        self._raw_headers = HEADERS + (extra_headers or [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._raw_headers})
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            for task in (pump, watch):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            await _close(self._source)

    async def _pump(self, send: Send) -> None:
        try:
            await self._send_all(send)
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as exc:
            # Redis went away mid-read (or a bug): end the response; the client resumes, and
            # meets a 503 until Redis is back. Never leave the socket hanging.
            log.warning("ending a stream early: %s: %s", type(exc).__name__, exc)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_all(self, send: Send) -> None:
        async for chunk in self._source:
            try:
                # asyncio.timeout, not wait_for: no task per write (a write per event per reader).
                async with asyncio.timeout(self._send_timeout_s):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except TimeoutError:
                log.info(
                    "closing a stream whose client did not read for %s s", self._send_timeout_s
                )
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _close(source: AsyncIterator[bytes]) -> None:
    close = getattr(source, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()
