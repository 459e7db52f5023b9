"""The reading side: replay from an offset, hand over to live without gap or duplicate, fan out.

A process that serves many readers of one stream issues one blocking ``XREAD`` for that stream
(a *feed*), and shares each batch with every reader of the stream (a *subscription*). A reader first
replays from Redis with ``XRANGE`` up to where the feed stands, then takes live batches. Each batch
says which entry id it follows, so a reader that sees a batch beginning past its position fills
the gap from Redis before going on: the hand-over never loses or repeats an event, whatever the
timing. A reader too slow to keep up loses its place on the feed and catches up from Redis, which
holds everything anyway; a slow client holds a feed's memory only up to ``QUEUE_LIMIT`` batches.

Replay and catch-up read pages that start small and double (``FIRST_PAGE`` up to
``BROKER_SSE_REPLAY_PAGE``), and a response asks for the next page only once its client took the
last (see :mod:`broker.sse`). A client that stops reading thus costs the reads of about what its
connection buffers, then nothing until the send timeout closes it: it holds one page's frames,
never the events' objects, and never a catch-up of everything it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Sequence
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
from broker.sse import Sink

log = logging.getLogger("broker.streams")

QUEUE_LIMIT: Final = 256  # batches a reader may be behind its feed before it reads Redis instead
TICK_MAX_S: Final = 1.0  # the heartbeat ticker's period: a quarter of the heartbeat, within these
TICK_MIN_S: Final = 0.01
TRIM_EVERY: Final = 64  # batches between two looks for what every reader has taken
FIRST_PAGE: Final = 64  # a replay's first page (its first event comes sooner); the next ones double
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


class _Batch:
    """What one read of a feed returned, shared by all the feed's readers."""

    __slots__ = ("_chunk", "after", "after_key", "ends", "entries", "rest")

    def __init__(
        self,
        after: str,
        entries: list[Entry],
        rest: tuple[str | None, str | None] | None = None,
    ) -> None:
        self.after = after  # the entry id this batch follows
        self.after_key = id_key(after)
        self.entries = entries
        self.ends = any(entry.kind == "end" for entry in entries)
        # The turn's (status, attempt) as the feed read it right after a batch holding an
        # `end`: one look for all the readers of the stream, instead of one each.
        self.rest = rest
        self._chunk: Chunk | None = None

    @property
    def chunk(self) -> Chunk:
        """The whole batch as one chunk, built once and shared by every reader."""
        if self._chunk is None:
            self._chunk = Chunk.of(self.entries)
        return self._chunk


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


class _Closed(Exception):
    """The hub was closed (shutdown) or the feed failed: end the response, the client resumes."""


class _Subscription:
    """One reader's place on its feed's tape."""

    __slots__ = (
        "after",
        "closed",
        "deadline",
        "feed",
        "index",
        "overflowed",
        "position",
        "sink",
        "ticked",
        "timeout",
        "waiter",
    )

    def __init__(self, feed: _Feed) -> None:
        self.feed = feed
        self.index = feed.end  # the next batch this reader takes; it starts with the next one
        self.waiter: asyncio.Future[None] | None = None
        self.timeout = 0.0
        self.deadline = 0.0  # when a parked reader gets a heartbeat instead
        self.overflowed = False
        self.ticked = False
        self.closed = False
        # While parked, a reader with a ``sink`` standing at ``position`` (entry id ``after``)
        # is written to by the feed itself: see _Feed.publish.
        self.sink: Sink | None = None
        self.position = (0, 0)
        self.after = ZERO_ID

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        self.closed = True
        self.wake()

    async def get_all(self, timeout: float) -> list[_Batch] | None:
        """Every batch this reader has not taken yet (at least one); None after ``timeout``
        seconds of quiet, or when it fell so far behind that it must catch up from Redis
        (``overflowed``).

        A reader that falls behind takes several batches at once and writes them to its client
        in one go: under load, readers make fewer, larger writes instead of falling further
        behind. Taking them costs the same whatever their number.
        """
        feed = self.feed
        while True:
            if self.closed:
                raise _Closed()
            start = self.index - feed.base
            tape = feed.tape
            if start < 0:
                # The feed dropped batches this reader had not taken: Redis has them.
                self.overflowed = True
                self.index = feed.end
                return None
            if start < len(tape):
                batches = tape[start:]
                self.index += len(batches)
                self.ticked = False
                return batches
            if self.ticked:
                self.ticked = False
                return None
            if self.sink is not None and self.sink.over:
                # The client is gone. Its cancellation should have ended this read, but one
                # that landed while redis-py awaited a reply may have been swallowed: never
                # park a reader for a client that left.
                raise _Closed()
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            self.timeout = timeout
            self.deadline = loop.time() + timeout
            feed.parked.append(self)
            feed.hub.heartbeat_within(timeout)
            try:
                await waiter
            finally:
                self.waiter = None


