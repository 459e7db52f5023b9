"""The Durable Streams routes: ``/ds/v1/stream/{path}``, the protocol over the broker's Redis.

A path is a stream of the protocol's own (created with PUT, appended to with POST, closed,
deleted), kept by :mod:`broker.dialects.durable.store`, or, when it is a generation's stream id
(``st_...``), that generation read as a JSON stream: one message per broker event, closed once
its turn is at rest, with the broker's offsets. A generation is written by its worker only: a
write through the protocol is refused with 405.

Paths belong to the caller's tenant (another tenant's streams are never found); an attach token
reads its one generation stream and nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.responses import Response

from broker.api.routes import Caller, disconnected, runtime, until_gone
from broker.auth import Principal
from broker.dialects.durable import wire
from broker.dialects.durable.store import (
    DurableStore,
    Meta,
    Read,
    StreamKeys,
    to_bytes,
    to_text,
)
from broker.errors import BadRequest, BrokerError, Conflict, Forbidden, Gone, NotFound
from broker.frames import ORIGIN, Cursor
from broker.keys import STREAM_ID_PATTERN, scoped
from broker.reader import FROM_NOW, Location, StartPoint
from broker.sse import PING, EventStreamResponse, Sink

if TYPE_CHECKING:
    from broker.app import Runtime

PREFIX: Final = "/ds/v1/stream"
MAX_PATH: Final = 1_024
GENERATION_TYPE: Final = wire.JSON_TYPE
SSE_HEADERS: Final = [(b"cache-control", b"no-cache")]
HEARTBEAT_S: Final = 15.0  # a comment line on a quiet SSE read of a generation

# Described by the protocol's own document, not in /openapi.json: its bodies are any bytes, and
# its statuses and headers are the protocol's (see the README's "Durable Streams").
router = APIRouter(tags=["Durable Streams"], include_in_schema=False)


class MethodNotAllowed(BrokerError):
    """A write to a stream the protocol may only read (a generation's)."""

    code = "read_only"
    status = 405


class NotSupported(BrokerError):
    """A part of the protocol this server does not implement (forks)."""

    code = "not_supported"
    status = 501


class _Full(BrokerError):
    """The stream holds as many appends as a stream may."""

    code = "stream_full"
    status = 413


class _Stale(BrokerError):
    """A stale producer epoch: the writer is fenced."""

    code = "stale_epoch"
    status = 403


def _store(rt: Runtime) -> DurableStore:
    return rt.durable


def _checked_path(path: str) -> str:
    if not path or len(path) > MAX_PATH or any(ord(c) < 32 or c == "\x7f" for c in path):
        raise NotFound("no such stream")
    if path == "__ds" or path.startswith("__ds/"):
        raise NotFound("the __ds paths are reserved for the protocol's control APIs")
    return path


def _writer(request: Request, principal: Principal) -> Principal:
    if principal.stream_id is not None:
        runtime(request).metrics.auth_failures.labels("forbidden").inc()
        raise Forbidden("an attach token only reads its generation's stream", code="read_only")
    return principal


def _headers(**values: str | None) -> dict[str, str]:
    names = {
        "next_offset": wire.NEXT_OFFSET,
        "closed": wire.CLOSED,
        "up_to_date": wire.UP_TO_DATE,
        "cursor": wire.CURSOR,
        "content_type": "content-type",
        "cache": "cache-control",
        "etag": "etag",
        "epoch": "Producer-Epoch",
        "seq": "Producer-Seq",
    }
    return {names[k]: v for k, v in values.items() if v is not None}


def _true(value: bool) -> str | None:
    return "true" if value else None


def _deleted() -> Gone:
    return Gone("the stream is deleted (forks of it still live)", code="deleted")


def _generation(path: str) -> bool:
    return STREAM_ID_PATTERN.fullmatch(path) is not None


@dataclasses.dataclass(frozen=True, slots=True)
class _Fork:
    """What a fork is made of: its source's metadata, what it copies, and its signature (the
    source, the offset as given, as resolved, and the sub-offset) for an idempotent PUT."""

    source: Meta
    signature: tuple[str, str, str, str]
    inherited: list[tuple[str, str]]


async def _fork(
    store: DurableStore, principal: Principal, me: str, headers: Headers
) -> _Fork | None:
    """The fork a PUT asks for (``Stream-Forked-From``), or None; 400, 404 or 409 when it
    cannot be made.

    A fork copies its source's appends up to the divergence point, with their offsets, and,
    with a sub-offset, the first bytes (or JSON values) of the next append, as an entry right
    after that point: it is then a stream of its own, which its source's later appends, closing
    or deletion never touch.
    """
    origin = headers.get("stream-forked-from")
    offset = headers.get("stream-fork-offset")
    sub = wire.sub_offset(headers.get("stream-fork-sub-offset"))
    if origin is None:
        if offset is not None or "stream-fork-sub-offset" in headers:
            raise BadRequest("fork headers need Stream-Forked-From", code="bad_fork")
        return None
    if sub and offset is None:
        raise BadRequest("a fork's sub-offset needs Stream-Fork-Offset", code="bad_fork")
    path = _checked_path(wire.source_path(origin))
    if _generation(path):
        raise NotSupported("a generation's stream cannot be forked")
    source = scoped(principal.tenant, path)
    if source == me:
        raise BadRequest("a stream cannot fork itself", code="bad_fork")
    keys = store.keys(source)
    meta = await store.meta(keys)
    if meta is None:
        raise NotFound("the fork's source does not exist")
    if meta.deleted:
        raise Conflict("the fork's source is deleted", code="source_deleted")
    at = meta.tail if offset is None else wire.cursor_of(offset)
    if at.key > meta.tail.key:
        raise BadRequest("Stream-Fork-Offset is past the source's tail", code="bad_fork")
    inherited = await store.inherited(keys, at)
    if sub:
        following = await store.next_append(keys, at)
        if following is None:
            raise BadRequest(
                "nothing follows the fork offset to take a sub-offset of", code="bad_fork"
            )
        part = wire.prefix(to_bytes(following[1]), sub, json=wire.is_json(meta.content_type))
        ms, _, seq = at.entry_id.partition("-")
        inherited.append((f"{ms}-{int(seq) + 1}", to_text(part)))
    given = "" if offset is None else at.entry_id
    return _Fork(meta, (source, given, at.entry_id, str(sub) if sub else ""), inherited)


# --- writes ----------------------------------------------------------------------------------


@router.put(PREFIX + "/{path:path}", status_code=201, responses={200: {}, 409: {}})
async def create_stream(request: Request, path: str, principal: Caller) -> Response:
    """Create a stream (201), or find the same one (200); 409 for another configuration."""
    rt = runtime(request)
    path = _checked_path(path)
    principal = _writer(request, principal)
    if _generation(path):
        raise MethodNotAllowed("a generation's stream is written by its worker only")
    headers = request.headers
    ttl_s = wire.ttl_seconds(headers.get("stream-ttl"))
    expires_at = headers.get("stream-expires-at")
    expires_ms = wire.expiry_ms(expires_at)
    if ttl_s is not None and expires_ms is not None:
        raise BadRequest("give Stream-TTL or Stream-Expires-At, not both", code="bad_expiry")
    raw_type = (headers.get("content-type") or "").strip()
    if not wire.media_type(raw_type):
        raw_type = ""
    store = _store(rt)
    me = scoped(principal.tenant, path)
    keys = store.keys(me)
    fork = await _fork(store, principal, me, headers)
    if fork is not None:
        source = fork.source
        if raw_type and wire.media_type(raw_type) != wire.media_type(source.content_type):
            raise Conflict(
                f"a fork's content type is its source's ({source.content_type})",
                code="type_mismatch",
            )
        raw_type = raw_type or source.content_type
        if ttl_s is None and expires_ms is None:  # a fork inherits its source's lifetime
            ttl_s, expires_ms, expires_at = source.ttl_s, source.expires_ms, source.expires_at
    raw_type = raw_type or wire.DEFAULT_TYPE
    content_type = wire.media_type(raw_type)
    body = await request.body()
    if body and content_type == wire.JSON_TYPE:
        body = wire.json_messages(body, allow_empty=True)
    closed = wire.flag(headers.get("stream-closed"))
    if fork is not None:
        taken = await store.take_ref(fork.signature[0], me)
        if taken.result == "missing":
            raise NotFound("the fork's source does not exist")
        if taken.result == "gone":
            raise Conflict("the fork's source is deleted", code="source_deleted")
    try:
        reply = await store.create(
            keys,
            me,
            content_type=content_type,
            raw_content_type=raw_type,
            ttl_s=ttl_s,
            expires_ms=expires_ms,
            expires_at=expires_at.strip() if expires_at else None,
            closed=closed,
            body=body,
            fork=fork.signature if fork is not None else ("", "", "", ""),
            inherited=fork.inherited if fork is not None else None,
        )
    except BaseException:
        if fork is not None and taken.value(0) == "1":
            await store.give_back(fork.signature[0], me)
        raise
    if fork is not None and reply.result != "created" and taken.value(0) == "1":
        await store.give_back(fork.signature[0], me)  # a refused fork holds no reference
    if reply.result == "conflict":
        raise Conflict(
            f"the stream exists with another configuration ({reply.value(0)})",
            code="stream_exists",
        )
    tail = wire.offset_of(Cursor.after(reply.value(0)))
    status = 201 if reply.result == "created" else 200
    response = Response(
        status_code=status,
        headers=_headers(
            content_type=raw_type if status == 201 else None,
            next_offset=tail,
            closed=_true(reply.value(1) == "1"),
        ),
    )
    if status == 201:
        response.headers["location"] = str(request.url.replace(query=""))
    else:
        meta = await store.meta(keys)
        response.headers["content-type"] = meta.content_type if meta else raw_type
    return response


@router.post(PREFIX + "/{path:path}", status_code=204, responses={200: {}, 409: {}})
async def append_stream(request: Request, path: str, principal: Caller) -> Response:
    """Append (204; 200 for a producer's new batch), close (``Stream-Closed: true``), or both."""
    rt = runtime(request)
    path = _checked_path(path)
    principal = _writer(request, principal)
    if _generation(path):
        raise MethodNotAllowed("a generation's stream is written by its worker only")
    headers = request.headers
    producer = wire.producer(
        headers.get("producer-id"), headers.get("producer-epoch"), headers.get("producer-seq")
    )
    close = wire.flag(headers.get("stream-closed"))
    body = await request.body()
    content_type = ""
    store = _store(rt)
    keys = store.keys(scoped(principal.tenant, path))
    if not body and not close:
        raise BadRequest("an append needs a body (or Stream-Closed: true)", code="empty_append")
    if body:
        content_type = wire.media_type(headers.get("content-type"))
        if not content_type:
            raise BadRequest("an append with a body needs its Content-Type", code="no_type")
        if content_type == wire.JSON_TYPE:
            try:
                body = wire.json_messages(body, allow_empty=False)
            except BadRequest:
                await _refusal_before_json(store, keys)
                raise
    reply = await store.append(
        keys,
        content_type=content_type,
        body=body,
        close=close,
        producer=producer,
        stream_seq=headers.get("stream-seq"),
    )
    result = reply.result
    with_tail = ("ok", "duplicate", "closed", "closed_again")
    tail = wire.offset_of(Cursor.after(reply.value(0))) if result in with_tail else None
    epoch = str(producer[1]) if producer is not None else None
    if result == "ok":
        status = 200 if producer is not None and body else 204
        seq = str(producer[2]) if producer is not None else None
        closed = _true(reply.value(1) == "1")
        return Response(
            status_code=status,
            headers=_headers(next_offset=tail, closed=closed, epoch=epoch, seq=seq),
        )
    if result == "duplicate":
        closed = _true(reply.value(2) == "1")
        return Response(
            status_code=204,
            headers=_headers(next_offset=tail, closed=closed, epoch=epoch, seq=reply.value(1)),
        )
    if result == "closed_again":
        return Response(status_code=204, headers=_headers(next_offset=tail, closed="true"))
    raise _append_error(reply.result, reply.values, tail)


async def _refusal_before_json(store: DurableStore, keys: StreamKeys) -> None:
    """Raise what the stream itself refuses before a body is parsed (it is missing or closed):
    those come first, as the protocol orders them."""
    meta = await store.meta(keys)
    if meta is None:
        raise NotFound("no such stream")
    if meta.deleted:
        raise _deleted()
    if meta.closed:
        raise _append_error("closed", (meta.tail.entry_id,), wire.offset_of(meta.tail))


def _append_error(result: str, values: tuple[str, ...], tail: str | None) -> BrokerError:
    value = values[0] if values else ""
    if result == "missing":
        return NotFound("no such stream")
    if result == "gone":
        return _deleted()
    if result == "closed":
        return Conflict(
            "the stream is closed",
            code="stream_closed",
            headers=_headers(next_offset=tail, closed="true"),
        )
    if result == "content_type":
        return Conflict(f"the stream's content type is {value}", code="type_mismatch")
    if result == "stale_epoch":
        return _Stale(
            "a newer epoch of this producer writes now", headers={"Producer-Epoch": value}
        )
    if result == "epoch_seq":
        return BadRequest("a new producer epoch starts at Producer-Seq 0", code="bad_producer")
    if result == "gap":
        return Conflict(
            f"Producer-Seq {values[1]} skips ahead: {value} is next",
            code="sequence_gap",
            headers={"Producer-Expected-Seq": value, "Producer-Received-Seq": values[1]},
        )
    if result == "stream_seq":
        return Conflict(f"Stream-Seq must sort after {value!r}", code="sequence_conflict")
    if result == "full":
        return _Full(f"the stream holds BROKER_DS_MAX_APPENDS={value} appends")
    return BrokerError(f"unexpected reply {result!r}")


@router.delete(PREFIX + "/{path:path}", status_code=204)
async def delete_stream(request: Request, path: str, principal: Caller) -> Response:
    """Delete a stream and everything in it."""
    rt = runtime(request)
    path = _checked_path(path)
    principal = _writer(request, principal)
    if _generation(path):
        raise MethodNotAllowed("a generation's stream is deleted by its retention only")
    store = _store(rt)
    me = scoped(principal.tenant, path)
    result = await store.delete(store.keys(me), me)
    if result == "missing":
        raise NotFound("no such stream")
    if result == "gone":
        raise _deleted()
    return Response(status_code=204)


# --- reads -----------------------------------------------------------------------------------


@router.head(PREFIX + "/{path:path}")
async def stream_metadata(request: Request, path: str, principal: Caller) -> Response:
    """The stream's content type, tail offset, TTL or expiry and closure, without a body."""
    rt = runtime(request)
    path = _checked_path(path)
    if _generation(path):
        location = await _locate(rt, path, principal)
        cursor = await rt.streams.resolve(location, FROM_NOW)
        closed = await rt.streams.finished_before(location, cursor)
        return Response(
            headers=_headers(
                content_type=GENERATION_TYPE,
                next_offset=cursor.offset,
                closed=_true(closed),
                cache="no-store",
            )
        )
    principal = _writer(request, principal)
    store = _store(rt)
    meta = await store.meta(store.keys(scoped(principal.tenant, path)))
    if meta is None:
        raise NotFound("no such stream")
    if meta.deleted:
        raise _deleted()
    response = Response(
        headers=_headers(
            content_type=meta.content_type,
            next_offset=wire.offset_of(meta.tail),
            closed=_true(meta.closed),
            cache="no-store",
        )
    )
    if meta.ttl_s is not None:
        response.headers["Stream-TTL"] = str(meta.ttl_s)
    if meta.expires_at is not None:
        response.headers["Stream-Expires-At"] = meta.expires_at
    return response


@router.get(PREFIX + "/{path:path}")
async def read_stream(request: Request, path: str, principal: Caller) -> Response:
    """Read from ``offset``: catch-up (default), ``live=long-poll`` or ``live=sse``."""
    rt = runtime(request)
    path = _checked_path(path)
    params = request.query_params
    live = params.get("live")
    if live not in (None, "long-poll", "sse"):
        raise BadRequest("live must be long-poll or sse", code="bad_live")
    offset = wire.start_offset(params.getlist("offset"), live=live is not None)
    if _generation(path):
        return await _read_generation(rt, request, path, principal, offset, live)
    principal = _writer(request, principal)
    store = _store(rt)
    keys = store.keys(scoped(principal.tenant, path))
    after = None if offset == "now" else ORIGIN if offset == "-1" else wire.cursor_of(offset)
    read = await store.read(keys, after)
    if read is None:
        raise NotFound("no such stream")
    if read.meta.deleted:
        raise _deleted()
    content_type = read.meta.content_type
    if live == "sse":
        frames = _OwnFrames(rt, store, keys, read, params.get("cursor"))
        return _sse(rt, frames.run, content_type)
    if live == "long-poll":
        if not read.items and not read.closed:
            waiting = store.wait(keys, read.after, rt.settings.ds_long_poll_s)
            if not await _until_gone(request, waiting):
                return Response(status_code=204)  # the client hung up: no one reads this
            waited = await store.read(keys, read.after)
            if waited is None:
                raise NotFound("no such stream")
            read = waited
        return _own_page(request, read, offset, live=True)
    return _own_page(request, read, offset, live=False)


async def _until_gone(request: Request, waiting: Coroutine[Any, Any, None]) -> bool:
    """Wait for ``waiting``, unless the client hangs up first (False): the wait then ends, and
    gives its place on the feed back."""
    wait = asyncio.ensure_future(waiting)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({wait, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if wait.done():
        wait.result()
        return True
    # The wait unsubscribes however its task ends: a cancellation swallowed by the Redis
    # client only lets it run out its time.
    wait.cancel()
    return False


def _own_page(request: Request, read: Read, offset: str, *, live: bool) -> Response:
    content_type = read.meta.content_type
    payloads = [to_bytes(payload) for _, payload in read.items]
    next_offset = wire.offset_of(read.after)
    closed = _true(read.closed and read.up_to_date)
    cursor = wire.next_cursor(request.query_params.get("cursor")) if live else None
    if live and not payloads:
        return Response(
            status_code=204,
            headers=_headers(
                next_offset=next_offset,
                up_to_date="true",
                closed=closed,
                cursor=None if closed else cursor,
                cache="no-store",
            ),
        )
    body = wire.json_body(payloads) if wire.is_json(content_type) else b"".join(payloads)
    headers = _headers(
        content_type=content_type,
        next_offset=next_offset,
        up_to_date=_true(read.up_to_date),
        closed=closed,
        cursor=cursor,
    )
    if offset == "now":
        headers["cache-control"] = "no-store"
        return Response(body, headers=headers)
    etag = f'"{read.meta.incarnation}:{offset}:{next_offset}{":c" if closed else ""}"'
    headers["etag"] = etag
    headers["cache-control"] = _cacheable(request)
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"etag": etag})
    return Response(body, headers=headers)


def _cacheable(request: Request) -> str:
    """Catch-up reads may be cached (the bytes at an offset never change): by anyone on an
    open broker, by the caller's own cache only on a secured one."""
    scope = "private" if runtime(request).auth.enabled else "public"
    return f"{scope}, max-age=60, stale-while-revalidate=300"


def _sse(
    rt: Runtime, source: Callable[[Sink], AsyncIterator[bytes]], content_type: str
) -> Response:
    extra = list(SSE_HEADERS)
    if not wire.is_text(content_type):
        extra.append((b"stream-sse-data-encoding", b"base64"))
    return EventStreamResponse(
        source, send_timeout_s=rt.settings.sse_send_timeout_s, extra_headers=extra
    )


class _OwnFrames:
    """The SSE events of one read of a stream of the protocol's own: a ``data`` event per
    append, each followed by its ``control``; ``upToDate`` once at the tail; the last control
    of a closed stream says so, and ends the response."""

    def __init__(
        self, rt: Runtime, store: DurableStore, keys: StreamKeys, first: Read, cursor: str | None
    ) -> None:
        self.rt, self.store, self.keys, self.first = rt, store, keys, first
        self.cursor = cursor

    async def run(self, sink: Sink) -> AsyncIterator[bytes]:
        settings = self.rt.settings
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + settings.ds_sse_max_s
        read: Read | None = self.first
        content_type = self.first.meta.content_type
        opened = False
        cursor = wire.next_cursor(self.cursor)
        while read is not None and not sink.over:
            cursor = wire.still_cursor(cursor)
            out = []
            for index, (place, payload) in enumerate(read.items):
                at_tail = index == len(read.items) - 1 and read.up_to_date
                out.append(wire.sse_data(to_bytes(payload), content_type))
                out.append(
                    wire.sse_control(
                        wire.offset_of(place),
                        cursor=cursor,
                        up_to_date=at_tail,
                        closed=at_tail and read.closed,
                    )
                )
            if not read.items and (read.closed or not opened or read.up_to_date):
                out.append(
                    wire.sse_control(
                        wire.offset_of(read.after),
                        cursor=cursor,
                        up_to_date=True,
                        closed=read.closed,
                    )
                )
            opened = True
            yield b"".join(out)
            if read.closed and read.up_to_date:
                return
            after = read.after
            if read.up_to_date:
                left = ends_at - loop.time()
                if left <= 0:
                    return  # the client resumes from its last offset (the protocol's ~60 s)
                await self.store.wait(self.keys, after, min(settings.ds_long_poll_s, left))
            read = await self.store.read(self.keys, after)


# --- generation streams, read-only -------------------------------------------------------------


async def _locate(rt: Runtime, stream_id: str, principal: Principal) -> Location:
    if principal.stream_id is not None and principal.stream_id != stream_id:
        rt.metrics.auth_failures.labels("forbidden").inc()
        raise Forbidden("the attach token is for another stream", code="wrong_stream")
    return await rt.streams.locate(stream_id, principal.tenant)


async def _read_generation(
    rt: Runtime,
    request: Request,
    stream_id: str,
    principal: Principal,
    offset: str,
    live: str | None,
) -> Response:
    location = await _locate(rt, stream_id, principal)
    start = StartPoint.parse(offset)
    if live == "sse":
        cursor = await rt.streams.resolve(location, start)
        frames = _GenerationFrames(rt, location, cursor, request.query_params.get("cursor"))
        return _sse(rt, frames.run, GENERATION_TYPE)
    page = await rt.streams.page(location, start)
    if live == "long-poll" and not page["events"] and not page["closed"]:
        after = await rt.streams.resolve(location, start)
        waiting = rt.streams.page(location, StartPoint("offset", after), rt.settings.ds_long_poll_s)
        page = await until_gone(request, waiting)
        if not page:
            return Response(status_code=204)  # the client hung up: no one reads this
    page["closed"] = await _settled(rt, location, page)
    next_offset = page["next_offset"] if page["next_offset"] != "-1" else ORIGIN.offset
    closed = _true(page["closed"])
    if live == "long-poll" and not page["events"]:
        return Response(
            status_code=204,
            headers=_headers(
                next_offset=next_offset,
                up_to_date="true",
                closed=closed,
                cursor=None if closed else wire.next_cursor(request.query_params.get("cursor")),
                cache="no-store",
            ),
        )
    body = wire.json_body([_message(event) for event in page["events"]])
    headers = _headers(
        content_type=GENERATION_TYPE,
        next_offset=next_offset,
        up_to_date=_true(page["up_to_date"]),
        closed=closed,
        cursor=wire.next_cursor(request.query_params.get("cursor")) if live else None,
    )
    if offset == "now":
        headers["cache-control"] = "no-store"
        return Response(body, headers=headers)
    etag = f'"{stream_id}:{offset}:{next_offset}{":c" if closed else ""}"'
    headers["etag"] = etag
    headers["cache-control"] = _cacheable(request)
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"etag": etag})
    return Response(body, headers=headers)


