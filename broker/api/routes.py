"""The v1 routes: turns, streams, health and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from broker.api.errors import describe_validation
from broker.errors import BadRequest, BrokerError
from broker.offsets import NOW, START, ZERO_ID, from_entry_id, to_entry_id
from broker.sse import PING, EventStreamResponse, opening_frame
from broker.streams import Heartbeat, Location
from broker.turns import AttemptRequest, CanonicalRequest, TurnRequest

if TYPE_CHECKING:
    from broker.app import Runtime

BodyT = TypeVar("BodyT", bound=BaseModel)

api_router = APIRouter()
ops_router = APIRouter()


def runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The request body as ``model``: 400 with a readable message for anything else."""
    raw = await request.body()
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


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body we parse ourselves (so that errors keep our shape)."""
    schema = {"content": {"application/json": {"schema": model.model_json_schema()}}}
    return {"requestBody": {"required": True, **schema}}


@api_router.post("/v1/turns", openapi_extra=body_schema(TurnRequest), status_code=201)
async def create_turn(request: Request) -> Response:
    """Start a turn; the same ``turn_id`` with the same request returns the existing turn."""
    turn_request = await parse_body(request, TurnRequest)
    created, turn = await runtime(request).turns.create(turn_request)
    return json_response(turn, 201 if created else 200)


@api_router.post(
    "/v1/turns/{turn_id}/attempts", openapi_extra=body_schema(AttemptRequest), status_code=201
)
async def start_attempt(request: Request, turn_id: str) -> Response:
    """Continue or regenerate a turn at rest: 409 while a generation runs, 422 not allowed."""
    attempt_request = await parse_body(request, AttemptRequest)
    return json_response(await runtime(request).turns.start_attempt(turn_id, attempt_request), 201)


@api_router.post("/v1/turns/{turn_id}/cancel")
async def cancel_turn(request: Request, turn_id: str) -> Response:
    """The stop button: ends the running attempt `cancelled`, keeping its text. Idempotent."""
    return json_response(await runtime(request).turns.cancel(turn_id))


@api_router.post("/v1/turns/{turn_id}/canonical", openapi_extra=body_schema(CanonicalRequest))
async def promote_attempt(request: Request, turn_id: str) -> Response:
    """Choose which attempt is the turn's answer, by compare-and-set on the current one."""
    canonical_request = await parse_body(request, CanonicalRequest)
    return json_response(await runtime(request).turns.promote(turn_id, canonical_request))


@api_router.get("/v1/turns/{turn_id}/tool-calls")
async def tool_calls(request: Request, turn_id: str) -> Response:
    """The ledger rows of a turn's tool calls, for audit."""
    rt = runtime(request)
    state = await rt.turns.get(turn_id)
    rows = await rt.ledger.rows(state["conversation_id"], turn_id)
    return json_response({"turn_id": turn_id, "tool_calls": rows})


@api_router.get("/v1/conversations/{conversation_id}/messages")
async def conversation_messages(request: Request, conversation_id: str) -> Response:
    """The conversation as the next request must send it: canonical answers only."""
    return json_response(await runtime(request).turns.history(conversation_id))


@api_router.get("/v1/turns/{turn_id}")
async def get_turn(request: Request, turn_id: str) -> Response:
    """The turn's status, attempts and canonical text."""
    return json_response(await runtime(request).turns.get(turn_id))


@api_router.get("/v1/streams/{stream_id}")
async def read_stream(
    request: Request, stream_id: str, offset: str | None = None, format: str | None = None
) -> Response:
    """Read a turn's events as SSE (default) or as a JSON catch-up page (``format=json``)."""
    rt = runtime(request)
    if format not in (None, "sse", "json"):
        raise BadRequest("format must be sse or json", code="bad_format")
    resume = request.headers.get("last-event-id") or offset or START
    if resume not in (START, NOW):
        to_entry_id(resume)  # 400 before anything else for a malformed offset
    try:
        location = await rt.streams.locate(stream_id)
    except BrokerError as exc:
        if resume not in (START, NOW):
            rt.metrics.resumes.labels("expired" if exc.status == 410 else "not_found").inc()
        raise
    if resume not in (START, NOW):
        rt.metrics.resumes.labels("ok").inc()
    if format == "json":
        return json_response(await rt.streams.page(location, resume))
    after = await rt.streams.start_after(location, resume)
    if await rt.streams.finished_before(location, after):
        # Nothing will ever follow this point. 204 tells EventSource to stop reconnecting;
        # a 200 that closes at once would make it reconnect every retry period for ever.
        return Response(status_code=204, headers={"Cache-Control": "no-store"})
    # Announce where this read starts, so a client that drops before the first event resumes
    # from here; after `now` even on an empty stream, where "the start" is the right answer.
    announce = from_entry_id(after) if after != ZERO_ID or resume == NOW else None
    return EventStreamResponse(
        _frames(rt, location, after, announce), send_timeout_s=rt.settings.sse_send_timeout_s
    )


async def _frames(
    rt: Runtime, location: Location, after: str, announce: str | None
) -> AsyncIterator[bytes]:
    viewers = rt.metrics.viewers.labels("sse")
    viewers.inc()
    try:
        yield opening_frame(rt.settings.sse_retry_ms, announce)
        async for item in rt.streams.follow(location, after):
            yield PING if isinstance(item, Heartbeat) else item.frame
    finally:
        viewers.dec()


@ops_router.get("/healthz")
async def healthz() -> Response:
    """Liveness: the process answers."""
    return json_response({"status": "ok"})


@ops_router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Readiness: Redis answers and every Lua script is loaded."""
    rt = runtime(request)
    try:
        await rt.redis.ping()
        if not await rt.scripts.loaded():
            await rt.scripts.load()
    except Exception as exc:  # any failure means "not ready", never a 500
        return json_response(
            {"error": {"code": "redis_unavailable", "message": f"not ready: {exc}"}}, 503
        )
    return json_response({"status": "ready"})


@ops_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    body = generate_latest(runtime(request).metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
