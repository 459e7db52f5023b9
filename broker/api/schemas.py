"""The shapes of the API's responses, for the OpenAPI document (``/openapi.json``).

The routes build their JSON themselves (orjson, no re-validation on the hot path); these models
only describe it, so that clients and the schema fuzzer know every status a route may answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

REF_TEMPLATE = "#/components/schemas/{model}"
# Schemas that routes reference by hand (bodies we parse ourselves): added to the document.
COMPONENTS: dict[str, Any] = {}


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema, with its nested models registered as document components."""
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    COMPONENTS.update(schema.pop("$defs", {}))
    return schema


def install_components(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI document include the components of :func:`json_schema`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in COMPONENTS.items():
                schemas.setdefault(name, schema)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class ErrorDetail(BaseModel):
    code: str = Field(description="stable, machine-readable")
    message: str = Field(description="for people")


class ErrorBody(BaseModel):
    error: ErrorDetail


class Links(BaseModel):
    self: str
    stream: str
    cancel: str
    attempts: str


class TurnCreated(BaseModel):
    turn_id: str
    conversation_id: str
    stream_id: str
    status: str
    attempt: int
    links: Links


class AttemptState(BaseModel):
    n: int
    strategy: str
    status: str
    reason: str | None = None
    canonical: bool
    usage: dict[str, Any] | None = None
    continues: int | None = None


class CanonicalText(BaseModel):
    attempt: int
    text: str


class TurnState(BaseModel):
    turn_id: str
    conversation_id: str
    stream_id: str
    status: str
    attempt: int
    attempts: list[AttemptState]
    canonical: CanonicalText | None
    created_ms: int
    links: Links


class HistoryTurn(BaseModel):
    turn_id: str
    status: str | None
    canonical: int | None
    partial: bool | None = None


class History(BaseModel):
    conversation_id: str
    messages: list[dict[str, Any]]
    turns: list[HistoryTurn]


class ToolCalls(BaseModel):
    turn_id: str
    tool_calls: list[dict[str, Any]]


class AttachLinks(BaseModel):
    stream: str


class AttachToken(BaseModel):
    token: str = Field(description="read-only, for this stream only")
    turn_id: str
    stream_id: str
    expires_at: int = Field(description="unix time, seconds")
    one_viewer: bool
    links: AttachLinks


class PageEvent(BaseModel):
    id: str
    event: str
    data: dict[str, Any]


class StreamPage(BaseModel):
    events: list[PageEvent]
    next_offset: str
    up_to_date: bool
    closed: bool


class Status(BaseModel):
    status: str


_MEANING = {
    400: "bad input: body, id, offset or parameter",
    401: "credentials missing or refused",
    403: "an attach token used beyond its scope",
    404: "unknown (or another tenant's)",
    409: "conflict with the turn's state or another request",
    410: "existed, but its data expired",
    413: "body larger than BROKER_MAX_BODY_BYTES",
    422: "valid, but not allowed in this state",
    429: "a tenant limit; see Retry-After",
    431: "headers larger than BROKER_MAX_HEADER_BYTES",
    503: "Redis is unavailable; retry shortly",
}
# What any authenticated route may answer whatever it does.
COMMON = (400, 401, 403, 404, 413, 431, 503)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries with the error body for ``statuses`` and the common ones."""
    wanted = sorted(set(statuses) | set(COMMON))
    return {s: {"model": ErrorBody, "description": _MEANING[s]} for s in wanted}


def stream_responses() -> dict[int | str, dict[str, Any]]:
    """``GET /v1/streams/{id}``: SSE, a JSON page, or 204 when nothing will ever follow."""
    return {
        200: {
            "description": "text/event-stream (default), or a catch-up page with format=json",
            "content": {
                "text/event-stream": {"schema": {"type": "string"}},
                "application/json": {"schema": json_schema(StreamPage)},
            },
        },
        204: {"description": "the turn is at rest and nothing follows the resume point"},
        **errors(409, 410),
    }
