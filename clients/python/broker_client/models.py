"""Plain data types returned by the client."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError

__all__ = ["Event", "Page", "Turn"]


@dataclass(frozen=True, slots=True)
class Event:
    """One broker event: `type` is the SSE event name, `data` its parsed JSON object.

    `attempt` repeats `data["attempt"]` for convenience (0 if the server left it out).
    """

    id: str
    type: str
    data: dict[str, Any]
    attempt: int

    @classmethod
    def from_parts(cls, id: str, type: str, data: str | dict[str, Any]) -> Event:
        """Build an event from its id, type and data (JSON text or an already-parsed object).

        Raises `ProtocolError` if the data is not a JSON object.
        """
        parsed: Any = data
        if isinstance(data, str):
            try:
                parsed = json.loads(data)
            except ValueError as exc:
                raise ProtocolError(f"event {id!r} has non-JSON data: {data[:200]!r}") from exc
        if not isinstance(parsed, dict):
            raise ProtocolError(f"event {id!r} data is not a JSON object: {parsed!r}")
        attempt = parsed.get("attempt")
        # bool is an int subclass; a boolean attempt number would be a server bug, not attempt 1.
        if not isinstance(attempt, int) or isinstance(attempt, bool):
            attempt = 0
        return cls(id=id, type=type, data=parsed, attempt=attempt)


@dataclass(frozen=True, slots=True)
class Page:
    """One answer of the JSON polling endpoint.

    Poll again with `next_offset`; `up_to_date` means no more stored events right now, `closed`
    means the turn is at rest and no more events will come.
    """

    events: list[Event]
    next_offset: str
    up_to_date: bool
    closed: bool

    @classmethod
    def from_json(cls, raw: Any) -> Page:
        """Parse the endpoint's JSON body, raising `ProtocolError` if it has the wrong shape."""
        if not isinstance(raw, dict):
            raise ProtocolError(f"catch-up answer is not a JSON object: {raw!r}")
        items = raw.get("events")
        next_offset = raw.get("next_offset")
        if not isinstance(items, list) or not isinstance(next_offset, str):
            raise ProtocolError(f"catch-up answer lacks events or next_offset: {raw!r}")
        events: list[Event] = []
        for item in items:
            if not isinstance(item, dict):
                raise ProtocolError(f"catch-up event is not a JSON object: {item!r}")
            event_id, event_type, data = item.get("id"), item.get("event"), item.get("data")
            if not isinstance(event_id, str) or not isinstance(event_type, str):
                raise ProtocolError(f"catch-up event lacks id or event: {item!r}")
            if not isinstance(data, dict):
                raise ProtocolError(f"catch-up event data is not a JSON object: {item!r}")
            events.append(Event.from_parts(event_id, event_type, data))
        return cls(
            events=events,
            next_offset=next_offset,
            up_to_date=bool(raw.get("up_to_date", False)),
            closed=bool(raw.get("closed", False)),
        )


@dataclass(frozen=True, slots=True)
class Turn:
    """The broker's answer to starting a turn.

    `created` is False when the broker returned an existing turn with the same `turn_id` (200
    instead of 201), which makes retrying `start_turn` with a fixed `turn_id` safe. `raw` is the
    full JSON body.
    """

    turn_id: str
    conversation_id: str
    stream_id: str
    status: str
    attempt: int
    created: bool
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, raw: Any, *, created: bool, conversation_id: str) -> Turn:
        """Parse a turn body; `conversation_id` is the fallback if the body does not repeat it."""
        if not isinstance(raw, dict):
            raise ProtocolError(f"turn answer is not a JSON object: {raw!r}")
        turn_id, stream_id = raw.get("turn_id"), raw.get("stream_id")
        if not isinstance(turn_id, str) or not isinstance(stream_id, str):
            raise ProtocolError(f"turn answer lacks turn_id or stream_id: {raw!r}")
        status = raw.get("status")
        attempt = raw.get("attempt")
        conv = raw.get("conversation_id")
        return cls(
            turn_id=turn_id,
            conversation_id=conv if isinstance(conv, str) else conversation_id,
            stream_id=stream_id,
            status=status if isinstance(status, str) else "",
            attempt=attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0,
            created=created,
            raw=raw,
        )
