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
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.responses import Response

from broker.auth import Principal
from broker.dialects.durable import wire
from broker.dialects.durable.store import (
    DurableStore,
    Meta,
    Read,
    StreamKeys,
    to_bytes,
)
from broker.errors import (
    BadRequest,
    BrokerError,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    TooManyRequests,
)
from broker.frames import ORIGIN, Cursor
from broker.http import Caller, Hangup, Services, services, until_gone
from broker.reader import FROM_NOW, Location, StartPoint
from broker.sse import PING, EventStreamResponse, Sink
from broker.viewer import REPLACED, FrameSource, admit, check_stream
from broker.vocabulary import STREAM_ID_PATTERN

PREFIX: Final = "/ds/v1/stream"
MAX_PATH: Final = 1_024
GENERATION_TYPE: Final = wire.JSON_TYPE
SSE_HEADERS: Final = [(b"cache-control", b"no-cache")]

# Described by the protocol's own document, not in /openapi.json: its bodies are any bytes, and
# its statuses and headers are the protocol's (see the README's "Durable Streams").
router = APIRouter(tags=["Durable Streams"], include_in_schema=False)


class MethodNotAllowed(BrokerError):
    """A write to a stream the protocol may only read (a generation's)."""

    code = "read_only"
    status = 405


class NotSupported(BrokerError):
    """A part of the protocol this server does not do: forking a generation's stream."""

    code = "not_supported"
    status = 501


class AppendsFull(BrokerError):
    """The stream holds as many appends as a stream may."""

    code = "stream_full"
    status = 413


class StaleEpoch(BrokerError):
    """A stale producer epoch: the writer is fenced."""

    code = "stale_epoch"
    status = 403


def _store(rt: Services) -> DurableStore:
    return rt.durable


def _checked_path(path: str) -> str:
    if not path or len(path) > MAX_PATH or any(ord(c) < 32 or c == "\x7f" for c in path):
        raise NotFound("no such stream")
    if path == "__ds" or path.startswith("__ds/"):
        raise NotFound("the __ds paths are reserved for the protocol's control APIs")
    return path


def _writer(request: Request, principal: Principal) -> Principal:
    if principal.stream_id is not None:
        services(request).metrics.auth_failures.labels("forbidden").inc()
        raise Forbidden("an attach token only reads its generation's stream", code="read_only")
    return principal


def _writable(
    request: Request, path: str, principal: Principal, refusal: str
) -> tuple[DurableStore, StreamKeys]:
    """The store and the keys of the stream a write (create, append, delete) goes to: 404 for
    a path no stream can have, 403 for an attach token, 405 (``refusal``) for a generation's
    stream."""
    path = _checked_path(path)
    principal = _writer(request, principal)
    if _generation(path):
        raise MethodNotAllowed(refusal)
    store = _store(services(request))
    return store, store.keys(principal.tenant, path)


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
    """What a fork is made of: its source's metadata, its signature (the source, the offset as
    given, as resolved, and the sub-offset) for an idempotent PUT, and the part of the source's
    next append that a sub-offset takes."""

    source: Meta
    signature: tuple[str, str, str, str]
    part: bytes


