"""A turn as its hash stores it, decoded in one place: the request it was made with, each
attempt's record, and the state ``GET /v1/turns/{id}`` shows.

The hash's fields (``request``, ``attempt:<n>``, ``text:<n>``, ``status``, ...) are written by the
scripts of ``lua/`` and read by :class:`broker.turns.Turns`; every other room, the doors
included, gets these types, never the fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from broker.vocabulary import ACTIVE_STATUSES, TurnStatus, unscoped

# The statuses a current attempt shows as its own: queued, generating, or waiting for a person.
WAITING_STATUSES = ACTIVE_STATUSES | {TurnStatus.AWAITING_APPROVAL}

# The fields of an attempt's record that a turn's state shows.
ATTEMPT_FIELDS = ("n", "strategy", "status", "reason", "canonical", "usage")


@dataclasses.dataclass(frozen=True, slots=True)
class StoredRequest:
    """The request a turn was made with (its hash's ``request``: canonical JSON of the body,
    without its turn id, session and notify target)."""

    conversation_id: str  # the client's own, unscoped
    messages: tuple[dict[str, Any], ...]
    provider: str | None
    model: str | None
    params: dict[str, Any]
    echo: dict[str, Any] = dataclasses.field(default_factory=dict)  # a door's echoed fields
    # The tools the client runs ({"name", "description"?, "parameters"?}), as the turn got them.
    client_tools: tuple[dict[str, Any], ...] = ()

    @classmethod
    def decode(cls, raw: str | None) -> StoredRequest:
        """The stored JSON as a request (an empty one for a turn that has none)."""
        body: dict[str, Any] = orjson.loads(raw) if raw else {}
        return cls(
            conversation_id=str(body.get("conversation_id") or ""),
            messages=tuple(body.get("messages") or ()),
            provider=body.get("provider"),
            model=body.get("model"),
            params=dict(body.get("params") or {}),
            echo=dict(body.get("echo") or {}),
            client_tools=tuple(body.get("client_tools") or ()),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt's record (its hash's ``attempt:<n>``): how it started and, once it ended,
    its status, reason and usage."""

    n: int
    strategy: str
    status: str
    reason: str | None
    canonical: bool
    usage: dict[str, Any] | None
    continues: int | None  # a continue's: the attempt whose partial text it continues
    # ``requires_action``'s: the client calls it ended with ({"call_id", "name", "arguments"})
    tool_calls: tuple[dict[str, Any], ...] = ()
    error: str | None = None  # a failed attempt's message (its reason is the code)

    @classmethod
    def decode(cls, raw: str | None) -> AttemptRecord | None:
        """The stored JSON as a record; None for an attempt that has none."""
        if not raw:
            return None
        record: dict[str, Any] = orjson.loads(raw)
        continues = record.get("from") if record.get("strategy") == "continue" else None
        return cls(
            n=int(record.get("n") or 0),
            strategy=str(record.get("strategy") or ""),
            status=str(record.get("status") or ""),
            reason=record.get("reason"),
            canonical=bool(record.get("canonical")),
            usage=record.get("usage"),
            continues=int(continues) if continues else None,
            tool_calls=tuple(record.get("tool_calls") or ()),
            error=record.get("error"),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """An attempt's record and its text: ``text`` is the whole answer it holds (for a
    continue, the partial it continues and then its own), ``own_text`` what it added itself."""

    record: AttemptRecord | None
    text: str
    own_text: str


@dataclasses.dataclass(frozen=True, slots=True)
class TurnHead:
    """A turn found by its id: where it lives and what it was asked."""

    turn_id: str
    conversation_id: str  # scoped to its tenant (see vocabulary.scoped)
    stream_id: str
    created_ms: int
    request: StoredRequest


def links(turn_id: str, stream_id: str) -> dict[str, str]:
    return {
        "self": f"/v1/turns/{turn_id}",
        "stream": f"/v1/streams/{stream_id}",
        "cancel": f"/v1/turns/{turn_id}/cancel",
        "attempts": f"/v1/turns/{turn_id}/attempts",
    }


def turn_state(
    turn_id: str,
    conversation_id: str,
    meta: dict[str, str],
    waiting: frozenset[str] | None = None,
) -> dict[str, Any]:
    """The turn's state as ``GET /v1/turns/{id}`` shows it, from its stored hash ``meta``;
    ``waiting``: the approvals a parked attempt still waits for (None: all it parked on)."""
    current = int(meta["attempt"])
    attempts = []
    for n in range(1, current + 1):
        raw = meta.get(f"attempt:{n}")
        if not raw:
            continue
        record = orjson.loads(raw)
        attempt = {field: record.get(field) for field in ATTEMPT_FIELDS}
        attempt["canonical"] = bool(attempt["canonical"])
        if n == current and meta["status"] in WAITING_STATUSES:
            attempt["status"] = meta["status"]
        if record.get("strategy") == "continue":
            attempt["continues"] = record.get("from")
        if record.get("error"):
            attempt["error"] = record["error"]
        attempts.append(attempt)
    canonical = None
    pending: list[dict[str, Any]] = []
    if meta.get("canonical"):
        n = int(meta["canonical"])
        canonical = {"attempt": n, "text": meta.get(f"text:{n}", "")}
        pending = list(orjson.loads(meta.get(f"attempt:{n}") or "{}").get("tool_calls") or ())
    stream_id = meta["stream_id"]
    state = {
        "turn_id": turn_id,
        "conversation_id": unscoped(conversation_id)[1],
        "stream_id": stream_id,
        "status": meta["status"],
        "attempt": current,
        "attempts": attempts,
        "canonical": canonical,
        "created_ms": int(meta["created_ms"]),
        "links": links(turn_id, stream_id),
    }
    if pending:
        state["tool_calls"] = pending  # the client calls the canonical attempt ended with
    if meta["status"] == TurnStatus.AWAITING_APPROVAL:
        parked = orjson.loads(meta.get(f"attempt:{current}") or "{}").get("parked") or {}
        state["approvals"] = [
            approval_shown(call)
            for call in parked.get("awaiting", ())
            if waiting is None or call["approval_id"] in waiting
        ]
    return state


def approval_shown(call: dict[str, Any]) -> dict[str, Any]:
    """A pending approval as ``GET /v1/turns/{id}`` lists it (the request event's fields)."""
    return {
        "approval_id": call["approval_id"],
        "call_id": call["call_id"],
        "name": call["name"],
        "ordinal": call["ordinal"],
        "args": orjson.loads(call["arguments"] or "{}"),
        "expires_at": call["expires_ms"] / 1000,
    }
