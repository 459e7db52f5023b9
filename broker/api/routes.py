"""The v1 routes: turns, streams, health and metrics."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import APIRouter, Query, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import PlainTextResponse, Response

from broker.api.native import event_stream
from broker.api.schemas import (
    ApprovalConflict,
    ApprovalDecided,
    AttachToken,
    ErrorBody,
    History,
    Status,
    ToolCalls,
    TurnCreated,
    TurnState,
    errors,
    stream_parameters,
    stream_responses,
)
from broker.approval_rules import MAX_REASON_CHARS
from broker.auth import Principal
from broker.errors import BadRequest, Forbidden
from broker.http import (
    Actor,
    Approver,
    Caller,
    Hangup,
    Services,
    body_schema,
    json_response,
    parse_body,
    services,
    until_gone,
)
from broker.numbers import whole_number
from broker.reader import StartPoint
from broker.turns import WHOLE, AttemptRequest, CanonicalRequest, TurnRequest
from broker.viewer import admit

if TYPE_CHECKING:
    from broker.settings import Settings

api_router = APIRouter()
ops_router = APIRouter()


class AttachTokenRequest(BaseModel):
    """The body of ``POST /v1/turns/{turn_id}/attach-tokens`` (all optional)."""

    # Strict: `true`, `"5"` and `0.5` are not a lifetime, and a boolean is only true or false.
    model_config = ConfigDict(extra="forbid", strict=True)

    ttl_s: Annotated[int, Field(ge=1, le=31_536_000), WHOLE] | None = Field(
        default=None,
        description="lifetime in whole seconds (default BROKER_ATTACH_TOKEN_TTL, capped at "
        "BROKER_ATTACH_TOKEN_MAX_TTL)",
    )
    one_viewer: bool = Field(
        default=False, description="admit one SSE connection at a time (409 for a second)"
    )
    approve: bool = Field(
        default=False,
        description="the approve scope: the token may also decide the turn's tool approvals",
    )


@api_router.post(
    "/v1/turns",
    openapi_extra=body_schema(TurnRequest),
    status_code=201,
    response_model=TurnCreated,
    responses={
        200: {"model": TurnCreated, "description": "the existing turn"},
        **errors(409, 410, 422, 429),  # 422: a notify URL this broker will not call
    },
)
async def create_turn(request: Request, principal: Actor) -> Response:
    """Start a turn; the same ``turn_id`` with the same request returns the existing turn."""
    turn_request = await parse_body(request, TurnRequest)
    created, turn = await services(request).turns.create(turn_request, principal.tenant)
    return json_response(turn, 201 if created else 200)


@api_router.post(
    "/v1/turns/{turn_id}/attempts",
    openapi_extra=body_schema(AttemptRequest),
    status_code=201,
    response_model=TurnState,
    responses=errors(409, 410, 422, 429),
)
async def start_attempt(request: Request, turn_id: str, principal: Actor) -> Response:
    """Continue or regenerate a turn at rest: 409 while a generation runs, 422 not allowed.

    Answers the turn as the request left it: ``queued``, the new attempt last.
    """
    attempt_request = await parse_body(request, AttemptRequest)
    turns = services(request).turns
    return json_response(await turns.start_attempt(turn_id, attempt_request, principal.tenant), 201)


@api_router.post("/v1/turns/{turn_id}/cancel", response_model=TurnState, responses=errors(410))
async def cancel_turn(request: Request, turn_id: str, principal: Actor) -> Response:
    """The stop button: ends the running attempt `cancelled`, keeping its text. Idempotent."""
    return json_response(await services(request).turns.cancel(turn_id, principal.tenant))


class ApprovalDecisionRequest(BaseModel):
    """The body of ``POST /v1/turns/{turn_id}/approvals/{approval_id}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    decision: Literal["approve", "deny"]
    reason: str | None = Field(
        default=None, max_length=MAX_REASON_CHARS, description="told to the model on deny"
    )


@api_router.post(
    "/v1/turns/{turn_id}/approvals/{approval_id}",
    openapi_extra=body_schema(ApprovalDecisionRequest),
    response_model=ApprovalDecided,
    responses={
        409: {"model": ApprovalConflict, "description": "another decision stands"},
        **errors(403, 410),
    },
)
async def decide_approval(
    request: Request, turn_id: str, approval_id: str, principal: Approver
) -> Response:
    """Approve or deny a tool call that waits for a person: the first decision wins. The same
    decision again answers 200 with it; another answers 409 with the one that stands."""
    body = await parse_body(request, ApprovalDecisionRequest)
    rt = services(request)
    if principal.kind == "attach":  # an approve-scoped attach token: its own turn's only
        head = await rt.turns.find(turn_id, principal.tenant)
        if head is None or head.stream_id != principal.stream_id:
            raise Forbidden("this attach token is for another turn", code="read_only")
    decided = await rt.turns.decide(
        turn_id, approval_id, body.decision, body.reason, principal.tenant
    )
    shown = {"turn_id": turn_id, **decided.shown()}
    if decided.decision != body.decision:
        message = f"approval {approval_id!r} was decided already: {decided.decision}"
        error = {"code": "approval_decided", "message": message}
        return json_response({"error": error, **shown}, 409)
    return json_response(shown)


