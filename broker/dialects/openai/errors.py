"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

The statuses are the broker's own (one table, ``broker.errors``); the SDKs map them to their
exception classes (400 ``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``,
409 ``ConflictError``, 422 ``UnprocessableEntityError``, 429 ``RateLimitError``, 5xx
``InternalServerError``).
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from pydantic import BaseModel
from starlette.responses import Response

from broker.api.schemas import ErrorBody
from broker.errors import BrokerError

TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


def error_response(
    status: int,
    message: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    kind = TYPES.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(orjson.dumps(body), status, headers=headers, media_type="application/json")


def from_broker_error(exc: BrokerError) -> Response:
    param = getattr(exc, "param", None)
    return error_response(exc.status, exc.message, exc.code, param, exc.headers)


_MEANING: Final = {
    400: "bad input (names the parameter)",
    401: "credentials missing or refused",
    403: "an attach token cannot act",
    404: "unknown (or another tenant's)",
    409: "the key names a response with a different request, or a turn busy",
    410: "the response existed, but its data expired",
    413: "body larger than BROKER_MAX_BODY_BYTES",
    422: "valid, but not allowed in this state",
    429: "a tenant limit, or the caller's share of connections; see Retry-After",
    431: "headers larger than BROKER_MAX_HEADER_BYTES",
    503: "Redis is unavailable; retry shortly",
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses of a dialect route (and the common ones)."""
    wanted = sorted({*statuses, 400, 401, 403, 404, 413, 429, 431, 503})
    # 413 and 431 come from the middleware in front of every route, in the native shape.
    return {
        s: {"model": ErrorBody if s in (413, 431) else OpenAIErrorBody, "description": _MEANING[s]}
        for s in wanted
    }
