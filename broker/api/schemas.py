"""The shapes of the API's responses, for the OpenAPI document (``/openapi.json``).

The routes build their JSON themselves (orjson, no re-validation on the hot path); these models
only describe it, so that clients and the schema fuzzer know every status a route may answer.
The event stream is described event by event: a model per event type for the JSON of its
``data``, the same in SSE frames and in JSON pages. Parameters that routes parse themselves
(to keep the broker's error codes) are declared here as the routes read them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from broker.vocabulary import ID_PATTERN

REF_TEMPLATE = "#/components/schemas/{model}"
# Schemas that routes reference by hand (bodies we parse ourselves): added to the document.
COMPONENTS: dict[str, Any] = {}


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema, with its nested models registered as document components."""
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    COMPONENTS.update(schema.pop("$defs", {}))
    return schema


def component(model: type[BaseModel]) -> dict[str, Any]:
    """A ``$ref`` to ``model``, registered (with its nested models) as a document component."""
    COMPONENTS[model.__name__] = json_schema(model)
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


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


class PendingToolCall(BaseModel):
    """A client tool call the canonical attempt ended with (``requires_action``)."""

    call_id: str = Field(description="derived from the call's slot: the same after a retry")
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class PendingApproval(BaseModel):
    """A tool call that waits for a person (the ``approval_request`` event's fields)."""

    approval_id: str
    call_id: str
    name: str
    ordinal: int
    args: Any
    expires_at: float = Field(description="seconds since the epoch: then it is denied (expired)")


class ApprovalDecided(BaseModel):
    """The decision that stands on an approval."""

    turn_id: str
    approval_id: str
    decision: Literal["approve", "deny"]
    reason: str | None
    by: Literal["person", "expiry", "stop"]


class ApprovalConflict(ApprovalDecided):
    """409: another decision stands (it is the body's ``decision``)."""

    error: ErrorDetail


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
    tool_calls: list[PendingToolCall] | None = Field(
        default=None,
        description="the client tool calls the canonical attempt ended with, when it ended "
        "requires_action: run them and send the results in the next turn",
    )
    approvals: list[PendingApproval] | None = Field(
        default=None,
        description="when the turn is awaiting_approval: the tool calls that wait for a "
        "decision (POST /v1/turns/{turn_id}/approvals/{approval_id})",
    )


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


# --- the events of a stream: the JSON of their `data`, one model per `event` type ---------

# A wire offset (zero-padded Redis entry id); a client sends one back, or a sentinel.
OFFSET_PATTERN = "^[0-9]{16}-[0-9]{10}$"
# What a read accepts as its resume point: nothing (from the start), -1, now, or an offset.
START_PATTERN = "^(|-1|now|[0-9]{16}-[0-9]{10})$"
STREAM_ID_PATTERN = "^st_[0-9a-f]{32}$"
# A path parameter that names a turn, a conversation or a chat: a client-minted id.
ID_PARAMETER: dict[str, Any] = {
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": ID_PATTERN.pattern},
}


class AttemptEvent(BaseModel):
    """``attempt``: an attempt begins (with its first delta: silent retries show nothing)."""

    attempt: int = Field(ge=1, description="the attempt's number, 1 for the turn's first")
    strategy: Literal["initial", "continue", "regenerate"]


class DeltaEvent(BaseModel):
    """``delta``: the next piece of the attempt's text; the text is the deltas joined."""

    attempt: int = Field(ge=1)
    text: str


class ToolCallEvent(BaseModel):
    """``tool_call``: the model called a tool; ``dispatched`` before it runs through the
    ledger, ``client`` when it is a call of a client tool whose arguments are whole (the client
    runs it: the attempt ends ``requires_action``), or ``not_run`` when its arguments were cut
    off (``reason`` ``connection_lost``; a server call's ``args`` and ``ordinal`` are null) or
    are not JSON (``bad_arguments``, a client call's)."""

    attempt: int = Field(ge=1)
    call_id: str
    name: str
    args: Any = Field(description="the parsed arguments (their raw text if not JSON)")
    ordinal: int | None = Field(ge=0, description="this tool's how-many-th call in the turn")
    status: Literal["dispatched", "client", "not_run"]
    reason: str | None = None


