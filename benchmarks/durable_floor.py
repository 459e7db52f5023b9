"""The floors under the Durable Streams figures: the same requests, answered by a bare ASGI app.

``python -m benchmarks.durable`` runs these beside the broker and the reference server, in the
same run, read and written by the same client, so each of the broker's figures can be read
against what bounds it on this machine:

* ``memory``: the uvicorn the broker runs (uvloop, httptools, its default middleware), serving an
  app with no framework, no checks and no Redis: a ``PUT`` makes a list, a ``POST`` appends its
  body to it, a ``GET`` answers the bytes past its offset. What a Python ASGI server answers at
  most here, storing as the reference server does (in memory).
* ``redis``: the same app, each append also one ``XADD`` through redis-py (hiredis) to the same
  Redis server the broker uses, each catch-up read one ``XRANGE`` of the appends past its
  offset: one round trip per append and per read, with nothing of the broker's in between.

Offsets are list positions (``memory``) or entry ids (``redis``); every answer carries the
headers the benchmark's reader follows (``Stream-Next-Offset``, ``Stream-Up-To-Date``). Run as
``python -m benchmarks.durable_floor --port P --mode memory|redis [--redis-url URL]``.
"""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

import redis.asyncio
import uvicorn

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MODES = ("memory", "redis")
Entries = list[tuple[bytes, dict[bytes, bytes]]]  # an XRANGE reply, undecoded


class FloorApp:
    """The bare app (see the module): ``redis_url`` None keeps appends in memory only."""

    def __init__(self, redis_url: str | None) -> None:
        self._streams: dict[str, list[bytes]] = {}
        self._redis_url = redis_url
        self._redis: redis.asyncio.Redis | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "PUT":
            self._streams.setdefault(path, [])
            await _answer(send, 201)
        elif method == "POST":
            body = await _body(receive)
            offset = await self._append(path, body)
            await _answer(send, 204, [(b"stream-next-offset", offset.encode())])
        elif method == "GET":
            query = urllib.parse.parse_qs(scope["query_string"].decode())
            data, offset = await self._read(path, query.get("offset", ["-1"])[0])
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"stream-next-offset", offset.encode()),
                (b"stream-up-to-date", b"true"),
            ]
            await _answer(send, 200, headers, data)
        else:
            await _answer(send, 405)

    async def _append(self, path: str, body: bytes) -> str:
        stream = self._streams.setdefault(path, [])
        stream.append(body)
        if self._redis is None:
            return str(len(stream))
        entry_id = await self._redis.xadd(path, {"b": body})
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def _read(self, path: str, offset: str) -> tuple[bytes, str]:
        if self._redis is None:
            stream = self._streams.get(path, [])
            start = 0 if offset == "-1" else int(offset)
            return b"".join(stream[start:]), str(len(stream))
        start_id = "-" if offset == "-1" else "(" + offset
        entries = cast(Entries, await self._redis.xrange(path, start_id, "+"))
        if not entries:
            return b"", offset
        data = b"".join(fields[b"b"] for _, fields in entries)
        return data, entries[-1][0].decode()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self._redis_url is not None:
                    self._redis = redis.asyncio.Redis.from_url(self._redis_url)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._redis is not None:
                    await self._redis.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _answer(
    send: Send, status: int, headers: list[tuple[bytes, bytes]] | None = None, body: bytes = b""
) -> None:
    fields = [*(headers or []), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.durable_floor", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--redis-url", help="the Redis the redis mode writes to")
    args = parser.parse_args(argv)
    if args.mode == "redis" and not args.redis_url:
        parser.error("--mode redis needs --redis-url")
    app = FloorApp(args.redis_url if args.mode == "redis" else None)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", log_level="warning"
    )
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
