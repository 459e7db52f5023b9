"""``GET /v1/streams/{id}`` over SSE: one door, ahead of the framework.

It is the broker's hottest route: a crowd that joins a live answer opens a thousand of these at
once, and a quiet deployment holds ten thousand open. Through FastAPI each would pay the walk
over every route, the dependency solving, a ``Request``, and exit stacks and wrappers that stay
suspended as long as the response lasts (see ``benchmarks/RESULTS.md``).

So the app uvicorn runs is :class:`FrontDoor`, an ASGI dispatcher: an SSE read (a ``GET`` of a
stream's path without ``format=json``) goes to :class:`StreamReads`, a plain ASGI app, and
everything else (the JSON pages included) to FastAPI. The FastAPI route stays to describe the
read in ``/openapi.json`` and to serve the JSON pages. :class:`StreamReads` makes the same checks
in the same order (``routes.checked_read``) and answers the same errors and the same response
(``routes.sse_read``). A read that needs none of the layers the app has (no ``Origin`` while CORS
is on, headers under the limit) is answered at once, doing what each layer would (the choice
of coding, the security headers) with the same functions; one that needs them (a CORS read, an
oversized one) goes through the same layers, built for the read alone (``layered``). Each layer
is a frame and a wrapper that stays suspended as long as the response, for each of ten
thousand quiet readers (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from starlette.datastructures import Headers, QueryParams
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from broker.api.errors import broker_error_response, internal_error, redis_unavailable
from broker.api.limits import header_bytes
from broker.api.routes import checked_read, sse_read
from broker.api.security import headers_for, with_headers
from broker.compression import CODING, negotiate
from broker.errors import REDIS_UNAVAILABLE, BrokerError
from broker.http import authenticate

if TYPE_CHECKING:
    from broker.http import Services

# The route's path, as the framework's router matches it: one segment, not empty.
PATH: Final = re.compile(r"/v1/streams/([^/]+)")


class StreamReads:
    """The one door of SSE stream reads (see the module's docstring)."""

    def __init__(
        self,
        services: Callable[[], Services],
        *,
        max_header_bytes: int,
        compression: bool,
        cors: bool,
        layered: Callable[[ASGIApp], ASGIApp],
    ) -> None:
        self.services = services
        self.max_header_bytes = max_header_bytes
        self.compression = compression
        self.cors = cors
        self._layered = layered(self._under_layers)  # the app's layers, around this read

    @staticmethod
    def stream_id(scope: Scope) -> str | None:
        """The stream id of an SSE read, or None for any other request."""
        stream_id = _stream_id(scope)
        query = scope["query_string"]
        if stream_id is None or (query and QueryParams(query).get("format") == "json"):
            return None  # (the JSON pages are the route's)
        return stream_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer an SSE read (a request :meth:`stream_id` names)."""
        if not self._alone(scope):
            await self._layered(scope, receive, send)
            return
        if self.compression:  # as broker.compression's middleware chooses it
            scope[CODING] = negotiate(Headers(scope=scope).get("accept-encoding"))
        response = await self._answer(scope)
        response.raw_headers = with_headers(response.raw_headers, headers_for(scope["path"]))
        await response(scope, receive, send)

    async def _under_layers(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self._answer(scope)
        await response(scope, receive, send)

    async def _answer(self, scope: Scope) -> Response:
        stream_id = _stream_id(scope)
        assert stream_id is not None  # (the front door sent only reads)
        return await _answer(scope, self.services(), stream_id, QueryParams(scope["query_string"]))

    def _alone(self, scope: Scope) -> bool:
        """Whether the read needs nothing of the layers the app has."""
        if header_bytes(scope) > self.max_header_bytes:
            return False  # the layers' 431 (with CORS headers when they apply)
        return not self.cors or all(name != b"origin" for name, _ in scope["headers"])


class Door(Protocol):
    """A door of its own ahead of the framework: the requests it claims are its."""

    def claims(self, scope: Scope) -> bool: ...

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


class FrontDoor:
    """The app uvicorn runs: SSE stream reads to ``reads``, a request another door claims
    (``doors``: the Durable Streams routes') to it, everything else to ``app``."""

    def __init__(self, app: ASGIApp, reads: StreamReads | None, doors: Sequence[Door] = ()) -> None:
        self.app = app
        self.reads = reads
        self.doors = tuple(doors)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            reads = self.reads
            if reads is not None and reads.stream_id(scope) is not None:
                await reads(scope, receive, send)
                return
            for door in self.doors:
                if door.claims(scope):
                    await door(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _stream_id(scope: Scope) -> str | None:
    """The stream id of an SSE read's path, or None for any other request."""
    if scope["type"] != "http" or scope["method"] != "GET":
        return None
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):  # as the router sees it
        path = path[len(root) :]
    matched = PATH.fullmatch(path)
    return matched.group(1) if matched else None


async def _answer(scope: Scope, rt: Services, stream_id: str, params: QueryParams) -> Response:
    """The read's response, or the JSON error the app's handlers would have answered."""
    headers = Headers(scope=scope)
    try:
        principal = authenticate(rt, scope, headers.get("authorization"), params.get("token"))
        read = checked_read(
            rt,
            stream_id,
            principal,
            format=params.get("format"),
            offset=params.get("offset"),
            wait=params.get("wait"),
            heartbeat=params.get("heartbeat"),
            batch_ms=params.get("batch_ms"),
            last_event_id=headers.get("last-event-id"),
        )
        return await sse_read(rt, stream_id, principal, read)
    except BrokerError as exc:
        return broker_error_response(exc)
    except REDIS_UNAVAILABLE as exc:
        return redis_unavailable("GET", scope["path"], exc, rt.metrics)
    except Exception:
        return internal_error("GET", scope["path"])
