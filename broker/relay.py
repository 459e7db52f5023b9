"""The relay: one streamed read of a generation, whatever its door.

It follows a generation from a cursor (the replay, then live; see :meth:`Streams.follow_chunks`)
and hands each batch of events to the door's :class:`Renderer`, and it owns every rule that all
doors share, so that none can forget one: the attach token's rules and the viewers gauge, with
the door's ``dialect`` label (:func:`broker.viewer.as_viewer`), batching, compression, send and
disconnect timeouts (:class:`broker.sse.EventStreamResponse`), heartbeats, a door's longest
read, and the end of the read at the ``end`` event after which the turn is at rest (the
reader's).

A door is a request translator plus a renderer: the renderer is a pure object, from the core's
events to the door's bytes, with no I/O (its tests are tables, without a socket). What a door
needs to know of an ``end`` beyond the event (an attempt's stored text, whether the turn is at
rest on it) it looks up in :attr:`Read.facts`, which the relay awaits right before that ``end``
is rendered, after the events before it.

A renderer whose bytes are the stored events' own SSE frames (:attr:`Renderer.raw`: the native
door) is handed no event: the stream's feed writes the frames rendered once for every reader
straight to the client, and the relay passes on the chunks it yields. Nothing is done per event
there: that is the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from broker.auth import Principal
from broker.deps import Deps
from broker.frames import CaughtUp, Chunk, Cursor, Entry
from broker.reader import Location, Opening, Streams
from broker.sse import EventStreamResponse, Sink
from broker.viewer import as_viewer

# What a renderer is told of an ``end`` beyond the event, by the ``end``'s offset.
Facts = Mapping[str, Any]
NO_FACTS: Final[Facts] = {}


class Renderer(Protocol):
    """A door's bytes of one read, rendered from the core's events; pure (no I/O)."""

    @property
    def dialect(self) -> str:
        """The door, as the viewers gauge labels it (``broker.metrics.DIALECTS``)."""
        ...

    @property
    def raw(self) -> bool:
        """Whether the door's bytes are the stored events' own SSE frames (the native door's):
        then the feed writes them itself, and :meth:`render` is not called."""
        ...

    @property
    def heartbeat(self) -> bytes:
        """What is sent after a quiet heartbeat period."""
        ...

    @property
    def replaced(self) -> bytes:
        """The last frame of a one-viewer read whose token a newer connection took over."""
        ...

    def opening(self) -> bytes:
        """The read's first bytes, sent with the response's head."""
        ...

    def render(self, entries: Sequence[Entry], facts: Facts) -> bytes:
        """The bytes of consecutive events, in order (``facts``: of the ``end`` among them)."""
        ...

    def caught_up(self) -> bytes:
        """The bytes once the read has every stored event, before it waits for live ones (asked
        for with :attr:`Read.caught_up` only)."""
        ...

    def closing(self) -> bytes:
        """The bytes after the read's last event, when the read ends and the client is there."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    """One read of a generation, as its door asks for it.

    ``facts`` is the door's look-up of what its renderer needs of an ``end`` beyond the event
    (None: nothing). ``opening`` is the reader's first round trip, when the door made it (see
    :class:`broker.reader.Opening`). ``heartbeat_s`` None is ``BROKER_SSE_HEARTBEAT_S``;
    ``batch_s`` holds the feed's live writes that long to send them in one (see
    :class:`EventStreamResponse`). With ``caught_up``, the renderer is told each time the read
    reached the stream's tail (:meth:`Renderer.caught_up`). ``max_s`` ends the read at its
    first batch or heartbeat after that long (the client resumes). ``settled`` is asked
    each time the read waits at the stream's tail (with ``caught_up``) and after each heartbeat:
    True ends the read there (a door whose message is over for now, such as the AI SDK's at a
    turn that waits for a person). (A raw renderer's read takes none of these: the native door
    has no use for them.)
    """

    location: Location
    after: Cursor
    renderer: Renderer
    facts: Callable[[Entry], Awaitable[Any]] | None = None
    opening: Opening | None = None
    heartbeat_s: float | None = None
    batch_s: float = 0.0
    headers: Sequence[tuple[bytes, bytes]] = ()
    caught_up: bool = False
    max_s: float | None = None
    settled: Callable[[], Awaitable[bool]] | None = None


async def relay(
    deps: Deps, streams: Streams, principal: Principal, read: Read
) -> EventStreamResponse:
    """The event stream of ``principal``'s ``read``: admitted by the token's rules, counted in
    the viewers gauge under the door's label, and taken over from an older connection of a
    one-viewer token (see :func:`broker.viewer.as_viewer`)."""
    renderer = read.renderer
    source = functools.partial(_raw if renderer.raw else _rendered, streams, read)
    viewed = await as_viewer(
        deps,
        principal,
        read.location,
        source,
        replaced=renderer.replaced,
        dialect=renderer.dialect,
    )
    return EventStreamResponse(
        viewed,
        send_timeout_s=deps.settings.sse_send_timeout_s,
        extra_headers=list(read.headers) or None,
        batch_s=read.batch_s,
        preamble=renderer.opening(),
    )


async def _raw(streams: Streams, read: Read, sink: Sink) -> AsyncIterator[bytes]:
    """The stored frames themselves: the feed writes live ones straight to the client."""
    # (The opening is the response's preamble: it goes with the response's head.) Closed on
    # every way out, so that the reader leaves its feed at once, not when it is collected.
    beat = read.renderer.heartbeat
    follow = streams.follow_chunks(
        read.location, read.after, sink, heartbeat_s=read.heartbeat_s, opening=read.opening
    )
    async with contextlib.aclosing(follow) as items:
        async for item in items:
            yield item.data if isinstance(item, Chunk) else beat
    closing = read.renderer.closing()
    if closing and not sink.over:
        yield closing


async def _rendered(streams: Streams, read: Read, sink: Sink) -> AsyncIterator[bytes]:
    """The door's own frames of each batch. A read's first event that renders to anything
    goes out alone, the rest of its batch after it: the client sees it sooner."""
    renderer, facts = read.renderer, read.facts
    alone = True
    loop = asyncio.get_running_loop()
    ends_at = None if read.max_s is None else loop.time() + read.max_s
    # Not direct: the stream's feed would write native frames straight to the client.
    follow = streams.follow_chunks(
        read.location,
        read.after,
        sink,
        direct=False,
        heartbeat_s=read.heartbeat_s,
        opening=read.opening,
        caught_up=read.caught_up,
    )
    async with contextlib.aclosing(follow) as items:
        async for item in items:
            if sink.over:
                return  # the client left, whether or not a cancellation says so
            if isinstance(item, Chunk):
                entries = item.entries
                if alone:
                    first, entries = await _first(renderer, facts, entries)
                    if first:
                        alone = False
                        yield first
                data = await render(renderer, facts, entries)
            else:
                data = renderer.caught_up() if isinstance(item, CaughtUp) else renderer.heartbeat
                if read.settled is not None and await read.settled():
                    break
            if data:
                yield data
            if ends_at is not None and loop.time() >= ends_at:
                break
    if not sink.over:
        closing = renderer.closing()
        if closing:
            yield closing


async def _first(
    renderer: Renderer, facts: Callable[[Entry], Awaitable[Any]] | None, entries: Sequence[Entry]
) -> tuple[bytes, Sequence[Entry]]:
    """The bytes of the first of ``entries`` that renders to any, and the entries after it."""
    for index in range(len(entries)):
        data = await render(renderer, facts, entries[index : index + 1])
        if data:
            return data, entries[index + 1 :]
    return b"", ()


async def render(
    renderer: Renderer, facts: Callable[[Entry], Awaitable[Any]] | None, entries: Sequence[Entry]
) -> bytes:
    """``renderer``'s bytes of ``entries``, each ``end``'s facts looked up right before it is
    rendered (after the events before it: a renderer may have learnt from those what it needs)."""
    if facts is None or not entries:
        return renderer.render(entries, NO_FACTS) if entries else b""
    out: list[bytes] = []
    start = 0
    for index, entry in enumerate(entries):
        if entry.kind != "end":
            continue
        if index > start:
            out.append(renderer.render(entries[start:index], NO_FACTS))
        out.append(renderer.render(entries[index : index + 1], {entry.offset: await facts(entry)}))
        start = index + 1
    if start < len(entries):
        out.append(renderer.render(entries[start:], NO_FACTS))
    return b"".join(out)