async def _fork(store: DurableStore, me: StreamKeys, headers: Headers) -> _Fork | None:
    """The fork a PUT asks for (``Stream-Forked-From``), or None; 400, 404 or 409 when it
    cannot be made.

    A fork has its source's appends up to the divergence point, with their offsets, and, with a
    sub-offset, the first bytes (or JSON values) of the next append, as an entry right after
    that point: it is then a stream of its own, which its source's later appends, closing or
    deletion never touch. The appends are copied by ``ds_create`` inside Redis; only the one
    append a sub-offset cuts is read here.
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
    if path == me.path:
        raise BadRequest("a stream cannot fork itself", code="bad_fork")
    keys = store.keys(me.tenant, path)
    meta = await store.meta(keys)
    if meta is None:
        raise NotFound("the fork's source does not exist")
    if meta.deleted:
        raise _source_deleted()
    at = meta.tail if offset is None else wire.cursor_of(offset)
    if at.key > meta.tail.key:
        raise _past_tail()
    part = b""
    if sub:
        following = await store.next_append(keys, at)
        if following is None:
            raise BadRequest(
                "nothing follows the fork offset to take a sub-offset of", code="bad_fork"
            )
        part = wire.prefix(to_bytes(following[1]), sub, json=wire.is_json(meta.content_type))
    given = "" if offset is None else at.entry_id
    return _Fork(meta, (path, given, at.entry_id, str(sub) if sub else ""), part)


def _source_deleted() -> Conflict:
    return Conflict("the fork's source is deleted", code="source_deleted")


def _past_tail() -> BadRequest:
    return BadRequest("Stream-Fork-Offset is past the source's tail", code="bad_fork")


# --- writes ----------------------------------------------------------------------------------


@router.put(PREFIX + "/{path:path}", status_code=201, responses={200: {}, 409: {}})
async def create_stream(request: Request, path: str, principal: Caller) -> Response:
    """Create a stream (201), or find the same one (200); 409 for another configuration."""
    store, keys = _writable(
        request, path, principal, "a generation's stream is written by its worker only"
    )
    location = _location(request, keys.path)
    headers = request.headers
    ttl_s = wire.ttl_seconds(headers.get("stream-ttl"))
    expires_at = headers.get("stream-expires-at")
    expires_ms = wire.expiry_ms(expires_at)
    if ttl_s is not None and expires_ms is not None:
        raise BadRequest("give Stream-TTL or Stream-Expires-At, not both", code="bad_expiry")
    raw_type = (headers.get("content-type") or "").strip()
    if not wire.media_type(raw_type):
        raw_type = ""
    fork = await _fork(store, keys, headers)
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
    reply = await store.create(
        keys,
        content_type=content_type,
        raw_content_type=raw_type,
        ttl_s=ttl_s,
        expires_ms=expires_ms,
        expires_at=expires_at.strip() if expires_at else None,
        closed=closed,
        body=body,
        fork=fork.signature if fork is not None else ("", "", "", ""),
        part=fork.part if fork is not None else b"",
    )
    if reply.result == "conflict":
        raise Conflict(
            f"the stream exists with another configuration ({reply.value(0)})",
            code="stream_exists",
        )
    if reply.result == "source_missing":
        raise NotFound("the fork's source does not exist")
    if reply.result == "source_deleted":
        raise _source_deleted()
    if reply.result == "past_tail":
        raise _past_tail()
    if reply.result not in ("created", "exists"):
        raise _refusal(request, reply.result, reply.values)
    tail = wire.offset_of(Cursor.after(reply.value(0)))
    status = 201 if reply.result == "created" else 200
    response = Response(
        status_code=status,
        headers=_headers(
            # The type as the stream keeps it: for a stream found again, as it was created.
            content_type=reply.value(2) or raw_type,
            next_offset=tail,
            closed=_true(reply.value(1) == "1"),
        ),
    )
    if status == 201:
        response.headers["location"] = location
    return response


def _location(request: Request, path: str) -> str:
    """The URL of the stream at ``path``, its path percent-encoded (RFC 3986): a header is
    Latin-1 at most, and a path may hold any character, ``?``, ``#`` and ``%`` included."""
    url = request.url
    # The request's own path ends with the stream's (decoded): what comes before is the mount.
    mount = url.path[: -len(path)] if url.path.endswith(path) else f"{PREFIX}/"
    return str(url.replace(path=wire.quote_path(mount) + wire.quote_path(path), query=""))


class QuotaExceeded(BrokerError):
    """A tenant holds as many Durable Streams streams, or bytes, as its quota allows."""

    code = "quota_exceeded"
    status = 429


