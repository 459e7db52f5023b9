"""Where a read numbered by a door's own sequence resumes: the OpenAI Responses numbering.

A Responses read numbers its events from the stored events alone (each stored event expands to a
fixed number of Responses events, by the door's expansion table), so a resume after sequence
number N needs the stored event that holds N+1. ``seek_sequence.lua`` finds it inside Redis,
from the nearest checkpoint it left behind before, in steps of at most ``SEEK_LIMIT`` entries:
one step never holds the server long, and a seek into a long stream that no read has walked
yet takes one call per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final

from broker.deps import Deps
from broker.frames import Cursor
from broker.reader import Location

SEEK_EVERY: Final = 64  # stored events between two checkpoints
SEEK_LIMIT: Final = 4_096  # the most stored events one call of the script walks


@dataclasses.dataclass(frozen=True, slots=True)
class Seek:
    """Where a read after a sequence number resumes: the cursor it reads after, and the
    sequence number of the first expansion of the event that follows it."""

    after: Cursor
    base: int


class SequenceIndex:
    """Seeks a sequence number in a turn's stream, leaving checkpoints for the next seek."""

    def __init__(self, deps: Deps, limit: int = SEEK_LIMIT) -> None:
        self._scripts = deps.scripts
        self._keys = deps.keys
        self._ttl_ms = deps.settings.stream_ttl_ms
        self._limit = limit

    async def seek(
        self, location: Location, starting_after: int, *, first: int, expansion: Mapping[str, int]
    ) -> Seek:
        """Where a read after sequence number ``starting_after`` resumes; ``first`` is the
        number of the first stored event's first expansion, ``expansion`` the door's table
        (event type, or ``type:attempt``, to its count; see ``seek_sequence.lua``)."""
        conversation_id, turn_id = location.conversation_id, location.turn_id
        resume: tuple[str, int] | None = None
        while True:
            step = await self._scripts.seek_sequence(
                events_key=self._keys.events(conversation_id, turn_id),
                checkpoints=self._keys.responses_seq(conversation_id, turn_id),
                starting_after=starting_after,
                first=first,
                every=SEEK_EVERY,
                ttl_ms=self._ttl_ms,
                limit=self._limit,
                expansion=expansion,
                resume=resume,
            )
            if step.done:
                return Seek(Cursor.after(step.after), step.base)
            resume = (step.after, step.base)
