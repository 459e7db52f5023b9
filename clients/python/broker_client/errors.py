"""Exceptions raised by the broker client; all derive from `BrokerClientError`."""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BadRequest",
    "BrokerClientError",
    "BrokerConnectionError",
    "BrokerHTTPError",
    "Conflict",
    "NotFound",
    "ProtocolError",
    "ReattachExhausted",
    "ResponseEnded",
    "ServerError",
    "StreamExpired",
    "StreamNotFound",
    "TurnNotFound",
    "error_from_response",
]


class BrokerClientError(Exception):
    """Root of every error this package raises on purpose."""


class ProtocolError(BrokerClientError):
    """The server answered with something that does not follow the broker's wire format."""


class BrokerConnectionError(BrokerClientError):
    """A one-shot request could not reach the broker; the transport error is the `__cause__`."""


class ResponseEnded(BrokerClientError):
    """A stream response closed before the turn came to rest; `attach` reconnects on this."""


class BrokerHTTPError(BrokerClientError):
    """The broker answered with an error status.

    `code` and `message` come from the `{"error": {"code", "message"}}` body when the server sent
    one; otherwise `code` is `http_<status>` and `message` is the start of the raw body.
    """

    def __init__(self, status: int, code: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body


class BadRequest(BrokerHTTPError):
    """400 (or 422): the request was malformed, e.g. an invalid offset."""


class NotFound(BrokerHTTPError):
    """404 for any resource."""


class StreamNotFound(NotFound):
    """404 from a stream endpoint: the broker does not know this stream."""


class TurnNotFound(NotFound):
    """404 from a turn endpoint."""


class Conflict(BrokerHTTPError):
    """409: e.g. a turn id reused with a different request."""


class StreamExpired(BrokerHTTPError):
    """410: the stream existed but its retention has passed."""


class ServerError(BrokerHTTPError):
    """5xx: the broker or its Redis is failing; `attach` retries these by itself."""


class ReattachExhausted(BrokerClientError):
    """`attach` gave up after too many consecutive reconnects without receiving an event.

    The last failure is chained as `__cause__` and kept in `last_error`.
    """

    def __init__(self, failures: int, last_error: BaseException | None) -> None:
        super().__init__(f"gave up after {failures} consecutive failed attempts: {last_error!r}")
        self.failures = failures
        self.last_error = last_error


_BY_STATUS: dict[int, type[BrokerHTTPError]] = {
    400: BadRequest,
    409: Conflict,
    410: StreamExpired,
    # FastAPI reports body validation failures as 422; to a caller that is the same mistake as 400.
    422: BadRequest,
}


def error_from_response(
    status: int, body: bytes, *, not_found: type[NotFound] = NotFound
) -> BrokerHTTPError:
    """Build the exception that matches an error response's status and body."""
    parsed: Any = None
    code = f"http_{status}"
    message = body[:500].decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            code = str(error.get("code") or code)
            message = str(error.get("message") or message)
        elif "detail" in parsed:
            message = str(parsed["detail"])
    if status == 404:
        cls: type[BrokerHTTPError] = not_found
    elif status >= 500:
        cls = ServerError
    else:
        cls = _BY_STATUS.get(status, BrokerHTTPError)
    return cls(status, code, message or f"HTTP {status}", parsed)