def _refusal(request: Request, result: str, values: tuple[str, ...]) -> BrokerError:
    """What a tenant's quota refused (``rate`` or ``quota``), counted; any other reply is the
    broker's own error."""
    settings = services(request).settings
    metrics = services(request).metrics
    if result == "rate":
        metrics.ds_refusals.labels("rate").inc()
        retry_after_s = math.ceil(int(values[0]) / 1000)
        return TooManyRequests(
            "this tenant appends to its Durable Streams faster than "
            f"BROKER_DS_TENANT_APPENDS_PER_S={settings.ds_tenant_appends_per_s:g} (burst "
            f"{settings.ds_tenant_append_burst}); retry in {max(1, retry_after_s)} s",
            retry_after_s=retry_after_s,
            code="rate_limited",
        )
    if result == "quota" and values and values[0] in ("streams", "bytes"):
        which = values[0]
        metrics.ds_refusals.labels(which).inc()
        if which == "streams":
            return QuotaExceeded(
                f"this tenant holds BROKER_DS_TENANT_MAX_STREAMS={values[1]} Durable Streams "
                "streams: delete one (or let one expire) first",
                code="stream_quota",
            )
        return QuotaExceeded(
            f"this would take this tenant's Durable Streams past "
            f"BROKER_DS_TENANT_MAX_BYTES={values[1]} bytes: delete a stream (or let one "
            "expire) first",
            code="byte_quota",
        )
    return BrokerError(f"unexpected reply {result!r}")


@router.post(PREFIX + "/{path:path}", status_code=204, responses={200: {}, 409: {}})
async def append_stream(request: Request, path: str, principal: Caller) -> Response:
    """Append (204; 200 for a producer's new batch), close (``Stream-Closed: true``), or both."""
    store, keys = _writable(
        request, path, principal, "a generation's stream is written by its worker only"
    )
    headers = request.headers
    producer = wire.producer(
        headers.get("producer-id"), headers.get("producer-epoch"), headers.get("producer-seq")
    )
    close = wire.flag(headers.get("stream-closed"))
    body = await request.body()
    content_type = ""
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
    if result in ("rate", "quota"):
        raise _refusal(request, result, reply.values)
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
        return StaleEpoch(
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
        return AppendsFull(f"the stream holds BROKER_DS_MAX_APPENDS={value} appends")
    return BrokerError(f"unexpected reply {result!r}")


@router.delete(PREFIX + "/{path:path}", status_code=204)
async def delete_stream(request: Request, path: str, principal: Caller) -> Response:
    """Delete a stream and everything in it."""
    store, keys = _writable(
        request, path, principal, "a generation's stream is deleted by its retention only"
    )
    result = await store.delete(keys)
    if result == "missing":
        raise NotFound("no such stream")
    if result == "gone":
        raise _deleted()
    return Response(status_code=204)


# --- reads -----------------------------------------------------------------------------------


@router.head(PREFIX + "/{path:path}")
async def stream_metadata(request: Request, path: str, principal: Caller) -> Response:
    """The stream's content type, tail offset, TTL or expiry and closure, without a body."""
    rt = services(request)
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
    meta = await store.meta(store.keys(principal.tenant, path))
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
    rt = services(request)
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
    keys = store.keys(principal.tenant, path)
    after = None if offset == "now" else ORIGIN if offset == "-1" else wire.cursor_of(offset)
    read = await store.read(keys, after)
    if read is None:
        raise NotFound("no such stream")
    if read.meta.deleted:
        raise _deleted()
    content_type = read.meta.content_type
    if live == "sse":
        own = _OwnLooks(store, keys, read)
        return _sse(rt, own.look, params.get("cursor"), content_type)
    if live == "long-poll":
        if not read.items and not read.closed:
            waiting = store.wait(keys, read.after, rt.settings.ds_long_poll_s)
            if await until_gone(request, waiting) is Hangup.HUNG_UP:
                return Response(status_code=204)  # the client hung up: no one reads this
            waited = await store.read(keys, read.after)
            if waited is None:
                raise NotFound("no such stream")
            read = waited
        return _own_page(request, read, offset, live=True)
    return _own_page(request, read, offset, live=False)


def _own_page(request: Request, read: Read, offset: str, *, live: bool) -> Response:
    content_type = read.meta.content_type
    return _page(
        request,
        [to_bytes(payload) for _, payload in read.items],
        json=wire.is_json(content_type),
        content_type=content_type,
        next_offset=wire.offset_of(read.after),
        up_to_date=read.up_to_date,
        closed=read.closed and read.up_to_date,
        offset=offset,
        live=live,
        tag=read.meta.incarnation,
    )


def _page(
    request: Request,
    messages: list[bytes],
    *,
    json: bool,
    content_type: str,
    next_offset: str,
    up_to_date: bool,
    closed: bool,
    offset: str,
    live: bool,
    tag: str,
) -> Response:
    """A catch-up or long-poll answer: 204 for a long poll with nothing new, else ``messages``
    (one JSON array, or their bytes one after another) with the protocol's headers. A catch-up
    read from a fixed offset has an ETag (``tag``: the stream's life) and may be cached."""
    cursor = wire.next_cursor(request.query_params.get("cursor")) if live else None
    if live and not messages:
        return Response(
            status_code=204,
            headers=_headers(
                next_offset=next_offset,
                up_to_date="true",
                closed=_true(closed),
                cursor=None if closed else cursor,
                cache="no-store",
            ),
        )
    body = wire.json_body(messages) if json else b"".join(messages)
    headers = _headers(
        content_type=content_type,
        next_offset=next_offset,
        up_to_date=_true(up_to_date),
        closed=_true(closed),
        cursor=cursor,
    )
    if offset == "now":
        headers["cache-control"] = "no-store"
        return Response(body, headers=headers)
    etag = f'"{tag}:{offset}:{next_offset}{":c" if closed else ""}"'
    headers["etag"] = etag
    headers["cache-control"] = _cacheable(request)
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"etag": etag})
    return Response(body, headers=headers)


