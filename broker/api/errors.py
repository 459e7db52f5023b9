"""Every error leaves the API as ``{"error": {"code", "message"}}`` with the right status."""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from broker.errors import BrokerError

log = logging.getLogger("broker.api")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}


def error_response(status: int, code: str, message: str) -> Response:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return Response(body, status_code=status, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Map broker errors, validation errors, Redis outages and stray HTTP errors to JSON."""

    async def broker_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, BrokerError)
        response = error_response(exc.status, exc.code, exc.message)
        response.headers.update(exc.headers)
        return response

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
        log.warning("Redis unavailable during %s %s: %s", request.method, request.url.path, exc)
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.redis_errors.inc()
        return error_response(503, "redis_unavailable", "Redis is unavailable; retry shortly")

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal error")

    app.add_exception_handler(BrokerError, broker_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_left)
    app.add_exception_handler(RedisError, redis_error)
    app.add_exception_handler(ConnectionError, redis_error)
    app.add_exception_handler(Exception, unexpected)


def describe_validation(errors: object) -> str:
    """One readable line from pydantic's error list: ``field.path: problem; ...``."""
    parts = []
    for error in errors if isinstance(errors, list | tuple) else []:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts[:10]) or "invalid request"