async def _settled(rt: Runtime, location: Location, page: dict[str, Any]) -> bool:
    """Whether a generation's page ends its stream. A page that ends with an ``end`` read as the
    turn came to rest says "open" (its status was read first): look once more, so that the
    client learns of the close with the ``end`` itself."""
    if page["closed"]:
        return True
    events = page["events"]
    if not events or events[-1]["event"] != "end" or not page["up_to_date"]:
        return False
    return await rt.streams.finished_before(location, Cursor.after_offset(events[-1]["id"]))


def _message(event: dict[str, Any]) -> bytes:
    """A broker event as one message of a generation's JSON stream: its offset, type and data."""
    return orjson.dumps({"id": event["id"], "event": event["event"], "data": event["data"]})


class _GenerationFrames:
    """A generation's events as Durable Streams SSE: a ``data`` event (a one-message array)
    and its ``control`` per broker event; closed once the turn is at rest."""

    def __init__(self, rt: Runtime, location: Location, after: Cursor, cursor: str | None) -> None:
        self.rt, self.location, self.after, self.cursor = rt, location, after, cursor

    async def run(self, sink: Sink) -> AsyncIterator[bytes]:
        rt = self.rt
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + rt.settings.ds_sse_max_s
        at_origin = self.after.at_origin
        start = StartPoint("start") if at_origin else StartPoint("offset", self.after)
        wait = 0.0
        opened = False
        cursor = wire.next_cursor(self.cursor)
        while not sink.over:
            page = await rt.streams.page(self.location, start, wait)
            page["closed"] = await _settled(rt, self.location, page)
            cursor = wire.still_cursor(cursor)
            events = page["events"]
            out = []
            for index, event in enumerate(events):
                at_tail = index == len(events) - 1 and page["up_to_date"]
                out.append(wire.sse_event("data", wire.json_body([_message(event)]).decode()))
                out.append(
                    wire.sse_control(
                        event["id"],
                        cursor=cursor,
                        up_to_date=at_tail,
                        closed=at_tail and page["closed"],
                    )
                )
            next_offset = page["next_offset"] if page["next_offset"] != "-1" else ORIGIN.offset
            if not events and (page["closed"] or not opened or page["up_to_date"]):
                out.append(
                    wire.sse_control(
                        next_offset, cursor=cursor, up_to_date=True, closed=page["closed"]
                    )
                )
            opened = True
            yield b"".join(out) if out else PING
            if page["closed"]:
                return
            if events:
                start = StartPoint.parse(events[-1]["id"])
            left = ends_at - loop.time()
            if left <= 0:
                return
            wait = min(rt.settings.ds_long_poll_s, left) if page["up_to_date"] else 0.0
