"""``GET /v1/streams/{id}`` over SSE, served below the framework's routing.

It is the broker's hottest route: a crowd that joins a live answer opens a thousand of these at
once, and a quiet deployment holds ten thousand open. Through FastAPI each pays the walk over
every route, the dependency solving, a ``Request``, and exit stacks and wrappers that stay
suspended as long as the response lasts (see ``benchmarks/RESULTS.md``). This middleware, the
innermost of the broker's own (so CORS, security headers, compression and the header limit
apply as to any route), answers the SSE form of that route itself: the same credentials, the
same checks in the same order (``routes.checked_read``), the same errors and the same response
(``routes.sse_read``). Everything else goes on to the app, ``format=json`` pages included; the
FastAPI route stays, and documents the read in ``/openapi.json``.

:class:`FrontReads` answers the same reads earlier still, at the very front of the app (ahead
of the framework's own calls, its error and telemetry layers and the broker's own middleware),
when they need nothing of what lies between: it does what each layer would do to such a read
(the header limit's count, the choice of coding, the security headers) with the same
functions. A read that needs more, one with an ``Origin`` when CORS is on or one over the
header limit, goes through the stack as before. Each layer is a frame and a wrapper that stays
suspended as long as the response: ten thousand quiet readers held about 2 KiB each in them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

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
    """Serves SSE stream reads itself; passes every other request on to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_id = _stream_id(scope)
        if stream_id is None:
            await self.app(scope, receive, send)
            return
        params = QueryParams(scope["query_string"])
        if params.get("format") == "json":
            await self.app(scope, receive, send)
            return
        response = await _answer(scope, scope["app"].state.services, stream_id, params)
        await response(scope, receive, send)


class FrontReads:
    """At the front of the app: answers the SSE stream reads that need none of its layers (see
    the module's docstring). The app asks it first (``BrokerApp.__call__``) and runs the
    response itself, so that no frame of the framework's stays suspended under it."""

    def __init__(self, *, max_header_bytes: int, compression: bool, cors: bool) -> None:
        self.max_header_bytes = max_header_bytes
        self.compression = compression
        self.cors = cors

    async def answer(self, scope: Scope, rt: Services) -> Response | None:
        """The response to a plain SSE read (an error's too), or None for any other request."""
        stream_id = _stream_id(scope)
        if stream_id is None or not self._alone(scope):
            return None
        params = QueryParams(scope["query_string"])
        if params.get("format") == "json":
            return None
        if self.compression:  # as broker.compression's middleware chooses it
            scope[CODING] = negotiate(Headers(scope=scope).get("accept-encoding"))
        response = await _answer(scope, rt, stream_id, params)
        response.raw_headers = with_headers(response.raw_headers, headers_for(scope["path"]))
        return response

    def _alone(self, scope: Scope) -> bool:
        """Whether the read needs nothing of the layers this one passes by."""
        if header_bytes(scope) > self.max_header_bytes:
            return False  # the stack's 431 (with CORS headers when they apply)
        return not self.cors or all(name != b"origin" for name, _ in scope["headers"])


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