class _Feed:
    """One blocking XREAD loop for one stream, shared by every subscription in this process.

    The feed keeps the batches it read on a *tape*; each reader holds its place on it. A new
    batch wakes the readers waiting for one (each at most once, whatever it missed), and a reader
    takes everything after its place at once. The tape is emptied when a batch went to every
    reader at once, and trimmed every ``TRIM_EVERY`` batches to what some reader has not taken,
    at most ``QUEUE_LIMIT`` batches behind the newest: a reader further behind catches up from
    Redis.
    """

    def __init__(self, hub: Hub, key: str, start: str | None, turn_key: str | None) -> None:
        self.hub = hub
        self.key = key
        self.turn_key = turn_key
        self.start = start  # the first subscriber's position; None: the stream's tail
        self.subscriptions: set[_Subscription] = set()
        self.task: asyncio.Task[None] | None = None
        self.tape: list[_Batch] = []
        self.base = 0  # the number of batches dropped from the front of the tape
        self.parked: list[_Subscription] = []  # readers waiting for the next batch
        self._published = 0

    @property
    def end(self) -> int:
        return self.base + len(self.tape)

    def publish(self, batch: _Batch) -> None:
        """Put ``batch`` on the tape, and hand it to the readers waiting for one.

        A waiting reader that stands right before the batch, and can be written to at once,
        gets the batch's frames from here and goes on waiting: no task switch, no copy, one
        write. The others (behind, or with a write under way), and every reader of a batch
        holding an ``end`` (whose reader decides whether the read is over), are woken and take
        it from the tape themselves.
        """
        index = self.end
        self.tape.append(batch)
        self._published += 1
        parked, self.parked = self.parked, []
        written = 0
        last = batch.entries[-1] if batch.entries else None
        if batch.ends or last is None:
            for subscription in parked:
                subscription.wake()
        else:
            data = batch.chunk.data
            after_key = batch.after_key
            now = asyncio.get_running_loop().time()
            for subscription in parked:
                if self._write(subscription, index, after_key, data):
                    subscription.index = index + 1
                    subscription.position, subscription.after = last.sort_key, last.entry_id
                    subscription.deadline = now + subscription.timeout
                    self.parked.append(subscription)
                    written += 1
                else:
                    subscription.wake()
        if written == len(self.subscriptions):
            self.tape.clear()  # every reader has it: nothing to keep
            self.base = index + 1
        elif len(self.tape) >= 2 * QUEUE_LIMIT or self._published % TRIM_EVERY == 0:
            self._trim()

    @staticmethod
    def _write(
        subscription: _Subscription, index: int, after_key: tuple[int, int], data: bytes
    ) -> bool:
        """Whether ``data`` was written to a waiting reader standing right before it."""
        sink, waiter = subscription.sink, subscription.waiter
        if sink is None or waiter is None or waiter.done():
            return False
        if subscription.index != index or subscription.position != after_key:
            return False
        try:
            return sink.write_now(data)
        except Exception:  # one response's failure must not stop the stream's other readers
            log.exception("writing to a stream's reader failed")
            return False

    def _trim(self) -> None:
        """Drop the batches every reader has taken, and those more than ``QUEUE_LIMIT`` behind
        the newest (whose readers then catch up from Redis)."""
        end = self.end
        oldest = min((s.index for s in self.subscriptions), default=end)
        keep_from = max(oldest, end - QUEUE_LIMIT)
        del self.tape[: keep_from - self.base]
        self.base = keep_from

    def unpark(self, subscription: _Subscription) -> None:
        with contextlib.suppress(ValueError):
            self.parked.remove(subscription)

    async def run(self) -> None:
        redis = self.hub.blocking_redis
        after: str | None = self.start
        failures = 0
        try:
            # Not only cancellation ends the loop (redis-py may swallow one mid-XREAD): the last
            # reader leaving, or the hub closing, does.
            while self.subscriptions and not self.hub.closed:
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
                if self.turn_key is not None and batch.ends:
                    status, attempt = await rc.hmget(
                        self.hub.redis, self.turn_key, ["status", "attempt"]
                    )
                    batch.rest = (status, attempt)
                # The lag from the append to this hand-over, once per event (not per reader).
                now_ms = time.time() * 1000
                observe = self.hub.metrics.delivery_lag_seconds.observe
                for entry in entries:
                    observe(max(0.0, now_ms - entry.sort_key[0]) / 1000)
                self.publish(batch)
        except Exception:
            log.exception("stream feed %s failed", self.key)
        finally:
            # However it ended (a bug, not Redis; a shutdown), no reader is left waiting for a
            # feed that is gone: their clients resume.
            for subscription in self.subscriptions:
                subscription.close()
            self.hub.forget(self)


