"""The OpenAI doors' renderers as tables: the core's events (and an ``end``'s facts) in, the
exact bytes out. No socket, no Redis."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from broker.dialects.openai.events import REPLACED, STATUS, AttemptEnd, Head
from broker.dialects.openai.render import CHAT_REPLACED, DONE, ChatRenderer, ResponsesRenderer
from broker.frames import Entry
from broker.relay import Facts
from broker.sse import PING
from broker.vocabulary import TurnStatus


def entry(entry_id: str, kind: str, data: str) -> Entry:
    return Entry.from_redis(entry_id, ["e", kind, "d", data])


def sse(data: dict[str, Any], *, event: str | None = None, id: str | None = None) -> bytes:
    head = (f"id: {id}\n" if id else "") + (f"event: {event}\n" if event else "")
    return head.encode() + b"data: " + orjson.dumps(data) + b"\n\n"


ATTEMPT = entry("1-0", "attempt", '{"attempt":1,"strategy":"initial"}')
DELTA = entry("1-1", "delta", '{"attempt":1,"text":"Hi"}')
USAGE = entry("1-2", "usage", '{"attempt":1,"input_tokens":3,"output_tokens":1}')
END = entry("2-0", "end", '{"attempt":1,"status":"complete","reason":null}')
FAILED = entry("2-0", "end", '{"attempt":1,"status":"failed","reason":"upstream_other"}')
CANCELLED = entry("2-0", "end", '{"attempt":1,"status":"cancelled","reason":"cancelled"}')
TOOL = entry("1-3", "tool_call", '{"attempt":1,"name":"pay","ordinal":0,"status":"dispatched"}')

# --- Responses ---------------------------------------------------------------------------------

HEAD = Head("resp_1", "m", 7, None, None, None, None, None, True)
ITEM = "msg_1_resp_1"
AT = {"item_id": ITEM, "output_index": 0, "content_index": 0}


def response(status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    return HEAD.response(status, output)


def message(status: str, text: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    content = content if text else []
    return {
        "id": ITEM,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


ADDED = sse(
    {
        "type": "response.output_item.added",
        "output_index": 0,
        "item": message("in_progress", ""),
        "sequence_number": 2,
    },
    event="response.output_item.added",
) + sse(
    {
        "type": "response.content_part.added",
        **AT,
        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        "sequence_number": 3,
    },
    event="response.content_part.added",
)


def text_delta(sequence: int) -> bytes:
    return sse(
        {
            "type": "response.output_text.delta",
            **AT,
            "delta": "Hi",
            "logprobs": [],
            "sequence_number": sequence,
        },
        event="response.output_text.delta",
    )


def ending(terminal: str, status: str, item: str, sequence: int, why: str | None = None) -> bytes:
    done = {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}
    body = response(status, [message(item, "Hi")])
    # Why it is incomplete, spelled out here (regression: it was null on response.incomplete).
    body["incomplete_details"] = {"reason": why} if why else None
    final = {"type": terminal, "response": body}
    return b"".join(
        [
            sse(
                {
                    "type": "response.output_text.done",
                    **AT,
                    "text": "Hi",
                    "logprobs": [],
                    "sequence_number": sequence,
                },
                event="response.output_text.done",
            ),
            sse(
                {
                    "type": "response.content_part.done",
                    **AT,
                    "part": done,
                    "sequence_number": sequence + 1,
                },
                event="response.content_part.done",
            ),
            sse(
                {
                    "type": "response.output_item.done",
                    "output_index": 0,
                    "item": message(item, "Hi"),
                    "sequence_number": sequence + 2,
                },
                event="response.output_item.done",
            ),
            sse({**final, "sequence_number": sequence + 3}, event=terminal),
        ]
    )


HI = AttemptEnd("Hi", "Hi", None, None)
INTERRUPTED = entry("2-0", "end", '{"attempt":1,"status":"interrupted","reason":"upstream_cut"}')
FILTERED = entry("2-0", "end", '{"attempt":1,"status":"interrupted","reason":"content_filter"}')
FILTERED_END = AttemptEnd("Hi", "Hi", None, "content_filter")


@pytest.mark.parametrize(
    ("starting_after", "batches", "expected"),
    [
        (-1, [([ATTEMPT, DELTA], {})], ADDED + text_delta(4)),
        (3, [([ATTEMPT, DELTA], {})], text_delta(4)),  # a resume after 3
        (4, [([ATTEMPT, DELTA], {})], b""),
        (-1, [([ATTEMPT, USAGE, TOOL], {})], ADDED),  # folded into the terminal response
        (
            -1,
            [([ATTEMPT, DELTA], {}), ([END], {END.offset: HI})],
            ADDED + text_delta(4) + ending("response.completed", "completed", "completed", 5),
        ),
        (
            -1,
            [([ATTEMPT], {}), ([CANCELLED], {CANCELLED.offset: HI})],
            ADDED
            + ending("response.incomplete", "cancelled", "incomplete", 4, "max_output_tokens"),
        ),
        (
            -1,
            [([ATTEMPT], {}), ([INTERRUPTED], {INTERRUPTED.offset: HI})],
            ADDED
            + ending("response.incomplete", "incomplete", "incomplete", 4, "max_output_tokens"),
        ),
        (
            -1,
            [([ATTEMPT], {}), ([FILTERED], {FILTERED.offset: FILTERED_END})],
            ADDED + ending("response.incomplete", "incomplete", "incomplete", 4, "content_filter"),
        ),
    ],
    ids=[
        "a first read",
        "a resume",
        "all seen",
        "events without a word",
        "complete",
        "cancel",
        "interrupted",
        "filtered",
    ],
)
def test_responses_events(
    starting_after: int, batches: list[tuple[list[Entry], Facts]], expected: bytes
) -> None:
    renderer = ResponsesRenderer(HEAD, starting_after)
    assert b"".join(renderer.render(entries, facts) for entries, facts in batches) == expected


@pytest.mark.parametrize(
    ("starting_after", "expected"),
    [
        (
            -1,
            sse(
                {
                    "type": "response.created",
                    "sequence_number": 0,
                    "response": response("queued", []),
                },
                event="response.created",
            )
            + sse(
                {
                    "type": "response.in_progress",
                    "sequence_number": 1,
                    "response": response("in_progress", []),
                },
                event="response.in_progress",
            ),
        ),
        (
            0,
            sse(
                {
                    "type": "response.in_progress",
                    "sequence_number": 1,
                    "response": response("in_progress", []),
                },
                event="response.in_progress",
            ),
        ),
        (1, b""),
        (9, b""),
    ],
)
def test_responses_opening(starting_after: int, expected: bytes) -> None:
    assert ResponsesRenderer(HEAD, starting_after).opening() == expected


def test_responses_fixed_frames() -> None:
    renderer = ResponsesRenderer(HEAD, -1)
    assert (renderer.dialect, renderer.raw, renderer.heartbeat) == ("responses", False, PING)
    assert renderer.closing() == b""
    assert renderer.replaced == REPLACED
    assert b'"code":"viewer_replaced"' in REPLACED
    assert b"sequence_number" not in REPLACED


# --- Chat Completions --------------------------------------------------------------------------


def chunk(offset: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    body = {**COMMON, "broker_offset": offset, "choices": [choice]}
    return sse(body, id=offset)


COMMON = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def usage(offset: str, prompt: int, completion: int) -> bytes:
    counts = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return sse({**COMMON, "broker_offset": offset, "choices": [], "usage": counts})


STORED_USAGE = {"input_tokens": 5, "output_tokens": 2}


@pytest.mark.parametrize(
    ("include_usage", "batches", "expected"),
    [
        (
            False,
            [([ATTEMPT, DELTA, USAGE, END], {})],
            chunk(ATTEMPT.offset, {"role": "assistant", "content": ""})
            + chunk(DELTA.offset, {"content": "Hi"})
            + chunk(END.offset, {}, "stop"),
        ),
        (
            True,
            [([DELTA, USAGE], {}), ([END], {})],
            chunk(DELTA.offset, {"content": "Hi"})
            + chunk(END.offset, {}, "stop")
            + usage(END.offset, 3, 1),
        ),
        (  # the usage event came before the read's start: the end's facts hold it
            True,
            [([END], {END.offset: STORED_USAGE})],
            chunk(END.offset, {}, "stop") + usage(END.offset, 5, 2),
        ),
        (
            True,
            [([END], {END.offset: None})],
            chunk(END.offset, {}, "stop") + usage(END.offset, 0, 0),
        ),
        (
            False,
            [([CANCELLED], {})],
            chunk(CANCELLED.offset, {}, "stop"),
        ),
        (
            True,
            [([FAILED], {})],
            b'data: {"error":{"message":"the generation failed: upstream_other",'
            b'"type":"server_error","param":null,"code":"upstream_other"}}\n\n',
        ),
        (False, [([TOOL], {})], b""),
    ],
    ids=["an answer", "usage seen", "usage stored", "usage unknown", "cancel", "failure", "tool"],
)
def test_chat_chunks(
    include_usage: bool, batches: list[tuple[list[Entry], Facts]], expected: bytes
) -> None:
    renderer = ChatRenderer("chatcmpl-1", "m", 7, include_usage)
    assert b"".join(renderer.render(entries, facts) for entries, facts in batches) == expected


def test_chat_needs_the_stored_usage_only_when_it_did_not_see_it() -> None:
    renderer = ChatRenderer("chatcmpl-1", "m", 7, True)
    assert renderer.needs_usage
    renderer.render([USAGE], {})
    assert not renderer.needs_usage
    assert not ChatRenderer("chatcmpl-1", "m", 7, False).needs_usage


def test_chat_fixed_frames() -> None:
    renderer = ChatRenderer("chatcmpl-1", "m", 7, False)
    assert (renderer.dialect, renderer.raw, renderer.heartbeat) == ("chat", False, PING)
    assert (renderer.opening(), renderer.closing()) == (b"", DONE)
    assert DONE == b"data: [DONE]\n\n"
    assert renderer.replaced == CHAT_REPLACED


def test_every_turn_status_has_a_response_status() -> None:
    # A status the table lacks read as `failed`: a turn waiting for an approval did.
    assert set(STATUS) == set(TurnStatus)
    assert STATUS[TurnStatus.AWAITING_APPROVAL] == "in_progress"
