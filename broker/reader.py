"""The reading side: replay from a client's start point, hand over to live without gap or
duplicate, and page a stream for polling clients.

A reader first replays from Redis with ``XRANGE``, then joins its stream's feed (see
:mod:`broker.fanout`) and reads once more what arrived in between, then takes live batches. Each
batch says where it follows, so a reader that sees a batch beginning past its cursor fills the
gap from Redis before going on, and one that overlaps it drops what it has: the hand-over never
loses or repeats an event, whatever the timing.

Full pages read from Redis are kept a moment for the next reader of the same page (see
:class:`_Pages`). Replay and catch-up read pages that start small and double (``FIRST_PAGE`` up to
``BROKER_SSE_REPLAY_PAGE``), and a response asks for the next page only once its client took the
last (see :mod:`broker.sse`). A client that stops reading thus costs the reads of about what its
connection buffers, then nothing until the send timeout closes it: it holds one page's frames,
never the events' objects, and never a catch-up of everything it missed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from typing import Any, Final, Literal

import orjson
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.errors import BrokerError, Gone, NotFound
from broker.fanout import Batch, Hub, HubClosed, Subscription
from broker.frames import CAUGHT_UP, HEARTBEAT, ORIGIN, CaughtUp, Chunk, Cursor, Entry, Heartbeat
from broker.offsets import NOW, START
from broker.sse import Sink
from broker.vocabulary import FINAL_STATUSES, STREAM_ID_PATTERN, decode_turn_ref, unscoped

PageKey = tuple[str, str, str, int]  # a page asked of Redis: key, after, until, count
PAGE_CACHE_EVENTS: Final = 8_192  # events of full pages a process keeps (see _Pages; ~4 MiB)
LOCATED_CACHE: Final = 8_192  # streams whose index lookup a process remembers (~1.5 MiB)
FIRST_PAGE: Final = 64  # a replay's first page (its first event comes sooner); the next ones double


@dataclasses.dataclass(frozen=True, slots=True)
class Opening:
    """A read's first round trip: whether anything is stored past ``cursor``, and the turn's
    status (None: it expired, or never was; or it was not read, events being stored past the
    cursor: then it is not needed, see :attr:`open`).

    Only that: reading the replay's first page here too was tried and measured worse. In an
    attach storm every route runs before any response starts, so the pages read there put all
    the replay work ahead of every viewer's first live write (join lag p99 2-4 s, against
    0.1-0.2 s; benchmarks/RESULTS.md).
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


class _Watched:
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


class _Kept(list[Entry]):
    """A page of events read from Redis, with what its readers ask of it worked out once,
    when first asked: its frames joined (the write of a reader that takes the whole page), and
    where its ``end`` events are. A page :class:`_Pages` keeps has many readers."""

    __slots__ = ("_data", "_ends")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        super().__init__(entries)
        self._data: bytes | None = None
        self._ends: list[int] | None = None

    @property
    def data(self) -> bytes:
        if self._data is None:
            self._data = b"".join(entry.frame for entry in self)
        return self._data

    @property
    def ends(self) -> list[int]:
        if self._ends is None:
            self._ends = _end_indexes(self)
        return self._ends


def _end_indexes(entries: Sequence[Entry]) -> list[int]:
    """Where the ``end`` events of ``entries`` are."""
    return [index for index, entry in enumerate(entries) if entry.kind == "end"]