@api_router.post(
    "/v1/turns/{turn_id}/canonical",
    openapi_extra=body_schema(CanonicalRequest),
    response_model=TurnState,
    responses=errors(409, 410, 422),
)
async def promote_attempt(request: Request, turn_id: str, principal: Actor) -> Response:
    """Choose which attempt is the turn's answer, by compare-and-set on the current one."""
    canonical_request = await parse_body(request, CanonicalRequest)
    turns = services(request).turns
    return json_response(await turns.promote(turn_id, canonical_request, principal.tenant))


@api_router.post(
    "/v1/turns/{turn_id}/attach-tokens",
    openapi_extra=body_schema(AttachTokenRequest, required=False),
    status_code=201,
    response_model=AttachToken,
    responses=errors(410),
)
async def mint_attach_token(request: Request, turn_id: str, principal: Actor) -> Response:
    """A signed, read-only token for the turn's stream: for EventSource, second devices, links."""
    token_request = await parse_body(request, AttachTokenRequest, optional=True)
    rt = services(request)
    state = await rt.turns.get(turn_id, principal.tenant)
    stream_id = state["stream_id"]
    minted = rt.auth.mint_attach(
        principal.tenant,
        stream_id,
        token_request.ttl_s,
        token_request.one_viewer,
        not_after=principal.expires_at,
        approve=token_request.approve,
    )
    return json_response(
        {
            "token": minted.token,
            "turn_id": turn_id,
            "stream_id": stream_id,
            "expires_at": minted.expires_at,
            "one_viewer": token_request.one_viewer,
            "links": {"stream": f"/v1/streams/{stream_id}?token={minted.token}"},
        },
        201,
    )


@api_router.get("/v1/turns/{turn_id}/tool-calls", response_model=ToolCalls, responses=errors(410))
async def tool_calls(request: Request, turn_id: str, principal: Actor) -> Response:
    """The ledger rows of a turn's tool calls, for audit."""
    rt = services(request)
    conversation_id = await rt.turns.locate(turn_id, principal.tenant)
    rows = await rt.ledger.rows(conversation_id, turn_id)
    return json_response({"turn_id": turn_id, "tool_calls": rows})


@api_router.get(
    "/v1/conversations/{conversation_id}/messages", response_model=History, responses=errors()
)
async def conversation_messages(
    request: Request, conversation_id: str, principal: Actor
) -> Response:
    """The conversation as the next request must send it: canonical answers only."""
    return json_response(await services(request).turns.history(conversation_id, principal.tenant))


@api_router.get("/v1/turns/{turn_id}", response_model=TurnState, responses=errors(410))
async def get_turn(request: Request, turn_id: str, principal: Actor) -> Response:
    """The turn's status, attempts and canonical text."""
    return json_response(await services(request).turns.get(turn_id, principal.tenant))


@api_router.get(
    "/v1/streams/{stream_id}", responses=stream_responses(), openapi_extra=stream_parameters()
)
async def read_stream(
    request: Request,
    stream_id: str,
    principal: Caller,
    offset: str | None = None,
    format: str | None = None,
    token: Annotated[
        str | None, Query(description="an attach token, for clients that cannot send headers")
    ] = None,
    wait: Annotated[
        str | None,
        Query(
            description="format=json only: seconds to wait for the first new event when none "
            "is stored past the offset (a long poll), from 0 to BROKER_LONG_POLL_MAX_S"
        ),
    ] = None,
    heartbeat: Annotated[
        str | None,
        Query(
            description="SSE only: seconds between heartbeats on a quiet stream, to save a "
            "phone's battery: from BROKER_SSE_HEARTBEAT_S to BROKER_SSE_HEARTBEAT_MAX_S"
        ),
    ] = None,
    batch_ms: Annotated[
        str | None,
        Query(
            description="SSE only: milliseconds live events may wait to be sent together in "
            "one write (fewer bytes compressed, fewer radio wake-ups), from 0 (each at once, "
            "the default) to BROKER_SSE_BATCH_MAX_MS"
        ),
    ] = None,
) -> Response:
    """Read a turn's events as SSE (default) or as a JSON catch-up page (``format=json``).

    The SSE form never reaches this route: the app's front door answers it
    (:mod:`broker.api.stream_reads`, the same checks and response). This route documents both
    forms, and serves the JSON pages."""
    rt = services(request)
    read = checked_read(
        rt,
        stream_id,
        principal,
        format=format,
        offset=offset,
        wait=wait,
        heartbeat=heartbeat,
        batch_ms=batch_ms,
        last_event_id=request.headers.get("last-event-id"),
    )
    assert read.json  # (an SSE read is the front door's: see the docstring)
    location = await rt.streams.locate(stream_id, principal.tenant, start=read.start)
    page = rt.streams.page(location, read.start, read.wait_s)
    if read.wait_s <= 0:
        return json_response(await page)
    waited = await until_gone(request, page)
    return json_response({} if waited is Hangup.HUNG_UP else waited)


