"""The AI SDK routes: post a chat, resume its stream, stop it, continue an interrupted answer.

They speak over the same turns, attempts and streams as the native routes: a chat is a
conversation, a user message is a turn, regenerate and continue are attempts of that turn.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Annotated, Any, Final

from fastapi import APIRouter, Header, Request
from starlette.responses import Response

from broker.api.schemas import ID_PARAMETER, errors, resume_parameters, ui_stream_event
from broker.auth import Principal
from broker.dialects.aisdk.chunks import Chunk
from broker.dialects.aisdk.messages import ChatRequest
from broker.dialects.aisdk.render import UIMessageRenderer
from broker.dialects.aisdk.tools import (
    ANSWERS,
    FOLLOW_UP,
    PRELUDE_PARTS,
    ApprovalAnswer,
    prelude,
    renamed,
)
from broker.errors import BadRequest, NotFound
from broker.frames import ORIGIN, Cursor, Entry
from broker.http import (
    Actor,
    Caller,
    Services,
    body_schema,
    json_response,
    parse_body,
    services,
)
from broker.reader import FROM_NOW, FROM_START, Location, StartPoint
from broker.relay import Read
from broker.turns import AttemptRequest
from broker.viewer import refuse_other_stream
from broker.vocabulary import FINAL_STATUSES, ID_PATTERN, scoped

router = APIRouter(tags=["AI SDK UI messages"])

# Besides the event stream's own (content type, no buffering, keep-alive).
UI_STREAM_HEADERS: Final = [
    (b"cache-control", b"no-cache"),
    (b"x-vercel-ai-ui-message-stream", b"v1"),
]
# How many follow-up turns back a resume looks for an answer that runs again.
MAX_FOLLOW_UPS: Final = 16
UI_STREAM: Final[dict[int | str, dict[str, Any]]] = {
    200: {
        "content": {"text/event-stream": {"itemSchema": ui_stream_event()}},
        "description": "the UI message stream",
    }
}


async def _stream(
    rt: Services,
    principal: Principal,
    location: Location,
    render_after: Cursor,
    emit_after: Cursor,
    prelude: Sequence[Chunk] = (),
) -> Response:
    """The UI message stream of ``location``: events past ``render_after`` are rendered, and
    those past ``emit_after`` sent (the ones before only bring the renderer to where the client
    stands); read by ``principal`` through the relay (see :mod:`broker.relay`)."""
    renderer = UIMessageRenderer(location.turn_id, location.stream_id, emit_after, prelude)
    facts = functools.partial(_final, rt, location)
    settled = functools.partial(_parked, rt, location, renderer)
    read = Read(
        location,
        render_after,
        renderer,
        facts,
        headers=UI_STREAM_HEADERS,
        caught_up=True,
        settled=settled,
    )
    return await rt.relay(principal, read)


async def _parked(rt: Services, location: Location, renderer: UIMessageRenderer) -> bool:
    """Whether the read ends at the stream's tail: approvals it showed wait for a person and the
    turn is ``awaiting_approval``, and the read has every request of the message (nothing
    comes until someone decides; see :meth:`broker.http.Services.parked`)."""
    return renderer.waiting and await rt.parked(location, renderer.last)


async def _final(rt: Services, location: Location, end: Entry) -> bool:
    """The facts of an ``end``: whether the turn is at rest on its attempt."""
    return await rt.turns.at_rest(location.conversation_id, location.turn_id, end.attempt())


async def _chain_start(rt: Services, location: Location) -> Cursor:
    """Where a full replay starts: before the last initial or regenerate attempt, so that a
    replay shows the answer the turn has now, not the ones it replaced."""
    start, previous = ORIGIN, ORIGIN
    page_start = FROM_START
    while True:
        page = await rt.streams.page(location, page_start)
        for event in page["events"]:
            if event["event"] == "attempt" and event["data"].get("strategy") != "continue":
                start = previous
            previous = Cursor.after_offset(event["id"])
        if page["up_to_date"] or not page["events"]:
            return start
        page_start = StartPoint.parse(page["next_offset"])


async def _latest_turn(rt: Services, chat_id: str, tenant: str | None) -> str | None:
    """The chat's newest turn, if it has one."""
    if not ID_PATTERN.fullmatch(chat_id):
        raise NotFound(f"unknown chat {chat_id[:80]!r}")
    return await rt.turns.latest(chat_id, tenant)


