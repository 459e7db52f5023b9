"""The upstream error taxonomy: one table, shared by every adapter and shown in docs/providers.md.

=====================================  ==========  ===========================================
upstream answer                         retryable   the broker
=====================================  ==========  ===========================================
400, 401, 403, 404, 422 (admission)     no          fails the attempt at once, message passed on
408, 409, 429, 500-599, 529             yes         retries silently before the first delta
                                                    (``Retry-After`` held within the window)
connect or read timeout, dropped conn.  yes         same
any error after the first delta         —           ``interrupted`` (``upstream_error``)
a stream without its terminal event     —           ``interrupted`` (before the first delta:
                                                    retried like a dropped connection)
no bytes for BROKER_UPSTREAM_IDLE_...   —           ``upstream_timeout`` (retried before the
                                                    first delta, ``interrupted`` after)
=====================================  ==========  ===========================================
"""

from __future__ import annotations

import email.utils
import time

from broker.providers.base import UpstreamError

ADMISSION = {
    400: "upstream_bad_request",
    401: "upstream_unauthorized",
    403: "upstream_forbidden",
    404: "upstream_not_found",
    422: "upstream_unprocessable",
}
RETRYABLE = {
    408: "upstream_timeout",
    409: "upstream_conflict",
    429: "upstream_rate_limited",
    529: "upstream_overloaded",
}


def classify_status(status: int) -> tuple[str, bool]:
    """``(code, retryable)`` for an upstream HTTP status."""
    if status in ADMISSION:
        return ADMISSION[status], False
    if status in RETRYABLE:
        return RETRYABLE[status], True
    if 500 <= status <= 599:
        return "upstream_unavailable", True
    if 400 <= status <= 499:
        return f"upstream_http_{status}", False
    return f"upstream_http_{status}", True


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def status_error(status: int, message: str, retry_after_header: str | None = None) -> UpstreamError:
    """The UpstreamError for an upstream HTTP error answer (message without secrets)."""
    code, retryable = classify_status(status)
    return UpstreamError(
        code,
        f"HTTP {status}: {message}"[:500],
        retryable=retryable,
        retry_after_s=retry_after(retry_after_header) if retryable else None,
    )


def transport_error(kind: str, message: str) -> UpstreamError:
    """A connect/read timeout or a dropped connection: retryable before the first delta."""
    code = "upstream_timeout" if "timeout" in kind.lower() else "upstream_connection"
    return UpstreamError(code, message[:500], retryable=True)
