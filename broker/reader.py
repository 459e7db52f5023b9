"""The reading side: replay from a client's start point, hand over to live without gap or
duplicate, and page a stream for polling clients.

A reader first replays from Redis with ``XRANGE``, then joins its stream's feed (see
:mod:`broker.fanout`) and reads once more what arrived in between, then takes live batches. Each
batch says where it follows, so a reader that sees a batch beginning past its cursor fills the
gap from Redis before going on, and one that overlaps it drops what it has: the hand-over never
loses or repeats an event, whatever the timing.

Stored events are read a page at a time, full pages shared with the next readers of the same
page (:mod:`broker.pages`), and a response asks for the next page only once its client took the
last (see :mod:`broker.sse`). A client that stops reading thus costs the reads of about what its
connection buffers, then nothing until the send timeout closes it: it holds one page's frames,
never the events' objects, and never a catch-up of everything it missed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final, Literal, TypeVar

import orjson
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.errors import BrokerError, Gone, NotFound
from broker.fanout import Hub, HubClosed, Subscription
from broker.follow import Follow, turn_at_rest
from broker.frames import CAUGHT_UP, HEARTBEAT, ORIGIN, CaughtUp, Chunk, Cursor, Entry, Heartbeat
from broker.offsets import NOW, START
from broker.pages import StoredPages
from broker.sse import Sink
from broker.vocabulary import FINAL_STATUSES, STREAM_ID_PATTERN, decode_turn_ref, unscoped

LOCATED_CACHE: Final = 8_192  # streams whose index lookup a process remembers
K = TypeVar("K")
V = TypeVar("V")


@dataclasses.dataclass(frozen=True, slots=True)
class Opening:
    """A read's first round trip: whether anything is stored past ``cursor``, and the turn's
    status (None: it expired, or never was; or it was not read, events being stored past the
    cursor: then it is not needed, see :attr:`open`).

    Only that: reading the replay's first page here too was tried and measured worse. In an
    attach storm every route runs before any response starts, so the pages read there put all
    the replay work ahead of every viewer's first live write (the join's lag: see
    benchmarks/RESULTS.md).
    """

    cursor: Cursor
    status: str | None
    stored_past: bool

    @property
    def finished(self) -> bool:
        """Whether nothing will ever follow the cursor: the turn is at rest (or gone), and
        nothing is stored past it."""
        return (self.status is None or self.status in FINAL_STATUSES) and not self.stored_past

    @property
    def open(self) -> bool:
        """Whether the read meets the turn's coming to rest without looking at the turn first.

        So it does when the turn was not at rest as the read began (its coming to rest writes
        an ``end`` after this), and when events are stored past the cursor, whatever the
        status: a turn comes to rest only with its ``end`` as the stream's last event, in one
        script (``finish_attempt.lua``, ``cancel_turn.lua``), so that ``end`` is past the
        cursor too, and the read meets it and asks then whether it ends the read. (Unless the
        stream expires before the read gets there: :meth:`Streams.follow_chunks` sees to it.)
        """
        return self.stored_past or self.running

    @property
    def running(self) -> bool:
        """Whether the turn was read, and not at rest: its coming to rest comes after this."""
        return self.status is not None and self.status not in FINAL_STATUSES


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    """Where a stream id points: its conversation and turn."""

    stream_id: str
    conversation_id: str
    turn_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class StartPoint:
    """Where a client asks its read to start, parsed once from its ``Last-Event-ID`` or
    ``offset``: from the ``start`` (``-1``), from ``now`` (only new events: the stream's tail
    when the read begins, see :meth:`Streams.resolve`), or after an event it names (an
    ``offset``, right after ``cursor``)."""

    kind: Literal["start", "now", "offset"]
    cursor: Cursor = ORIGIN

    @classmethod
    def parse(cls, value: str | None) -> StartPoint:
        """``value`` as a client sends it (none, or empty: from the start); 400 when it is a
        malformed offset."""
        if not value or value == START:
            return FROM_START
        if value == NOW:
            return FROM_NOW
        return cls("offset", Cursor.after_offset(value))

    @property
    def explicit(self) -> bool:
        """Whether the client named an event (it resumes a read), rather than a sentinel."""
        return self.kind == "offset"


FROM_START: Final = StartPoint("start")
FROM_NOW: Final = StartPoint("now")


class _SinkView:
    """A response as a reader that renders its own frames sees it: over when it is, and never
    written to by the feed (whose frames are the native ones)."""

    __slots__ = ("_sink",)

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    @property
    def over(self) -> bool:
        return self._sink.over

    def write_now(self, chunk: bytes) -> bool:
        return False


class Streams:
    """Locating, replaying, following and paging turn streams."""

    def __init__(self, deps: Deps, hub: Hub, reads: Redis | None = None) -> None:
        # Every read of a stream and of its turn's state goes to ``reads`` (a cluster's
        # replicas, with BROKER_REPLICA_ACKS), else to the process's client.
        self._redis = reads if reads is not None else deps.redis
        self._keys = deps.keys
        self._settings = deps.settings
        self._metrics = deps.metrics
        self._hub = hub
        # Stream id -> its turn (the index's value), for the streams this process has located:
        # a stream's index never changes in its life, and a reader that comes back (a long
        # poll, a reattach) skips its read. Whether the stream's data still exists is looked
        # up every time.
        self._located: dict[str, str] = {}
        # Openings asking Redis now, by stream and cursor: a crowd's first readers, which all
        # arrive before the stream has a feed here, share one round trip (see opening).
        self._opening: dict[tuple[str, str], asyncio.Future[Opening]] = {}
        self._locating: dict[str, asyncio.Future[str | None]] = {}  # the same, for locate
        # Pages bounded by what the feed read (see StoredPages.page) need the feed and the
        # pages to read the same server: not so when reads go to a cluster's replicas.
        self.pages = StoredPages(
            self._redis,
            replay_page=deps.settings.sse_replay_page,
            cache_ttl_s=deps.settings.sse_page_cache_s,
            bounded=reads is None,
        )

    def events_key(self, location: Location) -> str:
        """The Redis key of the turn's event stream."""
        return self._keys.events(location.conversation_id, location.turn_id)

    def turn_key(self, location: Location) -> str:
        """The Redis key of the turn's hash (its status and attempt)."""
        return self._keys.turn(location.conversation_id, location.turn_id)

    async def locate(
        self,
        stream_id: str,
        tenant: str | None,
        *,
        start: StartPoint | None = None,
        check: bool = True,
    ) -> Location:
        """The turn behind ``stream_id``; 404 when unknown (or ``tenant``'s stream it is not),
        410 when its data expired.

        Given the ``start`` of a client that names an event (it resumes a read), the outcome is
        counted in ``broker_resumes_total``: ok, expired or not_found. Without ``check``, whether
        the data still exists is left to the caller (an SSE read learns it from its opening, see
        :meth:`opening`), and so is the count.
        """
        counted = check and start is not None and start.explicit
        try:
            location = await self._locate(stream_id, tenant, check=check)
        except BrokerError as exc:
            if counted:
                self._metrics.resumes.labels("expired" if exc.status == 410 else "not_found").inc()
            raise
        if counted:
            self._metrics.resumes.labels("ok").inc()
        return location

    def count_resume(self, start: StartPoint, outcome: str = "ok") -> None:
        """Count a resume's outcome (a read whose ``start`` names an event)."""
        if start.explicit:
            self._metrics.resumes.labels(outcome).inc()

    async def _locate(self, stream_id: str, tenant: str | None, *, check: bool) -> Location:
        if not STREAM_ID_PATTERN.fullmatch(stream_id):
            raise NotFound(f"unknown stream {stream_id[:80]!r}")
        value = self._located.get(stream_id)
        if value is None:
            index = self._keys.stream_index(stream_id)
            value = await _once(self._locating, index, lambda: rc.get(self._redis, index))
            if value is None:
                raise NotFound(f"unknown stream {stream_id!r}")
            if len(self._located) >= LOCATED_CACHE:
                del self._located[next(iter(self._located))]  # the oldest goes
            self._located[stream_id] = value
        conversation_id, turn_id = decode_turn_ref(value)
        if unscoped(conversation_id)[0] != tenant:
            raise NotFound(f"unknown stream {stream_id!r}")  # another tenant's: never found
        keys = self._keys
        if check and not await self._redis.exists(
            keys.events(conversation_id, turn_id), keys.turn(conversation_id, turn_id)
        ):
            if await self._redis.exists(keys.tombstone(conversation_id, turn_id)):
                raise Gone(f"stream {stream_id!r} expired", code="expired")
            raise NotFound(f"unknown stream {stream_id!r}")
        return Location(stream_id, conversation_id, turn_id)

    async def resolve(self, location: Location, start: StartPoint) -> Cursor:
        """The cursor a read from ``start`` begins at: ``now`` is the stream's tail as it is."""
        if start.kind != "now":
            return start.cursor
        tail = await rc.last_entry_id(self._redis, self.events_key(location))
        return Cursor.after(tail) if tail else ORIGIN

    async def _at_rest(self, location: Location) -> bool:
        """Whether the turn is final."""
        return await turn_at_rest(self._redis, self.turn_key(location))

    async def finished_before(self, location: Location, cursor: Cursor) -> bool:
        """Whether the turn is at rest and nothing is stored past ``cursor``."""
        return (await self.opening(location, cursor)).finished

    async def opening(self, location: Location, cursor: Cursor) -> Opening:
        """What a read from ``cursor`` starts with, in one round trip at most (see
        :class:`Opening`)."""
        events_key, turn_key = self.events_key(location), self.turn_key(location)
        seen = self._hub.seen(events_key)
        if (seen is not None and seen.key > cursor.key) or self.pages.kept(events_key, cursor):
            # The stream's feed here read events past the cursor, or its first page is kept
            # (see broker.pages): events are stored past the cursor, which is all the read needs
            # to know (see Opening.open). No round trip: a crowd that joins a live answer opens
            # on what its first viewers read.
            return Opening(cursor, None, True)
        running = self._hub.running_at(events_key, cursor)
        if running is not None:
            # The feed stands at the cursor and vouches that the turn is not at rest (see
            # Hub.running_at): a crowd of a quiet turn opens on what its first viewer read.
            return Opening(cursor, running, False)

        async def ask() -> Opening:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hget(turn_key, "status")
                pipe.xrange(events_key, min="(" + cursor.entry_id, max="+", count=1)
                status, page = await pipe.execute()
            return Opening(cursor, status, bool(page))

        return await _once(self._opening, (events_key, cursor.entry_id), ask)

    async def follow(
        self, location: Location, after: Cursor | str, sink: Sink | None = None
    ) -> AsyncGenerator[Entry | Heartbeat, None]:
        """Every event past ``after`` (a cursor, or the entry id it follows), live, until the
        turn's final ``end`` (or until ``sink`` is over: see :meth:`follow_chunks`'s
        ``direct``)."""
        async for item in self.follow_chunks(location, after, sink, direct=False):
            if isinstance(item, Chunk):
                for entry in item.entries:
                    yield entry
            elif isinstance(item, Heartbeat):
                yield item

    async def follow_chunks(
        self,
        location: Location,
        after: Cursor | str,
        sink: Sink | None = None,
        *,
        direct: bool = True,
        heartbeat_s: float | None = None,
        opening: Opening | None = None,
        caught_up: bool = False,
    ) -> AsyncGenerator[Chunk | Heartbeat | CaughtUp, None]:
        """:meth:`follow`, a chunk of consecutive events at a time (one write per chunk).

        With ``sink`` (the response), live batches that follow this reader's cursor while it
        waits may be written by the stream's feed directly: they are not yielded. The read ends
        when the sink is over, instead of waiting for the next batch. Without ``direct`` (a
        reader that renders frames of its own, such as a dialect's), nothing is written to the
        sink and every chunk keeps its events: the sink only ends the read. ``heartbeat_s`` is
        the quiet time after which a heartbeat comes (by default ``BROKER_SSE_HEARTBEAT_S``).
        With the read's ``opening`` (see :meth:`opening`), a read that meets the turn's coming
        to rest on its own (:attr:`Opening.open`) does not look at the turn before the first
        wait. With ``caught_up``, :data:`~broker.frames.CAUGHT_UP` comes before each wait for
        live events (a reader that must say when it is at the stream's tail).
        """
        read, sink = self._start(location, after, sink, direct)
        cursor = read.cursor
        heartbeat_s = heartbeat_s or self._settings.sse_heartbeat_s
        subscription: Subscription | None = None
        try:
            async for chunk in read.stored(replay=True):
                yield chunk
            if read.ended:
                return
            # Join the live feed (a new feed starts where this reader stands), then read once
            # more what arrived in between: whatever the feed has already passed is in Redis by
            # now, so no event waits for a later one to surface. A feed that has read nothing
            # past this reader yet will bring all of it: no read then.
            subscription = self._join(read, cursor, opening)
            subscription.sink = sink
            catch_up, first_look = not subscription.covers(read.cursor), True
            look, at_rest = _looks_first(opening, read.dry), False
            while True:
                if catch_up:
                    async for chunk in read.stored():
                        yield chunk
                    if read.ended or at_rest:
                        return
                if look and await read.look(subscription, first_look, heartbeat_s):
                    # Final before we looked: anything past the cursor ends with the `end`
                    # event, which the read from Redis above reaches (then the read ends).
                    catch_up = at_rest = True
                    continue
                first_look = False
                if caught_up:
                    yield CAUGHT_UP
                subscription.cursor = read.cursor
                batches = await subscription.get_all(heartbeat_s)
                read.cursor = subscription.cursor  # moved on by the feed's direct writes
                # Too slow for the live tape: catch up from Redis, which has everything, a page
                # at a time (never all it missed at once: a page is read only when its client
                # took the last), then take the tape again from where it stands.
                catch_up, look = subscription.overflowed, False
                subscription.overflowed = False
                if batches is not None:
                    taken = await read.take(batches)
                    if taken is not None:
                        yield taken
                    if read.ended:
                        return
                elif not catch_up:
                    yield HEARTBEAT
                    look = True  # a quiet stream: its turn may have come to rest
        except HubClosed:
            return
        finally:
            if subscription is not None:
                self._hub.unsubscribe(subscription)

    def _join(self, read: Follow, start: Cursor, opening: Opening | None) -> Subscription:
        """``read``'s place on its stream's feed, from where it stands (it started at ``start``).

        A cursor the replay moved stands on an entry it read (a feed started there has seen
        it); one it did not is only where the client asked to start. A feed started by a read
        whose opening saw the turn running vouches for the turn (see Hub.running_at)."""
        running = opening.status if opening is not None and opening.running else None
        return self._hub.subscribe(
            read.key, read.cursor, read.turn_key, seen=read.cursor is not start, running=running
        )

    def _start(
        self, location: Location, after: Cursor | str, sink: Sink | None, direct: bool
    ) -> tuple[Follow, Sink | None]:
        """A follow of ``location`` from ``after``, and the sink as the feed sees it."""
        if sink is not None and not direct:
            sink = _SinkView(sink)
        cursor = Cursor.after(after) if isinstance(after, str) else after
        # A response writing our frames needs those only, not the events behind them. Its
        # replay's pages are shared with the other readers of the stream (broker.pages).
        read = Follow(
            self.pages,
            self._hub,
            self._redis,
            (self.events_key(location), self.turn_key(location)),
            cursor,
            keep=sink is None or not direct,
            shared=True,
        )
        return read, sink

    async def page(
        self, location: Location, start: StartPoint, wait_s: float = 0.0
    ) -> dict[str, Any]:
        """A catch-up page for polling clients; with ``wait_s``, a long poll: when nothing is
        stored past the start and the stream is open, the page waits up to ``wait_s`` for the
        first new event (an empty page once it runs out).

        A waiting page rides its stream's feed like an SSE reader: it costs the Redis reads of
        the page before it joins the feed (and once more after, unless the feed has read
        nothing past the page's start yet), and nothing while it waits, however many wait; the
        batch that ends the wait is answered from the feed (a batch holding an ``end`` is read
        again from Redis, which says whether the turn is at rest).
        """
        cursor = await self.resolve(location, start)
        page = await self._json_page(location, cursor)
        if wait_s <= 0 or page["events"] or page["closed"]:
            return page
        subscription = self._hub.subscribe(
            self.events_key(location), cursor, self.turn_key(location)
        )
        try:
            if not subscription.covers(cursor):
                # Anything the feed passed before this reader joined is in Redis by now.
                page = await self._json_page(location, cursor)
                if page["events"] or page["closed"]:
                    return page
            subscription.cursor = cursor
            batches = await subscription.get_all(wait_s)  # None: quiet for wait_s
        except HubClosed:
            return page  # shutting down: the client polls again elsewhere
        finally:
            self._hub.unsubscribe(subscription)
        arrived = [
            entry
            for batch in batches or ()
            for entry in batch.entries
            if entry.sort_key > cursor.key
        ]
        if not arrived or len(arrived) > self._settings.json_page_size:
            return await self._json_page(location, cursor)
        if any(entry.kind == "end" for entry in arrived):
            return await self._json_page(location, cursor)
        return {
            "events": [_page_event(entry) for entry in arrived],
            "next_offset": arrived[-1].offset,
            "up_to_date": True,
            "closed": False,
        }

    async def _json_page(self, location: Location, cursor: Cursor) -> dict[str, Any]:
        # Look at the status first: if it is final now, the page below reaches the `end` event.
        at_rest = await self._at_rest(location)
        size = self._settings.json_page_size
        entries, _ = await self.pages.page(self.events_key(location), cursor, "+", size)
        if entries:
            next_offset = entries[-1].offset
        elif cursor.at_origin:
            next_offset = START
        else:
            next_offset = cursor.offset
        up_to_date = len(entries) < size
        return {
            "events": [_page_event(e) for e in entries],
            "next_offset": next_offset,
            "up_to_date": up_to_date,
            "closed": at_rest and up_to_date,
        }