class ToolInputDeltaEvent(BaseModel):
    """``tool_input_delta``: the next piece of a client tool call's arguments (JSON text) as
    the model writes them; a ``tool_call`` follows once they are whole (or cut off)."""

    attempt: int = Field(ge=1)
    call_id: str = Field(description="derived from the call's slot: the same after a retry")
    name: str
    ordinal: int = Field(ge=0, description="this tool's how-many-th call in the attempt")
    delta: str


class ToolResultEvent(BaseModel):
    """``tool_result``: a dispatched call's outcome: ``ran`` now, ``replayed`` from the ledger
    (never run twice), or ``refused`` (not run); ``result`` when ``ok``, ``error`` otherwise."""

    attempt: int = Field(ge=1)
    call_id: str
    name: str
    ordinal: int = Field(ge=0)
    source: Literal["ran", "replayed", "refused"]
    status: Literal["ok", "error"]
    result: Any = None
    error: dict[str, Any] | None = None


class ApprovalRequestEvent(PendingApproval):
    """``approval_request``: a server tool call waits for a person's decision; the turn is
    ``awaiting_approval`` and the stream stays open until it is decided."""

    attempt: int = Field(ge=1)


class ApprovalDecisionEvent(BaseModel):
    """``approval_decision``: the decision that stands (the first one): by a ``person``, by
    the ``expiry`` (deny, reason ``expired``) or by a ``stop`` of the turn."""

    attempt: int = Field(ge=1)
    approval_id: str
    decision: Literal["approve", "deny"]
    reason: str | None = None
    by: Literal["person", "expiry", "stop"]


class UsageEvent(BaseModel):
    """``usage``: tokens of one upstream call (an attempt with tool steps has several)."""

    attempt: int = Field(ge=1)
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)


class ErrorEvent(BaseModel):
    """``error``: why the attempt is about to end ``failed`` or ``interrupted`` (an ``end``
    follows)."""

    attempt: int = Field(ge=1)
    code: str
    message: str
    retryable: bool
    upstream_code: str | None = Field(
        default=None,
        description="With attempts_exhausted or retry_budget_exhausted: the last upstream "
        "error's code (upstream_rate_limited, upstream_unavailable, ...).",
    )


class EndEvent(BaseModel):
    """``end``: the attempt's terminal sentinel. A turn is complete only if an ``end`` with
    ``complete`` arrived; a connection that closes without one was cut."""

    attempt: int = Field(ge=1)
    status: Literal["complete", "interrupted", "cancelled", "failed", "requires_action"]
    reason: str | None = Field(
        default=None, description="with requires_action: tool_calls (see the turn's tool_calls)"
    )


class ResumePointEvent(BaseModel):
    """``resume_point``: SSE only, the first frame of a read from ``now``, not a stored event:
    its id (and ``offset``) is where the read starts, so a client that drops before the first
    event resumes from there."""

    offset: str = Field(pattern=OFFSET_PATTERN)


class ReplacedEvent(BaseModel):
    """``replaced``: SSE only, without an id, the last frame of a one-viewer attach token's
    connection that a newer connection of the token took over: do not reconnect."""

    code: Literal["viewer_replaced"]
    message: str


