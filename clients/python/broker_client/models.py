"""Plain data types returned by the client."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from .errors import ProtocolError

__all__ = ["ApprovalDecision", "ApprovalRequest", "AttachToken", "Event", "Page", "Turn"]


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


@dataclass(frozen=True, slots=True)
class AttachToken:
    """A read-only credential for one turn's stream, minted by `BrokerClient.mint_attach_token`.

    Pass `token` to `attach(..., token=...)` or `catch_up(..., token=...)`, or hand `stream_url`
    (absolute, with `?token=`) to a reader that cannot send headers. `expires_at` is in unix
    seconds. The token and the URL are left out of `repr`: they are credentials.
    """

    token: str = field(repr=False)
    turn_id: str
    stream_id: str
    expires_at: int
    one_viewer: bool
    stream_url: str = field(repr=False)
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, raw: Any, *, base_url: str, turn_id: str) -> AttachToken:
        """Parse the broker's answer; `links.stream` is made absolute against `base_url`."""
        if not isinstance(raw, dict):
            raise ProtocolError("attach token answer is not a JSON object")
        token, stream_id = raw.get("token"), raw.get("stream_id")
        expires_at = raw.get("expires_at")
        if not isinstance(token, str) or not token or not isinstance(stream_id, str):
            raise ProtocolError("attach token answer lacks token or stream_id")
        if not isinstance(expires_at, int | float) or isinstance(expires_at, bool):
            raise ProtocolError("attach token answer lacks expires_at")
        links = raw.get("links")
        link = links.get("stream") if isinstance(links, dict) else None
        if not isinstance(link, str) or not link:
            link = f"/v1/streams/{quote(stream_id, safe='')}?token={quote(token, safe='')}"
        answered_turn = raw.get("turn_id")
        return cls(
            token=token,
            turn_id=answered_turn if isinstance(answered_turn, str) else turn_id,
            stream_id=stream_id,
            expires_at=int(expires_at),
            one_viewer=bool(raw.get("one_viewer", False)),
            stream_url=link if "://" in link else base_url.rstrip("/") + link,
            raw=raw,
        )


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """A tool call that waits for a person (an `approval_request` event, or one of a turn's
    `approvals` while it is `awaiting_approval`): answer it with `approve` or `deny`."""

    approval_id: str
    call_id: str
    name: str
    ordinal: int
    args: Any
    expires_at: float  # seconds since the epoch: then it is denied (reason "expired")
    attempt: int = 0

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> ApprovalRequest:
        """From an `approval_request` event's data or a turn's `approvals` entry."""
        try:
            return cls(
                approval_id=str(data["approval_id"]),
                call_id=str(data["call_id"]),
                name=str(data["name"]),
                ordinal=int(data["ordinal"]),
                args=data.get("args"),
                expires_at=float(data["expires_at"]),
                attempt=int(data.get("attempt") or 0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"not an approval request: {data!r}") from exc


@dataclass(frozen=True, slots=True)
class ApprovalDecision:
    """The decision that stands on an approval (an `approval_decision` event, or the answer of
    `approve`/`deny`): `by` is `person`, `expiry` (deny, reason `expired`) or `stop`."""

    approval_id: str
    decision: str  # approve | deny
    reason: str | None
    by: str

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> ApprovalDecision:
        try:
            reason = data.get("reason")
            return cls(
                approval_id=str(data["approval_id"]),
                decision=str(data["decision"]),
                reason=None if reason is None else str(reason),
                by=str(data["by"]),
            )
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"not an approval decision: {data!r}") from exc
