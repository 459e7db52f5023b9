"""Tool approvals' pure parts: a tool's rule, the words of a decision, the events' shapes, and
the clock that dates an approval.

A server tool (``BROKER_TOOLS``) carries an ``approval`` rule: ``"never"`` (the default),
``"always"``, or ``{"when": <JSON Schema>}``: a person must approve a call whose arguments match
the schema (an amount over a threshold, say). A call that needs approval parks its ledger slot as
``awaiting_approval``; the first decision, from anyone entitled, wins (see
:mod:`broker.approvals`). Everything here is pure and tested as tables.

The clock is a seam (:func:`set_clock`), so that a test moves time past an approval's expiry
instead of waiting for it; the broker's processes use the wall clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

import jsonschema

Decision = Literal["approve", "deny"]
DECISIONS: Final[tuple[Decision, ...]] = ("approve", "deny")
# How a decision was made: by a person, by the approval's expiry, or by a stop of its turn.
DECIDED_BY: Final = ("person", "expiry", "stop")
EXPIRED: Final = "expired"  # the reason of a decision the expiry made
STOPPED: Final = "stopped"  # the reason of a decision a stop made
APPROVAL_DENIED: Final = "approval_denied"  # the error code of a call that was declined
APPROVAL_ID_PATTERN: Final = re.compile(r"^apr_[0-9a-f]{24}$")
MAX_REASON_CHARS: Final = 1_000


class RuleError(ValueError):
    """An approval rule that is not one of the three forms (the message says why)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ApprovalRule:
    """When a tool's call waits for a person: ``mode`` never, always, or when (``schema``)."""

    mode: Literal["never", "always", "when"] = "never"
    schema: dict[str, Any] | None = None

    @classmethod
    def parse(cls, value: Any) -> ApprovalRule:
        """The rule from a tools file's ``approval`` value; :class:`RuleError` when malformed."""
        if value is None or value == "never":
            return cls("never")
        if value == "always":
            return cls("always")
        if isinstance(value, dict):
            if set(value) != {"when"} or not isinstance(value["when"], dict):
                raise RuleError('approval must be {"when": <a JSON Schema object>}')
            try:
                jsonschema.Draft202012Validator.check_schema(value["when"])
            except jsonschema.SchemaError as exc:
                raise RuleError(f"approval.when is not a valid schema: {exc.message}") from None
            return cls("when", value["when"])
        raise RuleError(
            f'approval must be "never", "always" or {{"when": <schema>}}, not {value!r}'
        )

    def needs_approval(self, arguments: Any) -> bool:
        """Whether a call with ``arguments`` waits for a person."""
        if self.mode == "when":
            return jsonschema.Draft202012Validator(self.schema or {}).is_valid(arguments)
        return self.mode == "always"

    def describe(self) -> str:
        """The rule in a few words, for ``broker tools audit``."""
        if self.mode == "when":
            return "when " + _compact(self.schema or {})
        return self.mode


def _compact(schema: dict[str, Any]) -> str:
    import orjson  # a leaf import: only the audit renders a schema

    text = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode()
    return text if len(text) <= 80 else text[:77] + "..."


def new_approval_id() -> str:
    """A fresh approval id: ``apr_`` and 24 hex digits."""
    return "apr_" + secrets.token_hex(12)


def declined_error(reason: str | None, by: str) -> dict[str, Any]:
    """What the model is told of a call a person (or the expiry, or a stop) declined."""
    why = f": {reason}" if reason else ""
    if by == "expiry":
        message = "the call was not approved in time and was not run"
    else:
        message = f"the user declined this call{why}; it was not run"
    return {"code": APPROVAL_DENIED, "message": message, "reason": reason}


def request_event(
    attempt: int,
    approval_id: str,
    call_id: str,
    name: str,
    ordinal: int,
    arguments: Any,
    expires_ms: int,
) -> tuple[str, dict[str, Any]]:
    """The ``approval_request`` event a call that waits for a person puts on the stream."""
    return (
        "approval_request",
        {
            "attempt": attempt,
            "approval_id": approval_id,
            "call_id": call_id,
            "name": name,
            "ordinal": ordinal,
            "args": arguments,
            "expires_at": expires_ms / 1000,
        },
    )


def decision_event(
    attempt: int, approval_id: str, decision: str, reason: str | None, by: str
) -> dict[str, Any]:
    """The data of the ``approval_decision`` event (written by ``decide_approval.lua``)."""
    return {
        "attempt": attempt,
        "approval_id": approval_id,
        "decision": decision,
        "reason": reason,
        "by": by,
    }


# --- the clock ------------------------------------------------------------------------------

_clock: list[Callable[[], float]] = [time.time]


def now_ms() -> int:
    """The approvals' clock, in whole milliseconds since the epoch."""
    return int(_clock[0]() * 1000)


@contextlib.contextmanager
def set_clock(clock: Callable[[], float]) -> Iterator[None]:
    """Date approvals by ``clock`` (seconds since the epoch) inside the block: for tests that
    move time past an expiry."""
    previous = _clock[0]
    _clock[0] = clock
    try:
        yield
    finally:
        _clock[0] = previous