# The stored events, as a JSON page lists them and an SSE stream sends them.
STORED_EVENTS: dict[str, type[BaseModel]] = {
    "attempt": AttemptEvent,
    "delta": DeltaEvent,
    "tool_call": ToolCallEvent,
    "tool_input_delta": ToolInputDeltaEvent,
    "tool_result": ToolResultEvent,
    "approval_request": ApprovalRequestEvent,
    "approval_decision": ApprovalDecisionEvent,
    "usage": UsageEvent,
    "error": ErrorEvent,
    "end": EndEvent,
}
# What an SSE stream sends besides them.
SSE_ONLY_EVENTS: dict[str, type[BaseModel]] = {
    "resume_point": ResumePointEvent,
    "replaced": ReplacedEvent,
}
# The events that carry no id of their own (a parser gives them the last one it saw).
WITHOUT_ID: frozenset[str] = frozenset({"replaced"})


class StreamPage(BaseModel):
    events: list[dict[str, Any]] = Field(
        description="the events after the page's start, in order: `id` (the offset), `event` "
        "(the type) and `data` (its JSON, as SSE sends it)"
    )
    next_offset: str = Field(
        description="where the next page starts: the last event's offset (or the page's own "
        "start when it is empty); store it and send it back as `offset`"
    )
    up_to_date: bool = Field(description="nothing more is stored past this page")
    closed: bool = Field(
        description="the turn is at rest and this page reaches its end: nothing more will "
        "come unless a new attempt starts"
    )


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
    429: "a tenant limit, or the caller's share of connections; see Retry-After",
    431: "headers larger than BROKER_MAX_HEADER_BYTES",
    503: "Redis is unavailable; retry shortly",
}
# What any authenticated route may answer whatever it does (429: a caller past its share of
# connections, BROKER_MAX_CONNECTIONS_PER_TENANT or _PER_ADDRESS, on any route).
COMMON = (400, 401, 403, 404, 413, 429, 431, 503)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries with the error body for ``statuses`` and the common ones."""
    wanted = sorted(set(statuses) | set(COMMON))
    return {s: {"model": ErrorBody, "description": _MEANING[s]} for s in wanted}


def _sse_event(kind: str, model: type[BaseModel]) -> dict[str, Any]:
    """One SSE event as a parsed frame: ``event``, ``id`` and its ``data`` of JSON."""
    return {
        "type": "object",
        "title": f"{kind} event",
        "required": ["event", "data"] if kind in WITHOUT_ID else ["event", "id", "data"],
        "properties": {
            "event": {"const": kind},
            "id": {"type": "string", "pattern": OFFSET_PATTERN},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": component(model),
            },
            "retry": {"type": "integer", "minimum": 0},
        },
    }


def _page_event(kind: str, model: type[BaseModel]) -> dict[str, Any]:
    """One event of a JSON page: the SSE event with its ``data`` parsed."""
    return {
        "type": "object",
        "title": f"{kind} event",
        "required": ["id", "event", "data"],
        "properties": {
            "id": {"type": "string", "pattern": OFFSET_PATTERN},
            "event": {"const": kind},
            "data": component(model),
        },
    }


def stream_page_schema() -> dict[str, Any]:
    """:class:`StreamPage`, with each event's ``data`` of the schema of its type."""
    schema = json_schema(StreamPage)
    schema["properties"]["events"]["items"] = {
        "oneOf": [_page_event(kind, model) for kind, model in STORED_EVENTS.items()]
    }
    COMPONENTS["StreamPage"] = schema
    return {"$ref": REF_TEMPLATE.format(model="StreamPage")}


def stream_responses() -> dict[int | str, dict[str, Any]]:
    """``GET /v1/streams/{id}``: SSE, a JSON page, or 204 when nothing will ever follow.

    The event stream is described as its events, one ``itemSchema`` per event (as OpenAPI 3.2
    and FastAPI's own SSE routes do): ``data`` is a string of JSON whose ``contentSchema`` is
    the event type's. Heartbeat comments and the ``retry:`` line are not events.
    """
    events = {**STORED_EVENTS, **SSE_ONLY_EVENTS}
    return {
        200: {
            "description": "text/event-stream (default): the events after the resume point, "
            "live until the turn is at rest; or, with format=json, a catch-up page",
            "content": {
                "text/event-stream": {
                    "itemSchema": {"oneOf": [_sse_event(k, m) for k, m in events.items()]}
                },
                "application/json": {"schema": stream_page_schema()},
            },
        },
        204: {"description": "the turn is at rest and nothing follows the resume point"},
        **errors(409, 410),
    }