class _Pages:
    """Full pages of stored events this process read lately, for the next reader of the same
    page: a crowd that replays a finished answer reads each page from Redis once.

    A crowd that joins a running answer shares them too: 2.1 Redis commands and 1.1 ms of CPU
    per attach instead of 4.4 and 1.3, the live lag unchanged (benchmarks/RESULTS.md).

    A full page is kept (as many events as asked for): the events of a stream between two ids
    never change (a turn's stream is only appended to, never trimmed), so it is the same page
    whoever asks. A page that came short may grow and is not kept, unless it was read up to an
    entry that was read already (see :meth:`Streams._page`'s ``bound``). A page is kept
    ``ttl_s`` (``BROKER_SSE_PAGE_CACHE_S``) at most, so a stream that expires is not read from
    here for longer than that, and ``PAGE_CACHE_EVENTS`` events in all, the oldest going first.
    """

    __slots__ = ("_events", "_pages", "_ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._pages: dict[PageKey, tuple[float, list[Entry]]] = {}
        self._events = 0

    def get(self, page: PageKey, now: float) -> list[Entry] | None:
        kept = self._pages.get(page)
        if kept is None:
            return None
        if kept[0] <= now:
            self._drop(page)
            return None
        return kept[1]

    def put(self, page: PageKey, entries: list[Entry], now: float) -> None:
        if self._ttl_s <= 0 or len(entries) > PAGE_CACHE_EVENTS or page in self._pages:
            return
        self._pages[page] = (now + self._ttl_s, entries)  # dicts keep order: oldest first
        self._events += len(entries)
        while self._events > PAGE_CACHE_EVENTS:
            self._drop(next(iter(self._pages)))

    def _drop(self, page: PageKey) -> None:
        self._events -= len(self._pages.pop(page)[1])


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
        self._pages = _Pages(deps.settings.sse_page_cache_s)
        # Pages bounded by what the feed read (see _page) need the feed and the pages to read
        # the same server: not so when reads go to a cluster's replicas, one or another.
        self._bounded = reads is None

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
            value = await rc.get(self._redis, self._keys.stream_index(stream_id))
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

    async def _at_rest(self, location: Location, end_attempt: int | None = None) -> bool:
        """Whether the turn is final (and, given an ``end``, still on that end's attempt)."""
        status, attempt = await rc.hmget(
            self._redis, self.turn_key(location), ["status", "attempt"]
        )
        if status is None:
            return True  # expired under the reader: nothing more will come
        if status not in FINAL_STATUSES:
            return False
        return end_attempt is None or str(end_attempt) == attempt

    async def _look(
        self, location: Location, subscription: Subscription, first: bool, max_age_s: float
    ) -> bool:
        """Whether the turn is at rest, for a reader that just joined (``first``: its own look)
        or whose stream was quiet for a heartbeat: then the feed's look, shared by all its
        readers (see :meth:`~broker.fanout._Feed.shared_look`)."""
        if first:
            return await self._at_rest(location)
        look = subscription.feed.shared_look(asyncio.get_running_loop().time(), max_age_s)
        # Shielded: a reader that goes away does not cancel the others' look.
        return await asyncio.shield(look)

    async def finished_before(self, location: Location, cursor: Cursor) -> bool:
        """Whether the turn is at rest and nothing is stored past ``cursor``."""
        return (await self.opening(location, cursor)).finished

    async def opening(self, location: Location, cursor: Cursor) -> Opening:
        """What a read from ``cursor`` starts with, in one round trip at most (see
        :class:`Opening`)."""
        events_key, turn_key = self.events_key(location), self.turn_key(location)
        first = (events_key, cursor.entry_id, "+", self._next_count(None))
        if self._pages.get(first, time.monotonic()) is not None:
            # Its first page is kept (see _Pages): events are stored past the cursor, which is
            # all the read needs to know (see Opening.open). No round trip: a crowd that joins a
            # live answer opens on the pages its first viewers read.
            return Opening(cursor, None, True)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hget(turn_key, "status")
            pipe.xrange(events_key, min="(" + cursor.entry_id, max="+", count=1)
            status, page = await pipe.execute()
        return Opening(cursor, status, bool(page))

    async def _page(
        self,
        key: str,
        after: Cursor,
        until: str,
        count: int,
        *,
        shared: bool = False,
        bound: Cursor | None = None,
    ) -> tuple[list[Entry], bool]:
        """Up to ``count`` stored events past ``after``, and whether there may be more. With
        ``shared``, a full page is taken from, or kept for, the next readers (see
        :class:`_Pages`); with ``bound`` as well (an entry this process's feed read, see
        :meth:`Hub.seen`), the page stops there, and is kept whether full or not: the stream up
        to an entry that was read never changes, so every reader standing at ``after`` while
        the feed stands at ``bound`` takes the same short last page (then the feed)."""
        now = time.monotonic()
        asked = (key, after.entry_id, until, count)
        if shared and (kept := self._pages.get(asked, now)) is not None:
            return kept, True
        if shared and self._bounded and until == "+" and bound and bound.key > after.key:
            return await self._bounded_page(asked, bound, now)
        entries = await self._read_page(key, after.entry_id, until, count)
        if len(entries) < count:
            return entries, False
        if shared:
            self._pages.put(asked, entries, now)
        return entries, True

    async def _bounded_page(
        self, asked: PageKey, bound: Cursor, now: float
    ) -> tuple[list[Entry], bool]:
        """The page ``asked`` for, up to ``bound``'s entry (see :meth:`_page`)."""
        key, start, _, count = asked
        bounded = (key, start, bound.entry_id, count)
        entries = self._pages.get(bounded, now)
        if entries is None:
            entries = await self._read_page(key, start, bound.entry_id, count)
            if entries:
                self._pages.put(bounded, entries, now)
        if len(entries) < count:
            return entries, False  # all there is up to the bound: the feed brings the rest
        self._pages.put(asked, entries, now)  # a full page is the same, bounded or not
        return entries, True

    async def _read_page(self, key: str, after: str, until: str, count: int) -> _Kept:
        """Up to ``count`` events of stream ``key`` past entry ``after``, up to ``until``,
        read from Redis."""
        page = await rc.xrange_raw(self._redis, key, "(" + after, until, count)
        return _Kept(Entry.from_redis(entry_id, fields) for entry_id, fields in page)

    def _next_count(self, count: int | None) -> int:
        """A replay's page sizes: a small first page, so that a reader resuming in a long stream
        gets its first event soon, then each twice the last, up to ``BROKER_SSE_REPLAY_PAGE``.

        A response asks for the next page only once its client took the last: a client that
        stops reading leaves its reader holding one page about the size of what it took.
        """
        size = self._settings.sse_replay_page
        return min(FIRST_PAGE if count is None else 2 * count, size)

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
        if sink is not None and not direct:
            sink = _Watched(sink)
        cursor = Cursor.after(after) if isinstance(after, str) else after
        # A response writing our frames needs those only, not the events behind them. Its
        # replay's pages are shared with the other readers of the stream (see _Pages).
        read = _Read(self, location, cursor, keep=sink is None or not direct, shared=True)
        heartbeat_s = heartbeat_s or self._settings.sse_heartbeat_s
        subscription: Subscription | None = None
        try:
            async for chunk in read.stored():  # the replay
                yield chunk
            if read.ended:
                return
            # Join the live feed (a new feed starts where this reader stands), then read once
            # more what arrived in between: whatever the feed has already passed is in Redis by
            # now, so no event waits for a later one to surface. A feed that has read nothing
            # past this reader yet will bring all of it: no read then.
            # A cursor the replay moved stands on an entry it read (a feed started there has
            # seen it); one it did not is only where the client asked to start.
            subscription = self._hub.subscribe(
                read.key, read.cursor, read.turn_key, seen=read.cursor is not cursor
            )
            subscription.sink = sink
            catch_up, first_look = not subscription.covers(read.cursor), True
            # A turn that was running as the read began, or one whose stream goes on past the
            # read's start, ends with an `end` the read will meet (see Opening.open). Unless
            # the stream expired since: a replay that found nothing where the opening saw
            # events (`dry`) looks, or it would wait a heartbeat for an `end` that is gone.
            look = opening is None or not opening.open or (read.dry and not opening.running)
            while True:
                if catch_up:
                    async for chunk in read.stored():
                        yield chunk
                    if read.ended:
                        return
                if look and await self._look(location, subscription, first_look, heartbeat_s):
                    # Final before we looked: anything past the cursor ends with the `end` event.
                    async for chunk in read.stored():
                        yield chunk
                    return
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
        entries, _ = await self._page(self.events_key(location), cursor, "+", size)
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


def _page_event(entry: Entry) -> dict[str, Any]:
    """An event as a JSON page lists it."""
    return {"id": entry.offset, "event": entry.kind, "data": orjson.loads(entry.data)}


class _Read:
    """One follow of a stream: where it stands (``cursor``), whether it is over (``ended``:
    it reached an ``end`` that ends the read), and its reads of Redis."""

    __slots__ = (
        "cursor",
        "dry",
        "ended",
        "keep",
        "key",
        "location",
        "shared",
        "streams",
        "turn_key",
    )

    def __init__(
        self,
        streams: Streams,
        location: Location,
        cursor: Cursor,
        *,
        keep: bool,
        shared: bool = False,
    ) -> None:
        self.streams = streams
        self.location = location
        self.key = streams.events_key(location)
        self.turn_key = streams.turn_key(location)
        self.cursor = cursor
        self.keep = keep
        self.shared = shared  # full pages are shared with the next readers (see _Pages)
        self.ended = False
        self.dry = False  # the last replay ended on an empty page (see stored)

    async def stored(self) -> AsyncIterator[Chunk]:
        """The stored events past the cursor, a chunk per page, up to an ``end`` that ends the
        read; the cursor moves past each chunk as it is yielded.

        Without ``keep`` the chunks hold their frames only, and no event is referenced here
        while a chunk is out: a reader whose client is slow to take a page holds that page's
        bytes, not its events' objects (several times their size; a full page's objects are
        kept for the next readers, a moment and within a bound, by :class:`_Pages`).
        """
        streams = self.streams
        count = streams._next_count(None)
        self.dry = False
        while True:
            entries, more = await streams._page(
                self.key,
                self.cursor,
                "+",
                count,
                shared=self.shared,
                bound=streams._hub.seen(self.key) if self.shared else None,
            )
            if not entries:
                self.dry = True  # (an empty page is never kept: this one was read)
                return
            stop = await self._ending(entries)
            if stop is None and not self.keep and isinstance(entries, _Kept):
                chunk = Chunk([], entries.data, entries[-1])  # joined once for all its readers
            else:
                chunk = Chunk.of(entries if stop is None else entries[:stop], keep=self.keep)
            del entries
            assert chunk.last is not None
            self.cursor = chunk.last.cursor
            self.ended = stop is not None
            yield chunk
            if self.ended or not more:
                return
            count = streams._next_count(count)

    async def take(self, batches: Sequence[Batch]) -> Chunk | None:
        """What live ``batches`` hold past the cursor, as one chunk (None: nothing new), up to
        an ``end`` that ends the read; the cursor moves past it."""
        parts: list[Chunk] = []
        for batch in batches:
            chunk = await self._past_cursor(batch)
            if chunk is None:
                continue
            parts.append(chunk)
            assert chunk.last is not None
            self.cursor = chunk.last.cursor
            if self.ended:
                break
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else Chunk.join(parts)

    async def _past_cursor(self, batch: Batch) -> Chunk | None:
        """The events of ``batch`` past the cursor (None: none), with the gap before the batch
        read from Redis, up to an ``end`` that ends the read."""
        position = self.cursor.key
        if batch.after.key == position:
            # The usual case: exactly what follows, its frames joined once for all.
            chunk, ends = batch.chunk, batch.ends
        else:
            entries = batch.entries
            if batch.after.key > position:
                entries = await self._range(batch.after) + entries
            chunk = Chunk.of([e for e in entries if e.sort_key > position])
            ends = any(entry.kind == "end" for entry in chunk.entries)
        if chunk.last is None:
            return None
        if ends:
            ending = await self._batch_ending(batch, chunk.entries)
            if ending is not None:
                chunk = Chunk.of(chunk.entries[:ending])
                self.ended = True
        return chunk

    async def _range(self, until: Cursor) -> list[Entry]:
        """The stored events past the cursor up to ``until``'s entry, a page at a time."""
        streams, after, entries = self.streams, self.cursor, []
        count = streams._next_count(None)
        while True:
            page, more = await streams._page(self.key, after, until.entry_id, count)
            if page:
                after = page[-1].cursor
                entries += page
            if not more:
                return entries
            count = streams._next_count(count)

    async def _ending(self, entries: Sequence[Entry]) -> int | None:
        """The length of ``entries`` up to an ``end`` that ends the read (the turn is at rest
        on that attempt), or None when the read goes on."""
        ends = entries.ends if isinstance(entries, _Kept) else _end_indexes(entries)
        for index in ends:
            if await self.streams._at_rest(self.location, entries[index].attempt()):
                return index + 1
        return None

    async def _batch_ending(self, batch: Batch, entries: Sequence[Entry]) -> int | None:
        """:meth:`_ending` for a live batch, answered from the feed's own look when it has one."""
        if batch.rest is None:
            return await self._ending(entries)
        status, attempt = batch.rest
        for index, entry in enumerate(entries):
            if entry.kind != "end":
                continue
            if status is None or (status in FINAL_STATUSES and attempt == str(entry.attempt())):
                return index + 1
        return None
