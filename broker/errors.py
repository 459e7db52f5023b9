r"""The broker's exceptions: one root, stable codes, one table of HTTP statuses.

::

    BrokerError                 code            status
    ├── BadRequest              bad_request     400   malformed body, offset or id
    │   └── ParamError          (dialects)      400   an OpenAI request parameter we refuse
    ├── Unauthorized            unauthorized    401   no credentials, or credentials refused
    ├── Forbidden               forbidden       403   an attach token used beyond its scope
    ├── StaleEpoch              stale_epoch     403   (durable_store) a fenced producer epoch
    ├── NotFound                not_found       404   unknown turn or stream
    ├── MethodNotAllowed        read_only       405   (dialects.durable) a generation written to
    ├── Conflict                conflict        409   same turn_id, different request
    ├── Gone                    expired         410   the turn existed but its data expired
    ├── BodyTooLarge            too_large       413   (api.limits) body over BROKER_MAX_BODY_BYTES
    ├── AppendsFull             stream_full     413   (durable_store) too many appends
    ├── NotAllowed              not_allowed     422   valid request, wrong state
    ├── TooManyRequests         rate_limited    429   a tenant's rate or stream limit
    ├── QuotaExceeded           quota_exceeded  429   (durable_store) a tenant's DS quota
    ├── NotSupported            not_supported   501   (dialects.durable) a generation forked
    ├── FencedWrite             fenced          —     a writer's lease was taken over
    ├── LeaseLost               lease_lost      —     an attempt's lease was taken over
    ├── StopRequested           stop_requested  —     the user pressed stop during an append
    ├── StreamFull              stream_full     —     BROKER_MAX_STREAM_EVENTS reached
    ├── UpstreamError           (the upstream's) —    (providers.base) the model call failed
    ├── ToolError               (the tool's)    —     (tools) a tool call failed
    ├── SettingsError           bad_setting     —     (settings) a BROKER_* value is unusable
    ├── ToolConfigError         bad_tools       —     (tools) the tools file is invalid
    ├── RedisConnectError       redis_unreachable —   (connection) Redis cannot be reached
    └── EmbeddedRedisError      embedded_redis  —     (embedded_redis) the embedded server failed

The classes marked with a module live next to the code that raises them. ``SettingsError`` and
``ToolConfigError`` are also ``ValueError``\ s, and the two Redis start-up errors
``RuntimeError``\ s, as callers have always caught them.

A class without a status never reaches a client as itself: the worker turns lease, stop and
stream errors into turn outcomes and upstream and tool errors into ``error`` events, and the
command line prints start-up errors in one line. A Redis error that reaches the HTTP layer is
answered 503 ``redis_unavailable`` by the error handlers (:data:`REDIS_UNAVAILABLE` names
what counts as one, so that no door imports the Redis client to catch it).

Deliberately outside the tree: control flow that never leaves the broker's own rooms and is
never an error of the broker: ``generation._Retry`` (a silent retry unwinding an upstream call),
``tool_steps.ToolFailure`` (a tool outcome that fails the turn, caught by the generation) and
``fanout.HubClosed`` (the hub closed at shutdown, which ends a read as its client's
disconnection would).
"""

from __future__ import annotations

from typing import ClassVar, Final

from redis.exceptions import RedisError

# What a call to Redis raises when Redis did not answer: the HTTP layer's 503.
REDIS_UNAVAILABLE: Final[tuple[type[Exception], ...]] = (RedisError, ConnectionError)


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
