"""A small SSE client on a raw asyncio connection, cheap enough to run a thousand per process.

One ``GET`` over HTTP/1.1, the response decoded in ``data_received`` (chunked or not), and the
events with data of each read handed to a callback together with the wall-clock time their bytes
arrived, which is comparable with the millisecond part of a Redis entry id on the same machine.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Final, cast

import httpx

from broker.offsets import to_entry_id

# The frames the broker writes: `id:`, `event:` and one `data:` line (Durable Streams servers
# write `data:` with no space, as SSE allows). Comments, `retry:` and the opening frame's bare
# `id:` carry no data and are skipped. One C call finds every event of a read, so that a
# thousand readers in one process cost little per event.
FRAME: Final = re.compile(rb"^(?:id: (.*)\n)?(?:event: (.*)\n)?data: ?(.*)\n\n", re.MULTILINE)

# ([(id, event, data), ...] of one read, received at) -> True to stop reading and close.
EventsHandler = Callable[[list[tuple[bytes, bytes, bytes]], float], bool]


def entry_ms(offset: str | bytes) -> int:
    """The Redis server time (ms) at which the event with this wire offset was appended."""
    if len(offset) == 27 and offset[16:17] in ("-", b"-"):  # the usual form: int() only
        return int(offset[:16])
    text = offset.decode() if isinstance(offset, bytes) else offset
    return int(to_entry_id(text).partition("-")[0])


class SSEReader(asyncio.Protocol):
    """Reads one SSE response; ``done`` resolves when it ends, is stopped or fails."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str,
        on_events: EventsHandler,
        last_event_id: str | None,
        on_head: Callable[[float], None] | None = None,
    ) -> None:
        extra = f"Last-Event-ID: {last_event_id}\r\n" if last_event_id else ""
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n"
            f"{extra}\r\n"
        ).encode()
        self._on_events = on_events
        # Told the wall-clock time a 200's head arrived, before any event of the same
        # read is handed over (a viewer counts lag for the events appended after it).
        self._on_head = on_head
        self.status = 0
        self.headers_at: float | None = None  # wall-clock time the response head arrived
        self.error: str | None = None
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[int] = loop.create_future()  # the status, once read
        self.done: asyncio.Future[None] = loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._head = bytearray()
        self._chunks = bytearray()
        self._body = bytearray()
        self._in_body = False
        self._chunked = False
        self._left = 0  # bytes left in the current chunk
        self._skip = 0  # bytes of CRLF left after the current chunk

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._transport.write(self._request)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"
        self._finish()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._finish()

    def _finish(self) -> None:
        if not self.opened.done():
            self.opened.set_result(self.status)
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            data = bytes(self._head[end + 4 :])
            head = bytes(self._head[:end])
            self._head.clear()
            if not self._read_head(head, now):
                return
        last = False
        if self._chunked:
            data, last = self._dechunk(data)
        self._body += data
        self._frames(now)
        if last:
            self.close()

    def _read_head(self, head: bytes, now: float) -> bool:
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers_at = now
        if self._on_head is not None and self.status == 200:
            self._on_head(now)
        self._in_body = True
        if not self.opened.done():
            self.opened.set_result(self.status)
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                self._chunked = True
        if self.status != 200:
            self.close()
            return False
        return True

    def _dechunk(self, data: bytes) -> tuple[bytes, bool]:
        """The payload in ``data`` (chunk framing removed), and whether the last chunk came."""
        out = bytearray()
        buffer = self._chunks
        buffer += data
        pos = 0
        last = False
        while pos < len(buffer):
            if self._skip:
                step = min(self._skip, len(buffer) - pos)
                pos += step
                self._skip -= step
            elif self._left:
                step = min(self._left, len(buffer) - pos)
                out += buffer[pos : pos + step]
                pos += step
                self._left -= step
                if not self._left:
                    self._skip = 2  # the CRLF after a chunk's data
            else:
                end = buffer.find(b"\r\n", pos)
                if end < 0:
                    break  # the size line is incomplete: wait for more
                size = int(bytes(buffer[pos:end]).split(b";", 1)[0], 16)
                pos = end + 2
                if size == 0:
                    last = True
                    pos = len(buffer)
                    break
                self._left = size
        del buffer[:pos]
        return bytes(out), last

    def _frames(self, now: float) -> None:
        """Hand every complete frame that carries data to the handler, in one call."""
        body = self._body
        end = body.rfind(b"\n\n")
        if end < 0:
            return
        events = FRAME.findall(body, 0, end + 2)
        del body[: end + 2]
        if events and not self.done.done() and self._on_events(events, now):
            self.close()


async def open_sse(
    base_url: str,
    path: str,
    on_events: EventsHandler,
    last_event_id: str | None = None,
    on_head: Callable[[float], None] | None = None,
) -> SSEReader:
    """Connect and send the request; the reader's ``done`` resolves when the read is over."""
    url = httpx.URL(base_url)
    host, port = str(url.host), int(url.port or 80)
    loop = asyncio.get_running_loop()
    _, reader = await loop.create_connection(
        lambda: SSEReader(host, port, path, on_events, last_event_id, on_head), host, port
    )
    return reader


def turn_body(
    conversation_id: str,
    turn_id: str,
    *,
    tokens: int,
    tokens_per_s: float,
    seed: int = 0,
    stamp: bool = False,
) -> dict[str, object]:
    """A ``POST /v1/turns`` body for the simulated provider; with ``stamp``, each delta starts
    with the time the model emitted it (see :func:`benchmarks.fanout.emitted_ms`)."""
    simulate: dict[str, object] = {"tokens": tokens, "tokens_per_s": tokens_per_s, "seed": seed}
    if stamp:
        simulate["stamp"] = True
    return {
        "conversation_id": conversation_id,
        "turn_id": turn_id,
        "messages": [{"role": "user", "content": "benchmark"}],
        "params": {"simulate": simulate},
    }
