"""The AI SDK door's renderer as a table: the core's events (and whether an ``end`` leaves the
turn at rest) in, the exact UI message stream bytes out. No socket, no Redis."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from broker.dialects.aisdk.chunks import DONE, REPLACED
from broker.dialects.aisdk.render import UIMessageRenderer
from broker.frames import ORIGIN, Cursor, Entry
from broker.relay import Facts
from broker.sse import PING


def entry(entry_id: str, kind: str, data: str) -> Entry:
    return Entry.from_redis(entry_id, ["e", kind, "d", data])


def frames(offset: str, *chunks: dict[str, Any]) -> bytes:
    """One event's frames: the last carries its offset."""
    out = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks]
    out[-1] = f"id: {offset}\n".encode() + out[-1]
    return b"".join(out)


ATTEMPT = entry("1-0", "attempt", '{"attempt":1,"strategy":"initial"}')
DELTA = entry("1-1", "delta", '{"attempt":1,"text":"Hi"}')
USAGE = entry("1-2", "usage", '{"attempt":1,"input_tokens":3,"output_tokens":1}')
END = entry("2-0", "end", '{"attempt":1,"status":"complete","reason":null}')
CANCELLED = entry("2-0", "end", '{"attempt":1,"status":"cancelled","reason":"cancelled"}')
O1, O2, O3 = ATTEMPT.offset, DELTA.offset, END.offset


def facts(offset: str, status: str, **extra: Any) -> dict[str, Any]:
    data = {"turnId": "t1", "streamId": "st1", "attempt": 1, "offset": offset, "status": status}
    return {"type": "data-broker", "id": "broker", "data": {**data, **extra}}


START = ({"type": "start", "messageId": "t1-reply"}, facts(O1, "streaming"))
TEXT = {"type": "text-delta", "id": "1-1", "delta": "Hi"}
DELTA_FRAMES = frames(
    O2,
    {"type": "text-start", "id": "1-1"},
    {**TEXT, "providerMetadata": {"broker": {"offset": O2}}},
)
CLOSE = ({"type": "text-end", "id": "1-1"}, {"type": "finish-step"})


@pytest.mark.parametrize(
    ("emit_after", "batches", "expected", "closing"),
    [
        (
            ORIGIN,
            [([ATTEMPT, DELTA, USAGE], {})],
            frames(O1, *START, {"type": "start-step"}) + DELTA_FRAMES,
            b"",
        ),
        (
            ORIGIN,
            [([ATTEMPT, DELTA], {}), ([END], {O3: True})],
            frames(O1, *START, {"type": "start-step"})
            + DELTA_FRAMES
            + frames(
                O3,
                *CLOSE,
                facts(O3, "complete", reason=None),
                {"type": "finish", "finishReason": "stop"},
            ),
            DONE,
        ),
        (  # an end after which another attempt follows: the message goes on
            ORIGIN,
            [([ATTEMPT, DELTA, END], {O3: False})],
            frames(O1, *START, {"type": "start-step"})
            + DELTA_FRAMES
            + frames(O3, *CLOSE, facts(O3, "complete", reason=None)),
            b"",
        ),
        (
            ORIGIN,
            [([ATTEMPT], {}), ([CANCELLED], {O3: True})],
            frames(O1, *START, {"type": "start-step"})
            + frames(
                O3,
                {"type": "finish-step"},
                facts(O3, "cancelled", reason="cancelled"),
                {"type": "abort", "reason": "cancelled"},
            ),
            DONE,
        ),
        (  # a resume after the delta: rendered up to there, sent past it
            DELTA.cursor,
            [([ATTEMPT, DELTA], {}), ([END], {O3: True})],
            frames(
                O3,
                *CLOSE,
                facts(O3, "complete", reason=None),
                {"type": "finish", "finishReason": "stop"},
            ),
            DONE,
        ),
    ],
    ids=["a first read", "complete", "another attempt follows", "cancel", "a resume"],
)
def test_ui_message_frames(
    emit_after: Cursor,
    batches: list[tuple[list[Entry], Facts]],
    expected: bytes,
    closing: bytes,
) -> None:
    renderer = UIMessageRenderer("t1", "st1", emit_after)
    assert b"".join(renderer.render(entries, facts) for entries, facts in batches) == expected
    assert renderer.closing() == closing


def test_ui_message_fixed_frames() -> None:
    renderer = UIMessageRenderer("t1", "st1")
    assert (renderer.dialect, renderer.raw, renderer.heartbeat) == ("aisdk", False, PING)
    assert renderer.opening() == b""
    assert (
        renderer.replaced == REPLACED == b'data: {"type":"error","errorText":"viewer_replaced"}\n\n'
    )


