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

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from broker.api.schemas import chunk_event, json_schema
from broker.auth import Principal
from broker.dialects.openai.errors import documented, error_response
from broker.dialects.openai.requests import ChatRequest, chat_messages, turn_params
from broker.dialects.openai.responses import (
    Credentials,
    Stored,
    answer,
    create_turn,
    load,
    parse,
    settle,
    to_turn,
    turn_id_of,
)
from broker.frames import ORIGIN, Cursor, Heartbeat
from broker.http import Services, json_response, services
from broker.offsets import START
from broker.sse import PING, EventStreamResponse, Sink

router = APIRouter(tags=["openai"])

FINISH: Final = {"complete": "stop", "cancelled": "stop", "interrupted": "length"}
DONE: Final = b"data: [DONE]\n\n"


def _usage(record: dict[str, Any] | None) -> dict[str, int] | None:
    if not record:
        return None
    prompt = int(record.get("input_tokens") or 0)
    completion = int(record.get("output_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _headers(stored: Stored) -> dict[str, str]:
    return {
        "x-broker-turn-id": stored.state["turn_id"],
        "x-broker-stream-id": stored.state["stream_id"],
    }


def _failure(reason: str) -> bytes:
    """An error event in OpenAI's shape: the SDKs raise it from the stream."""
    error = {
        "message": f"the generation failed: {reason}",
        "type": "server_error",
        "param": None,
        "code": reason,
    }
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


# The last frame of a read a newer one-viewer connection took over, in the SDKs' error shape.
# (Attach tokens may not create, so none reads here; the door's reads are viewers all the same.)
REPLACED: Final = (
    b'data: {"error":{"message":"a newer connection of this one-viewer token took over; do not '
    b'reconnect","type":"invalid_request_error","param":null,"code":"viewer_replaced"}}\n\n'
)


class _Chunks:
    """Renders one completion's chunks."""

    def __init__(self, stored: Stored, include_usage: bool) -> None:
        self.id = stored.state["turn_id"]
        self.model = stored.head.model
        self.created = stored.head.created_at
        self.include_usage = include_usage

    def chunk(self, offset: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "broker_offset": offset,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        return b"id: " + offset.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def usage(self, offset: str, usage: dict[str, int] | None) -> bytes:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "broker_offset": offset,
            "choices": [],
            "usage": usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"


async def _frames(
    rt: Services, stored: Stored, after: Cursor, include_usage: bool, sink: Sink
) -> AsyncIterator[bytes]:
    render = _Chunks(stored, include_usage)
    location = stored.location
    usage: dict[str, Any] | None = None
    # Not direct: the stream's feed would write native frames straight to the client.
    follow = rt.streams.follow_chunks(location, after, sink, direct=False)
    async with contextlib.aclosing(follow) as items:
        async for item in items:
            if sink.over:
                return  # the client left, whether or not a cancellation says so
            if isinstance(item, Heartbeat):
                yield PING
                continue
            out: list[bytes] = []
            for entry in item.entries:
                data = orjson.loads(entry.data)
                if entry.kind == "attempt":
                    out.append(render.chunk(entry.offset, {"role": "assistant", "content": ""}))
                elif entry.kind == "delta":
                    out.append(render.chunk(entry.offset, {"content": str(data.get("text", ""))}))
                elif entry.kind == "usage":
                    usage = data
                elif entry.kind == "end":
                    status = str(data.get("status"))
                    if status not in FINISH:
                        out.append(_failure(str(data.get("reason") or "failed")))
                        continue
                    out.append(render.chunk(entry.offset, {}, FINISH[status]))
                    if include_usage:
                        if usage is None:  # the usage event came before this read's start
                            usage = await _stored_usage(rt, stored, data.get("attempt"))
                        out.append(render.usage(entry.offset, _usage(usage)))
            if out:
                yield b"".join(out)
    if not sink.over:
        yield DONE


async def _stored_usage(rt: Services, stored: Stored, attempt: object) -> dict[str, Any] | None:
    """The usage an attempt's record kept (None: none, or no such attempt)."""
    location = stored.location
    n = attempt if isinstance(attempt, int) else 0
    record = await rt.turns.attempt_record(location.conversation_id, location.turn_id, n)
    return record.usage if record is not None else None


def _completion(stored: Stored) -> Response:
    state = stored.state
    records = {a["n"]: a for a in state["attempts"]}
    canonical = state["canonical"]
    record = records.get(canonical["attempt"] if canonical else state["attempt"], {})
    status = record.get("status") or state["status"]
    if status not in FINISH:
        reason = record.get("reason") or "the generation failed"
        return error_response(502, f"the generation failed: {reason}", str(reason))
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
                "message": {"role": "assistant", "content": canonical["text"] if canonical else ""},
            }
        ],
        "usage": _usage(record.get("usage"))
        or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
    return json_response(body, headers=_headers(stored))


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
        resume = request.headers.get("last-event-id") or START
        # Where a stream reattaches: from the start, or after the event it names (there is no
        # `now` here); 400 for a malformed offset, before any turn starts.
        after = Cursor.after_offset(resume) if body.stream and resume != START else ORIGIN
        turn = to_turn(rt, turn_id, turn_id, body.model, chat_messages(body), params)
        await create_turn(rt, turn, principal.tenant, "messages")
        stored = await load(rt, turn_id, principal.tenant)
        if not body.stream:
            await settle(rt, stored.location)
            return _completion(await load(rt, turn_id, principal.tenant))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        source = functools.partial(_frames, rt, stored, after, include_usage)
        viewed = await rt.as_viewer(principal, stored.location, source, replaced=REPLACED)
        return EventStreamResponse(
            viewed,
            send_timeout_s=rt.settings.sse_send_timeout_s,
            extra_headers=[(k.encode(), v.encode()) for k, v in _headers(stored).items()],
        )

    return await answer(request, work)
