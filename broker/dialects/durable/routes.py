"""The Durable Streams routes: ``/ds/v1/stream/{path}``, the protocol over the broker's Redis.

A path is a stream of the protocol's own (created with PUT, appended to with POST, closed,
deleted), kept by the Durable Streams service (:mod:`broker.durable_store`, the runtime's
``durable``): these routes parse the request, call the service and render its typed result with
the protocol's headers. Or, when the path is a generation's stream id (``st_...``), that
generation is read as a JSON stream: one message per broker event, closed once its turn is at
rest, with the broker's offsets. A generation is written by its worker only: a write through the
protocol is refused with 405.

Paths belong to the caller's tenant (another tenant's streams are never found); an attach token
reads its one generation stream and nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.responses import Response

from broker import relay as relays
from broker.auth import Principal
from broker.dialects.durable import wire
from broker.dialects.durable.render import GenerationRenderer
from broker.durable_store import (
    Appended,
    AppendRequest,
    ClosedAgain,
    CreateRequest,
    DurableStore,
    ForkRequest,
    Read,
)
from broker.durable_store.protocol import (
    CLOSED,
    JSON_TYPE,
    NEXT_OFFSET,
    checked_path,
    is_json,
    offset_of,
    start_cursor,
)
from broker.errors import BadRequest, BrokerError, Forbidden, NotFound
from broker.frames import ORIGIN, Cursor, Entry
from broker.http import Caller, Hangup, Services, services, until_gone
from broker.reader import FROM_NOW, Location, StartPoint
from broker.sse import PING, EventStreamResponse, Sink
from broker.viewer import FrameSource, admit, check_stream
from broker.vocabulary import STREAM_ID_PATTERN

PREFIX: Final = "/ds/v1/stream"
GENERATION_TYPE: Final = JSON_TYPE
SSE_HEADERS: Final = [(b"cache-control", b"no-cache")]

# Described by the protocol's own document, not in /openapi.json: its bodies are any bytes, and
# its statuses and headers are the protocol's (see docs/durable-streams.md).
router = APIRouter(tags=["Durable Streams"], include_in_schema=False)


class MethodNotAllowed(BrokerError):
    """A write to a stream the protocol may only read (a generation's)."""

    code = "read_only"
    status = 405


class NotSupported(BrokerError):
    """A part of the protocol this server does not do: forking a generation's stream."""

    code = "not_supported"
    status = 501


def _store(rt: Services) -> DurableStore:
    return rt.durable


def _writer(request: Request, principal: Principal) -> Principal:
    if principal.stream_id is not None:
        services(request).metrics.auth_failures.labels("forbidden").inc()
        raise Forbidden("an attach token only reads its generation's stream", code="read_only")
    return principal


def _writable(request: Request, path: str, principal: Principal, refusal: str) -> str | None:
    """The tenant a write (create, append, delete) to ``path`` goes to: 404 for a path no
    stream can have, 403 for an attach token, 405 (``refusal``) for a generation's stream."""
    path = checked_path(path)
    principal = _writer(request, principal)
    if _generation(path):
        raise MethodNotAllowed(refusal)
    return principal.tenant


def _headers(**values: str | None) -> dict[str, str]:
    names = {
        "next_offset": NEXT_OFFSET,
        "closed": CLOSED,
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


def _generation(path: str) -> bool:
    return STREAM_ID_PATTERN.fullmatch(path) is not None


def _fork_request(headers: Headers) -> ForkRequest | None:
    """The fork a PUT asks for (``Stream-Forked-From``), or None; 400 for headers that do not
    go together, 404 for a source path no stream can have, 501 for a generation's stream."""
    origin = headers.get("stream-forked-from")
    offset = headers.get("stream-fork-offset")
    sub = wire.sub_offset(headers.get("stream-fork-sub-offset"))
    if origin is None:
        if offset is not None or "stream-fork-sub-offset" in headers:
            raise BadRequest("fork headers need Stream-Forked-From", code="bad_fork")
        return None
    if sub and offset is None:
        raise BadRequest("a fork's sub-offset needs Stream-Fork-Offset", code="bad_fork")
    path = checked_path(wire.source_path(origin))
    if _generation(path):
        raise NotSupported("a generation's stream cannot be forked")
    return ForkRequest(path, offset, sub)


def _create_request(headers: Headers) -> CreateRequest:
    ttl_s = wire.ttl_seconds(headers.get("stream-ttl"))
    expires_at = headers.get("stream-expires-at")
    expires_ms = wire.expiry_ms(expires_at)
    if ttl_s is not None and expires_ms is not None:
        raise BadRequest("give Stream-TTL or Stream-Expires-At, not both", code="bad_expiry")
    return CreateRequest(
        content_type=(headers.get("content-type") or "").strip(),
        ttl_s=ttl_s,
        expires_ms=expires_ms,
        expires_at=expires_at,
        closed=wire.flag(headers.get("stream-closed")),
        fork=_fork_request(headers),
    )


# --- writes ----------------------------------------------------------------------------------


@router.put(PREFIX + "/{path:path}", status_code=201, responses={200: {}, 409: {}})
async def create_stream(request: Request, path: str, principal: Caller) -> Response:
    """Create a stream (201), or find the same one (200); 409 for another configuration."""
    tenant = _writable(
        request, path, principal, "a generation's stream is written by its worker only"
    )
    location = _location(request, path)
    made = await _store(services(request)).create(
        tenant, path, _create_request(request.headers), request.body
    )
    response = Response(
        status_code=201 if made.created else 200,
        headers=_headers(
            # The type as the stream keeps it: for a stream found again, as it was created.
            content_type=made.content_type,
            next_offset=offset_of(made.tail),
            closed=_true(made.closed),
        ),
    )
    if made.created:
        response.headers["location"] = location
    return response


def _location(request: Request, path: str) -> str:
    """The URL of the stream at ``path``, its path percent-encoded (RFC 3986): a header is
    Latin-1 at most, and a path may hold any character, ``?``, ``#`` and ``%`` included."""
    url = request.url
    # The request's own path ends with the stream's (decoded): what comes before is the mount.
    mount = url.path[: -len(path)] if url.path.endswith(path) else f"{PREFIX}/"
    return str(url.replace(path=wire.quote_path(mount) + wire.quote_path(path), query=""))


@router.post(PREFIX + "/{path:path}", status_code=204, responses={200: {}, 409: {}})
async def append_stream(request: Request, path: str, principal: Caller) -> Response:
    """Append (204; 200 for a producer's new batch), close (``Stream-Closed: true``), or both."""
    tenant = _writable(
        request, path, principal, "a generation's stream is written by its worker only"
    )
    headers = request.headers
    producer = wire.producer(
        headers.get("producer-id"), headers.get("producer-epoch"), headers.get("producer-seq")
    )
    close = wire.flag(headers.get("stream-closed"))
    body = await request.body()
    done = await _store(services(request)).append(
        tenant,
        path,
        AppendRequest(
            headers.get("content-type"), body, close, producer, headers.get("stream-seq")
        ),
    )
    tail = offset_of(done.tail)
    if isinstance(done, ClosedAgain):
        return Response(status_code=204, headers=_headers(next_offset=tail, closed="true"))
    epoch = str(producer[1]) if producer is not None else None
    if isinstance(done, Appended):
        return Response(
            status_code=200 if producer is not None and body else 204,
            headers=_headers(
                next_offset=tail,
                closed=_true(done.closed),
                epoch=epoch,
                seq=str(producer[2]) if producer is not None else None,
            ),
        )
    return Response(  # a batch this producer sent already
        status_code=204,
        headers=_headers(
            next_offset=tail, closed=_true(done.closed), epoch=epoch, seq=str(done.seq)
        ),
    )


@router.delete(PREFIX + "/{path:path}", status_code=204)
async def delete_stream(request: Request, path: str, principal: Caller) -> Response:
    """Delete a stream and everything in it."""
    tenant = _writable(
        request, path, principal, "a generation's stream is deleted by its retention only"
    )
    await _store(services(request)).delete(tenant, path)
    return Response(status_code=204)


# --- reads -----------------------------------------------------------------------------------


@router.head(PREFIX + "/{path:path}")
async def stream_metadata(request: Request, path: str, principal: Caller) -> Response:
    """The stream's content type, tail offset, TTL or expiry and closure, without a body."""
    rt = services(request)
    path = checked_path(path)
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
    meta = await _store(rt).meta(principal.tenant, path)
    response = Response(
        headers=_headers(
            content_type=meta.content_type,
            next_offset=offset_of(meta.tail),
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
    path = checked_path(path)
    params = request.query_params
    live = params.get("live")
    if live not in (None, "long-poll", "sse"):
        raise BadRequest("live must be long-poll or sse", code="bad_live")
    offset = wire.start_offset(params.getlist("offset"), live=live is not None)
    if _generation(path):
        return await _read_generation(rt, request, path, principal, offset, live)
    tenant = _writer(request, principal).tenant
    store = _store(rt)
    # An SSE read sends each append's offset; a catch-up or long poll only the last one.
    read = await store.read(tenant, path, start_cursor(offset), places=live == "sse")
    content_type = read.meta.content_type
    if live == "sse":
        own = _OwnStreamPoller(store, tenant, path, read)
        return _sse(rt, own.look, params.get("cursor"), content_type)
    if live == "long-poll":
        if read.waits:
            waiting = store.wait(tenant, path, read.after, rt.settings.ds_long_poll_s)
            if await until_gone(request, waiting) is Hangup.HUNG_UP:
                return Response(status_code=204)  # the client hung up: no one reads this
            waited = await store.read_on(tenant, path, read.after, places=False)
            if waited is None:
                raise NotFound("no such stream")
            read = waited
        return _own_page(request, read, offset, live=True)
    return _own_page(request, read, offset, live=False)


def _own_page(request: Request, read: Read, offset: str, *, live: bool) -> Response:
    content_type = read.meta.content_type
    return _page(
        request,
        read.payloads,
        json=is_json(content_type),
        content_type=content_type,
        next_offset=offset_of(read.after),
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
    look: Callable[[float], Awaitable[_LookResult | None]],
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
class _LookResult:
    """One look at a stream for an SSE read: its new messages (each its offset and ``data``
    event), where the look ends, whether that is the stream's tail, and whether it is closed."""

    items: list[tuple[str, bytes]]
    next_offset: str
    up_to_date: bool
    closed: bool


async def _frames(
    rt: Services,
    look: Callable[[float], Awaitable[_LookResult | None]],
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


class _OwnStreamPoller:
    """The looks of an SSE read of a stream of the protocol's own, from its first read on;
    waits ride the stream's feed."""

    def __init__(self, store: DurableStore, tenant: str | None, path: str, first: Read) -> None:
        self.store, self.tenant, self.path = store, tenant, path
        self.pending: Read | None = first
        self.after = first.after
        self.content_type = first.meta.content_type

    async def look(self, wait_s: float) -> _LookResult | None:
        read, self.pending = self.pending, None
        if read is None:
            if wait_s > 0:
                await self.store.wait(self.tenant, self.path, self.after, wait_s)
            read = await self.store.read_on(self.tenant, self.path, self.after)
            if read is None:
                return None
        self.after = read.after
        return _LookResult(
            [
                (offset, wire.sse_data(payload, self.content_type))
                for offset, payload in zip(read.offsets, read.payloads, strict=True)
            ],
            offset_of(read.after),
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
        opening = await rt.streams.opening(location, cursor)
        token = wire.next_cursor(request.query_params.get("cursor"))
        renderer = GenerationRenderer(cursor, token, finished=opening.finished)
        read = relays.Read(
            location,
            cursor,
            renderer,
            functools.partial(_closes, rt, location),
            opening=opening,
            heartbeat_s=rt.settings.ds_long_poll_s,
            headers=SSE_HEADERS,
            caught_up=True,
            max_s=rt.settings.ds_sse_max_s,
        )
        return await rt.relay(principal, read)
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


async def _closes(rt: Services, location: Location, end: Entry) -> bool:
    """The facts of an ``end``: whether it closes the generation (nothing follows it)."""
    return await rt.streams.finished_before(location, end.cursor)