# Client tool calls: the arguments stream as tool input, the call is the client's to run, and
# the attempt that ends requires_action finishes the message for tool calls.
CALL = "call_0123456789abcdef01234567"
PIECE_1 = entry(
    "1-3",
    "tool_input_delta",
    f'{{"attempt":1,"call_id":"{CALL}","name":"get_weather","ordinal":0,"delta":"{{\\"city\\""}}',
)
PIECE_2 = entry(
    "1-4",
    "tool_input_delta",
    f'{{"attempt":1,"call_id":"{CALL}","name":"get_weather","ordinal":0,"delta":":\\"Oslo\\"}}"}}',
)
CLIENT_CALL = entry(
    "1-5",
    "tool_call",
    f'{{"attempt":1,"call_id":"{CALL}","name":"get_weather","ordinal":0,"args":{{"city":"Oslo"}},"status":"client"}}',
)
NOT_RUN = entry(
    "1-5",
    "tool_call",
    f'{{"attempt":1,"call_id":"{CALL}","name":"get_weather","ordinal":0,"args":null,"status":"not_run","reason":"connection_lost"}}',
)
ACTION = entry("2-0", "end", '{"attempt":1,"status":"requires_action","reason":"tool_calls"}')
CUT = entry("2-0", "end", '{"attempt":1,"status":"interrupted","reason":"connection_lost"}')
START_INPUT = {"type": "tool-input-start", "toolCallId": CALL, "toolName": "get_weather"}
INPUT_1 = {"type": "tool-input-delta", "toolCallId": CALL, "inputTextDelta": '{"city"'}
INPUT_2 = {"type": "tool-input-delta", "toolCallId": CALL, "inputTextDelta": ':"Oslo"}'}
AVAILABLE = {
    "type": "tool-input-available",
    "toolCallId": CALL,
    "toolName": "get_weather",
    "input": {"city": "Oslo"},
}
TOOL_CALLS_FINISH = (
    {"type": "finish-step"},
    facts(ACTION.offset, "requires_action", reason="tool_calls"),
    {"type": "finish", "finishReason": "tool-calls"},
)
O4, O5, O6 = PIECE_1.offset, PIECE_2.offset, CLIENT_CALL.offset


@pytest.mark.parametrize(
    ("emit_after", "entries", "expected", "closing"),
    [
        (
            ORIGIN,
            [ATTEMPT, DELTA, PIECE_1, PIECE_2, CLIENT_CALL, ACTION],
            frames(O1, *START, {"type": "start-step"})
            + DELTA_FRAMES
            + frames(O4, {"type": "text-end", "id": "1-1"}, START_INPUT, INPUT_1)
            + frames(O5, INPUT_2)
            + frames(O6, AVAILABLE)
            + frames(ACTION.offset, *TOOL_CALLS_FINISH),
            DONE,
        ),
        (  # arguments that came whole, with no piece before: the input starts with the call
            ORIGIN,
            [ATTEMPT, CLIENT_CALL, ACTION],
            frames(O1, *START, {"type": "start-step"})
            + frames(O6, START_INPUT, AVAILABLE)
            + frames(ACTION.offset, *TOOL_CALLS_FINISH),
            DONE,
        ),
        (  # a resume between two pieces of one call: the call's input started before the cut
            PIECE_1.cursor,
            [ATTEMPT, DELTA, PIECE_1, PIECE_2, CLIENT_CALL, ACTION],
            frames(O5, INPUT_2) + frames(O6, AVAILABLE) + frames(ACTION.offset, *TOOL_CALLS_FINISH),
            DONE,
        ),
        (  # arguments cut off: never available; an error the client does not run (the broker's)
            ORIGIN,
            [ATTEMPT, PIECE_1, NOT_RUN, CUT],
            frames(
                O1,
                *START,
                {"type": "start-step"},
            )
            + frames(O4, START_INPUT, INPUT_1)
            + frames(
                O6,
                {
                    "type": "tool-input-error",
                    "toolCallId": CALL,
                    "toolName": "get_weather",
                    "input": None,
                    "providerExecuted": True,
                    "errorText": "not_run: connection_lost",
                },
            )
            + frames(
                CUT.offset,
                {"type": "finish-step"},
                facts(CUT.offset, "interrupted", reason="connection_lost", partial=True),
                {"type": "error", "errorText": "turn_interrupted"},
                {"type": "finish", "finishReason": "interrupted"},
            ),
            DONE,
        ),
    ],
    ids=["a client call", "a call without pieces", "a resume mid-call", "a call cut off"],
)
def test_client_tool_call_frames(
    emit_after: Cursor, entries: list[Entry], expected: bytes, closing: bytes
) -> None:
    renderer = UIMessageRenderer("t1", "st1", emit_after)
    final = {entries[-1].offset: True}
    assert renderer.render(entries, final) == expected
    assert renderer.closing() == closing


def test_a_follow_up_turn_goes_on_in_the_message_of_its_calls() -> None:
    renderer = UIMessageRenderer("m1-reply.tools-0123456789abcdef", "st1")
    first = orjson.loads(renderer.render([ATTEMPT], {})[len(b"data: ") :].split(b"\n\n")[0])
    assert first == {"type": "start", "messageId": "m1-reply"}


