"""A TCP proxy on loopback that a test can cut: every connection through it is ended at once,
either cleanly (a FIN, as a server that closes mid-stream) or with a reset (an RST, as a dead
network path), while the client reconnects through it as before.

``reply_delay_s`` holds each chunk the server sends, as a slow server or a long path would; the
server may be on a Unix socket (a ``unix://`` URL). ``cut_at`` cuts the first response whose
body carries those bytes, once: the body crosses up to them (a compressed body is cut where
its decoded text holds them), then the connection is reset, as a network path that dies
while an answer crosses it.

It runs its own event loop in a thread, so tests that use blocking clients can drive it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import zlib
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit

_READ = 65_536
T = TypeVar("T")


class CutProxy:
    """Forwards ``127.0.0.1:<port>`` to the server of ``upstream_url``; see :meth:`cut`.

    ``accepted`` counts the connections it took; :meth:`requests` and :meth:`bodies` tell what
    crossed the wire.
    """

    def __init__(
        self, upstream_url: str, *, reply_delay_s: float = 0.0, cut_at: bytes | None = None
    ) -> None:
        parts = urlsplit(upstream_url)
        self._unix = parts.path if parts.scheme == "unix" else ""
        if not self._unix:
            assert parts.hostname is not None, upstream_url
            assert parts.port is not None, upstream_url
        self._upstream = (parts.hostname or "", parts.port or 0)
        self._reply_delay_s = reply_delay_s  # each chunk the server sends waits this long
        self._cut_at = cut_at
        self.cuts = 0  # responses cut at ``cut_at``
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.accepted = 0
        self._sent: list[bytearray] = []  # what clients sent, per connection
        self._received: list[bytearray] = []  # what the server sent, per connection
        self.url = ""

    def __enter__(self) -> Self:
        self._thread.start()
        server = self._call(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self._server = server
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            self._call(self._server.wait_closed())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def cut(self, *, reset: bool = False) -> int:
        """End every live connection now, with an RST when ``reset``, else a FIN; how many."""
        return self._call(self._cut(reset))

    def requests(self) -> list[str]:
        """The request line of every request that came through (a client's), in order."""
        lines = []
        for raw in list(self._sent):
            for head in bytes(raw).split(b"\r\n\r\n")[:-1]:
                lines.append(head.split(b"\r\n")[0].decode("latin-1"))
        return lines

    def bodies(self) -> list[bytes]:
        """The body of every response the server sent through the proxy, as far as it got,
        without its transfer and content coding (chunked, gzip)."""
        return [body for raw in list(self._received) for body in _responses(bytes(raw))]

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _cut(self, reset: bool) -> int:
        pairs, self._pairs = list(self._pairs), set()
        for client, upstream in pairs:
            if reset:
                sock = client.get_extra_info("socket")
                # A zero linger makes the close an RST, as a path that died would look.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.transport.abort()
            else:
                client.close()
            upstream.close()  # the server sees its client leave, as it would
        return len(pairs)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            if self._unix:
                up_reader, up_writer = await asyncio.open_unix_connection(self._unix)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        sent, received = bytearray(), bytearray()
        self._sent.append(sent)
        self._received.append(received)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, sent),
                self._pump(up_reader, writer, received, self._reply_delay_s, self._cut_at),
            )
        finally:
            self._pairs.discard(pair)
            for side in pair:
                side.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: bytearray,
        delay_s: float = 0.0,
        cut_at: bytes | None = None,
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while chunk := await reader.read(_READ):
                if delay_s:
                    await asyncio.sleep(delay_s)  # a slow server or a long path
                if writer.is_closing():
                    return
                if (
                    cut_at is not None
                    and self.cuts == 0
                    and _carries(bytes(record + chunk), cut_at)
                ):
                    self.cuts += 1
                    # What crossed before the path died: the chunk up to the bytes (decoded).
                    size = next(
                        n
                        for n in range(1, len(chunk) + 1)
                        if _carries(bytes(record + chunk[:n]), cut_at)
                    )
                    half = chunk[:size]
                    record += half
                    writer.write(half)
                    await writer.drain()
                    writer.transport.abort()  # an RST
                    return
                record += chunk
                writer.write(chunk)
                await writer.drain()
        if not writer.is_closing():
            writer.close()


def _carries(data: bytes, wanted: bytes) -> bool:
    """Whether a response body in ``data`` (one connection's, as far as it got) holds
    ``wanted``."""
    return any(wanted in body for body in _responses(data))


def _responses(data: bytes) -> list[bytes]:
    """The bodies of the HTTP/1.1 responses in ``data`` (one connection's), decoded."""
    bodies: list[bytes] = []
    while True:
        head, found, data = data.partition(b"\r\n\r\n")
        if not found:
            return bodies
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if b"content-length" in headers:
            size = int(headers[b"content-length"])
            body, data = data[:size], data[size:]
        elif headers.get(b"transfer-encoding") == b"chunked":
            body, data = _dechunk(data)
        else:
            body, data = data, b""
        if headers.get(b"content-encoding") == b"gzip":
            body = zlib.decompressobj(wbits=31).decompress(body)  # as far as it got
        bodies.append(body)


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    """A chunked body, as far as it got, and what follows it."""
    body = bytearray()
    while True:
        size_line, found, rest = data.partition(b"\r\n")
        if not found:
            return bytes(body), b""
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(body), rest.partition(b"\r\n")[2]
        body += rest[:size]
        data = rest[size + 2 :]
        if len(rest) < size:
            return bytes(body), b""
