"""The Durable Streams routes' own door: ``/ds/v1/stream/{path}``, ahead of the framework.

Every append, read and close of the protocol passes here, and a writer sends thousands a second:
through FastAPI each would pay the walk over every route before the protocol's, the dependency
solving of the caller and the framework's exception layers (``benchmarks/RESULTS.md``). So the
front door (:class:`broker.api.stream_reads.FrontDoor`) sends them to :class:`DurableDoor`, a
plain ASGI app that calls the same handlers (:mod:`broker.dialects.durable.routes`) with the
same caller (``http.authenticate``: credentials, their failure counts, the tenant's share),
answers every error with the same JSON the app's handlers would (``api.errors``), and runs
inside the same layers as the app (body and header limits, compression, security headers,
CORS), built for it from the app's one list. A request that needs none of them but compression
(CORS off, headers under their limit, a body of a declared length within its limit: the
appends of a plain client) is answered without them, doing what each would (the
security headers, the same compression) with the same functions, as the SSE reads' door does.
The FastAPI routes stay: they are the document's
(the protocol's own, see docs/durable-streams.md) and answer what this door does not claim (a
method the protocol does not have: FastAPI's 405; a CORS preflight is the CORS layer's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from broker.api.errors import broker_error_response, error_response, internal_error
from broker.api.errors import redis_unavailable as unavailable
from broker.api.limits import header_bytes
from broker.api.security import cors_origins, headers_for, with_headers
from broker.auth import Principal
from broker.compression import Compression
from broker.dialects.durable import routes
from broker.errors import REDIS_UNAVAILABLE, BrokerError
from broker.http import Services, authenticate
from broker.settings import Settings

Handler = Callable[[Request, str, Principal], Awaitable[Response]]

# What the routes' path matches, as the router sees it: the prefix and a stream's path (any).
MOUNT: Final = routes.PREFIX + "/"
HANDLERS: Final[dict[str, Handler]] = {
    "PUT": routes.create_stream,
    "POST": routes.append_stream,
    "DELETE": routes.delete_stream,
    "HEAD": routes.stream_metadata,
    "GET": routes.read_stream,
}


class DurableDoor:
    """The one door of the Durable Streams routes (see the module's docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        services: Callable[[], Services],
        layered: Callable[[ASGIApp], ASGIApp],
        settings: Settings,
    ) -> None:
        self.app = app  # the framework's app: ``request.app`` of the handlers (its state)
        self.services = services
        self._layered = layered(self._answer)  # the app's layers, around these routes
        self.max_header_bytes = settings.max_header_bytes
        self.max_body_bytes = settings.max_body_bytes
        self.compression = settings.compression == "on"
        self.cors = bool(cors_origins(settings.cors_origins))

    @staticmethod
    def path(scope: Scope) -> str | None:
        """The stream's path of a request this door answers, or None for any other."""
        if scope["type"] != "http" or scope["method"] not in HANDLERS:
            return None
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):  # as the router sees it
            path = path[len(root) :]
        if not path.startswith(MOUNT):
            return None
        stream = path[len(MOUNT) :]
        # The reserved paths (subscriptions, the wakes' signing keys) are the framework's routes.
        return None if stream == "__ds" or stream.startswith("__ds/") else stream

    def claims(self, scope: Scope) -> bool:
        return self.path(scope) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self.app  # as the framework sets it: the handlers find their services
        if not self._alone(scope):
            await self._layered(scope, receive, send)
            return
        path = self.path(scope)
        assert path is not None  # (the front door sent only these)
        response = await answer(self.services(), Request(scope, receive), path)
        response.raw_headers = with_headers(response.raw_headers, headers_for(scope["path"]))
        # The one layer that may change the answer, as the app runs it (a 204, an append's
        # answer, has no body: it would pass untouched).
        if self.compression and response.status_code != 204:
            await Compression(response)(scope, receive, send)
        else:
            await response(scope, receive, send)

    def _alone(self, scope: Scope) -> bool:
        """Whether the request needs none of the layers but compression: CORS is off, the
        headers are under their limit, and there is no body, or one whose declared length is
        within the limit (the server reads no more than it declares)."""
        if self.cors or header_bytes(scope) > self.max_header_bytes:
            return False  # (the CORS layer adds Vary: Origin to every answer; the layers' 431)
        declared: int | None = 0 if scope["method"] in ("GET", "HEAD") else None
        for name, value in scope["headers"]:
            if name == b"content-length" and declared is None:
                declared = int(value) if value.isdigit() else None
                if declared is None:
                    return False  # the layers' 400
        return declared is not None and declared <= self.max_body_bytes

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = self.path(scope)
        assert path is not None  # (the front door sent only these)
        response = await answer(self.services(), Request(scope, receive), path)
        await response(scope, receive, send)


async def answer(rt: Services, request: Request, path: str) -> Response:
    """The route's response to ``request``, or the JSON error the app's handlers would answer."""
    method = request.method
    try:
        principal = authenticate(
            rt, request.scope, request.headers.get("authorization"), _token(request)
        )
        return await HANDLERS[method](request, path, principal)
    except BrokerError as exc:
        return broker_error_response(exc)
    except ClientDisconnect:  # routine: the answer reaches no one (as api.errors counts it)
        rt.metrics.requests_abandoned.inc()
        return error_response(400, "client_disconnected", "the request body did not arrive")
    except REDIS_UNAVAILABLE as exc:
        return unavailable(method, request.url.path, exc, rt.metrics)
    except Exception:
        return internal_error(method, request.url.path)


def _token(request: Request) -> str | None:
    return request.query_params.get("token") if request.scope["query_string"] else None