def test_a_prelude_goes_out_after_start_and_before_the_turns_own_steps() -> None:
    before = [{"type": "start-step"}, {"type": "finish-step"}]
    renderer = UIMessageRenderer("t1", "st1", ORIGIN, before)
    assert renderer.render([ATTEMPT], {}) == frames(O1, *START, *before, {"type": "start-step"})
    resumed = UIMessageRenderer("t1", "st1", ATTEMPT.cursor, before)
    assert resumed.render([ATTEMPT, DELTA], {}) == DELTA_FRAMES, "past the start: not again"


# A server call that waits for a person: its request, the decision that stands, its result.
APR = "apr_0123456789abcdef01234567"
PAY = entry(
    "1-1",
    "tool_call",
    '{"attempt":1,"call_id":"c1","name":"pay","args":{"amount":500},"ordinal":0,'
    '"status":"dispatched"}',
)
ASK = entry(
    "1-2",
    "approval_request",
    f'{{"attempt":1,"approval_id":"{APR}","call_id":"c1","name":"pay","ordinal":0,'
    '"args":{"amount":500},"expires_at":1.5}',
)
APPROVED = entry(
    "3-0",
    "approval_decision",
    f'{{"attempt":1,"approval_id":"{APR}","decision":"approve","reason":null,"by":"person"}}',
)
DENIED = entry(
    "3-0",
    "approval_decision",
    f'{{"attempt":1,"approval_id":"{APR}","decision":"deny","reason":"too much","by":"person"}}',
)
RAN = entry(
    "3-1",
    "tool_result",
    '{"attempt":1,"call_id":"c1","name":"pay","ordinal":0,"source":"ran","status":"ok",'
    '"result":{"id":"p1"}}',
)
REFUSED = entry(
    "3-1",
    "tool_result",
    '{"attempt":1,"call_id":"c1","name":"pay","ordinal":0,"source":"replayed","status":"error",'
    '"error":{"code":"approval_denied","message":"declined","reason":"too much"}}',
)
CALL_FRAMES = frames(O1, *START, {"type": "start-step"}) + frames(
    PAY.offset,
    {
        "type": "tool-input-available",
        "toolCallId": "c1",
        "toolName": "pay",
        "input": {"amount": 500},
        "providerExecuted": True,
    },
)
ASK_FRAMES = frames(
    ASK.offset, {"type": "tool-approval-request", "approvalId": APR, "toolCallId": "c1"}
)


def response(approved: bool, **reason: str) -> dict[str, Any]:
    chunk = {"type": "tool-approval-response", "approvalId": APR, "approved": approved}
    return {**chunk, "providerExecuted": True, **reason}


def plain(*chunks: dict[str, Any]) -> bytes:
    """Frames of no event: no ``id:``."""
    return b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks)


@pytest.mark.parametrize(
    ("emit_after", "entries", "expected", "closing"),
    [
        (  # the read ends at the tail of a turn that waits: the message ends for now
            ORIGIN,
            [ATTEMPT, PAY, ASK],
            CALL_FRAMES + ASK_FRAMES,
            plain(
                {"type": "finish-step"},
                facts(ASK.offset, "awaiting_approval"),
                {"type": "finish", "finishReason": "tool-calls"},
            )
            + DONE,
        ),
        (  # approved: the response, then the call's output, in the same step
            ORIGIN,
            [ATTEMPT, PAY, ASK, APPROVED, RAN],
            CALL_FRAMES
            + ASK_FRAMES
            + frames(APPROVED.offset, response(True))
            + frames(
                RAN.offset,
                {
                    "type": "tool-output-available",
                    "toolCallId": "c1",
                    "output": {"id": "p1"},
                    "providerExecuted": True,
                },
            ),
            b"",
        ),
        (  # denied: the reason on the response, and the part is output-denied
            ORIGIN,
            [ATTEMPT, PAY, ASK, DENIED, REFUSED],
            CALL_FRAMES
            + ASK_FRAMES
            + frames(DENIED.offset, response(False, reason="too much"))
            + frames(REFUSED.offset, {"type": "tool-output-denied", "toolCallId": "c1"}),
            b"",
        ),
        (  # the continuation a client's approval response reads: from the decision on
            ASK.cursor,
            [ATTEMPT, PAY, ASK, APPROVED],
            frames(APPROVED.offset, response(True)),
            b"",
        ),
    ],
    ids=["waiting", "approved", "denied", "the answer goes on"],
)
def test_approval_frames(
    emit_after: Cursor, entries: list[Entry], expected: bytes, closing: bytes
) -> None:
    renderer = UIMessageRenderer("t1", "st1", emit_after)
    assert renderer.render(entries, {}) == expected
    assert renderer.waiting is (closing != b"")
    assert renderer.closing() == closing
    assert renderer.closing() == (DONE if closing else b""), "the pause goes out once"
