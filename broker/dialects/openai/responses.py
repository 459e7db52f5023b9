"""``/v1/responses``: a response is a turn, and its events are read from the turn's stream.

The response id is the turn id: the ``Idempotency-Key`` header, else ``metadata.turn_id``, else
one minted here. A new response starts a conversation named after it; ``previous_response_id``
continues that response's conversation, sending that response's context (its input and answer)
plus the new input (see :mod:`broker.dialects.openai.inputs`). The fields the response object
echoes (``instructions``, ``metadata``, ``background``, ``store``, ``previous_response_id``) are
stored with the turn's request as its ``echo``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Request, Security
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from broker.api.schemas import ID_PARAMETER, json_schema, response_event
from broker.auth import Principal
from broker.dialects.openai.calls import Calls, function_tools, pending_items
from broker.dialects.openai.errors import documented, error_response, from_broker_error
from broker.dialects.openai.events import (
    EXPANSION,
    OPENING,
    STATUS,
    TEXT_FORMAT,
    WHOLE,
    AttemptEnd,
    Head,
    failure_message,
    message_item,
)
from broker.dialects.openai.formats import responses_format
from broker.dialects.openai.inputs import Context, context
from broker.dialects.openai.render import ResponsesRenderer
from broker.dialects.openai.requests import (
    INCLUDE_NOTHING,
    ParamError,
    ResponsesRequest,
    check_include,
    check_known,
    check_supported,
    describe,
    resolve_model,
    tool_params,
    turn_params,
)
from broker.dialects.openai.tools import renamed, responses_client_tools
from broker.errors import REDIS_UNAVAILABLE, BadRequest, BrokerError
from broker.frames import ORIGIN, Entry
from broker.http import Services, actor, bearer, caller, json_response, services
from broker.numbers import whole_number
from broker.reader import Location
from broker.relay import Read
from broker.turn_records import StoredRequest
from broker.turns import TurnRequest
from broker.viewer import admit
from broker.vocabulary import ACTIVE_STATUSES, ID_PATTERN, TurnStatus

router = APIRouter(tags=["openai"])

INTEGER = re.compile(r"-?[0-9]+")
CANCEL_WAIT_S = 5.0  # how long a cancel waits for the running attempt to end
BaseModelT = TypeVar("BaseModelT", bound=BaseModel)

Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


async def answer(
    request: Request, work: Callable[[Principal], Awaitable[Response]], *, reading: bool = False
) -> Response:
    """Authenticate, run ``work``, and answer any error in OpenAI's shape (never a 500). Only a
    ``reading`` work admits an attach token (it then checks the token's rules itself)."""
    try:
        principal = await caller(request, None)
        if not reading:
            principal = await actor(request, principal)
        return await work(principal)
    except BrokerError as exc:
        return from_broker_error(exc)
    except REDIS_UNAVAILABLE:
        services(request).metrics.redis_errors.inc()
        return error_response(503, "Redis is unavailable; retry shortly", "redis_unavailable")


async def parse(request: Request, model: type[BaseModelT]) -> tuple[BaseModelT, dict[str, Any]]:
    """The body as ``model``; 400 naming the parameter for anything else."""
    raw = await request.body()
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ParamError(f"body is not valid JSON: {exc}", None, code="bad_json") from None
    if not isinstance(payload, dict):
        raise ParamError("body must be a JSON object", None)
    check_known(payload, model)
    try:
        return model.model_validate(payload), payload
    except ValidationError as exc:
        message, param = describe(exc)
        raise ParamError(message, param) from None


def turn_id_of(request: Request, metadata: dict[str, str] | None, prefix: str) -> str:
    """The idempotency key: ``Idempotency-Key``, else ``metadata.turn_id``, else a new id."""
    key = request.headers.get("idempotency-key") or (metadata or {}).get("turn_id")
    if key is None:
        return f"{prefix}{secrets.token_hex(16)}"
    if not ID_PATTERN.fullmatch(key):
        raise ParamError(
            "the idempotency key must be 1-128 characters of letters, digits and ._:-",
            "Idempotency-Key",
            code="bad_idempotency_key",
        )
    return key


def to_turn(
    rt: Services,
    conversation_id: str,
    turn_id: str,
    model: str,
    messages: list[dict[str, Any]],
    params: dict[str, Any],
    echoed: dict[str, Any] | None = None,
    response_format: Any = "text",
    client_tools: list[dict[str, Any]] | None = None,
) -> TurnRequest:
    provider, model_name = resolve_model(rt.providers, model)
    try:
        return TurnRequest.model_validate(
            {
                "conversation_id": conversation_id,
                "turn_id": turn_id,
                "messages": messages,
                "provider": provider,
                "model": model_name,
                "params": params,
                "echo": echoed,
                "response_format": response_format,
                "client_tools": client_tools or [],
            }
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ParamError(f"{first.get('msg', 'invalid request')}", None) from None


# The native codes of a refused turn, as the OpenAI parameter at fault.
PARAM_OF_CODE = {
    "unknown_model": "model",
    "unknown_provider": "model",
    "provider_not_served": "model",
    "too_many_messages": None,
    "too_many_images": None,
    "message_too_long": None,
}


async def create_turn(rt: Services, turn: TurnRequest, tenant: str | None, messages: str) -> None:
    """:meth:`Turns.create`, its 400s naming the parameter (``messages``: the input's name)."""
    try:
        await rt.turns.create(turn, tenant)
    except BadRequest as exc:
        if isinstance(exc, ParamError):
            raise
        message, param = renamed(exc.message, messages)
        if param is not None:  # the core's checks of client tools and tool messages
            raise ParamError(message, param, code=exc.code) from None
        if exc.code not in PARAM_OF_CODE:
            raise
        param = PARAM_OF_CODE[exc.code] or messages
        raise ParamError(exc.message, param, code=exc.code) from None


def echoed_fields(body: ResponsesRequest, sent: Context) -> dict[str, Any]:
    """What the response object hands back as sent, stored with the turn (absent: left out)."""
    fields: dict[str, Any] = {
        "instructions": body.instructions,
        "metadata": body.metadata or None,
        "previous_response_id": body.previous_response_id,
        "background": body.background or None,
        "store": False if body.store is False else None,
        "input_ids": sent.input_ids or None,
        "tool_choice": body.tool_choice if body.tool_choice != "auto" else None,
        "parallel_tool_calls": False if body.parallel_tool_calls is False else None,
    }
    return {k: v for k, v in fields.items() if v is not None}


# --- reading a response back ------------------------------------------------------------------


class StoredResponse:
    """One response as stored: its turn's state, location and the request it was made with."""

    def __init__(self, state: dict[str, Any], location: Location, request: StoredRequest) -> None:
        self.state = state
        self.location = location
        self.request = request

    @property
    def head(self) -> Head:
        request = self.request
        params = request.params
        model = request.model or request.provider or "simulated"
        if request.provider and request.provider != "simulated":
            model = f"{request.provider}/{model}"
        echo = request.echo
        return Head(
            response_id=self.state["turn_id"],
            model=str(model),
            created_at=int(self.state["created_ms"]) // 1000,
            instructions=echo.get("instructions"),
            temperature=params.get("temperature"),
            top_p=params.get("top_p"),
            max_output_tokens=params.get("max_tokens"),
            previous_response_id=echo.get("previous_response_id"),
            background=bool(echo.get("background", False)),
            metadata=dict(echo.get("metadata") or {}),
            text=echo.get("text") or TEXT_FORMAT,
            tools=function_tools(request.client_tools),
            tool_choice=echo.get("tool_choice") or "auto",
            parallel_tool_calls=echo.get("parallel_tool_calls", True),
        )


async def load(rt: Services, response_id: str, tenant: str | None) -> StoredResponse:
    state = await rt.turns.get(response_id, tenant)
    location = await rt.streams.locate(state["stream_id"], tenant)
    request = await rt.turns.request(location.conversation_id, location.turn_id)
    return StoredResponse(state, location, request)


async def load_for_reading(rt: Services, response_id: str, tenant: str | None) -> StoredResponse:
    """What a read of the response's events needs, in two round trips (a resume waits for
    them); the full :func:`load` answers the unknown and expired ones with their error."""
    found = await rt.turns.find(response_id, tenant)
    if found is None:
        return await load(rt, response_id, tenant)
    state = {"turn_id": response_id, "stream_id": found.stream_id, "created_ms": found.created_ms}
    location = Location(found.stream_id, found.conversation_id, response_id)
    return StoredResponse(state, location, found.request)


async def attempt_end(rt: Services, location: Location, attempt: int) -> AttemptEnd:
    """An attempt's own text, usage and reason, as stored when it ended (a continue's item
    holds the rest of the partial it continues, and its response the whole answer)."""
    ended = await rt.turns.attempt(location.conversation_id, location.turn_id, attempt)
    record = ended.record
    usage = record.usage if record is not None else None
    reason = record.reason if record is not None else None
    error = record.error if record is not None else None
    return AttemptEnd(ended.own_text, ended.text, usage, reason, error)


async def response_object(rt: Services, stored: StoredResponse) -> dict[str, Any]:
    """The response as ``GET /v1/responses/{id}`` shows it: the answer so far, usage once known."""
    state, head = stored.state, stored.head
    status = STATUS.get(state["status"], "failed")
    current = int(state["attempt"])
    records = {a["n"]: a for a in state["attempts"]}
    output: list[dict[str, Any]] = []
    usage = None
    error = None
    reason = None
    if state["status"] in ACTIVE_STATUSES:
        location = stored.location
        text = await rt.turns.text_so_far(location.conversation_id, location.turn_id, current)
        output.append(message_item(head.response_id, current, text, "in_progress"))
    else:
        canonical = state["canonical"]
        n = canonical["attempt"] if canonical else current
        record = records.get(n, {})
        text = canonical["text"] if canonical else ""
        item_status = "completed" if record.get("status") in WHOLE else "incomplete"
        output.append(message_item(head.response_id, n, text, item_status))
        output += pending_items(n, state.get("tool_calls") or ())
        usage = record.get("usage")
        if state["status"] == "failed":
            message = failure_message(record.get("reason"), record.get("error"))
            error = {"code": "server_error", "message": message}
        reason = record.get("reason")
    return head.response(status, output, usage=usage, error=error, reason=reason)


async def stream_response(
    rt: Services, stored: StoredResponse, starting_after: int, principal: Principal
) -> Response:
    """The response's events after sequence number ``starting_after`` (-1: all), live, to the
    turn's final ``end``, read by ``principal`` through the relay (see :mod:`broker.relay`)."""
    location = stored.location
    # The token's rules before the seek, which looks at the stream (the relay checks them too).
    admit(rt.metrics, principal, location.stream_id, sse=True)
    calls = Calls() if stored.request.client_tools else None
    if starting_after < OPENING - 1 or calls is not None:
        after, base = ORIGIN, OPENING  # with calls: numbered by what is read (see calls.py)
    else:
        seek = await rt.sequences.seek(location, starting_after, first=OPENING, expansion=EXPANSION)
        after, base = seek.after, seek.base
    renderer = ResponsesRenderer(stored.head, starting_after, base, calls)
    facts = functools.partial(_attempt_end_of, rt, location)
    return await rt.relay(principal, Read(location, after, renderer, facts))


async def _attempt_end_of(rt: Services, location: Location, end: Entry) -> AttemptEnd:
    """The facts of an ``end``: its attempt's stored text, usage and reason."""
    return await attempt_end(rt, location, end.attempt())


async def settle(rt: Services, location: Location, within_s: float | None = None) -> None:
    """Wait until the turn is at rest (the stream's final ``end``), or ``within_s`` passed (seen
    at the next event or heartbeat: no cancellation is relied on)."""
    deadline = None if within_s is None else time.monotonic() + within_s
    async with contextlib.aclosing(rt.streams.follow_chunks(location, ORIGIN)) as items:
        async for _ in items:
            if deadline is not None and time.monotonic() > deadline:
                return


# --- routes -----------------------------------------------------------------------------------

_SSE_OR_JSON: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the response object, or its events (text/event-stream) with stream",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"itemSchema": response_event()},
        },
    }
}


