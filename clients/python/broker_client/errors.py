"""Exceptions raised by the broker client; all derive from `BrokerClientError`.

```
BrokerClientError
├── ProtocolError
├── BrokerConnectionError
├── ResponseEnded
├── ReattachExhausted
└── BrokerHTTPError            (status, code, message, body)
    ├── BadRequest             400, 422
    ├── Unauthorized           401: bad_credentials, bad_token, token_expired, ...
    ├── Forbidden              403: read_only, wrong_stream, sse_only
    ├── NotFound               404
    │   ├── StreamNotFound
    │   └── TurnNotFound
    ├── Conflict               409: turn_conflict, turn_busy, token_in_use, ...
    ├── StreamExpired          410
    ├── RateLimited            429: rate_limited, too_many_streams (retry_after)
    └── ServerError            5xx
```
"""

from __future__ import annotations

import email.utils
import json
import math
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BadRequest",
    "BrokerClientError",
    "BrokerConnectionError",
    "BrokerHTTPError",
    "Conflict",
    "Forbidden",
    "NotFound",
    "ProtocolError",
    "RateLimited",
    "ReattachExhausted",
    "ResponseEnded",
    "ServerError",
    "StreamExpired",
    "StreamNotFound",
    "TurnNotFound",
    "Unauthorized",
    "error_from_response",
    "parse_retry_after",
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


class Unauthorized(BrokerHTTPError):
    """401: credentials missing or refused (`bad_credentials`, `bad_token`, `token_expired`)."""


class Forbidden(BrokerHTTPError):
    """403: an attach token used beyond its scope (`read_only`, `wrong_stream`, `sse_only`)."""


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


class RateLimited(BrokerHTTPError):
    """429: a tenant limit (`rate_limited`, `too_many_streams`); nothing was created.

    `retry_after` is the server's `Retry-After` in seconds, or None when it sent none.
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        body: Any = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, code, message, body)
        self.retry_after = retry_after


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
    401: Unauthorized,
    403: Forbidden,
    409: Conflict,
    410: StreamExpired,
    # FastAPI reports body validation failures as 422; to a caller that is the same mistake as 400.
    422: BadRequest,
}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or an HTTP date); None if unusable."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def error_from_response(
    status: int,
    body: bytes,
    *,
    not_found: type[NotFound] = NotFound,
    headers: Mapping[str, str] | None = None,
) -> BrokerHTTPError:
    """Build the exception that matches an error response's status, body and headers."""
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
    message = message or f"HTTP {status}"
    if status == 429:
        retry_after = parse_retry_after((headers or {}).get("retry-after"))
        return RateLimited(status, code, message, parsed, retry_after=retry_after)
    if status == 404:
        cls: type[BrokerHTTPError] = not_found
    elif status >= 500:
        cls = ServerError
    else:
        cls = _BY_STATUS.get(status, BrokerHTTPError)
    return cls(status, code, message, parsed)