async def _once(pending: dict[K, asyncio.Future[V]], key: K, call: Callable[[], Awaitable[V]]) -> V:
    """``call()``'s result, one call for every caller asking for ``key`` while it runs (in
    ``pending``). A caller whose shared call failed (or was cancelled) calls for itself:
    nothing here waits on a cancellation reaching a Redis call."""
    shared = pending.get(key)
    if shared is not None:
        await asyncio.wait((shared,))  # (raises only this caller's own cancellation)
        if not shared.cancelled():
            return shared.result()
    future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
    pending.setdefault(key, future)
    try:
        value = await call()
    except BaseException:
        future.cancel()  # the callers waiting on it call for themselves
        raise
    finally:
        if pending.get(key) is future:
            del pending[key]
    future.set_result(value)
    return value


def _page_event(entry: Entry) -> dict[str, Any]:
    """An event as a JSON page lists it."""
    return {"id": entry.offset, "event": entry.kind, "data": orjson.loads(entry.data)}


def _looks_first(opening: Opening | None, dry: bool) -> bool:
    """Whether a read looks at its turn before its first wait for live events.

    A turn that was running as the read began, or one whose stream goes on past the read's
    start, ends with an ``end`` the read will meet (see :attr:`Opening.open`). Unless the stream
    expired since: a replay that found nothing where the opening saw events (``dry``) looks, or
    it would wait a heartbeat for an ``end`` that is gone."""
    return opening is None or not opening.open or (dry and not opening.running)
