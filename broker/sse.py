"""Server-sent events: the frames and an ASGI response that streams them.

The response reads its source in its own task and ends at whichever comes first: the source's
end, the client's disconnect, or a write that waited past the send timeout (watched for every
response of the event loop by one task, :class:`SendWatch`). The source is always closed, so a
reader's subscription is released the moment its client goes away. A server that offers a
:class:`Wire` (the fast path's HTTP protocol does) says when the client left and takes a
write without a coroutine; with any other, a second task waits for ``http.disconnect``.
Heartbeats are SSE comments, so ``EventSource`` ignores them while proxies and clients see a
live connection.

While the source waits, a live feed may write a chunk for it (:meth:`EventStreamResponse.
write_now`): one write, in order with the source's own, without waking the reader's task. A
client that asked for batching (``batch_s``) has those chunks held for up to that long and sent
in one write: fewer bytes once compressed (each write pays a flush) and fewer radio wake-ups on
a phone, for that much delay. Whatever the source yields goes at once, with anything held
before it.

A client that reads slowly holds up its own response only, at a bounded cost: a chunk is written
at most ``WRITE_SLICE`` bytes at a time, and the source is asked for the next chunk only once the
server has taken the last one (its write buffer is below its high-water mark). A reader whose
client stops reading thus stops reading Redis too, holding one chunk, until the send timeout
ends it; it never reads ahead of its client. With a :class:`Wire`, the send timeout aborts the
connection (a graceful close would wait for that client too, socket and descriptor held).

The response never relies on a cancellation reaching its source: redis-py can swallow a
``CancelledError`` that lands while a reply is awaited, and the source would then go on for a
client that is gone. So the response is also a :class:`Sink` whose ``over`` the source checks
before it waits, and no chunk is sent once the response is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any, Final, Protocol

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.compression import CODING, GZIP, GzipStream, stream_headers

log = logging.getLogger("broker.sse")

# A comment line with no blank line after it: the next frame's block takes it in, and comments
# are ignored. A blank line would end a block of its own, which loose parsers (httpx-sse after
# any id, fetch-event-source always) hand to their callers as an event with empty data.
PING = b": ping\n"
# The event that carries a read's resume point (see opening_frame).
RESUME_POINT: Final = "resume_point"
RAW_SEND: Final = "broker.raw_send"  # the scope key of the server's own send (see RawSend)
WIRE: Final = "broker.wire"  # the scope key of the connection's Wire, when the server has one
# The most one write hands the server: what it buffers for a client that does not read is then
# at most its high-water mark plus this, whatever the size of a chunk.
WRITE_SLICE: Final = 16_384


class Sink(Protocol):
    """Where a source's chunks go: see :class:`EventStreamResponse`."""

    def write_now(self, chunk: bytes) -> bool:
        """Write ``chunk`` at once, or return False (the source yields it instead)."""
        ...

    @property
    def over(self) -> bool:
        """Whether the response has ended (its client left): the source must stop."""
        ...


