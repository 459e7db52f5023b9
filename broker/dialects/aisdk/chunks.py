"""UI message chunks rendered from a turn's stored events.

One turn's stream becomes one assistant message. Each attempt is a step; text between tool calls
is one text part, whose id is derived from the attempt and its place in it, so that a replay
renders the very same chunks. A chunk is sent as ``data: <json>``; the last frame rendered from
an event carries the event's offset as its SSE ``id:``, so ``Last-Event-ID`` names an event
whose frames all arrived. The AI SDK's parser drops SSE ids, so each ``text-delta`` also carries
its offset as ``providerMetadata.broker.offset``, which the SDK keeps on the text part: a client
that does not want a full replay resumes after it.

| broker event | chunks |
|---|---|
| first event of a read | ``start`` (``messageId``), ``data-broker``; a follow-up turn's |
|  | replay from ``start``: the steps of the message before it (``tools.prelude``) |
| ``attempt`` | ``start-step`` (a continue attempt: a new step of the same message) |
| ``delta`` | ``text-start`` (first of a part), ``text-delta`` (with its offset) |
| ``tool_input_delta`` | ``tool-input-start`` (a call's first), ``tool-input-delta`` |
| ``tool_call`` | ``tool-input-available`` (dispatched: ``providerExecuted``; client: the |
|  | client's to run, after a ``tool-input-start`` if none came), ``tool-input-error`` (not |
|  | run: ``providerExecuted``, so that the client never runs it) |
| ``tool_result`` | ``tool-output-available`` or ``tool-output-error``; a call a person |
|  | denied: ``tool-output-denied`` |
| ``approval_request`` | ``tool-approval-request`` (``approvalId``, the call's ``toolCallId``) |
| ``approval_decision`` | ``tool-approval-response`` (``approved``, ``reason``, |
|  | ``providerExecuted``) |
| ``error`` | kept for the ``end`` that follows |
| ``usage`` | nothing (``GET /v1/turns/{id}`` has it) |
| ``end`` | ``text-end``, ``finish-step``, ``data-broker``; at rest: ``finish`` (complete; |
|  | ``tool-calls`` for requires_action), ``abort`` (cancelled), ``error`` + ``finish`` |
|  | (interrupted, failed) |

A read that reaches its tail while approvals it showed wait for a person (the turn is
``awaiting_approval``: nothing comes until someone decides) ends the message for now:
``finish-step``, ``data-broker`` (``awaiting_approval``), ``finish`` (``tool-calls``), as the AI
SDK's own server does. The client's approval response (``addToolApprovalResponse``) sends the
chat again, and the answer goes on in the same message (see :mod:`broker.dialects.aisdk.tools`).

A client call's ``toolCallId`` is the broker's call id, derived from its slot: the same after a
retry, a regenerate or a resume (see :mod:`broker.client_tools`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import orjson

from broker.approval_rules import APPROVAL_DENIED
from broker.dialects.aisdk.tools import reply_id
from broker.frames import Entry
from broker.vocabulary import TurnStatus

DONE: Final = b"data: [DONE]\n\n"
# The last frame of a one-viewer read whose token a newer connection took over: an ``error``
# chunk (no id: it is no event of the stream), after which the client does not resume.
REPLACED: Final = b'data: {"type":"error","errorText":"viewer_replaced"}\n\n'
# The ``errorText`` of a turn that did not complete: stable codes a client may switch on.
INTERRUPTED: Final = "turn_interrupted"
FAILED: Final = "turn_failed"

Chunk = dict[str, Any]


def message_id(turn_id: str) -> str:
    """The assistant message's id: one per turn, whichever attempt is shown (a turn that
    answers tool results goes on in the message of the calls)."""
    return reply_id(turn_id)


def encode(offset: str, chunks: list[Chunk]) -> bytes:
    """The SSE frames of one event's chunks; the last one carries the event's offset."""
    frames = [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks]
    frames[-1] = f"id: {offset}\n".encode() + frames[-1]
    return b"".join(frames)


class Renderer:
    """Turns one stream's events, in order, into UI message chunks."""

    def __init__(self, turn_id: str, stream_id: str, prelude: Sequence[Chunk] = ()) -> None:
        self.turn_id = turn_id
        self.stream_id = stream_id
        self.prelude = list(prelude)  # the steps before this turn's, after ``start``
        self.started = False
        self.finished = False  # a terminal chunk went out: [DONE] follows
        self._attempt = 0
        self._step_open = False
        self._text: str | None = None  # the open text part's id
        self._parts = 0  # text parts of the current attempt
        self._error: dict[str, Any] | None = None
        self._inputs: set[str] = set()  # client calls of the attempt whose input started
        self.waiting: set[str] = set()  # approvals shown and not decided yet
        self.offset = ""  # the last event rendered

    def facts(self, offset: str, status: str, **extra: Any) -> Chunk:
        """The broker's own facts as one data part, updated in place (fixed ``id``)."""
        data = {
            "turnId": self.turn_id,
            "streamId": self.stream_id,
            "attempt": self._attempt,
            "offset": offset,
            "status": status,
            **extra,
        }
        return {"type": "data-broker", "id": "broker", "data": data}

    def render(self, entry: Entry, *, final: bool = False) -> list[Chunk]:
        """The chunks of one event; ``final``: an ``end`` after which the turn is at rest."""
        data: dict[str, Any] = orjson.loads(entry.data)
        chunks: list[Chunk] = []
        attempt = data.get("attempt")
        if isinstance(attempt, int) and attempt != self._attempt:
            self._attempt, self._parts = attempt, 0
            self._inputs = set()
        if not self.started:
            self.started = True
            chunks.append({"type": "start", "messageId": message_id(self.turn_id)})
            chunks.append(self.facts(entry.offset, TurnStatus.STREAMING))
            chunks += self.prelude
        kind = entry.kind
        self.offset = entry.offset
        if kind == "attempt":
            chunks += self._close_step()
            chunks.append({"type": "start-step"})
            self._step_open = True
            self._error = None
        elif kind == "delta":
            chunks += self._open_step()
            if self._text is None:
                self._parts += 1
                self._text = f"{self._attempt}-{self._parts}"
                chunks.append({"type": "text-start", "id": self._text})
            chunks.append(
                {
                    "type": "text-delta",
                    "id": self._text,
                    "delta": str(data["text"]),
                    "providerMetadata": {"broker": {"offset": entry.offset}},
                }
            )
        elif kind == "tool_input_delta":
            chunks += self._open_step() + self._close_text() + self._input_start(data)
            delta = {"toolCallId": str(data.get("call_id")), "inputTextDelta": str(data["delta"])}
            chunks.append({"type": "tool-input-delta", **delta})
        elif kind == "tool_call":
            chunks += self._open_step() + self._close_text()
            if data.get("status") == "client":
                chunks += self._input_start(data)
            chunks.append(self._tool_call(data))
        elif kind == "tool_result":
            chunks += self._open_step() + self._close_text()
            chunks.append(self._tool_result(data))
        elif kind in ("approval_request", "approval_decision"):
            chunks += self._approval(kind, data)
        elif kind == "error":
            self._error = data
        elif kind == "end":
            chunks += self._end(entry.offset, data, final)
        return chunks

    def _approval(self, kind: str, data: dict[str, Any]) -> list[Chunk]:
        """A server call that waits for a person, or the decision that stands on it."""
        approval_id = str(data.get("approval_id"))
        if kind == "approval_request":
            self.waiting.add(approval_id)
            chunk = {"approvalId": approval_id, "toolCallId": str(data.get("call_id"))}
            return (
                self._open_step()
                + self._close_text()
                + [{"type": "tool-approval-request", **chunk}]
            )
        self.waiting.discard(approval_id)
        response: Chunk = {
            "type": "tool-approval-response",
            "approvalId": approval_id,
            "approved": data.get("decision") == "approve",
            "providerExecuted": True,
        }
        if data.get("reason"):
            response["reason"] = str(data["reason"])
        return [response]

    def pause(self) -> list[Chunk]:
        """The message's end for now, at the tail of a turn that waits for a person: the
        client answers the approvals it shows and sends the chat again."""
        if self.finished or not self.waiting:
            return []
        self.finished = True
        chunks = self._close_step()
        chunks.append(self.facts(self.offset, TurnStatus.AWAITING_APPROVAL))
        chunks.append({"type": "finish", "finishReason": "tool-calls"})
        return chunks

    def _open_step(self) -> list[Chunk]:
        if self._step_open:
            return []
        self._step_open = True
        return [{"type": "start-step"}]

    def _close_text(self) -> list[Chunk]:
        if self._text is None:
            return []
        text_id, self._text = self._text, None
        return [{"type": "text-end", "id": text_id}]

    def _close_step(self) -> list[Chunk]:
        chunks = self._close_text()
        if self._step_open:
            self._step_open = False
            chunks.append({"type": "finish-step"})
        return chunks

    def _input_start(self, data: dict[str, Any]) -> list[Chunk]:
        """A client call's ``tool-input-start``, before its first piece of input."""
        call_id = str(data.get("call_id"))
        if call_id in self._inputs:
            return []
        self._inputs.add(call_id)
        return [{"type": "tool-input-start", "toolCallId": call_id, "toolName": data.get("name")}]

    @staticmethod
    def _tool_call(data: dict[str, Any]) -> Chunk:
        call_id, name = str(data.get("call_id")), str(data.get("name"))
        if data.get("status") == "client":
            return {
                "type": "tool-input-available",
                "toolCallId": call_id,
                "toolName": name,
                "input": data.get("args"),
            }
        if data.get("status") == "dispatched":
            return {
                "type": "tool-input-available",
                "toolCallId": call_id,
                "toolName": name,
                "input": data.get("args"),
                "providerExecuted": True,
            }
        return {
            "type": "tool-input-error",
            "toolCallId": call_id,
            "toolName": name,
            "input": data.get("args"),
            "providerExecuted": True,
            "errorText": f"{data.get('status')}: {data.get('reason')}",
        }

    @staticmethod
    def _tool_result(data: dict[str, Any]) -> Chunk:
        call_id = str(data.get("call_id"))
        error = data.get("error")
        if error is not None:
            code = error.get("code") if isinstance(error, dict) else error
            if code == APPROVAL_DENIED:
                return {"type": "tool-output-denied", "toolCallId": call_id}
            return {
                "type": "tool-output-error",
                "toolCallId": call_id,
                "errorText": str(code),
                "providerExecuted": True,
            }
        return {
            "type": "tool-output-available",
            "toolCallId": call_id,
            "output": data.get("result"),
            "providerExecuted": True,
        }

    def _end(self, offset: str, data: dict[str, Any], final: bool) -> list[Chunk]:
        status, reason = str(data.get("status")), data.get("reason")
        chunks = self._close_step()
        extra: dict[str, Any] = {"reason": reason}
        if status in ("interrupted", "failed"):
            extra["partial"] = True
            if self._error is not None:
                extra["error"] = {k: self._error.get(k) for k in ("code", "message", "retryable")}
        chunks.append(self.facts(offset, status, **extra))
        if not final:
            return chunks  # another attempt follows on this stream
        self.finished = True
        if status == "complete":
            chunks.append({"type": "finish", "finishReason": "stop"})
        elif status == "requires_action":  # the client runs the calls, then sends the chat
            chunks.append({"type": "finish", "finishReason": "tool-calls"})
        elif status == "cancelled":
            chunks.append({"type": "abort", "reason": "cancelled"})
        else:
            text = INTERRUPTED if status == "interrupted" else FAILED
            chunks.append({"type": "error", "errorText": text})
            reason_code = "interrupted" if status == "interrupted" else "error"
            chunks.append({"type": "finish", "finishReason": reason_code})
        return chunks
