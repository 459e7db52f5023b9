"""Reading a response back: a turn's stored state and events as the Responses object and events.

A turn that may wait for a person (the broker has tools with an approval rule, and the request
has no client tools) is read with :class:`~broker.dialects.openai.render.ApprovalsRenderer`,
from the start of the response (the turn's origin, or a continuation's start; see
:mod:`broker.dialects.openai.approvals`), its events numbered by what is read; every other
response as before, resumed by the seek table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any

from starlette.responses import Response

from broker.auth import Principal
from broker.dialects.openai.approvals import Span, chain, continuation_of
from broker.dialects.openai.calls import Calls, function_tools, pending_items
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
from broker.dialects.openai.render import ApprovalsRenderer, ResponsesRenderer
from broker.errors import NotFound
from broker.frames import ORIGIN, Chunk, Entry
from broker.http import Services
from broker.reader import FROM_START, Location, StartPoint
from broker.relay import Read, render
from broker.turn_records import StoredRequest
from broker.turns import PARK_WAIT_S
from broker.viewer import admit
from broker.vocabulary import ACTIVE_STATUSES


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


# --- responses of turns that may wait for a person ----------------------------------------------


def with_approvals(rt: Services, stored: StoredResponse) -> bool:
    """Whether the response is read as one that may show approval requests (see the module)."""
    return rt.turns.asks_approval and not stored.request.client_tools


async def spans(rt: Services, location: Location) -> list[Span]:
    """The responses of the turn at ``location``, from its stored events (see :func:`chain`)."""
    events: list[dict[str, Any]] = []
    start = FROM_START
    while True:
        page = await rt.streams.page(location, start)
        events += page["events"]
        if page["up_to_date"] or not page["events"]:
            return chain(location.turn_id, events)
        start = StartPoint.parse(page["next_offset"])


async def find_continuation(
    rt: Services, response_id: str, tenant: str | None
) -> tuple[StoredResponse, Span] | None:
    """The turn and span of a continuation's id; None when ``response_id`` is no continuation's
    (a turn of that very name comes first); 404 for one its turn does not have (yet)."""
    parsed = continuation_of(response_id)
    if parsed is None or await rt.turns.find(response_id, tenant) is not None:
        return None
    stored = await load(rt, parsed[0], tenant)
    for span in await spans(rt, stored.location):
        if span.response_id == response_id:
            return stored, span
    raise NotFound(f"unknown response {response_id!r}")


def _renderer(stored: StoredResponse, span: Span, starting_after: int) -> ApprovalsRenderer:
    head = dataclasses.replace(
        stored.head,
        response_id=span.response_id,
        previous_response_id=span.previous or stored.head.previous_response_id,
    )
    return ApprovalsRenderer(head, starting_after, continued=span.after != ORIGIN)


async def _settled(
    rt: Services, location: Location, renderer: ApprovalsRenderer, within_s: float = PARK_WAIT_S
) -> bool:
    """Whether the read of a response ends here: it ended, or it waits for a person and has
    read every request of the message (:meth:`Services.parked`)."""
    if renderer.finished:
        return True
    return renderer.waiting and await rt.parked(location, renderer.last, within_s)


async def stream_span(
    rt: Services, stored: StoredResponse, span: Span, starting_after: int, principal: Principal
) -> Response:
    """The events of one response of a turn that may wait for a person, after sequence number
    ``starting_after``, read by ``principal`` through the relay."""
    location = stored.location
    admit(rt.metrics, principal, location.stream_id, sse=True)
    renderer = _renderer(stored, span, starting_after)
    facts = functools.partial(_attempt_end_of, rt, location)
    settled = functools.partial(_settled, rt, location, renderer)
    read = Read(location, span.after, renderer, facts, caught_up=True, settled=settled)
    return await rt.relay(principal, read)


async def span_object(
    rt: Services, stored: StoredResponse, span: Span, wait: bool
) -> dict[str, Any]:
    """One response of a turn that may wait for a person, as an object: as it stands, or with
    ``wait``, once it ended (at the turn's rest, or at approval requests that wait)."""
    location = stored.location
    renderer = _renderer(stored, span, -1)
    facts = functools.partial(_attempt_end_of, rt, location)
    follow = rt.streams.follow_chunks(location, span.after, direct=False, caught_up=True)
    async with contextlib.aclosing(follow) as items:
        async for item in items:
            if isinstance(item, Chunk):
                await render(renderer, facts, item.entries)
                if renderer.finished:
                    break
            elif not wait or await _settled(rt, location, renderer):
                break
    if renderer.waiting and await _settled(rt, location, renderer, within_s=0):
        renderer.closing()
    return renderer.snapshot()