class Wire(Protocol):
    """What an event stream may ask of its connection past ASGI, when the server offers it
    (``scope[WIRE]``, see ``broker.fastpath``): a body write that never waits, and a
    call when the client leaves. Without it, the response does both through ASGI: a task per
    response that waits for ``http.disconnect``, and a coroutine per write.
    """

    def write(self, body: bytes) -> bool:
        """Write ``body`` as the response's next body chunk now, or return False when that
        cannot be done without waiting (the client's buffer is full, or the connection or the
        response is over): the caller then sends it through ASGI, which waits."""
        ...

    def when_lost(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once the connection is lost (at once if it is already); None
        forgets the one given before."""
        ...

    def abort(self) -> None:
        """Drop the connection now, unsent bytes and all: a graceful close waits until the
        client takes what is unsent, and one that stopped reading never does."""
        ...

    async def start(self, send: Send, message: Message) -> None:
        """Send the response's start (``message``) through ``send``, the server's own. Its
        head is held with the chunks written after it (:meth:`write`) until the event loop's
        next turn, or until they fill the connection's unsent bound: a response's first write
        to the connection carries its head, its first frames and the replay that was at hand.
        (Anything sent through ASGI must call :meth:`flush` first.)"""
        ...

    def flush(self) -> None:
        """Write what is held now (see :meth:`start`)."""
        ...


HEADERS = [
    # Without parameters (the stream is UTF-8 by definition): clients that compare the type as a
    # whole string, as fetch-event-source's documented onopen does, accept it.
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
    (b"connection", b"keep-alive"),
]


def opening_frame(retry_ms: int, resume_offset: str | None) -> bytes:
    """``retry:``, and with ``resume_offset`` the ``resume_point`` event that carries it.

    No frame is a block without data: strict parsers skip one, but loose ones hand it to their
    callers as an event with empty data. So without a resume point, ``retry:`` is a line that
    the first frame's block takes in (it applies when it is read). The resume point is the id
    of a ``resume_point`` event, whose data repeats it: it moves a client's Last-Event-ID to
    where this read starts, so a client that asked for ``now`` and drops before the first event
    resumes from that point instead of asking for ``now`` again and missing what came between.
    """
    if resume_offset is None:
        return f"retry: {retry_ms}\n".encode()
    data = f'{{"offset":"{resume_offset}"}}'
    return (
        f"retry: {retry_ms}\nid: {resume_offset}\nevent: {RESUME_POINT}\ndata: {data}\n\n"
    ).encode()


class RawSend:
    """Outermost middleware: keeps the server's own ``send`` in the scope (``RAW_SEND``).

    An event stream's body chunks go straight to it: the middleware between only looks at a
    response's start (its headers), and on a live stream with a thousand readers each layer
    is paid a thousand times per batch. This holds only while every middleware passes the start
    on before the body (none holds an event stream's start back): one that held the start back
    would let body chunks reach the server first. An event stream compresses its own body
    (``broker.compression``): the middleware that chooses the coding passes its start at once.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class EventStreamResponse(Response):
    """Streams chunks as ``text/event-stream`` until the source ends or the client leaves.

    ``source`` is called with the response as its :class:`Sink`: a live feed may call
    :meth:`write_now` to write a chunk while the source is waiting for one, and the source ends
    once ``over`` is true. It returns the chunks to write. ``preamble``, known before the
    response starts (a read's opening frame), is its first chunk: with a :class:`Wire`, it
    goes in the same write as the response's head (one write, not two, for each of a crowd's
    attaches).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        source: Callable[[Sink], AsyncIterator[bytes]],
        *,
        send_timeout_s: float,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
        batch_s: float = 0.0,
        preamble: bytes = b"",
    ) -> None:
        super().__init__(status_code=200)
        self._source = source(self)
        self._preamble = preamble
        self._send_timeout_s = send_timeout_s
        extra = extra_headers or []
        named = {name for name, _ in extra}  # an extra header replaces a default of its name
        self.raw_headers = [h for h in HEADERS if h[0] not in named] + extra
        self._sending_since: float | None = None
        self._send_body: Send | None = None  # set once the response has started
        self._finishing: asyncio.Task[None] | None = None  # a direct write the client holds up
        self._gzip: GzipStream | None = None  # set at the start when the client asked for gzip
        self._over = False
        self._batch_s = batch_s
        self._held: list[bytes] = []  # live chunks taken for the next batched write
        self._flush_timer: asyncio.TimerHandle | None = None
        self._watch: SendWatch | None = None  # the loop's, once the response started
        self._wire: Wire | None = None  # the connection's, when the server offers one
        self._task: asyncio.Task[Any] | None = None  # the task that runs the response
        self._pumping = False  # the source is being read and written (ended by _end)
        self._cancelled = False  # _end cancelled the response's task

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The source is read in this task, and in this frame: one task per response, and no
        # coroutine of its own for each step of the read (a quiet response stays suspended
        # here for as long as it lasts: each frame is memory, for each of thousands).
        # The client's leaving, or a write stuck past the send timeout, ends it (_end): over at
        # once, then a cancellation that wakes a source parked on its feed. A source that lost
        # the cancellation in a Redis call sees over before it waits again.
        await self._start(scope, send)
        task, wire = self._task, self._wire
        watch: asyncio.Task[None] | None = None
        if wire is not None:
            wire.when_lost(self._end)
        else:
            watch = asyncio.create_task(_wait_for_disconnect(receive))
            watch.add_done_callback(self._ended_by)
        self._pumping = True
        interrupted = False
        try:
            try:
                async for chunk in self._source:
                    if self._over:
                        break  # the client is gone, though the cancellation may not have said so
                    await self._send(chunk)
                else:
                    await self._send(b"", more=False)
            except (asyncio.CancelledError, OSError):
                raise
            except Exception as exc:
                # Redis went away mid-read (or a bug): end the response; the client resumes,
                # and meets a 503 until Redis is back. Never leave the socket hanging.
                log.warning("ending a stream early: %s: %s", type(exc).__name__, exc)
                await self._send(b"", more=False)
        except asyncio.CancelledError:
            interrupted = True
        except Exception:  # (the connection broke, or was logged above) the response ends
            pass
        finally:
            await self._stop(watch)
        if self._cancelled and task is not None:
            task.uncancel()  # the cancellation was this response's own
        if interrupted and (not self._cancelled or (task is not None and task.cancelling())):
            raise asyncio.CancelledError  # someone else's: the server's, at shutdown

    async def _start(self, scope: Scope, send: Send) -> None:
        """Send the response's start, and take what its writes need."""
        coding = scope.get(CODING)  # chosen by broker.compression's middleware, when it is on
        if coding == GZIP:
            self._gzip = GzipStream()  # one per response: its history is this stream's frames
        headers = self.raw_headers + stream_headers(coding)
        start: Message = {"type": "http.response.start", "status": 200, "headers": headers}
        self._send_body = send_body = scope.get(RAW_SEND, send)
        self._wire = wire = scope.get(WIRE)
        self._task = asyncio.current_task()
        preamble, self._preamble = self._preamble, b""
        if preamble and self._gzip is not None:
            preamble = self._gzip.write(preamble)
        if wire is None:
            await send(start)
        else:
            await wire.start(send, start)  # the head goes with what follows it at once
        if preamble and (wire is None or not wire.write(preamble)):
            # Small, and the first: no slicing, nothing before it.
            await send_body({"type": "http.response.body", "body": preamble, "more_body": True})
        self._watch = sends = SendWatch.of(asyncio.get_running_loop())
        sends.add(self)

    async def _stop(self, watch: asyncio.Task[None] | None) -> None:
        """Over: let go of the connection, the writes under way and the source."""
        self._pumping = False
        self._over = True
        if self._wire is not None:
            self._wire.when_lost(None)
        if self._watch is not None:
            self._watch.discard(self)
        self._drop_held()
        tasks = [t for t in (watch, self._finishing) if t is not None]
        for other in tasks:
            other.cancel()
        for other in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await other  # (what failed was logged where it failed)
        await _close(self._source)

    def _end(self) -> None:
        """End the response: its client left, or a write waited past the send timeout."""
        self._over = True
        if self._pumping and not self._cancelled and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    def _ended_by(self, _watch: asyncio.Task[None]) -> None:
        self._end()

    @property
    def over(self) -> bool:
        return self._over

    def write_now(self, chunk: bytes) -> bool:
        """Write ``chunk`` now, without waiting; False when that cannot be done (another write
        is under way, or the response is over): the caller hands the chunk to the source instead.

        The server's send returns at once unless the client is slow to read (the connection's
        buffer is full); such a write is finished by a task, and later chunks wait for it. With
        batching, the chunk is held instead, and written with the others of its batch once the
        first of them has waited ``batch_s``.
        """
        if self._batch_s <= 0:
            return self._write_direct(chunk)
        if self._send_body is None or self._busy or self._over:
            return False
        if chunk is PING:  # a heartbeat is never held: it goes now, after what was
            return self._write_direct(self._take_held() + chunk)
        self._held.append(chunk)
        if self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self._batch_s, self._flush_held)
        return True

    @property
    def _busy(self) -> bool:
        return self._sending_since is not None or self._finishing is not None

    def _flush_held(self) -> None:
        """Write the held batch (the timer's callback)."""
        self._flush_timer = None
        if not self._held or self._over:
            return
        if self._busy:  # (a write under way takes the batch in; none should be, but wait)
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self._batch_s, self._flush_held)
            return
        data = self._take_held()
        # Taken already: if the connection broke, the client resumes from its last id.
        self._write_direct(data)

    def _take_held(self) -> bytes:
        """The held chunks, joined, and none held any more."""
        data = b"".join(self._held)
        self._drop_held()
        return data

    def _drop_held(self) -> None:
        self._held.clear()
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _write_direct(self, chunk: bytes) -> bool:
        send = self._send_body
        if send is None or self._busy or self._over:
            return False
        # Coded only now that it will be sent: the compressor's output must follow the writes.
        body = chunk if self._gzip is None else self._gzip.write(chunk)
        wire = self._wire
        if wire is not None and wire.write(body):
            return True  # no ASGI message, no coroutine: the common case, a client that reads
        message = {"type": "http.response.body", "body": body, "more_body": True}
        if wire is not None:
            wire.flush()  # what the wire holds goes first
        steps = send(message).__await__()
        try:
            waiting_on = steps.send(None)
        except StopIteration:
            return True
        except Exception:  # the connection broke: the source's next write ends the response
            return False
        loop = asyncio.get_running_loop()
        self._mark_sending(loop.time())
        self._finishing = loop.create_task(self._finish(steps, waiting_on))
        return True

    async def _finish(self, steps: Generator[Any, None, None], waiting_on: object) -> None:
        """Drive a send that :meth:`write_now` started by hand, and that had to wait, to its end.

        It waits on a future (or yielded bare, to let others run): wait for it to settle,
        then resume the send, as a task would.
        """
        try:
            while True:
                if isinstance(waiting_on, asyncio.Future):
                    await asyncio.wait([waiting_on])
                else:
                    await asyncio.sleep(0)
                waiting_on = steps.send(None)
        except StopIteration:
            self._mark_sending(None)
            self._finishing = None
        except Exception as exc:  # the next chunk's send re-raises it and ends the response
            log.info("a write the client held up failed: %s: %s", type(exc).__name__, exc)
            raise
        finally:
            steps.close()

    async def _send(self, chunk: bytes, *, more: bool = True) -> None:
        """Write ``chunk``, a slice at a time, and return once the server could take more."""
        finishing, self._finishing = self._finishing, None
        if finishing is not None:
            await finishing  # a direct write goes first: it was accepted before this chunk
        send = self._send_body
        assert send is not None
        if self._held:  # a batch held back goes first: it was taken before this chunk
            chunk = self._take_held() + chunk
        if self._gzip is not None:  # each chunk is flushed whole: nothing waits in the compressor
            chunk = self._gzip.write(chunk) if more else self._gzip.finish(chunk)
        # A write that blocks (the client stopped reading) is ended by _watch_sends: one
        # timer per response instead of one per write. Each slice restarts the clock: a client
        # that takes bytes, however slowly, is not the one the timeout is for.
        clock = asyncio.get_running_loop().time
        wire = self._wire
        if more and wire is not None and len(chunk) <= WRITE_SLICE and wire.write(chunk):
            # Taken at once, and nothing awaited, so no direct write can come between. The
            # source reads on at once if the server can take more (a write of nothing says so).
            if not wire.write(b""):
                wire.flush()
                self._mark_sending(clock())
                await send({"type": "http.response.body", "body": b"", "more_body": True})
                self._mark_sending(None)
            return
        if wire is not None:
            wire.flush()  # what the wire holds goes before what ASGI sends
        start = 0
        while len(chunk) - start > WRITE_SLICE:
            # The server waits for its buffer to drain before a write, not after one.
            self._mark_sending(clock())
            piece = chunk[start : start + WRITE_SLICE]
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            start += WRITE_SLICE
        self._mark_sending(clock())
        rest = chunk[start:] if start else chunk
        await send({"type": "http.response.body", "body": rest, "more_body": more})
        if more:
            # An empty body waits for the drain, writing nothing: the source reads its next
            # chunk only once this one is on its way, never ahead of a client that stopped.
            self._mark_sending(clock())
            await send({"type": "http.response.body", "body": b"", "more_body": True})
        self._mark_sending(None)

    def _mark_sending(self, since: float | None) -> None:
        """A write began waiting at ``since`` (None: none waits): the loop's SendWatch looks at
        the responses with a write under way only."""
        self._sending_since = since
        watch = self._watch
        if watch is not None:
            if since is None:
                watch.sending.discard(self)
            else:
                watch.sending.add(self)

    def _check_send(self, now: float) -> None:
        """End the response if one write has waited ``send_timeout_s`` for the client (called by
        the loop's :class:`SendWatch`)."""
        since = self._sending_since
        if since is None or self._over:
            return
        if now - since >= self._send_timeout_s:
            log.info("closing a stream whose client did not read for %s s", self._send_timeout_s)
            if self._wire is not None:
                # Not a close: it would wait for the unsent bytes, which this client never
                # takes, and hold its socket and descriptor for as long.
                self._wire.abort()
            self._end()


class SendWatch:
    """One task per event loop that ends the responses whose write waited too long for their
    client: a timer of its own per response would be a task, and a wake-up per send timeout,
    for each of thousands of quiet connections.

    It looks at every response with a write under way (``sending``; a quiet connection has
    none) every quarter of the shortest send timeout (at most every second), so a stuck write
    ends between one and 1.25 timeouts after it began.
    """

    def __init__(self) -> None:
        self.responses: set[EventStreamResponse] = set()
        self.sending: set[EventStreamResponse] = set()
        self.period = 1.0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> SendWatch:
        watch = _SEND_WATCHES.get(loop)
        if watch is None:
            watch = _SEND_WATCHES[loop] = cls()
        return watch

    def add(self, response: EventStreamResponse) -> None:
        self.responses.add(response)
        self.period = min(self.period, max(0.01, response._send_timeout_s / 4))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, response: EventStreamResponse) -> None:
        self.responses.discard(response)
        self.sending.discard(response)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.responses:
                await asyncio.sleep(self.period)
                now = loop.time()
                for response in list(self.sending):
                    response._check_send(now)
        finally:
            self._task = None  # the next response starts it again


_SEND_WATCHES: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SendWatch]] = (
    weakref.WeakKeyDictionary()
)


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
