"""The Durable Streams door's renderer of a generation read over SSE (see :mod:`broker.relay`).

Each broker event is one message: a ``data`` event holding a one-message JSON array (its
offset, type and data), followed by its ``control`` (the offset to resume after it, the
``Stream-Cursor``). The control of the read's last message says ``upToDate`` once the read has
every stored event, and ``streamClosed`` when it was the ``end`` after which the turn is at rest
(that ``end``'s facts). So the last control of a batch is held until the read knows which: the
next batch says not at the tail, the relay's "caught up" says at the tail. A read with nothing
to send yet says where it stands, up to date; a quiet read says so again every heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import orjson

from broker.dialects.durable import wire
from broker.frames import Cursor, Entry
from broker.relay import Facts
from broker.viewer import REPLACED


def message(entry: Entry) -> bytes:
    """A broker event as one message of a generation's JSON stream: its offset, type and data."""
    return orjson.dumps({"id": entry.offset, "event": entry.kind, "data": orjson.loads(entry.data)})


class GenerationRenderer:
    """The SSE events of one read of a generation from ``after``; ``token`` is the read's
    ``Stream-Cursor``, ``finished`` a read that starts where nothing will ever follow."""

    dialect: ClassVar[str] = "durable"
    raw: ClassVar[bool] = False
    # The native ``replaced`` event (no id, unknown to the protocol's clients): the protocol
    # has no word for it.
    replaced: ClassVar[bytes] = REPLACED

    def __init__(self, after: Cursor, token: str, *, finished: bool = False) -> None:
        self.offset = after.offset  # where a client resumes after what it was sent
        self.token = token
        self.finished = finished
        self._held = False  # the control of the last message sent is held (see the module)
        self._opened = False

    def _control(self, *, up_to_date: bool = False, closed: bool = False) -> bytes:
        return wire.sse_control(
            self.offset, cursor=self.token, up_to_date=up_to_date, closed=closed
        )

    def _release(self, *, up_to_date: bool) -> bytes:
        """The held control, if any."""
        if not self._held:
            return b""
        self._held = False
        return self._control(up_to_date=up_to_date)

    def opening(self) -> bytes:
        if not self.finished:
            return b""
        self._opened = True
        return self._control(up_to_date=True, closed=True)

    def render(self, entries: Sequence[Entry], facts: Facts) -> bytes:
        if not entries:
            return b""
        self.token = wire.still_cursor(self.token)
        out = [self._release(up_to_date=False)]
        for entry in entries:
            if self._held:
                out.append(self._control())
            out.append(wire.sse_event("data", wire.json_body([message(entry)]).decode()))
            self.offset = entry.offset
            self._held = True
            if entry.kind == "end" and facts.get(entry.offset):
                self._held = False
                self.finished = True
                out.append(self._control(closed=True))
        self._opened = True
        return b"".join(out)

    def caught_up(self) -> bytes:
        if self.finished:
            return b""
        self.token = wire.still_cursor(self.token)
        if not self._opened:
            self._opened = True
            return self._control(up_to_date=True)
        return self._release(up_to_date=True)

    @property
    def heartbeat(self) -> bytes:
        """Where the read stands, up to date: nothing came for a heartbeat period."""
        self.token = wire.still_cursor(self.token)
        return self._release(up_to_date=True) or self._control(up_to_date=True)

    def closing(self) -> bytes:
        return b"" if self.finished else self._release(up_to_date=False)
