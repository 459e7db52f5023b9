"""The broker's exceptions: one root, stable codes, one table of HTTP statuses.

::

    BrokerError                 code            status
    ├── BadRequest              bad_request     400   malformed body, offset or id
    ├── Unauthorized            unauthorized    401   no credentials, or credentials refused
    ├── Forbidden               forbidden       403   an attach token used beyond its scope
    ├── NotFound                not_found       404   unknown turn or stream
    ├── Conflict                conflict        409   same turn_id, different request
    ├── Gone                    expired         410   the turn existed but its data expired
    ├── PayloadTooLarge         too_large       413   body over BROKER_MAX_BODY_BYTES
    ├── NotAllowed              not_allowed     422   valid request, wrong state
    ├── TooManyRequests         rate_limited    429   a tenant's rate or stream limit
    ├── Unavailable             redis_unavailable 503 Redis cannot be reached
    ├── FencedWrite             fenced          —     a writer's lease was taken over
    ├── LeaseLost               lease_lost      —     an attempt's lease was taken over
    ├── StopRequested           stop_requested  —     the user pressed stop during an append
    └── StreamFull              stream_full     —     BROKER_MAX_STREAM_EVENTS reached

``FencedWrite``, ``LeaseLost``, ``StopRequested`` and ``StreamFull`` never reach a client: the
worker turns them into turn outcomes.
"""

from __future__ import annotations

from typing import ClassVar


class BrokerError(Exception):
    """Root of every error the broker raises on purpose."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500

    def __init__(
        self, message: str, *, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        if code is not None:
            self.code = code  # type: ignore[misc]  # a finer code for one instance

    def to_json(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


class BadRequest(BrokerError):
    code = "bad_request"
    status = 400


class Unauthorized(BrokerError):
    """No credentials, or credentials the broker does not accept."""

    code = "unauthorized"
    status = 401

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"WWW-Authenticate": 'Bearer realm="broker"'})


class Forbidden(BrokerError):
    code = "forbidden"
    status = 403


class NotFound(BrokerError):
    code = "not_found"
    status = 404


class Conflict(BrokerError):
    code = "conflict"
    status = 409


class Gone(BrokerError):
    code = "expired"
    status = 410


class PayloadTooLarge(BrokerError):
    code = "too_large"
    status = 413


class NotAllowed(BrokerError):
    code = "not_allowed"
    status = 422


class TooManyRequests(BrokerError):
    """A limit of the caller's tenant; ``retry_after_s`` goes out as ``Retry-After``."""

    code = "rate_limited"
    status = 429

    def __init__(self, message: str, *, retry_after_s: int, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, retry_after_s))})
        self.retry_after_s = max(1, retry_after_s)


class Unavailable(BrokerError):
    code = "redis_unavailable"
    status = 503


class FencedWrite(BrokerError):
    code = "fenced"
    status = 409


class LeaseLost(BrokerError):
    """The attempt's lease was taken over: it must write nothing more."""

    code = "lease_lost"
    status = 409

    def __init__(self, message: str = "the lease was taken over") -> None:
        super().__init__(message)


class StopRequested(BrokerError):
    code = "stop_requested"
    status = 409


class StreamFull(BrokerError):
    code = "stream_full"
    status = 422