class Hub:
    """All feeds of one process."""

    def __init__(self, blocking_redis: Redis, metrics: Metrics, redis: Redis | None = None) -> None:
        self.blocking_redis = blocking_redis
        self.redis = redis if redis is not None else blocking_redis  # for short calls
        self.metrics = metrics
        self._feeds: dict[str, _Feed] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # including cancelled ones still unwinding
        self.closed = False
        self._tick_s = TICK_MAX_S
        self._ticker: asyncio.Task[None] | None = None

    def heartbeat_within(self, timeout: float) -> None:
        """Make sure a reader parked now gets a heartbeat about ``timeout`` seconds from now.

        One ticker per process looks at the parked readers a few times per heartbeat period,
        instead of one timer per wait: readers wait often and almost never time out.
        """
        period = min(TICK_MAX_S, max(TICK_MIN_S, timeout / 4))
        if period < self._tick_s:
            self._tick_s = period
        if self._ticker is None and not self.closed:
            self._ticker = self._start(self._tick(), "feed heartbeats")
            self._ticker.add_done_callback(self._ticker_ended)

    def _ticker_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the heartbeat ticker failed; starting another", exc_info=task.exception())
        self._ticker = None  # the next reader to wait starts another (unless closed)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._tick_s)
            now = loop.time()
            for feed in list(self._feeds.values()):
                waiting = []
                for subscription in feed.parked:
                    if subscription.deadline <= now:
                        subscription.ticked = True
                        subscription.wake()
                    else:
                        waiting.append(subscription)
                feed.parked = waiting

    def _start(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
        if self.closed:
            subscription.close()
        feed.subscriptions.add(subscription)
        if feed.task is None:
            feed.task = self._start(feed.run(), f"feed {key}")
        return subscription

    def unsubscribe(self, subscription: _Subscription) -> None:
        feed = subscription.feed
        feed.subscriptions.discard(subscription)
        feed.unpark(subscription)
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
        self.closed = True
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

    async def _page(self, key: str, after: str, until: str, count: int) -> tuple[list[Entry], bool]:
        """Up to ``count`` stored events after ``after``, and whether there may be more."""
        page = await rc.xrange_raw(self._redis, key, "(" + after, until, count)
        return [Entry.from_redis(entry_id, fields) for entry_id, fields in page], len(page) == count

    def _next_count(self, count: int | None) -> int:
        """A replay's page sizes: a small first page, so that a reader resuming in a long stream
        gets its first event soon, then each twice the last, up to ``BROKER_SSE_REPLAY_PAGE``.

        A response asks for the next page only once its client took the last: a client that
        stops reading leaves its reader holding one page about the size of what it took.
        """
        size = self._settings.sse_replay_page
        return min(FIRST_PAGE if count is None else 2 * count, size)

    async def _pages(self, key: str, after: str, until: str = "+") -> AsyncIterator[list[Entry]]:
        """The stored events after ``after`` (up to ``until``), a page at a time."""
        count = self._next_count(None)
        while True:
            entries, more = await self._page(key, after, until, count)
            if entries:
                after = entries[-1].entry_id
                yield entries
            if not more:
                return
            count = self._next_count(count)

    async def _stored(
        self, location: Location, key: str, after: str, *, keep: bool
    ) -> AsyncIterator[tuple[Chunk, bool]]:
        """The stored events after ``after``, a chunk per page, up to an ``end`` that ends the
        read; with each chunk, whether it ended the read.

        Without ``keep`` the chunks hold their frames only, and no event is referenced here
        while a chunk is out: a reader whose client is slow to take a page holds that page's
        bytes, not its events' objects (several times their size).
        """
        count = self._next_count(None)
        while True:
            entries, more = await self._page(key, after, "+", count)
            if not entries:
                return
            stop = await self._ending(location, entries)
            chunk = Chunk.of(entries if stop is None else entries[:stop], keep=keep)
            del entries
            assert chunk.last is not None
            after = chunk.last.entry_id
            yield chunk, stop is not None
            if stop is not None or not more:
                return
            count = self._next_count(count)

    async def _range(self, key: str, after: str, until: str = "+") -> list[Entry]:
        return [entry async for page in self._pages(key, after, until) for entry in page]

    async def follow(
        self, location: Location, after: str, sink: Sink | None = None
    ) -> AsyncGenerator[Entry | Heartbeat, None]:
        """Every event after entry id ``after``, live, until the turn's final ``end`` (or until
        ``sink`` is over: see :meth:`follow_chunks`'s ``direct``)."""
        async for item in self.follow_chunks(location, after, sink, direct=False):
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
        self,
        location: Location,
        after: str,
        sink: Sink | None = None,
        *,
        direct: bool = True,
    ) -> AsyncGenerator[Chunk | Heartbeat, None]:
        """:meth:`follow`, a chunk of consecutive events at a time (one write per chunk).

        With ``sink`` (the response), live batches that follow this reader's position while it
        waits may be written by the stream's feed directly: they are not yielded. The read ends
        when the sink is over, instead of waiting for the next batch. Without ``direct`` (a
        reader that renders frames of its own, such as a dialect's), nothing is written to the
        sink and every chunk keeps its events: the sink only ends the read.
        """
        if sink is not None and not direct:
            sink = _Watched(sink)
        key = self._keys.events(location.conversation_id, location.turn_id)
        turn_key = self._keys.turn(location.conversation_id, location.turn_id)
        position = id_key(after)
        heartbeat_s = self._settings.sse_heartbeat_s
        subscription: _Subscription | None = None
        try:
            # Replay what is stored, join the live feed (a new feed starts where this reader
            # stands), then read once more what arrived in between: whatever the feed has
            # already passed is in Redis by now, so no event waits for a later one to surface.
            keep = sink is None or not direct  # a response writing our frames needs those only
            for phase in ("replay", "catch-up"):
                if phase == "catch-up":
                    subscription = self._hub.subscribe(key, after, turn_key)
                async for chunk, final in self._stored(location, key, after, keep=keep):
                    last = chunk.last
                    assert last is not None
                    yield chunk
                    position, after = last.sort_key, last.entry_id
                    if final:
                        return
            assert subscription is not None
            if await self._at_rest(location):
                # Final before we looked: anything after our position ends with the `end` event.
                async for chunk, _ in self._stored(location, key, after, keep=keep):
                    yield chunk
                return
            subscription.sink = sink
            while True:
                subscription.position, subscription.after = position, after
                batches = await subscription.get_all(heartbeat_s)
                position, after = subscription.position, subscription.after  # after direct writes
                if batches is None and subscription.overflowed:
                    # Too slow for the live tape: catch up from Redis, which has everything, a
                    # page at a time (never all it missed at once: a page is read only when its
                    # client took the last), then take the tape again from where it stands.
                    subscription.overflowed = False
                    async for chunk, final in self._stored(location, key, after, keep=keep):
                        last = chunk.last
                        assert last is not None
                        yield chunk
                        position, after = last.sort_key, last.entry_id
                        if final:
                            return
                    continue
                if batches is None:
                    yield HEARTBEAT
                    if await self._at_rest(location):
                        async for chunk, _ in self._stored(location, key, after, keep=keep):
                            yield chunk
                        return
                    continue
                parts: list[Chunk] = []
                ending = None
                for batch in batches:
                    if batch.after_key == position:
                        # The usual case: exactly what follows, its frames joined once for all.
                        chunk, ends = batch.chunk, batch.ends
                    else:
                        entries = batch.entries
                        if batch.after_key > position:
                            entries = await self._range(key, after, batch.after) + entries
                        chunk = Chunk.of([e for e in entries if e.sort_key > position])
                        ends = any(entry.kind == "end" for entry in chunk.entries)
                    if chunk.last is None:
                        continue
                    if ends:
                        ending = await self._batch_ending(location, batch, chunk.entries)
                        if ending is not None:
                            chunk = Chunk.of(chunk.entries[:ending])
                    parts.append(chunk)
                    assert chunk.last is not None
                    position, after = chunk.last.sort_key, chunk.last.entry_id
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
        page = await rc.xrange_raw(self._redis, key, "(" + after, "+", size)
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
