"""The OpenAI doors' renderers: a turn's stored events as Responses events and as Chat
Completions chunks (see :mod:`broker.relay`). Pure: what they need of an ``end`` beyond the
event comes as its facts, looked up by the door.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Final

import orjson

from broker.dialects.openai.approvals import request_item
from broker.dialects.openai.calls import Calls
from broker.dialects.openai.events import (
    OPENING,
    REPLACED,
    TERMINAL,
    AttemptEnd,
    Head,
    expand,
    expansion,
    failure_message,
    frame,
    item_id,
    message_item,
    opening,
)
from broker.frames import Entry
from broker.relay import Facts
from broker.sse import PING

# --- Responses ---------------------------------------------------------------------------------


def opening_frames(head: Head, starting_after: int) -> bytes:
    """A response's ``response.created`` and ``response.in_progress``, those numbered past
    ``starting_after``."""
    if starting_after >= OPENING - 1:
        return b""
    return b"".join(frame(e) for e in opening(head) if e["sequence_number"] > starting_after)


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
        return opening_frames(self.head, self.starting_after)

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


# The terminal events' types: the response object they hold is the response as it ended.
_TERMINAL_TYPES: Final = frozenset(kind for kind, _ in TERMINAL.values())


class ApprovalsRenderer:
    """A response of a turn that may wait for a person, numbered by what is read from its
    start (the turn's origin, or a continuation's: ``continued``), the events after sequence
    number ``starting_after`` sent. See :mod:`broker.dialects.openai.approvals`.

    Each ``approval_request`` is an ``mcp_approval_request`` item (``output_item.added`` and
    ``.done``); the response ends, ``completed`` with the message so far and its requests, at
    the first ``approval_decision`` (not a stop's) after a request it showed, or, when the turn
    waits for that decision, at :meth:`closing` (the door ends the read once the turn parked).
    A continuation's message is opened by its first event and holds its own text only. An
    ``end``'s facts are its :class:`AttemptEnd`."""

    dialect: ClassVar[str] = "responses"
    raw: ClassVar[bool] = False
    heartbeat: ClassVar[bytes] = PING
    replaced: ClassVar[bytes] = REPLACED

    def __init__(self, head: Head, starting_after: int, continued: bool = False) -> None:
        self.head, self.starting_after, self.continued = head, starting_after, continued
        self.sequence = OPENING
        self.items = 0  # output items added so far
        self.messages: dict[int, int] = {}  # attempt -> its message's output index
        self.texts: dict[int, str] = {}  # attempt -> its text read here
        self.attempt = 0
        self.usage: dict[str, Any] | None = None
        self.requests: list[dict[str, Any]] = []  # the approval requests shown
        self.finished = False
        self.ended: dict[str, Any] | None = None  # the response its terminal event held
        self.last: str | None = None  # the wire offset of the last event read

    @property
    def waiting(self) -> bool:
        """Whether it showed approval requests and waits for their decision."""
        return bool(self.requests) and not self.finished

    def opening(self) -> bytes:
        return opening_frames(self.head, self.starting_after)

    def render(self, entries: Sequence[Entry], facts: Facts) -> bytes:
        frames: list[bytes] = []
        for entry in entries:
            events = self.events(entry.kind, orjson.loads(entry.data), facts.get(entry.offset))
            frames += self._numbered(events)
            self.last = entry.offset
        return b"".join(frames)

    def _numbered(self, events: list[dict[str, Any]]) -> list[bytes]:
        out = []
        for event in events:
            event["sequence_number"] = self.sequence
            self.sequence += 1
            if event["type"] in _TERMINAL_TYPES:
                self.ended = event["response"]
            if event["sequence_number"] > self.starting_after:
                out.append(frame(event))
        return out

    def events(
        self, kind: str, data: dict[str, Any], end: AttemptEnd | None
    ) -> list[dict[str, Any]]:
        """The Responses events of one stored event (unnumbered)."""
        if self.finished:
            return []
        attempt = int(data.get("attempt") or self.attempt)
        if kind == "attempt":
            self.attempt, self.requests = attempt, []
            self.messages[attempt], self.texts[attempt] = self.items, ""
            self.items += 1
            return expand(self.head, kind, data, 0, index=self.messages[attempt])
        if kind == "usage":
            self.usage = data
            return []
        if kind == "approval_decision":
            if self.requests and data.get("by") != "stop":
                return self.close()
            return []
        if kind not in ("delta", "approval_request", "end"):
            return []
        events = self._open(attempt)
        if kind == "delta":
            self.texts[attempt] += str(data.get("text", ""))
            events += expand(self.head, kind, data, 0, index=self.messages[attempt])
        elif kind == "approval_request":
            events += self._request(data)
        else:
            events += self._end(data, end)
        return events

    def _open(self, attempt: int) -> list[dict[str, Any]]:
        """The message of ``attempt``, opened by its first event read here (a continuation's)."""
        self.attempt = attempt
        if attempt in self.messages:
            return []
        self.messages[attempt], self.texts[attempt] = self.items, ""
        self.items += 1
        opened = expand(self.head, "attempt", {"attempt": attempt}, 0, index=self.messages[attempt])
        return [e for e in opened if e["type"] != "response.in_progress"]

    def _request(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        item = request_item(data)
        index = self.items
        self.items += 1
        self.requests.append(item)
        return [
            {"type": "response.output_item.added", "output_index": index, "item": item},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def _end(self, data: dict[str, Any], end: AttemptEnd | None) -> list[dict[str, Any]]:
        attempt = self.attempt
        stored = end or AttemptEnd("", "", self.usage, None)
        if self.continued:  # a continuation's message holds what it read
            text = self.texts[attempt]
            stored = AttemptEnd(text, text, stored.usage, stored.reason, stored.error)
        self.finished = True
        index = self.messages[attempt]
        return expand(self.head, "end", data, 0, stored, index=index, calls=self.requests)

    def close(self) -> list[dict[str, Any]]:
        """The end of a response at its approval requests: its message done, then
        ``response.completed`` with the message and the requests."""
        self.finished = True
        attempt = self.attempt
        text = self.texts.get(attempt, "")
        index = self.messages.get(attempt, 0)
        common = {"item_id": item_id(self.head.response_id, attempt), "output_index": index}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        message = message_item(self.head.response_id, attempt, text, "completed")
        response = self.head.response("completed", [message, *self.requests], usage=self.usage)
        return [
            {
                "type": "response.output_text.done",
                **common,
                "content_index": 0,
                "text": text,
                "logprobs": [],
            },
            {"type": "response.content_part.done", **common, "content_index": 0, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": message},
            {"type": "response.completed", "response": response},
        ]

    def caught_up(self) -> bytes:
        return b""

    def closing(self) -> bytes:
        """The end at the approval requests, when the read ended while they wait."""
        return b"".join(self._numbered(self.close())) if self.waiting else b""

    def snapshot(self) -> dict[str, Any]:
        """The response as it stands: as it ended, or in progress with its message so far."""
        if self.ended is not None:
            return self.ended
        attempt = self.attempt
        output = []
        if attempt in self.messages:
            text = self.texts[attempt]
            output.append(message_item(self.head.response_id, attempt, text, "in_progress"))
        return self.head.response("in_progress", [*output, *self.requests])


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
