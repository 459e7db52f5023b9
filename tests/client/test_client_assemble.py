"""Tests for TurnText, which folds events into per-attempt text."""

from __future__ import annotations

from itertools import count
from typing import Any

from broker_client import Event, TurnText


class Events:
    """Builds events with increasing ids, the way the broker numbers them."""

    def __init__(self) -> None:
        self._ids = count(1)

    def __call__(self, type: str, attempt: int, **data: Any) -> Event:
        return Event(
            id=f"{next(self._ids):016d}-0000000000",
            type=type,
            data={"attempt": attempt, **data},
            attempt=attempt,
        )


def test_deltas_append_to_their_attempt() -> None:
    ev = Events()
    text = TurnText()
    text.feed(ev("attempt", 1, strategy="initial"))
    text.feed(ev("delta", 1, text="Hel"))
    text.feed(ev("delta", 1, text="lo"))
    text.feed(ev("usage", 1, input_tokens=3))
    assert text.text == "Hello"
    assert text.attempts == {1: "Hello"}
    assert text.latest_attempt == 1
    assert text.status is None


def test_end_sets_status_and_reason() -> None:
    ev = Events()
    text = TurnText(
        [
            ev("attempt", 1, strategy="initial"),
            ev("delta", 1, text="Hi"),
            ev("end", 1, status="failed", reason="provider_error"),
        ]
    )
    assert text.status == "failed"
    assert text.reason == "provider_error"
    assert text.text == "Hi"


def test_regenerate_starts_a_fresh_text() -> None:
    ev = Events()
    text = TurnText()
    text.feed_all(
        [
            ev("attempt", 1, strategy="initial"),
            ev("delta", 1, text="partial ans"),
            ev("end", 1, status="interrupted", reason="provider_disconnect"),
            ev("attempt", 2, strategy="regenerate"),
        ]
    )
    # The new attempt is running, so the first attempt's end no longer describes the turn.
    assert text.status is None
    assert text.text == ""
    text.feed_all([ev("delta", 2, text="Full answer."), ev("end", 2, status="complete")])
    assert text.text == "Full answer."
    assert text.attempts == {1: "partial ans", 2: "Full answer."}
    assert text.status == "complete"
    assert text.reason is None


def test_continue_extends_the_previous_attempt() -> None:
    ev = Events()
    text = TurnText(
        [
            ev("attempt", 1, strategy="initial"),
            ev("delta", 1, text="The answer"),
            ev("end", 1, status="interrupted"),
            ev("attempt", 2, strategy="continue"),
            ev("delta", 2, text=" is 42."),
            ev("end", 2, status="complete"),
        ]
    )
    assert text.text == "The answer is 42."
    assert text.attempts == {1: "The answer", 2: "The answer is 42."}


def test_continue_after_regenerate_uses_the_latest_attempt() -> None:
    ev = Events()
    text = TurnText(
        [
            ev("attempt", 1, strategy="initial"),
            ev("delta", 1, text="old"),
            ev("attempt", 2, strategy="regenerate"),
            ev("delta", 2, text="new"),
            ev("attempt", 3, strategy="continue"),
            ev("delta", 3, text="er"),
        ]
    )
    assert text.text == "newer"


def test_replayed_events_are_ignored() -> None:
    ev = Events()
    attempt, a, b = (
        ev("attempt", 1, strategy="initial"),
        ev("delta", 1, text="a"),
        ev("delta", 1, text="b"),
    )
    text = TurnText()
    # Overlapping pages: the second one starts with the last event of the first.
    text.feed_all([attempt, a])
    text.feed_all([a, b])
    assert text.text == "ab"
    assert text.last_id == b.id


def test_deltas_without_attempt_event_still_count() -> None:
    # A reader that attached with offset "now" never sees the attempt event.
    ev = Events()
    text = TurnText([ev("delta", 3, text="tail"), ev("end", 3, status="cancelled")])
    assert text.attempts == {3: "tail"}
    assert text.status == "cancelled"


def test_late_end_of_older_attempt_does_not_set_status() -> None:
    ev = Events()
    text = TurnText([ev("attempt", 2, strategy="regenerate"), ev("end", 1, status="interrupted")])
    assert text.latest_attempt == 2
    assert text.status is None


def test_empty_turn() -> None:
    text = TurnText()
    assert text.text == ""
    assert text.attempts == {}
    assert text.latest_attempt is None
