"""Rebuild a turn's text from its events, attempt by attempt."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .models import Event

__all__ = ["TurnText"]


class TurnText:
    """Accumulates delta text per attempt number.

    An `attempt` event with strategy `continue` starts from the text of the attempt before it (the
    continuation extends the earlier partial answer); any other strategy (`initial`, `regenerate`)
    starts empty. `text` is the latest attempt's text. `status` and `reason` come from the latest
    attempt's `end` event and are None while that attempt is still running, so a retry after an
    interrupted attempt clears them. Events whose id is not above the last one fed are ignored,
    which makes feeding overlapping pages or replays harmless.
    """

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self.attempts: dict[int, str] = {}
        self.status: str | None = None
        self.reason: Any = None
        self.last_id: str | None = None
        self._latest: int | None = None
        self.feed_all(events)

    @property
    def latest_attempt(self) -> int | None:
        """Number of the newest attempt seen, or None before any."""
        return self._latest

    @property
    def text(self) -> str:
        """Text of the latest attempt ("" before any)."""
        return self.attempts.get(self._latest, "") if self._latest is not None else ""

    def feed_all(self, events: Iterable[Event]) -> None:
        """Feed several events in order."""
        for event in events:
            self.feed(event)

    def feed(self, event: Event) -> None:
        """Apply one event; event types that carry no text or status are ignored."""
        if event.id:
            if self.last_id is not None and event.id <= self.last_id:
                return
            self.last_id = event.id
        n = event.attempt
        if event.type == "attempt":
            previous = self._latest
            start = ""
            if event.data.get("strategy") == "continue" and previous is not None:
                start = self.attempts.get(previous, "")
            self.attempts[n] = start
            self._note_attempt(n)
        elif event.type == "delta":
            text = event.data.get("text")
            if isinstance(text, str):
                self.attempts[n] = self.attempts.get(n, "") + text
                self._note_attempt(n)
        elif event.type == "end":
            self._note_attempt(n)
            if n != self._latest:
                return
            status = event.data.get("status")
            self.status = status if isinstance(status, str) else None
            self.reason = event.data.get("reason")

    def _note_attempt(self, n: int) -> None:
        if self._latest is None or n > self._latest:
            self._latest = n
            # The new attempt has not ended yet; an older attempt's end says nothing about it.
            self.status = None
            self.reason = None