@dataclasses.dataclass(frozen=True, slots=True)
class StreamRead:
    """A read of ``GET /v1/streams/{id}`` whose parameters passed: its form and its start."""

    json: bool
    start: StartPoint
    wait_s: float
    heartbeat_s: float | None
    batch_s: float


def checked_read(
    rt: Services,
    stream_id: str,
    principal: Principal,
    *,
    format: str | None,
    offset: str | None,
    wait: str | None,
    heartbeat: str | None,
    batch_ms: str | None,
    last_event_id: str | None,
) -> StreamRead:
    """The checks of a stream read, in the order its errors come: a bad parameter (400), a
    token that may not read this stream this way (403), a malformed offset (400)."""
    if format not in (None, "sse", "json"):
        raise BadRequest("format must be sse or json", code="bad_format")
    json = format == "json"
    wait_s = long_poll_wait(wait, rt.settings.long_poll_max_s, json=json)
    heartbeat_s = heartbeat_period(heartbeat, rt.settings, sse=not json)
    batch_s = batch_period(batch_ms, rt.settings.sse_batch_max_ms, sse=not json)
    admit(rt.metrics, principal, stream_id, sse=not json)
    # 400 for a malformed offset before anything else. Last-Event-ID wins over ?offset=, but a
    # malformed ?offset= is refused even then: it is bad input all the same.
    start = StartPoint.parse(offset)
    if last_event_id:
        start = StartPoint.parse(last_event_id)
    return StreamRead(json, start, wait_s, heartbeat_s, batch_s)


async def sse_read(
    rt: Services, stream_id: str, principal: Principal, read: StreamRead
) -> Response:
    """The SSE response of a checked read: 404 or 410 when its stream is unknown or expired,
    204 when nothing will ever follow its start."""
    # An SSE read learns whether the data still exists from its opening round trip.
    location = await rt.streams.locate(stream_id, principal.tenant, start=read.start, check=False)
    return await event_stream(rt, location, read.start, principal, read.heartbeat_s, read.batch_s)


def heartbeat_period(raw: str | None, settings: Settings, *, sse: bool) -> float | None:
    """The seconds of a ``heartbeat`` parameter (None: the default); 400 unless it is a whole
    number from the broker's own period to its longest (and the read SSE)."""
    if raw is None:
        return None
    if not sse:
        raise BadRequest("heartbeat applies to SSE reads only", code="bad_heartbeat")
    low, high = settings.sse_heartbeat_s, settings.sse_heartbeat_max_s
    seconds = whole_number(raw, math.ceil(low), math.floor(high))
    if seconds is None:
        raise BadRequest(
            f"heartbeat must be a whole number of seconds from {low:g} to {high:g}",
            code="bad_heartbeat",
        )
    return float(seconds)


def batch_period(raw: str | None, max_ms: int, *, sse: bool) -> float:
    """The seconds of a ``batch_ms`` parameter (0: none); 400 unless it is a whole number of
    milliseconds in range (and the read SSE)."""
    if raw is None:
        return 0.0
    if not sse:
        raise BadRequest("batch_ms applies to SSE reads only", code="bad_batch")
    millis = whole_number(raw, 0, max_ms)
    if millis is None:
        raise BadRequest(
            f"batch_ms must be a whole number of milliseconds from 0 to {max_ms}",
            code="bad_batch",
        )
    return millis / 1000


def long_poll_wait(raw: str | None, max_s: float, *, json: bool) -> float:
    """The seconds of a ``wait`` parameter; 400 unless it is a whole number in range (and the
    read a JSON page)."""
    if raw is None:
        return 0.0
    if not json:
        raise BadRequest("wait applies to format=json only (SSE waits by itself)", code="bad_wait")
    seconds = whole_number(raw, 0, math.floor(max_s))
    if seconds is None:
        raise BadRequest(
            f"wait must be a whole number of seconds from 0 to {max_s:g}", code="bad_wait"
        )
    return float(seconds)


@ops_router.get("/healthz", response_model=Status)
async def healthz() -> Response:
    """Liveness: the process answers."""
    return json_response({"status": "ok"})


@ops_router.get(
    "/readyz",
    response_model=Status,
    responses={503: {"model": ErrorBody, "description": "not ready"}},
)
async def readyz(request: Request) -> Response:
    """Readiness: Redis answers and every Lua script is loaded."""
    try:
        await services(request).ready()
    except Exception as exc:  # any failure means "not ready", never a 500
        # The exception's class only: its text may name hosts and paths.
        message = f"not ready: Redis answered {type(exc).__name__}"
        return json_response({"error": {"code": "redis_unavailable", "message": message}}, 503)
    return json_response({"status": "ready"})


@ops_router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={401: {"model": ErrorBody, "description": "BROKER_METRICS_TOKEN needed"}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format (behind ``Bearer <BROKER_METRICS_TOKEN>`` when that is set)."""
    services(request).auth.check_metrics(request.headers.get("authorization"))
    body = services(request).metrics.exposition()
    return Response(body, media_type=CONTENT_TYPE_LATEST)