@router.post(
    "/v1/responses",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": json_schema(ResponsesRequest)}},
        }
    },
    responses={**_SSE_OR_JSON, **documented(409, 410, 429)},
)
async def create_response(request: Request, _credentials: Credentials) -> Response:
    """Create a response (a turn); with ``stream``, its events; with ``background``, at once."""

    async def work(principal: Principal) -> Response:
        rt = services(request)
        body, _ = await parse(request, ResponsesRequest)
        tools = responses_client_tools(check_supported(body), body.tool_choice)
        response_format, text_echo = responses_format(body.text)
        turn_id = turn_id_of(request, body.metadata, "resp_")
        sent = await context(rt, body, turn_id, principal.tenant)
        params = turn_params(body.broker, body.temperature, body.top_p, body.max_output_tokens)
        names = [t["name"] for t in tools]
        params |= tool_params(body.tool_choice, body.parallel_tool_calls, names)
        echoed = echoed_fields(body, sent) | ({"text": text_echo} if text_echo else {})
        turn = to_turn(
            rt,
            sent.conversation_id,
            turn_id,
            body.model,
            sent.messages,
            params,
            echoed,
            response_format,
            client_tools=tools,
        )
        await create_turn(rt, turn, principal.tenant, "input")
        stored = await load(rt, turn_id, principal.tenant)
        if body.stream:
            return await stream_response(rt, stored, -1, principal)
        if not body.background:
            await settle(rt, stored.location)
            stored = await load(rt, turn_id, principal.tenant)
        return json_response(await response_object(rt, stored))

    return await answer(request, work)


