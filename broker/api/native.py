"""The native door's streamed read (``GET /v1/streams/{id}``, SSE): its renderer, and the read.

The native renderer is the stored events' own SSE frames (``id:`` the offset, ``event:`` the
type, ``data:`` the stored JSON; see :class:`broker.frames.Entry`), rendered once for every
reader: the relay lets the stream's feed write them straight to the client (see
:mod:`broker.relay`). The read opens with ``retry:`` and, after ``now``, the ``resume_point``
event that says where it starts (:func:`broker.sse.opening_frame`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from starlette.responses import Response

from broker.auth import Principal
from broker.frames import Entry
from broker.http import Services
from broker.reader import Location, StartPoint
from broker.relay import Facts, Read
from broker.sse import PING, opening_frame
from broker.viewer import REPLACED


@dataclasses.dataclass(frozen=True, slots=True)
class NativeRenderer:
    """The native SSE frames of one read: ``retry_ms`` and, when the read names no start of its
    own, the ``announce``d resume point first."""

    retry_ms: int
    announce: str | None = None

    dialect: ClassVar[str] = "native"
    raw: ClassVar[bool] = True
    heartbeat: ClassVar[bytes] = PING
    replaced: ClassVar[bytes] = REPLACED

    def opening(self) -> bytes:
        return opening_frame(self.retry_ms, self.announce)

    def render(self, entries: Sequence[Entry], facts: Facts) -> bytes:
        return b"".join(entry.frame for entry in entries)

    def caught_up(self) -> bytes:
        return b""

    def closing(self) -> bytes:
        return b""


async def event_stream(
    rt: Services,
    location: Location,
    start: StartPoint,
    principal: Principal,
    heartbeat_s: float | None = None,
    batch_s: float = 0.0,
) -> Response:
    """The SSE response of ``principal``'s read of ``location`` from ``start``: 204 when
    nothing will ever follow that point. A one-viewer token's earlier connection, if any, is let
    go. ``batch_s`` holds live events that long to send them in one write (see
    :mod:`broker.sse`)."""
    cursor = await rt.streams.resolve(location, start)
    opening = await rt.streams.opening(location, cursor)
    if opening.status is None and not opening.stored_past:
        # No turn and nothing past the cursor: its data expired (410), or never was (404); the
        # located stream's data was not looked for before (see Streams.locate's ``check``).
        await rt.streams.locate(location.stream_id, principal.tenant, start=start)
    else:
        rt.streams.count_resume(start)
    if opening.finished:
        # Nothing will ever follow this point. 204 tells EventSource to stop reconnecting;
        # a 200 that closes at once would make it reconnect every retry period for ever.
        return Response(status_code=204, headers={"Cache-Control": "no-store"})
    # After `now`, announce where this read starts (even on an empty stream, where "the start"
    # is the right answer), so a client that drops before the first event resumes from here.
    # A client that named its start already holds it: a second event with that id would only
    # look like a duplicate to it.
    announce = cursor.offset if start.kind == "now" else None
    renderer = NativeRenderer(rt.settings.sse_retry_ms, announce)
    read = Read(
        location, cursor, renderer, opening=opening, heartbeat_s=heartbeat_s, batch_s=batch_s
    )
    return await rt.relay(principal, read)
