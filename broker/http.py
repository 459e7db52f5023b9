"""Handler plumbing every door imports: the services a handler gets, the caller, bodies, JSON
answers, and the race of a wait against the client's leaving.

:class:`Services` is what the assembly (:class:`broker.app.Runtime`) hands to the doors: the
core's objects (turns, streams, the sequence index, auth, ...) and the viewer rules, and neither
a Redis client nor a key builder. A handler reaches Redis only through the core's methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import orjson
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import Scope

from broker.api.errors import describe_validation
from broker.api.limits import hold_share
from broker.api.schemas import json_schema
from broker.auth import Authenticator, Principal, require_actor, require_approver
from broker.errors import BadRequest, Forbidden, Unauthorized
from broker.metrics import AUTH_FAILURES, Metrics
from broker.providers import Providers
from broker.reader import Location, StartPoint, Streams
from broker.relay import Read, relay
from broker.sequence_index import SequenceIndex
from broker.settings import Settings
from broker.sse import EventStreamResponse
from broker.turns import PARK_WAIT_S, Turns
from broker.webhook_config import WebhookConfig

if TYPE_CHECKING:
    from broker.deps import Deps
    from broker.durable_store import DurableStore, Subscriptions
    from broker.ledger import Ledger

BodyT = TypeVar("BodyT", bound=BaseModel)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    """What a door's handlers may use: the core's objects, no Redis client, no key builder."""

    settings: Settings
    metrics: Metrics
    auth: Authenticator
    providers: Providers
    turns: Turns
    streams: Streams
    sequences: SequenceIndex
    # The tool ledger's audit rows (the writer side's object: reached here, never imported).
    ledger: Ledger
    # Durable Streams' own streams (a service of their own).
    durable: DurableStore
    # Its subscriptions, and the webhook rules their URLs follow.
    subscriptions: Subscriptions
    webhook_config: WebhookConfig
    # For the relay and readiness only; no door reaches into it.
    _deps: Deps = dataclasses.field(repr=False)

    async def ready(self) -> None:
        """Readiness: Redis answers and has every script (see ``Scripts.ready``)."""
        await self._deps.scripts.ready()

    async def parked(
        self, location: Location, last: str | None, within_s: float = PARK_WAIT_S
    ) -> bool:
        """Whether a read that showed approval requests, its last event at offset ``last``,
        ends at the turn's park: the turn waits for a person (now, or within ``within_s``: see
        :meth:`Turns.parks`) and nothing is stored past ``last`` (the attempt parks after the
        last request of its message: a read that caught up between two goes on, and its reader
        delivers the rest). Every door that ends a read there asks this."""
        if last is None:
            return False
        if not await self.turns.parks(location.conversation_id, location.turn_id, within_s):
            return False
        page = await self.streams.page(location, StartPoint.parse(last))
        return not page["events"]

    async def relay(self, principal: Principal, read: Read) -> EventStreamResponse:
        """``principal``'s streamed ``read`` of a generation, through the one relay (see
        :mod:`broker.relay`: the token's rules, the viewers gauge, batching, heartbeats)."""
        return await relay(self._deps, self.streams, principal, read)


def services(request: Request) -> Services:
    """The services of the app that serves ``request``."""
    found: Services = request.app.state.services
    return found


bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API key, a JWT, or an attach token (read-only, one stream).",
)


async def caller(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
) -> Principal:
    """Who sends the request; 401 when the broker needs credentials and these are refused."""
    return authenticate(
        services(request),
        request.scope,
        request.headers.get("authorization"),
        request.query_params.get("token"),
    )


def authenticate(
    svc: Services, scope: Scope, authorization: str | None, token: str | None
) -> Principal:
    """The principal of an ``Authorization`` header or ``?token=``; 401, counted, when the
    broker needs credentials and these are refused; 429 when the caller's tenant has all its
    share of the process's connections (``limits.hold_share``: every door passes here)."""
    try:
        principal = svc.auth.authenticate(authorization, token)
    except Unauthorized as exc:
        missing = authorization is None and token is None
        reason = (
            "missing" if missing else exc.code if exc.code in AUTH_FAILURES else "bad_credentials"
        )
        svc.metrics.auth_failures.labels(reason).inc()
        raise
    hold_share(scope, principal.tenant)
    return principal


Caller = Annotated[Principal, Depends(caller)]


async def actor(request: Request, principal: Caller) -> Principal:
    """A caller that may act on turns: an attach token is refused (403)."""
    try:
        return require_actor(principal)
    except Forbidden:
        services(request).metrics.auth_failures.labels("forbidden").inc()
        raise


Actor = Annotated[Principal, Depends(actor)]


async def approver(request: Request, principal: Caller) -> Principal:
    """A caller that may decide approvals: an actor, or an attach token with the ``approve``
    scope (403 otherwise)."""
    try:
        return require_approver(principal)
    except Forbidden:
        services(request).metrics.auth_failures.labels("forbidden").inc()
        raise


Approver = Annotated[Principal, Depends(approver)]


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers=headers, media_type="application/json")


async def parse_body(request: Request, model: type[BodyT], *, optional: bool = False) -> BodyT:
    """The request body as ``model``: 400 with a readable message for anything else."""
    raw = await request.body()
    if optional and not raw.strip():
        return model()
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", code="bad_json") from None
    if not isinstance(payload, dict):
        raise BadRequest("body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise BadRequest(describe_validation(exc.errors())) from None


def body_schema(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """OpenAPI for a body we parse ourselves (so that errors keep our shape)."""
    schema = {"content": {"application/json": {"schema": json_schema(model)}}}
    return {"requestBody": {"required": required, **schema}}


class Hangup(enum.Enum):
    """What :func:`until_gone` answers when the client hung up before the work was done."""

    HUNG_UP = "hung up"


async def until_gone(request: Request, work: Coroutine[Any, Any, T]) -> T | Hangup:
    """What ``work`` (a long poll's wait) returns, or ``Hangup.HUNG_UP`` as soon as its client
    hangs up: the work is then cancelled, and a wait gives its place on the feed back."""
    working = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({working, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if working.done():
        return working.result()
    # A wait unsubscribes however its task ends: a cancellation swallowed by the Redis client
    # only lets it run out its time.
    working.cancel()
    return Hangup.HUNG_UP


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (a GET's body is empty: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
