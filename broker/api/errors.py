"""Every error leaves the API as ``{"error": {"code", "message"}}`` with the right status."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from broker.errors import REDIS_UNAVAILABLE, BrokerError

if TYPE_CHECKING:
    from broker.metrics import Metrics

log = logging.getLogger("broker.api")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}


def error_response(status: int, code: str, message: str) -> Response:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return Response(body, status_code=status, media_type="application/json")


def broker_error_response(exc: BrokerError) -> Response:
    """A broker error's answer: its status, code and message, and its headers."""
    response = error_response(exc.status, exc.code, exc.message)
    response.headers.update(exc.headers)
    return response


def redis_unavailable(method: str, path: str, exc: Exception, metrics: Metrics | None) -> Response:
    """The 503 of a request that met a Redis outage (logged and counted)."""
    log.warning("Redis unavailable during %s %s: %s", method, path, exc)
    if metrics is not None:
        metrics.redis_errors.inc()
    return error_response(503, "redis_unavailable", "Redis is unavailable; retry shortly")


def internal_error(method: str, path: str) -> Response:
    """The 500 of a bug (logged with its traceback: call it where the exception is handled)."""
    log.exception("unexpected error in %s %s", method, path)
    return error_response(500, "internal", "internal error")


def install_error_handlers(app: FastAPI) -> None:
    """Map broker errors, validation errors, Redis outages and stray HTTP errors to JSON."""

    async def broker_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, BrokerError)
        return broker_error_response(exc)

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(400, "bad_request", describe_validation(exc.errors()))

    async def client_left(request: Request, _: Exception) -> Response:
        # Routine (a phone between networks): nothing was done, and the answer reaches no one.
        log.debug("client left before the body of %s %s arrived", request.method, request.url.path)
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.requests_abandoned.inc()
        return error_response(400, "client_disconnected", "the request body did not arrive")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's own body parsing wraps it
            return await client_left(request, exc.__cause__)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        response = error_response(exc.status_code, code, str(exc.detail))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def redis_error(request: Request, exc: Exception) -> Response:
        metrics = getattr(request.app.state, "metrics", None)
        return redis_unavailable(request.method, request.url.path, exc, metrics)

    async def unexpected(request: Request, exc: Exception) -> Response:
        return internal_error(request.method, request.url.path)

    app.add_exception_handler(BrokerError, broker_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_left)
    for unavailable in REDIS_UNAVAILABLE:
        app.add_exception_handler(unavailable, redis_error)
    app.add_exception_handler(Exception, unexpected)


def describe_validation(errors: object) -> str:
    """One readable line from pydantic's error list: ``field.path: problem; ...``."""
    parts = []
    for error in errors if isinstance(errors, list | tuple) else []:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts[:10]) or "invalid request"