async def _running(
    rt: Services, location: Location, state: dict[str, Any], tenant: str | None
) -> tuple[Location, dict[str, Any]]:
    """The turn a resume reads: the chat's newest, unless that one is a follow-up at rest and
    a turn it answers runs again (a regenerate of the answer whose calls it took the outputs
    of; the follow-up stays the newest turn)."""
    newest = (location, state)
    for _ in range(MAX_FOLLOW_UPS):
        if state["status"] not in FINAL_STATUSES or not FOLLOW_UP.fullmatch(location.turn_id):
            break
        stored = await rt.turns.request(location.conversation_id, location.turn_id)
        answered = stored.echo.get(ANSWERS)
        if not isinstance(answered, str) or not ID_PATTERN.fullmatch(answered):
            break
        try:
            state = await rt.turns.get(answered, tenant)
        except NotFound:
            break
        older = await rt.streams.locate(state["stream_id"], tenant)
        if older.conversation_id != location.conversation_id:
            break  # not this chat's: the client's facts part named another turn
        location = older
    if state["status"] in FINAL_STATUSES:
        return newest
    return location, state


async def _replay(
    rt: Services, stream_id: str, principal: Principal, *, whole: bool = False
) -> Response:
    """The whole answer of a turn, from its ``start``; ``whole``: for a client that rebuilds
    the message from it (a resume), a follow-up turn's starts with the steps before it."""
    location = await rt.streams.locate(stream_id, principal.tenant)
    state = await rt.turns.get(location.turn_id, principal.tenant)
    after = await _chain_start(rt, location) if state["attempt"] > 1 else ORIGIN
    steps: list[Chunk] = []
    if whole and FOLLOW_UP.fullmatch(location.turn_id):
        request = await rt.turns.request(location.conversation_id, location.turn_id)
        steps = prelude(request.echo.get(PRELUDE_PARTS) or [])
    return await _stream(rt, principal, location, after, after, steps)


async def _answer_approvals(
    rt: Services,
    principal: Principal,
    chat_id: str,
    turn_id: str,
    answers: Sequence[ApprovalAnswer],
) -> Response:
    """A person's answers to a turn's approvals (``addToolApprovalResponse``): each is that
    turn's decision through the core (the first decision wins, from any device), and the answer
    goes on in the same message, from the first of their decisions on the stream (the one that
    stands, whoever made it)."""
    tenant = principal.tenant
    state = await rt.turns.get(turn_id, tenant)
    location = await rt.streams.locate(state["stream_id"], tenant)
    if location.conversation_id != scoped(tenant, chat_id):
        raise NotFound(f"chat {chat_id!r} has no turn {turn_id!r}")
    for answer in answers:
        decision = "approve" if answer.approved else "deny"
        await rt.turns.decide(turn_id, answer.id, decision, answer.reason, tenant)
    start = await _chain_start(rt, location) if state["attempt"] > 1 else ORIGIN
    after = await _before_decision(rt, location, {answer.id for answer in answers})
    return await _stream(rt, principal, location, start, after)


async def _before_decision(rt: Services, location: Location, approval_ids: set[str]) -> Cursor:
    """Where the continuation of a message whose approvals were answered starts: right before
    the first decision on one of ``approval_ids`` (the client has everything before it)."""
    previous, page_start = ORIGIN, FROM_START
    while True:
        page = await rt.streams.page(location, page_start)
        for event in page["events"]:
            decided = event["event"] == "approval_decision"
            if decided and event["data"].get("approval_id") in approval_ids:
                return previous
            previous = Cursor.after_offset(event["id"])
        if page["up_to_date"] or not page["events"]:
            return previous
        page_start = StartPoint.parse(page["next_offset"])


