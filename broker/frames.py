"""What a reader of a stream yields, and where it stands: events with their SSE frames rendered
once for all readers, chunks of them (one write each), heartbeats, and the cursor.

A :class:`Cursor` is the one spelling of a place in a stream: right after one entry, with that
entry's id (what Redis takes) and its sort key (what compares: entry ids do not sort as strings).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

import orjson

from broker import redis_calls as rc
from broker.offsets import ZERO_ID, from_entry_id, id_key, to_entry_id


@dataclasses.dataclass(frozen=True, slots=True)
class Cursor:
    """A place in a stream: right after entry ``entry_id`` (``0-0``: before the first one)."""

    entry_id: str
    key: tuple[int, int]  # the entry id's sort key

    @classmethod
    def after(cls, entry_id: str) -> Cursor:
        """The place right after the entry ``entry_id``."""
        return cls(entry_id, id_key(entry_id))

    @classmethod
    def after_offset(cls, offset: str) -> Cursor:
        """The place right after the event of wire offset ``offset`` (not a sentinel); 400 when
        malformed."""
        return cls.after(to_entry_id(offset))

    @property
    def offset(self) -> str:
        """The wire offset of the entry this place follows."""
        return from_entry_id(self.entry_id)

    @property
    def at_origin(self) -> bool:
        """Whether this place is before the stream's first entry."""
        return self.key == ORIGIN.key


ORIGIN: Final = Cursor(ZERO_ID, (0, 0))


@dataclasses.dataclass(slots=True)  # not frozen: built per event, and frozen costs a third more
class Entry:
    """One event of a stream, with its SSE frame rendered once for all readers."""

    entry_id: str
    sort_key: tuple[int, int]
    offset: str
    kind: str
    data: str
    frame: bytes

    @classmethod
    def from_redis(cls, entry_id: str, fields: rc.Fields) -> Entry:
        ms, _, seq = entry_id.partition("-")
        offset = f"{ms.zfill(16)}-{seq.zfill(10)}"  # as offsets.from_entry_id, without int()
        if type(fields) is list and len(fields) == 4 and fields[0] == "e" and fields[2] == "d":
            kind, data = fields[1], fields[3]  # the usual raw reply: type, then data
        else:
            named = rc.fields_dict(fields)
            kind, data = named.get("e", "message"), named.get("d", "{}")
        frame = f"id: {offset}\nevent: {kind}\ndata: {data}\n\n".encode()
        return cls(entry_id, (int(ms), int(seq)), offset, kind, data, frame)

    @classmethod
    def place(cls, entry_id: bytes) -> Entry:
        """An entry known by its place only (its id as Redis sent it): no kind, data or frame."""
        text = entry_id.decode()
        ms, _, seq = text.partition("-")
        return cls(text, (int(ms), int(seq)), f"{ms.zfill(16)}-{seq.zfill(10)}", "", "", b"")

    @property
    def cursor(self) -> Cursor:
        """The place right after this event (built on demand: most events never need one)."""
        return Cursor(self.entry_id, self.sort_key)

    def attempt(self) -> int:
        value = orjson.loads(self.data).get("attempt", 0)
        return int(value) if isinstance(value, int) else 0


class Heartbeat:
    """Yielded by a reader when nothing happened for a heartbeat period."""


HEARTBEAT: Final = Heartbeat()


class CaughtUp:
    """Yielded by a reader that asked for it when it has yielded every stored event, before it
    waits for live ones: what it yielded last was the stream's tail."""


CAUGHT_UP: Final = CaughtUp()


class Chunk:
    """Consecutive events of one stream, with their SSE frames joined: one write to a client."""

    __slots__ = ("_entries", "_parts", "data", "last")

    def __init__(
        self, parts: Sequence[Sequence[Entry]], data: bytes, last: Entry | None = None
    ) -> None:
        self._parts = parts
        self._entries: Sequence[Entry] | None = parts[0] if len(parts) == 1 else None
        self.data = data
        if last is None:
            last = next((part[-1] for part in reversed(parts) if part), None)
        self.last = last

    @classmethod
    def of(cls, entries: Sequence[Entry], *, keep: bool = True) -> Chunk:
        """The chunk of ``entries``; without ``keep``, their frames and the last one only."""
        data = b"".join(e.frame for e in entries)
        if keep:
            return cls([entries], data)
        return cls([], data, entries[-1] if entries else None)

    @classmethod
    def join(cls, chunks: Sequence[Chunk]) -> Chunk:
        """One chunk of several: their bytes joined, their entries listed only when asked for."""
        parts = [part for chunk in chunks for part in chunk._parts]
        return cls(parts, b"".join(chunk.data for chunk in chunks))

    @property
    def entries(self) -> Sequence[Entry]:
        if not self._parts and self.data:
            raise RuntimeError("this chunk kept its frames only")
        if self._entries is None:
            self._entries = [entry for part in self._parts for entry in part]
        return self._entries