def _int_param(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    if INTEGER.fullmatch(value) is None:  # int() also takes "+5", " 5", "5_0" and other digits
        raise ParamError(f"{name} must be an integer", name)
    number = whole_number(value, -1, 2**53)
    if number is None:
        raise ParamError(f"{name} must be from -1 to 2**53", name)
    return number


def _bool_param(value: str | None, name: str) -> bool:
    if value is None or value.lower() == "false":
        return False
    if value.lower() == "true":
        return True
    raise ParamError(f"{name} must be true or false", name)


@router.get(
    "/v1/responses/{response_id}",
    responses={**_SSE_OR_JSON, **documented(410)},
    openapi_extra={
        "parameters": [
            {**ID_PARAMETER, "name": "response_id"},
            {
                "name": "stream",
                "in": "query",
                "required": False,
                "schema": {"type": "boolean", "default": False},
                "description": "true: the response's events (text/event-stream)",
            },
            {
                "name": "starting_after",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": -1, "maximum": 2**53},
                "description": "with stream=true: the events after this sequence_number",
            },
            {
                "name": "include",
                "in": "query",
                "required": False,
                "schema": {
                    "type": "array",
                    "items": {"type": "string", "enum": sorted(INCLUDE_NOTHING)},
                },
                "description": "values that change nothing here (see docs/openai.md); others: 400",
            },
        ]
    },
)
async def retrieve_response(
    request: Request,
    response_id: str,
    _credentials: Credentials,
    stream: str | None = None,
    starting_after: str | None = None,
) -> Response:
    """The response object; with ``stream=true``, its events after ``starting_after``."""

    async def work(principal: Principal) -> Response:
        rt = services(request)
        streaming = _bool_param(stream, "stream")
        after = _int_param(starting_after, "starting_after")
        query = request.query_params  # the SDKs send a list as include[]=...
        check_include([*query.getlist("include[]"), *query.getlist("include")])
        if streaming:
            stored = await load_for_reading(rt, response_id, principal.tenant)
            return await stream_response(rt, stored, -1 if after is None else after, principal)
        if after is not None:
            raise BadRequest("starting_after needs stream=true", code="bad_request")
        stored = await load(rt, response_id, principal.tenant)
        # An attach token reads its own response only; a one-viewer token over SSE only.
        admit(rt.metrics, principal, stored.location.stream_id, sse=False)
        return json_response(await response_object(rt, stored))

    return await answer(request, work, reading=True)


@router.post(
    "/v1/responses/{response_id}/cancel",
    responses={200: {"description": "the response object"}, **documented(410)},
)
async def cancel_response(
    request: Request, response_id: str, _credentials: Credentials
) -> Response:
    """The stop button: the response ends ``cancelled``, keeping its text. Idempotent."""

    async def work(principal: Principal) -> Response:
        rt = services(request)
        await rt.turns.cancel(response_id, principal.tenant)
        stored = await load(rt, response_id, principal.tenant)
        if stored.state["status"] == TurnStatus.STREAMING:
            # The worker running it stops at its next append: answer with the final state.
            await settle(rt, stored.location, CANCEL_WAIT_S)
            stored = await load(rt, response_id, principal.tenant)
        return json_response(await response_object(rt, stored))

    return await answer(request, work)