@router.post(
    "/v1/ui/chat",
    openapi_extra=body_schema(ChatRequest),
    responses={**UI_STREAM, **errors(409, 410, 422, 429)},
)
async def post_chat(request: Request, principal: Actor) -> Response:
    """Send a message (a turn) or regenerate the answer to one (an attempt); the answer streams
    as UI message chunks. The same user message sent again attaches to its turn."""
    rt = services(request)
    chat = await parse_body(request, ChatRequest)
    approvals = chat.approvals()
    if approvals is not None:
        return await _answer_approvals(rt, principal, chat.id, *approvals)
    turn_request = chat.turn_request()
    tenant = principal.tenant
    if chat.trigger == "regenerate-message":
        try:
            state = await rt.turns.get(chat.turn_id, tenant)
        except NotFound:
            pass  # never answered here: this is its first answer
        else:
            location = await rt.streams.locate(state["stream_id"], tenant)
            after = await rt.streams.resolve(location, FROM_NOW)
            await rt.turns.start_attempt(
                chat.turn_id, AttemptRequest(strategy="regenerate"), tenant
            )
            return await _stream(rt, principal, location, after, after)
    try:
        _, turn = await rt.turns.create(turn_request, tenant)
    except BadRequest as exc:
        raise renamed(exc) from None
    return await _replay(rt, turn["stream_id"], principal)


@router.get(
    "/v1/ui/chat/{chat_id}/stream",
    responses={**UI_STREAM, 204: {"description": "no turn of this chat is running"}, **errors(410)},
    openapi_extra={
        "parameters": [{**ID_PARAMETER, "name": "chat_id"}, *resume_parameters(sentinels=False)]
    },
)
async def resume_chat(
    request: Request,
    chat_id: str,
    principal: Caller,
    offset: str | None = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    """Resume the chat's running answer: a full replay from ``start``, or with ``Last-Event-ID``
    (``?offset=``) the frames after it; 204 when no answer runs (or nothing follows). An attach
    token resumes its own turn's chat, while that turn is the chat's newest."""
    rt = services(request)
    # 400 for a malformed one, first; Last-Event-ID wins, but a malformed ?offset= is refused.
    emit_after = Cursor.after_offset(offset) if offset else None
    if last_event_id:
        emit_after = Cursor.after_offset(last_event_id)
    if principal.stream_id is not None:
        # Nothing of another chat is looked at: not even whether it runs an answer.
        own = await rt.streams.locate(principal.stream_id, principal.tenant)
        if own.conversation_id != scoped(principal.tenant, chat_id):
            refuse_other_stream(rt.metrics)
    turn_id = await _latest_turn(rt, chat_id, principal.tenant)
    no_content = Response(status_code=204, headers={"Cache-Control": "no-store"})
    if turn_id is None:
        return no_content
    try:
        state = await rt.turns.get(turn_id, principal.tenant)
    except NotFound:
        return no_content  # being created this instant, or gone
    location = await rt.streams.locate(state["stream_id"], principal.tenant)
    location, state = await _running(rt, location, state, principal.tenant)
    if emit_after is None:
        if state["status"] in FINAL_STATUSES:
            return no_content
        return await _replay(rt, state["stream_id"], principal, whole=True)
    if await rt.streams.finished_before(location, emit_after):
        return no_content
    return await _stream(rt, principal, location, ORIGIN, emit_after)


@router.post("/v1/ui/chat/{chat_id}/stop", responses=errors(410))
async def stop_chat(request: Request, chat_id: str, principal: Actor) -> Response:
    """The stop button: cancel the chat's running answer (its newest turn, or the regenerate
    behind a turn that took tool outputs), keeping its partial answer."""
    rt = services(request)
    tenant = principal.tenant
    turn_id = await _latest_turn(rt, chat_id, tenant)
    if turn_id is None:
        raise NotFound(f"chat {chat_id!r} has no turn")
    if FOLLOW_UP.fullmatch(turn_id):
        state = await rt.turns.get(turn_id, tenant)
        location = await rt.streams.locate(state["stream_id"], tenant)
        location, _ = await _running(rt, location, state, tenant)
        turn_id = location.turn_id
    return json_response(await rt.turns.cancel(turn_id, tenant))


@router.post("/v1/ui/chat/{chat_id}/continue", responses={**UI_STREAM, **errors(409, 410, 422)})
async def continue_chat(request: Request, chat_id: str, principal: Actor) -> Response:
    """Continue the chat's interrupted answer: its frames append to the same message."""
    rt = services(request)
    tenant = principal.tenant
    turn_id = await _latest_turn(rt, chat_id, tenant)
    if turn_id is None:
        raise NotFound(f"chat {chat_id!r} has no turn")
    state = await rt.turns.get(turn_id, tenant)
    location = await rt.streams.locate(state["stream_id"], tenant)
    after = await rt.streams.resolve(location, FROM_NOW)
    await rt.turns.start_attempt(turn_id, AttemptRequest(strategy="continue"), tenant)
    return await _stream(rt, principal, location, after, after)
