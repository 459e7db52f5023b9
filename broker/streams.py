"""The reading side: replay from an offset, hand over to live without gap or duplicate, fan out.

A process that serves many readers of one stream issues one blocking ``XREAD`` for that stream
(a *feed*), and hands each batch to every reader of the stream (a *subscription*). A reader first
replays from Redis with ``XRANGE`` up to where the feed stands, then takes live batches. Each batch
says which entry id it follows, so a reader that sees a batch beginning past its position fills
the gap from Redis before going on: the hand-over never loses or repeats an event, whatever the
timing. A reader too slow to keep up drops its queue and catches up from Redis, which holds
everything anyway; a slow client costs memory only up to ``QUEUE_LIMIT`` batches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import redis_calls as rc
from broker.errors import Gone, NotFound
from broker.keys import STREAM_ID_PATTERN, Keys, unscoped
from broker.lease import FINAL_STATUSES
from broker.metrics import Metrics
from broker.offsets import NOW, START, ZERO_ID, from_entry_id, id_key, to_entry_id
from broker.settings import Settings

log = logging.getLogger("broker.streams")

QUEUE_LIMIT: Final = 256
FIRST_PAGE: Final = 64  # a resuming reader's first page: its first event comes sooner
FEED_BLOCK_MS: Final = 5_000
FEED_MAX_FAILURES: Final = 3


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
    def from_redis(cls, entry_id: str, fields: dict[str, str]) -> Entry:
        ms, _, seq = entry_id.partition("-")
        offset = f"{ms.zfill(16)}-{seq.zfill(10)}"  # as offsets.from_entry_id, without int()
        kind = fields.get("e", "message")
        data = fields.get("d", "{}")
        frame = f"id: {offset}\nevent: {kind}\ndata: {data}\n\n".encode()
        return cls(entry_id, (int(ms), int(seq)), offset, kind, data, frame)

    def attempt(self) -> int:
        value = orjson.loads(self.data).get("attempt", 0)
        return int(value) if isinstance(value, int) else 0


class Heartbeat:
    """Yielded by :meth:`Streams.follow` when nothing happened for a heartbeat period."""


HEARTBEAT: Final = Heartbeat()


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    """Where a stream id points: its conversation and turn."""

    stream_id: str
    conversation_id: str
    turn_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """Consecutive events of one stream, with their SSE frames joined: one write to a client."""

    entries: Sequence[Entry]
    data: bytes

    @classmethod
    def of(cls, entries: Sequence[Entry]) -> Chunk:
        return cls(entries, b"".join(e.frame for e in entries))

    @classmethod
    def join(cls, chunks: Sequence[Chunk]) -> Chunk:
        entries = [entry for chunk in chunks for entry in chunk.entries]
        return cls(entries, b"".join(chunk.data for chunk in chunks))


@dataclasses.dataclass(slots=True)
class _Batch:
    after: str  # the entry id this batch follows
    entries: list[Entry]
    # The turn's (status, attempt) as the feed read it right after a batch holding an `end`:
    # one look for all the readers of the stream, instead of one each.
    rest: tuple[str | None, str | None] | None = None
    _chunk: Chunk | None = None

    @property
    def chunk(self) -> Chunk:
        """The whole batch as one chunk, built once and shared by every reader."""
        if self._chunk is None:
            self._chunk = Chunk.of(self.entries)
        return self._chunk


class _Closed(Exception):
    """The hub was closed (shutdown) or the feed failed: end the response, the client resumes."""


class _Subscription:
    __slots__ = ("closed", "feed", "overflowed", "queue", "wake")

    def __init__(self, feed: _Feed) -> None:
        self.feed = feed
        self.queue: collections.deque[_Batch] = collections.deque()
        self.wake = asyncio.Event()
        self.overflowed = False
        self.closed = False

    def put(self, batch: _Batch) -> None:
        if len(self.queue) >= QUEUE_LIMIT:
            self.queue.clear()
            self.overflowed = True
        else:
            self.queue.append(batch)
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()

    async def get_all(self, timeout: float) -> list[_Batch] | None:
        """Every batch waiting (at least one), None after ``timeout`` seconds of quiet.

        A reader that falls behind takes several batches at once and writes them to its client
        in one go: under load, readers make fewer, larger writes instead of falling further
        behind.
        """
        if not self.queue:
            if self.closed:
                raise _Closed()
            if self.overflowed:
                return None
            self.wake.clear()
            try:
                async with asyncio.timeout(timeout):  # no task per wait, unlike wait_for
                    while not self.queue:
                        if self.closed:
                            raise _Closed()
                        if self.overflowed:
                            return None
                        await self.wake.wait()
                        self.wake.clear()
            except TimeoutError:
                return None
        batches = list(self.queue)
        self.queue.clear()
        return batches


class _Feed:
    """One blocking XREAD loop for one stream, shared by every subscription in this process."""

    def __init__(self, hub: Hub, key: str, start: str | None, turn_key: str | None) -> None:
        self.hub = hub
        self.key = key
        self.turn_key = turn_key
        self.start = start  # the first subscriber's position; None: the stream's tail
        self.subscriptions: set[_Subscription] = set()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        redis = self.hub.blocking_redis
        after: str | None = self.start
        failures = 0
        try:
            while self.subscriptions:
                try:
                    if after is None:
                        after = await rc.last_entry_id(redis, self.key) or ZERO_ID
                    reply = await rc.xread(redis, self.key, after, 1000, FEED_BLOCK_MS)
                except (RedisError, OSError) as exc:
                    # A blip is retried; a Redis that stays away ends the reads, whose clients
                    # then resume (and get 503 until Redis is back).
                    self.hub.metrics.redis_errors.inc()
                    failures += 1
                    if failures >= FEED_MAX_FAILURES:
                        log.warning("stream feed %s stopped: %s", self.key, exc)
                        for subscription in self.subscriptions:
                            subscription.close()
                        return
                    await asyncio.sleep(0.05 * failures)
                    continue
                failures = 0
                if not reply:
                    continue
                entries = [Entry.from_redis(i, f) for i, f in reply]
                batch = _Batch(after, entries)
                after = entries[-1].entry_id
                if self.turn_key is not None and any(e.kind == "end" for e in entries):
                    status, attempt = await rc.hmget(
                        self.hub.redis, self.turn_key, ["status", "attempt"]
                    )
                    batch.rest = (status, attempt)
                # The lag from the append to this hand-over, once per event (not per reader).
                now_ms = time.time() * 1000
                observe = self.hub.metrics.delivery_lag_seconds.observe
                for entry in entries:
                    observe(max(0.0, now_ms - entry.sort_key[0]) / 1000)
                for subscription in self.subscriptions:
                    subscription.put(batch)
        finally:
            self.hub.forget(self)


class Hub:
    """All feeds of one process."""

    def __init__(self, blocking_redis: Redis, metrics: Metrics, redis: Redis | None = None) -> None:
        self.blocking_redis = blocking_redis
        self.redis = redis if redis is not None else blocking_redis  # for short calls
        self.metrics = metrics
        self._feeds: dict[str, _Feed] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # including cancelled ones still unwinding
        self._closed = False

    def subscribe(
        self, key: str, start: str | None = None, turn_key: str | None = None
    ) -> _Subscription:
        """Join (or start, reading after ``start``) the feed of one stream.

        With ``turn_key``, the feed looks up the turn's state after each batch holding an
        ``end`` event, for all its readers at once.
        """
        feed = self._feeds.get(key)
        if feed is None or feed.task is None or feed.task.done():
            feed = _Feed(self, key, start, turn_key)
            self._feeds[key] = feed
            self.metrics.live_streams.set(len(self._feeds))
        subscription = _Subscription(feed)
        if self._closed:
            subscription.close()
        feed.subscriptions.add(subscription)
        if feed.task is None:
            feed.task = asyncio.create_task(feed.run(), name=f"feed {key}")
            self._tasks.add(feed.task)
            feed.task.add_done_callback(self._tasks.discard)
        return subscription

    def unsubscribe(self, subscription: _Subscription) -> None:
        feed = subscription.feed
        feed.subscriptions.discard(subscription)
        if not feed.subscriptions and feed.task is not None:
            feed.task.cancel()
            # A reader arriving before the cancelled task has unwound must get a fresh feed.
            self.forget(feed)

    def forget(self, feed: _Feed) -> None:
        if self._feeds.get(feed.key) is feed:
            del self._feeds[feed.key]
            self.metrics.live_streams.set(len(self._feeds))

    async def close(self) -> None:
        """End every live read (their clients resume elsewhere) and stop the feeds."""
        self._closed = True
        for feed in list(self._feeds.values()):
            for subscription in feed.subscriptions:
                subscription.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Streams:
    """Locating, replaying, following and paging turn streams."""

    def __init__(
        self, redis: Redis, keys: Keys, hub: Hub, settings: Settings, metrics: Metrics
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._hub = hub
        self._settings = settings
        self._metrics = metrics

    async def locate(self, stream_id: str, tenant: str | None) -> Location:
        """The turn behind ``stream_id``; 404 when unknown (or ``tenant``'s stream it is not),
        410 when its data expired."""
        if not STREAM_ID_PATTERN.match(stream_id):
            raise NotFound(f"unknown stream {stream_id[:80]!r}")
        value = await rc.get(self._redis, self._keys.stream_index(stream_id))
        if value is None:
            raise NotFound(f"unknown stream {stream_id!r}")
        conversation_id, _, turn_id = value.partition(" ")
        if unscoped(conversation_id)[0] != tenant:
            raise NotFound(f"unknown stream {stream_id!r}")  # another tenant's: never found
        keys = self._keys
        if not await self._redis.exists(
            keys.events(conversation_id, turn_id), keys.turn(conversation_id, turn_id)
        ):
            if await self._redis.exists(keys.tombstone(conversation_id, turn_id)):
                raise Gone(f"stream {stream_id!r} expired", code="expired")
            raise NotFound(f"unknown stream {stream_id!r}")
        return Location(stream_id, conversation_id, turn_id)

    async def start_after(self, location: Location, offset: str) -> str:
        """The entry id a read resumes after: ``-1`` → before everything, ``now`` → the tail."""
        if offset == START:
            return ZERO_ID
        key = self._keys.events(location.conversation_id, location.turn_id)
        if offset == NOW:
            return await rc.last_entry_id(self._redis, key) or ZERO_ID
        return to_entry_id(offset)

    async def _at_rest(self, location: Location, end_attempt: int | None = None) -> bool:
        """Whether the turn is final (and, given an ``end``, still on that end's attempt)."""
        status, attempt = await rc.hmget(
            self._redis,
            self._keys.turn(location.conversation_id, location.turn_id),
            ["status", "attempt"],
        )
        if status is None:
            return True  # expired under the reader: nothing more will come
        if status not in FINAL_STATUSES:
            return False
        return end_attempt is None or str(end_attempt) == attempt

    async def finished_before(self, location: Location, after: str) -> bool:
        """Whether the turn is at rest and nothing is stored after entry id ``after``."""
        key = self._keys.events(location.conversation_id, location.turn_id)
        turn_key = self._keys.turn(location.conversation_id, location.turn_id)
        # One round trip: a resuming reader waits for this before its first event.
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hget(turn_key, "status")
            pipe.xrevrange(key, max="+", min="-", count=1)
            status, tail = await pipe.execute()
        if status is not None and status not in FINAL_STATUSES:
            return False  # (no status: the turn expired under the reader, nothing will come)
        return not tail or id_key(tail[0][0]) <= id_key(after)

    async def _pages(
        self, key: str, after: str, until: str = "+", first: int | None = None
    ) -> AsyncIterator[list[Entry]]:
        """The stored events after ``after`` (up to ``until``), a page at a time; the first page
        may be smaller, so that a reader resuming in a long stream gets its first event soon."""
        size = self._settings.sse_replay_page
        count = min(first or size, size)
        start = "(" + after
        while True:
            page = await rc.xrange(self._redis, key, start, until, count)
            if page:
                yield [Entry.from_redis(entry_id, fields) for entry_id, fields in page]
            if len(page) < count:
                return
            start = "(" + page[-1][0]
            count = size

    async def _range(self, key: str, after: str, until: str = "+") -> list[Entry]:
        return [entry async for page in self._pages(key, after, until) for entry in page]

    async def follow(self, location: Location, after: str) -> AsyncIterator[Entry | Heartbeat]:
        """Every event after entry id ``after``, live, until the turn's final ``end``."""
        async for item in self.follow_chunks(location, after):
            if isinstance(item, Heartbeat):
                yield item
            else:
                for entry in item.entries:
                    yield entry

    async def _ending(self, location: Location, entries: Sequence[Entry]) -> int | None:
        """The length of ``entries`` up to an ``end`` that ends the read (the turn is at rest
        on that attempt), or None when the read goes on."""
        for index, entry in enumerate(entries):
            if entry.kind == "end" and await self._at_rest(location, entry.attempt()):
                return index + 1
        return None

    async def follow_chunks(
        self, location: Location, after: str
    ) -> AsyncIterator[Chunk | Heartbeat]:
        """:meth:`follow`, a chunk of consecutive events at a time (one write per chunk)."""
        key = self._keys.events(location.conversation_id, location.turn_id)
        turn_key = self._keys.turn(location.conversation_id, location.turn_id)
        position = id_key(after)
        heartbeat_s = self._settings.sse_heartbeat_s
        subscription: _Subscription | None = None
        try:
            # Replay what is stored, join the live feed (a new feed starts where this reader
            # stands), then read once more what arrived in between: whatever the feed has
            # already passed is in Redis by now, so no event waits for a later one to surface.
            for phase in ("replay", "catch-up"):
                if phase == "catch-up":
                    subscription = self._hub.subscribe(key, after, turn_key)
                async for page in self._pages(key, after, first=FIRST_PAGE):
                    stop = await self._ending(location, page)
                    page = page if stop is None else page[:stop]
                    yield Chunk.of(page)
                    position, after = page[-1].sort_key, page[-1].entry_id
                    if stop is not None:
                        return
            assert subscription is not None
            if await self._at_rest(location):
                # Final before we looked: anything after our position ends with the `end` event.
                async for page in self._pages(key, after):
                    yield Chunk.of(page)
                return
            while True:
                batches = await subscription.get_all(heartbeat_s)
                if batches is None and subscription.overflowed:
                    # Too slow for the live queue: catch up from Redis, which has everything.
                    subscription.overflowed = False
                    batches = [_Batch(after, await self._range(key, after))]
                elif batches is None:
                    yield HEARTBEAT
                    if await self._at_rest(location):
                        async for page in self._pages(key, after):
                            yield Chunk.of(page)
                        return
                    continue
                parts: list[Chunk] = []
                ending = None
                for batch in batches:
                    if id_key(batch.after) == position:
                        chunk = batch.chunk  # the usual case: exactly what follows, shared
                    else:
                        entries = batch.entries
                        if id_key(batch.after) > position:
                            entries = await self._range(key, after, batch.after) + entries
                        chunk = Chunk.of([e for e in entries if e.sort_key > position])
                    if not chunk.entries:
                        continue
                    ending = await self._batch_ending(location, batch, chunk.entries)
                    if ending is not None:
                        chunk = Chunk.of(chunk.entries[:ending])
                    parts.append(chunk)
                    position, after = chunk.entries[-1].sort_key, chunk.entries[-1].entry_id
                    if ending is not None:
                        break
                if parts:
                    yield parts[0] if len(parts) == 1 else Chunk.join(parts)
                if ending is not None:
                    return
        except _Closed:
            return
        finally:
            if subscription is not None:
                self._hub.unsubscribe(subscription)

    async def _batch_ending(
        self, location: Location, batch: _Batch, entries: Sequence[Entry]
    ) -> int | None:
        """:meth:`_ending` for a live batch, answered from the feed's own look when it has one."""
        if batch.rest is None:
            return await self._ending(location, entries)
        status, attempt = batch.rest
        for index, entry in enumerate(entries):
            if entry.kind != "end":
                continue
            if status is None or (status in FINAL_STATUSES and attempt == str(entry.attempt())):
                return index + 1
        return None

    async def page(self, location: Location, offset: str) -> dict[str, Any]:
        """A catch-up page for polling clients."""
        after = await self.start_after(location, offset)
        key = self._keys.events(location.conversation_id, location.turn_id)
        # Look at the status first: if it is final now, the page below reaches the `end` event.
        at_rest = await self._at_rest(location)
        size = self._settings.json_page_size
        page = await rc.xrange(self._redis, key, "(" + after, "+", size)
        entries = [Entry.from_redis(i, f) for i, f in page]
        if entries:
            next_offset = entries[-1].offset
        elif after == ZERO_ID:
            next_offset = START
        else:
            next_offset = from_entry_id(after)
        up_to_date = len(entries) < size
        return {
            "events": [
                {"id": e.offset, "event": e.kind, "data": orjson.loads(e.data)} for e in entries
            ],
            "next_offset": next_offset,
            "up_to_date": up_to_date,
            "closed": at_rest and up_to_date,
        }