def response_event() -> dict[str, Any]:
    """An event of the OpenAI Responses stream: ``event`` is the ``type`` of its JSON ``data``."""
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string", "description": "response.created, ..."},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"type": "object", "required": ["type", "sequence_number"]},
            },
        },
    }


def chunk_event() -> dict[str, Any]:
    """An event of a Chat Completions stream: a ``chat.completion.chunk`` of JSON, or the
    closing ``[DONE]`` (which is not JSON)."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"const": "message"},
            "data": {"type": "string", "description": "a chat.completion.chunk, or [DONE]"},
        },
    }


def ui_stream_event() -> dict[str, Any]:
    """An event of the AI SDK's UI message stream: a chunk of JSON, or the closing ``[DONE]``."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "description": "a UI message chunk, or [DONE]"}},
    }


def resume_parameters(*, sentinels: bool) -> list[dict[str, Any]]:
    """``Last-Event-ID`` and ``offset`` of a stream read (``-1`` and ``now`` with
    ``sentinels``; an empty value is no resume point)."""
    pattern = START_PATTERN if sentinels else "^(|[0-9]{16}-[0-9]{10})$"
    start = {"type": "string", "pattern": pattern}
    return [
        {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "schema": start,
            "description": "the resume point: the id of the last event the client got "
            "(browsers' EventSource sends it when they reconnect); the read starts right "
            "after it. Wins over `offset`.",
        },
        {
            "name": "offset",
            "in": "query",
            "required": False,
            "schema": {**start, "default": "-1"} if sentinels else start,
            "description": "the resume point when there is no Last-Event-ID: `-1` from the "
            "start (the default), `now` only new events, or an event's id (replay is "
            "exclusive of it)"
            if sentinels
            else "the resume point when there is no Last-Event-ID: an event's id",
        },
    ]


def stream_parameters(long_poll_max_s: int = 25) -> dict[str, Any]:
    """``openapi_extra`` of ``GET /v1/streams/{id}``: its parameters, as the route parses them."""
    return {
        "parameters": [
            {
                "name": "stream_id",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "pattern": STREAM_ID_PATTERN},
                "description": "the turn's stream id (`stream_id` of the turn)",
            },
            *resume_parameters(sentinels=True),
            {
                "name": "format",
                "in": "query",
                "required": False,
                "schema": {"type": "string", "enum": ["sse", "json"], "default": "sse"},
                "description": "`sse`: an event stream; `json`: one catch-up page",
            },
            {
                "name": "wait",
                "in": "query",
                "required": False,
                "schema": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": long_poll_max_s,
                    "default": 0,
                },
                "description": "with format=json only (else 400): seconds a page with nothing "
                "past its offset waits for the first new event (a long poll), up to "
                "BROKER_LONG_POLL_MAX_S; 0 answers at once",
            },
            {
                "name": "heartbeat",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 15, "maximum": 120},
                "description": "SSE only (else 400): seconds between heartbeats on a quiet "
                "stream, to save a phone's battery: from BROKER_SSE_HEARTBEAT_S to "
                "BROKER_SSE_HEARTBEAT_MAX_S",
            },
            {
                "name": "batch_ms",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 0, "maximum": 1000, "default": 0},
                "description": "SSE only (else 400): milliseconds live events may wait to be "
                "sent together in one write, for fewer bytes once compressed and fewer radio "
                "wake-ups; 0 sends each at once; up to BROKER_SSE_BATCH_MAX_MS",
            },
            {
                "name": "token",
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "description": "an attach token, for clients that cannot send headers",
            },
        ]
    }