def _cacheable(request: Request) -> str:
    """Catch-up reads may be cached (the bytes at an offset never change): by anyone on an
    open broker, by the caller's own cache only on a secured one."""
    scope = "private" if services(request).auth.enabled else "public"
    return f"{scope}, max-age=60, stale-while-revalidate=300"


def _sse(
    rt: Services,
    look: Callable[[float], Awaitable[_Look | None]],
    cursor: str | None,
    content_type: str,
) -> Response:
    return _sse_response(rt, functools.partial(_frames, rt, look, cursor), content_type)


def _sse_response(rt: Services, source: FrameSource, content_type: str) -> Response:
    extra = list(SSE_HEADERS)
    if not wire.is_text(content_type):
        extra.append((b"stream-sse-data-encoding", b"base64"))
    return EventStreamResponse(
        source, send_timeout_s=rt.settings.sse_send_timeout_s, extra_headers=extra
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Look:
    """One look at a stream for an SSE read: its new messages (each its offset and ``data``
    event), where the look ends, whether that is the stream's tail, and whether it is closed."""

    items: list[tuple[str, bytes]]
    next_offset: str
    up_to_date: bool
    closed: bool


async def _frames(
    rt: Services,
    look: Callable[[float], Awaitable[_Look | None]],
    cursor: str | None,
    sink: Sink,
) -> AsyncIterator[bytes]:
    """The SSE events of a read: a ``data`` event per message, each followed by its ``control``;
    ``upToDate`` once at the tail; the last control of a closed stream says so, and ends the
    response, as does the protocol's ~60 s (the client resumes from its last offset). ``look``
    is called with the seconds it may wait for something new (0: look now); None ends the read
    (the stream is gone)."""
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + rt.settings.ds_sse_max_s
    wait = 0.0
    opened = False
    token = wire.next_cursor(cursor)
    while not sink.over:
        seen = await look(wait)
        if seen is None:
            return
        token = wire.still_cursor(token)
        out = []
        for index, (offset, data) in enumerate(seen.items):
            at_tail = index == len(seen.items) - 1 and seen.up_to_date
            out.append(data)
            out.append(
                wire.sse_control(
                    offset, cursor=token, up_to_date=at_tail, closed=at_tail and seen.closed
                )
            )
        if not seen.items and (seen.closed or not opened or seen.up_to_date):
            out.append(
                wire.sse_control(
                    seen.next_offset, cursor=token, up_to_date=True, closed=seen.closed
                )
            )
        opened = True
        yield b"".join(out) if out else PING
        if seen.closed:
            return
        left = ends_at - loop.time()
        if left <= 0:
            return
        wait = min(rt.settings.ds_long_poll_s, left) if seen.up_to_date else 0.0


class _OwnLooks:
    """The looks of an SSE read of a stream of the protocol's own, from its first read on;
    waits ride the stream's feed."""

    def __init__(self, store: DurableStore, keys: StreamKeys, first: Read) -> None:
        self.store, self.keys = store, keys
        self.pending: Read | None = first
        self.after = first.after
        self.content_type = first.meta.content_type

    async def look(self, wait_s: float) -> _Look | None:
        read, self.pending = self.pending, None
        if read is None:
            if wait_s > 0:
                await self.store.wait(self.keys, self.after, wait_s)
            read = await self.store.read(self.keys, self.after)
            if read is None:
                return None
        self.after = read.after
        return _Look(
            [
                (wire.offset_of(place), wire.sse_data(to_bytes(payload), self.content_type))
                for place, payload in read.items
            ],
            wire.offset_of(read.after),
            read.up_to_date,
            read.closed and read.up_to_date,
        )


# --- generation streams, read-only -------------------------------------------------------------


async def _locate(rt: Services, stream_id: str, principal: Principal) -> Location:
    check_stream(rt.metrics, principal, stream_id)
    return await rt.streams.locate(stream_id, principal.tenant)


async def _read_generation(
    rt: Services,
    request: Request,
    stream_id: str,
    principal: Principal,
    offset: str,
    live: str | None,
) -> Response:
    # A one-viewer token's catch-up or long poll is refused (the token rules of every door).
    admit(rt.metrics, principal, stream_id, sse=live == "sse")
    location = await rt.streams.locate(stream_id, principal.tenant)
    start = StartPoint.parse(offset)
    if live == "sse":
        cursor = await rt.streams.resolve(location, start)
        generation = _GenerationLooks(rt, location, cursor)
        source = functools.partial(_frames, rt, generation.look, request.query_params.get("cursor"))
        # A replaced one-viewer read ends with the native ``replaced`` event (no id, unknown to
        # the protocol's clients): the protocol has no word for it.
        viewed = await rt.as_viewer(principal, location, source, replaced=REPLACED)
        return _sse_response(rt, viewed, GENERATION_TYPE)
    page = await rt.streams.page(location, start)
    if live == "long-poll" and not page["events"] and not page["closed"]:
        after = await rt.streams.resolve(location, start)
        waiting = rt.streams.page(location, StartPoint("offset", after), rt.settings.ds_long_poll_s)
        waited = await until_gone(request, waiting)
        if waited is Hangup.HUNG_UP:
            return Response(status_code=204)  # the client hung up: no one reads this
        page = waited
    return _page(
        request,
        [_message(event) for event in page["events"]],
        json=True,
        content_type=GENERATION_TYPE,
        next_offset=_next_offset(page),
        up_to_date=page["up_to_date"],
        closed=await _settled(rt, location, page),
        offset=offset,
        live=live is not None,
        tag=stream_id,
    )


def _next_offset(page: dict[str, Any]) -> str:
    offset: str = page["next_offset"]
    return ORIGIN.offset if offset == "-1" else offset


async def _settled(rt: Services, location: Location, page: dict[str, Any]) -> bool:
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


class _GenerationLooks:
    """The looks of an SSE read of a generation: a one-message array per broker event; closed
    once the turn is at rest."""

    def __init__(self, rt: Services, location: Location, after: Cursor) -> None:
        self.rt, self.location = rt, location
        self.start = StartPoint("start") if after.at_origin else StartPoint("offset", after)

    async def look(self, wait_s: float) -> _Look:
        page = await self.rt.streams.page(self.location, self.start, wait_s)
        closed = await _settled(self.rt, self.location, page)
        events = page["events"]
        if events:
            self.start = StartPoint.parse(events[-1]["id"])
        return _Look(
            [
                (event["id"], wire.sse_event("data", wire.json_body([_message(event)]).decode()))
                for event in events
            ],
            _next_offset(page),
            page["up_to_date"],
            closed,
        )
