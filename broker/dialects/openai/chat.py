"""``/v1/chat/completions``: a completion is a turn; its chunks are read from the turn's stream.

Every chunk carries the SSE ``id:`` of the stored event it comes from (the native offset), and
the same offset as the extension field ``broker_offset`` in its JSON, where SDKs that hide SSE
ids let the app see it. A client cut off re-sends the same request with the same
``Idempotency-Key`` and ``Last-Event-ID: <offset>``: it attaches to the same generation and gets
only the chunks after that point. The response headers name the turn and its stream.

A stored event becomes at most one chunk: ``attempt`` the role chunk, ``delta`` a content chunk,
``end`` the finish chunk (``finish_reason`` ``stop``; ``length`` for an answer cut short), then the
usage chunk when ``stream_options.include_usage`` asks for it, then ``data: [DONE]``. An attempt
that failed ends with an error event in OpenAI's shape instead (the SDKs raise it).
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from broker.api.schemas import chunk_event, json_schema
from broker.auth import Principal
from broker.dialects.openai.errors import documented, error_response
from broker.dialects.openai.events import failure_message
from broker.dialects.openai.formats import chat_format
from broker.dialects.openai.render import FINISH, ChatRenderer, usage_of
from broker.dialects.openai.requests import ChatRequest, chat_messages, tool_params, turn_params
from broker.dialects.openai.responses import (
    Credentials,
    answer,
    create_turn,
    parse,
    to_turn,
    turn_id_of,
)
from broker.dialects.openai.stored import StoredResponse, load, settle
from broker.dialects.openai.tools import chat_calls, chat_client_tools
from broker.frames import ORIGIN, Cursor, Entry
from broker.http import Services, json_response, services
from broker.offsets import START
from broker.reader import Location
from broker.relay import Read

router = APIRouter(tags=["openai"])


def _headers(stored: StoredResponse) -> dict[str, str]:
    return {
        "x-broker-turn-id": stored.state["turn_id"],
        "x-broker-stream-id": stored.state["stream_id"],
    }


async def _usage_record(
    rt: Services, location: Location, renderer: ChatRenderer, end: Entry
) -> dict[str, Any] | None:
    """The facts of an ``end``: the attempt's stored usage, when the renderer needs it."""
    if not renderer.needs_usage:
        return None
    record = await rt.turns.attempt_record(
        location.conversation_id, location.turn_id, end.attempt()
    )
    return record.usage if record is not None else None


def _completion(stored: StoredResponse) -> Response:
    state = stored.state
    records = {a["n"]: a for a in state["attempts"]}
    canonical = state["canonical"]
    record = records.get(canonical["attempt"] if canonical else state["attempt"], {})
    status = record.get("status") or state["status"]
    if status not in FINISH:
        reason = record.get("reason") or "the generation failed"
        message = failure_message(reason, record.get("error"))
        return error_response(502, f"the generation failed: {message}", str(reason))
    body = {
        "id": state["turn_id"],
        "object": "chat.completion",
        "created": stored.head.created_at,
        "model": stored.head.model,
        "choices": [
            {
                "index": 0,
                "finish_reason": FINISH[status],
                "logprobs": None,
                "message": _message(state, canonical["text"] if canonical else ""),
            }
        ],
        "usage": usage_of(record.get("usage"))
        or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
    return json_response(body, headers=_headers(stored))


def _message(state: dict[str, Any], text: str) -> dict[str, Any]:
    """The completion's message: its text, and the client tool calls it ended with (a call
    not run is never one of them)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    pending = state.get("tool_calls")
    if pending:
        message["content"] = text or None
        message["tool_calls"] = chat_calls(pending)
    return message


_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a chat.completion, or chat.completion.chunk events with stream",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"itemSchema": chunk_event()},
        },
    },
    502: {
        "description": "the generation failed (not streaming)",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
}


@router.post(
    "/v1/chat/completions",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": json_schema(ChatRequest)}},
        }
    },
    responses={**_ANSWERS, **documented(409, 410, 429)},
)
async def create_chat_completion(request: Request, _credentials: Credentials) -> Response:
    """Create a completion (a turn); the same ``Idempotency-Key`` and ``Last-Event-ID``
    reattach to it."""

    async def work(principal: Principal) -> Response:
        rt = services(request)
        body, _ = await parse(request, ChatRequest)
        turn_id = turn_id_of(request, body.metadata, "chatcmpl-")
        params = turn_params(
            body.broker, body.temperature, body.top_p, body.max_completion_tokens or body.max_tokens
        )
        if body.stop is not None:
            params["stop"] = body.stop
        if body.seed is not None:
            params["seed"] = body.seed
        tools = chat_client_tools(body.tools, body.tool_choice)
        names = [t["name"] for t in tools]
        params |= tool_params(body.tool_choice, body.parallel_tool_calls, names)
        resume = request.headers.get("last-event-id") or START
        # Where a stream reattaches: from the start, or after the event it names (there is no
        # `now` here); 400 for a malformed offset, before any turn starts. With tools, it reads
        # from the start and shows what follows that event, so that each call keeps the index
        # the client saw.
        resuming = body.stream and resume != START
        after = Cursor.after_offset(resume) if resuming else ORIGIN
        response_format = chat_format(body.response_format)
        turn = to_turn(
            rt,
            turn_id,
            turn_id,
            body.model,
            chat_messages(body),
            params,
            None,
            response_format,
            client_tools=tools,
        )
        await create_turn(rt, turn, principal.tenant, "messages")
        stored = await load(rt, turn_id, principal.tenant)
        if not body.stream:
            await settle(rt, stored.location)
            return _completion(await load(rt, turn_id, principal.tenant))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = stored.head
        skip = after.offset if resuming and tools else None
        renderer = ChatRenderer(
            stored.state["turn_id"], head.model, head.created_at, include_usage, skip
        )
        read = Read(
            stored.location,
            ORIGIN if skip else after,
            renderer,
            functools.partial(_usage_record, rt, stored.location, renderer),
            headers=[(k.encode(), v.encode()) for k, v in _headers(stored).items()],
        )
        return await rt.relay(principal, read)

    return await answer(request, work)
