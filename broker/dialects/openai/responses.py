"""``/v1/responses``: a response is a turn, and its events are read from the turn's stream.

The response id is the turn id: the ``Idempotency-Key`` header, else ``metadata.turn_id``, else
one minted here. A new response starts a conversation named after it; ``previous_response_id``
continues that response's conversation, sending that response's context (its input and answer)
plus the new input (see :mod:`broker.dialects.openai.inputs`). The fields the response object
echoes (``instructions``, ``metadata``, ``background``, ``store``, ``previous_response_id``) are
stored with the turn's request as its ``echo``.

A turn whose tool call waits for a person is more than one response: the turn's own ends at
its ``mcp_approval_request`` items, and each answer (``mcp_approval_response`` items, with
``previous_response_id``) is decided through the core and answered with the turn's
continuation, whose id is ``<turn_id>:<approval_id>`` (the approval whose decision it starts
at); see :mod:`broker.dialects.openai.approvals`.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Request, Security
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from broker.api.schemas import ID_PARAMETER, json_schema, response_event
from broker.auth import Principal
from broker.dialects.openai.approvals import (
    MAX_TURN_ID,
    ApprovalAnswer,
    Span,
    approval_answers,
    stands,
)
from broker.dialects.openai.errors import documented, error_response, from_broker_error
from broker.dialects.openai.formats import responses_format
from broker.dialects.openai.inputs import Context, context
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
from broker.dialects.openai.stored import (
    StoredResponse,
    find_continuation,
    load,
    load_for_reading,
    response_object,
    settle,
    span_object,
    spans,
    stream_response,
    stream_span,
    with_approvals,
)
from broker.dialects.openai.tools import renamed, responses_client_tools
from broker.errors import REDIS_UNAVAILABLE, BadRequest, BrokerError, Conflict, NotFound
from broker.frames import ORIGIN
from broker.http import Services, actor, bearer, caller, json_response, services
from broker.numbers import whole_number
from broker.turns import TurnRequest
from broker.viewer import admit
from broker.vocabulary import ID_PATTERN, TurnStatus

if TYPE_CHECKING:
    from broker.approvals import Decided

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


# --- approvals --------------------------------------------------------------------------------


def turn_span(stored: StoredResponse) -> Span:
    """The turn's own response, from its origin (its first span)."""
    return Span(stored.location.turn_id, ORIGIN, None)


async def respond(
    rt: Services, stored: StoredResponse, span: Span, body: ResponsesRequest, principal: Principal
) -> Response:
    """A response of a turn that may wait for a person, as ``body`` asks for it: its events,
    at once (``background``), or once it ended (at rest, or at approval requests)."""
    if body.stream:
        return await stream_span(rt, stored, span, -1, principal)
    return json_response(await span_object(rt, stored, span, wait=not body.background))


async def answer_approvals(
    rt: Services, principal: Principal, body: ResponsesRequest, answers: list[ApprovalAnswer]
) -> Response:
    """``mcp_approval_response`` items: each decides its approval through the core (the first
    decision wins, from any door; another decision that stands is a 409 naming it), and the
    response is the turn's continuation after the response that asked."""
    tenant = principal.tenant
    previous = body.previous_response_id
    if previous is None:
        raise ParamError(
            "mcp_approval_response items answer a previous response's approval requests: "
            "previous_response_id is required",
            "previous_response_id",
            code="missing_previous_response",
        )
    stored = await _answered(rt, previous, tenant)
    turn_id = stored.location.turn_id
    if len(turn_id) > MAX_TURN_ID:
        raise ParamError(
            f"response {turn_id[:64]!r}... has an id longer than {MAX_TURN_ID} characters, too "
            "long to name its continuations: decide with POST /v1/turns/{turn_id}/approvals/"
            "{approval_id} and read the response again",
            "previous_response_id",
            code="response_id_too_long",
        )
    _check_all_answered(await rt.turns.get(turn_id, tenant), answers)
    standing: list[Decided] = []
    for item in answers:
        try:
            decided = await rt.turns.decide(
                turn_id, item.approval_request_id, item.decision, item.reason, tenant
            )
        except NotFound:
            raise ParamError(
                f"input: {item.approval_request_id[:64]!r} is no approval request of response "
                f"{previous!r}",
                "input",
                code="unknown_approval_request",
            ) from None
        if decided.decision != item.decision:
            standing.append(decided)
    if standing:
        raise Conflict("; ".join(map(stands, standing)), code="approval_decided")
    chained = await spans(rt, stored.location)
    following = [n for n, span in enumerate(chained) if span.response_id == previous]
    if not following or following[0] + 1 >= len(chained):
        raise ParamError(
            f"response {previous!r} shows no approval request that these items answer",
            "input",
            code="unknown_approval_request",
        )
    return await respond(rt, stored, chained[following[0] + 1], body, principal)


