"""The OpenAI doors' renderers: a turn's stored events as Responses events and as Chat
Completions chunks (see :mod:`broker.relay`). Pure: what they need of an ``end`` beyond the
event comes as its facts, looked up by the door.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Final

import orjson

from broker.dialects.openai.calls import Calls
from broker.dialects.openai.events import (
    OPENING,
    REPLACED,
    AttemptEnd,
    Head,
    expand,
    expansion,
    failure_message,
    frame,
    opening,
)
from broker.frames import Entry
from broker.relay import Facts
from broker.sse import PING

# --- Responses ---------------------------------------------------------------------------------


class ResponsesRenderer:
    """A response's events after sequence number ``starting_after`` (-1: all), the first stored
    event read numbered from ``base``. An ``end``'s facts are its :class:`AttemptEnd`.

    A response with function tools (``calls``) is read from the stream's origin: its client
    calls' events are rendered too (see :mod:`broker.dialects.openai.calls`), and their number
    follows from what was read."""

    dialect: ClassVar[str] = "responses"
    raw: ClassVar[bool] = False
    heartbeat: ClassVar[bytes] = PING
    replaced: ClassVar[bytes] = REPLACED

    def __init__(
        self, head: Head, starting_after: int, base: int = OPENING, calls: Calls | None = None
    ) -> None:
        self.head, self.starting_after, self.base = head, starting_after, base
        self.calls = calls

    def opening(self) -> bytes:
        """``response.created`` and ``response.in_progress``, those past ``starting_after``."""
        if self.starting_after >= OPENING - 1:
            return b""
        opened = opening(self.head)
        return b"".join(frame(e) for e in opened if e["sequence_number"] > self.starting_after)

    def render(self, entries: Sequence[Entry], facts: Facts) -> bytes:
        frames: list[bytes] = []
        for entry in entries:
            data = orjson.loads(entry.data)
            if self.calls is not None:
                events = self._with_calls(self.calls, entry, data, facts)
            elif expansion(entry.kind, data):
                end: AttemptEnd | None = facts.get(entry.offset) if entry.kind == "end" else None
                events = expand(self.head, entry.kind, data, self.base, end)
            else:
                continue
            for event in events:
                if event["sequence_number"] > self.starting_after:
                    frames.append(frame(event))
            self.base += len(events)
        return b"".join(frames)

    def _with_calls(
        self, calls: Calls, entry: Entry, data: dict[str, Any], facts: Facts
    ) -> list[dict[str, Any]]:
        kind = entry.kind
        if kind in ("tool_input_delta", "tool_call"):
            events = calls.events(kind, data)
            for n, event in enumerate(events):
                event["sequence_number"] = self.base + n
            return events
        if not expansion(kind, data):
            return []
        attempt = int(data.get("attempt") or 0)
        index = calls.start(attempt) if kind == "attempt" else calls.messages.get(attempt)
        end: AttemptEnd | None = facts.get(entry.offset) if kind == "end" else None
        ended = kind == "end" and data.get("status") == "requires_action"
        completed = list(calls.completed) if ended else None
        return expand(self.head, kind, data, self.base, end, index=index, calls=completed)

    def caught_up(self) -> bytes:
        return b""

    def closing(self) -> bytes:
        return b""


# --- Chat Completions --------------------------------------------------------------------------

# An ``end``'s status (and an attempt record's: an interrupted attempt's record says ``partial``)
# as a ``finish_reason``; a failed attempt has none (it ends with an error).
FINISH: Final = {
    "complete": "stop",
    "cancelled": "stop",
    "interrupted": "length",
    "partial": "length",
    "requires_action": "tool_calls",
}
DONE: Final = b"data: [DONE]\n\n"
# The last frame of a read a newer one-viewer connection took over, in the SDKs' error shape.
# (Attach tokens may not create, so none reads here; the door's reads are viewers all the same.)
CHAT_REPLACED: Final = (
    b'data: {"error":{"message":"a newer connection of this one-viewer token took over; do not '
    b'reconnect","type":"invalid_request_error","param":null,"code":"viewer_replaced"}}\n\n'
)


def usage_of(record: dict[str, Any] | None) -> dict[str, int] | None:
    """The broker's usage record as Chat Completions usage (None while unknown)."""
    if not record:
        return None
    prompt = int(record.get("input_tokens") or 0)
    completion = int(record.get("output_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def failure(reason: str, message: str | None = None) -> bytes:
    """An error event in OpenAI's shape: the SDKs raise it from the stream."""
    error = {
        "message": f"the generation failed: {failure_message(reason, message)}",
        "type": "server_error",
        "param": None,
        "code": reason,
    }
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


class ChatRenderer:
    """One completion's chunks: ``attempt`` the role chunk, ``delta`` a content chunk, a client
    tool call's ``tool_input_delta`` a ``tool_calls`` chunk (``index`` in order of first
    appearance in the attempt, ``id``, ``type`` and ``name`` on the call's first chunk, the
    arguments' pieces after), ``end`` the finish chunk (and the usage chunk with
    ``include_usage``), then ``[DONE]``. An ``end``'s facts are the attempt's usage record,
    looked up when :attr:`needs_usage` (the ``usage`` event came before the read's start).

    A read that resumes after ``skip_through`` (a wire offset) may start at the stream's origin:
    the events up to that offset are taken in (so that a call's ``index`` is the one the client
    saw) and give no chunk."""

    dialect: ClassVar[str] = "chat"
    raw: ClassVar[bool] = False
    heartbeat: ClassVar[bytes] = PING
    replaced: ClassVar[bytes] = CHAT_REPLACED

    def __init__(
        self,
        completion_id: str,
        model: str,
        created: int,
        include_usage: bool,
        skip_through: str | None = None,
    ) -> None:
        self.id, self.model, self.created = completion_id, model, created
        self.include_usage = include_usage
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None  # the attempt's error message, when one came
        self.skip_through = skip_through
        self.calls: dict[str, int] = {}  # the attempt's client calls: call id -> index

    @property
    def needs_usage(self) -> bool:
        """Whether an ``end`` now needs the attempt's stored usage as its facts."""
        return self.include_usage and self.usage is None

    def opening(self) -> bytes:
        return b""

    def render(self, entries: Sequence[Entry], facts: Facts) -> bytes:
        out: list[bytes] = []
        for entry in entries:
            chunks = self._entry(entry, orjson.loads(entry.data), facts)
            if self.skip_through is None or entry.offset > self.skip_through:
                out += chunks
        return b"".join(out)

    def _entry(self, entry: Entry, data: dict[str, Any], facts: Facts) -> list[bytes]:
        kind = entry.kind
        if kind == "attempt":
            self.calls, self.error = {}, None
            return [self.chunk(entry.offset, {"role": "assistant", "content": ""})]
        if kind == "delta":
            return [self.chunk(entry.offset, {"content": str(data.get("text", ""))})]
        if kind == "tool_input_delta":
            return [self._call(entry.offset, data, str(data.get("delta", "")))]
        if kind == "tool_call" and data.get("status") == "client":
            if data.get("call_id") in self.calls:  # its arguments came as tool_input_delta
                return []
            return [self._call(entry.offset, data, orjson.dumps(data.get("args", {})).decode())]
        if kind == "usage":
            self.usage = data
        elif kind == "error":
            self.error = data.get("message")
        elif kind == "end":
            return self._end(entry.offset, data, facts)
        return []

    def _call(self, offset: str, data: dict[str, Any], arguments: str) -> bytes:
        """A ``tool_calls`` chunk: the call's first carries its id, type and name."""
        call_id = str(data.get("call_id"))
        index = self.calls.get(call_id)
        if index is not None:
            call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
        else:
            index = self.calls[call_id] = len(self.calls)
            function = {"name": str(data.get("name")), "arguments": arguments}
            call = {"index": index, "id": call_id, "type": "function", "function": function}
        return self.chunk(offset, {"tool_calls": [call]})

    def _end(self, offset: str, data: dict[str, Any], facts: Facts) -> list[bytes]:
        status = str(data.get("status"))
        if status not in FINISH:
            return [failure(str(data.get("reason") or "failed"), self.error)]
        out = [self.chunk(offset, {}, FINISH[status])]
        if self.include_usage:
            if self.usage is None:  # the usage event came before this read's start
                self.usage = facts.get(offset)
            out.append(self.usage_chunk(offset, usage_of(self.usage)))
        return out

    def caught_up(self) -> bytes:
        return b""

    def closing(self) -> bytes:
        return DONE

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

    def usage_chunk(self, offset: str, usage: dict[str, int] | None) -> bytes:
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
