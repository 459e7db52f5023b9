"""The AI SDK door's renderer: a turn's stored events as UI message stream frames (see
:mod:`broker.dialects.aisdk.chunks` for the chunks of each event, and :mod:`broker.relay`).

Pure: an ``end``'s facts say whether the turn is at rest on its attempt (then the message
finishes, and ``[DONE]`` closes the read). Events up to ``emit_after`` are rendered but not
sent: they bring the renderer to where a resuming client stands. A ``prelude`` goes out after
the first ``start``: the steps a follow-up turn's message had before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import orjson

from broker.dialects.aisdk.chunks import DONE, REPLACED, Chunk, Renderer, encode
from broker.frames import ORIGIN, Cursor, Entry
from broker.relay import Facts
from broker.sse import PING


class UIMessageRenderer:
    """The UI message stream of one turn's read, sent past ``emit_after``."""

    dialect: ClassVar[str] = "aisdk"
    raw: ClassVar[bool] = False
    heartbeat: ClassVar[bytes] = PING
    replaced: ClassVar[bytes] = REPLACED

    def __init__(
        self,
        turn_id: str,
        stream_id: str,
        emit_after: Cursor = ORIGIN,
        prelude: Sequence[Chunk] = (),
    ) -> None:
        self.chunks = Renderer(turn_id, stream_id, prelude)
        self.emit_key = emit_after.key
        self.last: str | None = None  # the wire offset of the last event read

    def opening(self) -> bytes:
        return b""

    def render(self, entries: Sequence[Entry], facts: Facts) -> bytes:
        out: list[bytes] = []
        for entry in entries:
            final = entry.kind == "end" and bool(facts.get(entry.offset))
            chunks = self.chunks.render(entry, final=final)
            if chunks and entry.sort_key > self.emit_key:
                out.append(encode(entry.offset, chunks))
            self.last = entry.offset
        return b"".join(out)

    def caught_up(self) -> bytes:
        return b""

    def closing(self) -> bytes:
        """``[DONE]`` once the message finished; a read that ends at a turn waiting for a
        person ends the message for now first (:meth:`Renderer.pause`)."""
        # (No ``id:``: these frames are of no event; a resume starts after the last one.)
        head = b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in self.chunks.pause())
        return head + DONE if self.chunks.finished else b""

    @property
    def waiting(self) -> bool:
        """Whether approvals it showed wait for a person."""
        return bool(self.chunks.waiting)
