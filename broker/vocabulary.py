"""The broker's words: turn and attempt statuses, the ids clients name (their alphabet, their
tenant scoping), and the space-joined ids stored in Redis.

The ground floor: this module imports nothing of the broker, and every room may import it. The
status words are stored in Redis and sent on the wire, so each is a ``StrEnum`` whose value is
the word itself: ``TurnStatus.QUEUED == "queued"``, and a value read back from Redis compares
equal to its member.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final


class TurnStatus(StrEnum):
    """A turn's status (the ``status`` field of its hash): where its current attempt stands."""

    QUEUED = "queued"
    STREAMING = "streaming"
    COMPLETE = "complete"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    FAILED = "failed"
    # The model called client tools: the attempt ended with the calls as its outcome, and the
    # next turn carries their results.
    REQUIRES_ACTION = "requires_action"
    # A tool call waits for a person's approval: no worker holds the turn, readers stay
    # attached, and a decision queues it again. Not at rest, and not active.
    AWAITING_APPROVAL = "awaiting_approval"


class AttemptStatus(StrEnum):
    """An attempt's own status, as its record on the turn keeps it once it ended."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    CANCELLED = "cancelled"
    FAILED = "failed"
    REQUIRES_ACTION = "requires_action"


# A turn at rest: its current attempt ended, and nothing more comes unless a new one starts.
FINAL_STATUSES: Final = frozenset(
    {
        TurnStatus.COMPLETE,
        TurnStatus.INTERRUPTED,
        TurnStatus.CANCELLED,
        TurnStatus.FAILED,
        TurnStatus.REQUIRES_ACTION,
    }
)
# A turn that holds a stream slot of its tenant: queued, or generating.
ACTIVE_STATUSES: Final = frozenset({TurnStatus.QUEUED, TurnStatus.STREAMING})
# The statuses whose text (when there is any) becomes the turn's canonical answer.
PROMOTED_STATUSES: Final = frozenset(
    {
        TurnStatus.COMPLETE,
        TurnStatus.INTERRUPTED,
        TurnStatus.CANCELLED,
        TurnStatus.REQUIRES_ACTION,
    }
)
# The attempt's status for the turn status it ended with: an interrupted turn holds a partial one.
ATTEMPT_STATUS: Final = {
    TurnStatus.COMPLETE: AttemptStatus.COMPLETE,
    TurnStatus.INTERRUPTED: AttemptStatus.PARTIAL,
    TurnStatus.CANCELLED: AttemptStatus.CANCELLED,
    TurnStatus.FAILED: AttemptStatus.FAILED,
    TurnStatus.REQUIRES_ACTION: AttemptStatus.REQUIRES_ACTION,
}


def encode_turn_ref(conversation_id: str, turn_id: str) -> str:
    """The stream index's value: ``"<conversation_id> <turn_id>"`` (neither holds a space)."""
    return f"{conversation_id} {turn_id}"


def decode_turn_ref(value: str) -> tuple[str, str]:
    """``(conversation_id, turn_id)`` from :func:`encode_turn_ref`'s form."""
    conversation_id, _, turn_id = value.partition(" ")
    return conversation_id, turn_id


def encode_attempt_ref(conversation_id: str, turn_id: str, attempt: int) -> str:
    """One attempt of a turn: ``"<conversation_id> <turn_id> <attempt>"``. It names a stop
    notification's attempt and a tenant's stream slot (so freeing a slot never frees a newer
    attempt's)."""
    return f"{conversation_id} {turn_id} {attempt}"


def decode_attempt_ref(data: str) -> tuple[str, str, int]:
    """``(conversation_id, turn_id, attempt)`` from :func:`encode_attempt_ref`'s form; a
    malformed value gives ``("", "", 0)``, which names no attempt."""
    parts = data.split(" ")
    try:
        return parts[0], parts[1], int(parts[2])
    except (IndexError, ValueError):
        return "", "", 0


# Ids chosen by clients become part of key names and hash tags: keep them to a safe alphabet.
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# A tool's name, server or client: what the providers' function names take.
TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
STREAM_ID_PATTERN = re.compile(r"^st_[0-9a-f]{32}$")
# Tenant names never hold "/", so "<tenant>/<id>" splits one way only (client ids hold no "/").
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@|+:-]{0,127}$")
OPEN_TENANT = "-"  # the rate and stream limits' name for every caller of an open broker


def scoped(tenant: str | None, ident: str) -> str:
    """A client-chosen id inside its tenant: ``<tenant>/<id>``; unchanged when the broker is open.

    Conversations and turn ids are named by clients, so two tenants may pick the same ones: the
    scoped form keeps their keys apart, and a tenant can only ever name ids of its own.
    """
    return ident if tenant is None else f"{tenant}/{ident}"


def unscoped(scoped_id: str) -> tuple[str | None, str]:
    """``(tenant, id)`` from :func:`scoped`'s form (tenant ``None`` for an open broker's ids)."""
    tenant, slash, ident = scoped_id.partition("/")
    return (tenant, ident) if slash else (None, scoped_id)