def _check_all_answered(state: dict[str, Any], answers: list[ApprovalAnswer]) -> None:
    """400 naming ``input`` when the answers leave requests of the same message waiting (the
    response they continue would wait for those, with nothing to show): the client answers
    every request it was shown, or none waits any more (another device decided them)."""
    waiting = [a["approval_id"] for a in state.get("approvals") or ()]
    answered = {item.approval_request_id for item in answers}
    left = [approval_id for approval_id in waiting if approval_id not in answered]
    if left and answered & set(waiting):
        raise ParamError(
            f"input: answer every approval request of the response at once; {', '.join(left)} "
            "still waits",
            "input",
            code="approval_requests_unanswered",
        )


async def _answered(rt: Services, previous: str, tenant: str | None) -> StoredResponse:
    """The turn of the response whose approval requests are answered; 400 when unknown."""
    try:
        continued = await find_continuation(rt, previous, tenant)
        return continued[0] if continued is not None else await load(rt, previous, tenant)
    except BrokerError as exc:
        if exc.status != 404:
            raise
        raise ParamError(
            f"previous response with id {previous[:128]!r} not found",
            "previous_response_id",
            code="previous_response_not_found",
        ) from None


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
        answers = approval_answers(body.input)
        if answers is not None:
            return await answer_approvals(rt, principal, body, answers)
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
        if with_approvals(rt, stored):
            return await respond(rt, stored, turn_span(stored), body, principal)
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
        if not streaming and after is not None:
            raise BadRequest("starting_after needs stream=true", code="bad_request")
        continued = await find_continuation(rt, response_id, principal.tenant)
        span: Span | None
        if continued is not None:
            stored, span = continued
        elif streaming:
            stored = await load_for_reading(rt, response_id, principal.tenant)
            span = turn_span(stored) if with_approvals(rt, stored) else None
        else:
            stored = await load(rt, response_id, principal.tenant)
            span = turn_span(stored) if with_approvals(rt, stored) else None
        if streaming:
            since = -1 if after is None else after
            if span is not None:
                return await stream_span(rt, stored, span, since, principal)
            return await stream_response(rt, stored, since, principal)
        # An attach token reads its own response only; a one-viewer token over SSE only.
        admit(rt.metrics, principal, stored.location.stream_id, sse=False)
        if span is not None:
            return json_response(await span_object(rt, stored, span, wait=False))
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
        continued = await find_continuation(rt, response_id, principal.tenant)
        if continued is not None:  # a continuation's stop is its turn's
            stored, span = continued
            await rt.turns.cancel(stored.location.turn_id, principal.tenant)
            await settle(rt, stored.location, CANCEL_WAIT_S)
            return json_response(await span_object(rt, stored, span, wait=False))
        await rt.turns.cancel(response_id, principal.tenant)
        stored = await load(rt, response_id, principal.tenant)
        if stored.state["status"] == TurnStatus.STREAMING:
            # The worker running it stops at its next append: answer with the final state.
            await settle(rt, stored.location, CANCEL_WAIT_S)
            stored = await load(rt, response_id, principal.tenant)
        return json_response(await response_object(rt, stored))

    return await answer(request, work)
