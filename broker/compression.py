"""Content coding of responses: the coding a client's ``Accept-Encoding`` asks for, a gzip stream
that flushes every write, and the middleware that compresses whole JSON and text bodies.

Only gzip is offered. Measured on the broker's own frames (``python -m benchmarks.wire``), brotli
and zstd both cost more bytes than gzip once every write is flushed on its own, which an event
stream must do: their per-flush framing outweighs what they gain on a few dozen bytes.

An event stream compresses its own body (``broker.sse``), since its chunks bypass the middleware
stack (``RawSend``). The middleware only decides the coding for every request (``CODING`` in the
scope) and compresses responses that arrive whole; it passes an event stream's start on at once
and leaves its body alone.
"""

from __future__ import annotations

import zlib
from typing import Final

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

GZIP: Final = "gzip"
IDENTITY: Final = "identity"
# The scope key of the coding chosen for this request's response (GZIP or IDENTITY); absent when
# compression is off (BROKER_COMPRESSION=off), so a response without it is never compressed.
CODING: Final = "broker.content_coding"
# Bodies smaller than this are sent as they are: gzip's 18-byte frame would eat the saving.
MIN_BODY_BYTES: Final = 512
# One compressor per event stream, for as long as the stream lasts: a 4 KiB window and small hash
# tables keep it near 40 KiB instead of zlib's default 260 KiB, for a few per cent more bytes
# (the frames repeat within a few hundred bytes; the window needs no more).
STREAM_WINDOW_BITS: Final = 12
STREAM_MEM_LEVEL: Final = 5
LEVEL: Final = 6
_GZIP_WRAPPER: Final = 16  # added to the window bits: a gzip header and trailer, not zlib's
_COMPRESSIBLE: Final = ("application/json", "text/", "application/javascript")


def negotiate(accept_encoding: str | None) -> str:
    """GZIP or IDENTITY, for an ``Accept-Encoding`` request header (RFC 9110, 12.5.3).

    No header, or an empty one, means identity: the broker never compresses for a client that
    did not ask. q-values are honoured (``gzip;q=0`` refuses gzip, ``*`` accepts it, the higher
    q of gzip and identity wins, a tie goes to gzip); ``x-gzip`` is gzip. When neither is acceptable
    (``identity;q=0`` alone, ``*;q=0``), the answer is identity, which every client can read,
    rather than a 406 that a reconnecting stream could not get past.
    """
    if not accept_encoding:
        return IDENTITY
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        name, _, params = item.partition(";")
        name = name.strip().lower()
        if not name:
            continue
        q = _quality(params)
        if q is None:
            continue  # a malformed q: the entry counts for nothing
        name = GZIP if name == "x-gzip" else name
        weights[name] = max(q, weights.get(name, 0.0))
    wildcard = weights.get("*")
    gzip_q = weights.get(GZIP, wildcard if wildcard is not None else 0.0)
    # Identity is always acceptable (nothing else is left to send), but it outranks gzip only
    # when the client gave it the higher q itself, by name or by ``*``.
    identity_q = weights.get(IDENTITY, wildcard if wildcard is not None else 0.0)
    return GZIP if gzip_q > 0 and gzip_q >= identity_q else IDENTITY


def _quality(params: str) -> float | None:
    """The q of an entry's parameters (1 without one); None when it is not a number in 0..1."""
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() != "q":
            continue
        try:
            q = float(value.strip())
        except ValueError:
            return None
        return q if 0.0 <= q <= 1.0 else None
    return 1.0


class GzipStream:
    """One gzip member written a piece at a time: every :meth:`write` returns bytes that decode
    to all of that piece (a sync flush), so a client sees each write as soon as it arrives."""

    __slots__ = ("_deflate",)

    def __init__(self) -> None:
        self._deflate = zlib.compressobj(
            LEVEL, zlib.DEFLATED, _GZIP_WRAPPER + STREAM_WINDOW_BITS, STREAM_MEM_LEVEL
        )

    def write(self, data: bytes) -> bytes:
        return self._deflate.compress(data) + self._deflate.flush(zlib.Z_SYNC_FLUSH)

    def finish(self, data: bytes = b"") -> bytes:
        """``data`` and the end of the member (its trailer): nothing may be written after it."""
        return self._deflate.compress(data) + self._deflate.flush(zlib.Z_FINISH)


def stream_headers(coding: str | None) -> list[tuple[bytes, bytes]]:
    """The headers an event stream adds for the coding chosen for it (none when compression is
    off): ``Vary`` whenever the coding depended on the request, ``Content-Encoding`` for gzip."""
    if coding is None:
        return []
    vary = [(b"vary", b"Accept-Encoding")]
    return [(b"content-encoding", b"gzip"), *vary] if coding == GZIP else vary


class Compression:
    """Chooses each request's coding (``CODING``) and gzips whole JSON and text bodies of at
    least ``MIN_BODY_BYTES`` for clients that ask.

    A response whose start says it streams (an event stream, or one already coded) passes at
    once, untouched; any other start is held until its first body message. A body that comes in
    one message is compressed; one that comes in several passes as it is (nothing the broker
    streams that way is worth the delay a non-flushing compressor would add).
    """

    def __init__(self, app: ASGIApp, minimum_size: int = MIN_BODY_BYTES) -> None:
        self.app = app
        self.minimum_size = minimum_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        coding = negotiate(Headers(scope=scope).get("accept-encoding"))
        scope[CODING] = coding
        held: Message | None = None
        passing = False

        async def send_coded(message: Message) -> None:
            nonlocal held, passing
            if passing:
                await send(message)
            elif message["type"] == "http.response.start":
                if _may_compress(message):
                    held = message
                else:
                    passing = True
                    await send(message)
            else:
                assert held is not None
                passing = True
                start, held = held, None
                await _send_first_body(send, start, message, coding, self.minimum_size)

        await self.app(scope, receive, send_coded)


def _may_compress(start: Message) -> bool:
    """Whether a response, by its start, is one this middleware may compress."""
    if start["status"] in (204, 206, 304) or start["status"] < 200:
        return False
    headers = Headers(raw=start.get("headers", []))
    if "content-encoding" in headers or "content-range" in headers:
        return False
    content_type = headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        return False
    return content_type.startswith(_COMPRESSIBLE) or "+json" in content_type


async def _send_first_body(
    send: Send, start: Message, body_message: Message, coding: str, minimum_size: int
) -> None:
    body: bytes = body_message.get("body", b"")
    whole = not body_message.get("more_body", False)
    if not whole or len(body) < minimum_size:
        await send(start)
        await send(body_message)
        return
    headers = MutableHeaders(raw=list(start.get("headers", [])))
    headers.add_vary_header("Accept-Encoding")
    if coding == GZIP:
        body = zlib.compress(body, LEVEL, wbits=_GZIP_WRAPPER + zlib.MAX_WBITS)
        headers["content-encoding"] = GZIP
        headers["content-length"] = str(len(body))
        etag = headers.get("etag")
        if etag is not None and not etag.startswith("W/"):
            headers["etag"] = f"W/{etag}"  # the coded bytes differ from the identity's
    await send({**start, "headers": headers.raw})
    await send({**body_message, "body": body})
