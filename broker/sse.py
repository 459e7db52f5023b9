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
        self._sending_since: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._raw_headers})
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(_wait_for_disconnect(receive))
        stuck = asyncio.create_task(self._watch_sends())
        try:
            await asyncio.wait({pump, watch, stuck}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch, stuck):
                task.cancel()
            for task in (pump, watch, stuck):
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
        loop = asyncio.get_running_loop()
        async for chunk in self._source:
            # A write that blocks (the client stopped reading) is ended by _watch_sends: one
            # timer per response instead of one per write.
            self._sending_since = loop.time()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._sending_since = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_sends(self) -> None:
        """End the response when one write has waited ``send_timeout_s`` for the client."""
        loop = asyncio.get_running_loop()
        timeout = self._send_timeout_s
        while True:
            since = self._sending_since
            if since is not None and loop.time() - since >= timeout:
                log.info("closing a stream whose client did not read for %s s", timeout)
                return
            wait = timeout if since is None else since + timeout - loop.time()
            await asyncio.sleep(max(wait, 0.01))


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
