"""The per-process fan-out: one blocking ``XREAD`` per stream, shared by all its readers here.

A process that serves many readers of one stream issues one blocking ``XREAD`` for that stream
(a *feed*), and shares each batch with every reader of the stream (a *subscription*). Each batch
says where it follows (a :class:`~broker.frames.Cursor`), so that a reader can tell whether it
follows its own place, overlaps it, or leaves a gap to fill from Redis (see
:mod:`broker.reader`). The feed keeps its batches on a *tape*, on which each reader holds its
place; a reader too slow to keep up loses its place and catches up from Redis, which holds
everything anyway: a slow client holds a feed's memory only up to ``QUEUE_LIMIT`` batches.

A hand-over costs a write per reader, whatever the batch holds. After one that took long (many
readers), the feed rests before its next read (:func:`pause_after`, at most the linger,
``BROKER_APPEND_LINGER_MS``): that read takes every entry appended meanwhile, one write per
reader for all of them. A feed of a few readers never rests, and a delta after a quiet gap is
handed over at once: its read was waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, Final, cast

from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import redis_calls as rc
from broker.frames import ORIGIN, Chunk, Cursor, Entry
from broker.metrics import Metrics
from broker.sse import Sink
from broker.ticker import beat
from broker.vocabulary import FINAL_STATUSES

log = logging.getLogger("broker.fanout")

QUEUE_LIMIT: Final = 256  # batches a reader may be behind its feed before it reads Redis instead
TICK_MAX_S: Final = 0.25  # the heartbeat ticker's period: a quarter of the heartbeat, within these
TICK_MIN_S: Final = 0.01
TRIM_EVERY: Final = 64  # batches between two looks for what every reader has taken
FEED_BLOCK_MS: Final = 5_000
FEED_MAX_FAILURES: Final = 3
# After a hand-over, a feed rests this many times its CPU time (a stream's hand-overs use about
# a fifth of a core at most), its reads at most the linger apart, and never for less than
# PAUSE_MIN_S (a few readers: not worth a timer).
PAUSE_PER_HANDOVER: Final = 4.0
PAUSE_MIN_S: Final = 0.001


def pause_after(cpu_s: float, wall_s: float, cap_s: float) -> float:
    """How long a feed rests before its next read after a hand-over that took ``cpu_s`` of
    CPU (a busy machine's delays are not its cost) and ``wall_s`` in all."""
    pause = min(cap_s - wall_s, PAUSE_PER_HANDOVER * cpu_s)
    return pause if pause >= PAUSE_MIN_S else 0.0


class Batch:
    """What one read of a feed returned, shared by all the feed's readers."""

    __slots__ = ("_chunk", "after", "ends", "entries", "rest")

    def __init__(
        self,
        after: Cursor | str,
        entries: list[Entry],
        rest: tuple[str | None, str | None] | None = None,
    ) -> None:
        # Where this batch follows (given as an entry id, the place right after it).
        self.after = Cursor.after(after) if isinstance(after, str) else after
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


class HubClosed(Exception):
    """The hub was closed (shutdown) or the feed failed: end the response, the client resumes."""


class Subscription:
    """One reader's place on its feed's tape."""

    __slots__ = (
        "closed",
        "cursor",
        "deadline",
        "feed",
        "index",
        "overflowed",
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
        # While parked, a reader with a ``sink`` standing at ``cursor`` is written to by the
        # feed itself, which moves the cursor on: see _Feed.publish.
        self.sink: Sink | None = None
        self.cursor = ORIGIN

    @property
    def position(self) -> tuple[int, int]:
        """The sort key of where this reader stands."""
        return self.cursor.key

    def covers(self, cursor: Cursor) -> bool:
        """Whether every entry past ``cursor`` will reach this subscription from its feed: the
        feed has read nothing past it yet. (A reader that joined a feed already further on must
        read what lies between from Redis.)"""
        read_after = self.feed.read_after
        return read_after is not None and read_after.key <= cursor.key

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        self.closed = True
        self.wake()

    async def get_all(self, timeout: float) -> list[Batch] | None:
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
                raise HubClosed()
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
                raise HubClosed()
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            self.timeout = timeout
            self.deadline = loop.time() + timeout
            feed.park(self)
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

    def __init__(
        self,
        hub: Hub,
        key: str,
        start: Cursor | None,
        turn_key: str | None,
        seen: bool = False,
        bare: bool = False,
        running: str | None = None,
    ) -> None:
        self.hub = hub
        self.key = key
        self.turn_key = turn_key
        self.bare = bare  # entries are places only: their payloads are bytes nobody decodes
        self.start = start  # where the first subscriber stands; None: the stream's tail
        # Where the feed's reads stand: every entry past it is published after now (None: not
        # known yet, the feed will read the tail).
        self.read_after = start
        # The newest entry this feed read from Redis (None: none yet): every entry up to it is
        # stored for good, whatever a reader's resume point said.
        self.seen: Cursor | None = start if seen else None
        # The status of a turn not at rest, as its first reader saw it before this feed began
        # reading; None once the feed read an ``end`` or a look found the turn at rest (or
        # never known). See Hub.running_at.
        self.running = running
        # The readers' shared look at whether the turn is at rest, after a heartbeat (see
        # shared_look), and when it began.
        self.rest_look: asyncio.Future[bool] | None = None
        self.rest_looked_at = 0.0
        self.subscriptions: set[Subscription] = set()
        self.task: asyncio.Task[None] | None = None
        self.tape: list[Batch] = []
        self.base = 0  # the number of batches dropped from the front of the tape
        self.parked: list[Subscription] = []  # readers waiting for the next batch
        # Whether ``parked`` is in the order of its readers' heartbeat deadlines (so the ticker
        # looks at its front only): it is while they share one heartbeat period.
        self.in_order = True
        self._published = 0

    def park(self, subscription: Subscription) -> None:
        """Add a waiting reader (its ``deadline`` set) at the end of ``parked``."""
        parked = self.parked
        if parked and parked[-1].deadline > subscription.deadline:
            self.in_order = False
        parked.append(subscription)

    @property
    def end(self) -> int:
        return self.base + len(self.tape)

    def publish(self, batch: Batch) -> None:
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
        self.in_order = True
        written = 0
        last = batch.entries[-1] if batch.entries else None
        if batch.ends or last is None:
            for subscription in parked:
                subscription.wake()
        else:
            data = batch.chunk.data
            after, moved = batch.after, last.cursor
            now = asyncio.get_running_loop().time()
            for subscription in parked:
                if self._write(subscription, index, after, data):
                    subscription.index = index + 1
                    subscription.cursor = moved
                    subscription.deadline = now + subscription.timeout
                    self.park(subscription)
                    written += 1
                else:
                    subscription.wake()
        if written == len(self.subscriptions):
            self.tape.clear()  # every reader has it: nothing to keep
            self.base = index + 1
        elif len(self.tape) >= 2 * QUEUE_LIMIT or self._published % TRIM_EVERY == 0:
            self._trim()

    @staticmethod
    def _write(subscription: Subscription, index: int, after: Cursor, data: bytes) -> bool:
        """Whether ``data`` (following ``after``) was written to a waiting reader standing right
        before it."""
        sink, waiter = subscription.sink, subscription.waiter
        if sink is None or waiter is None or waiter.done():
            return False
        if subscription.index != index or subscription.cursor.key != after.key:
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

    def shared_look(self, now: float, max_age_s: float) -> asyncio.Future[bool]:
        """Whether the turn is at rest, one look for all the stream's readers: the look under
        way, or the last one if it said "not at rest" less than ``max_age_s`` ago, else a new
        one. A look that finds the turn at rest (or fails) wakes every parked reader, which
        then looks for itself and ends. A quiet stream costs a look per heartbeat period,
        however many read it."""
        look = self.rest_look
        if look is not None and (
            not look.done()
            or (
                not look.cancelled()
                and look.exception() is None
                and not look.result()
                and now - self.rest_looked_at < max_age_s
            )
        ):
            return look
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieved)  # a failure no reader waited for is not logged
        self.rest_look, self.rest_looked_at = future, now
        self.hub._start(self._look(future), f"feed look {self.key}")
        return future

    async def _look(self, future: asyncio.Future[bool]) -> None:
        try:
            at_rest = True
            if self.turn_key is not None:
                status, _ = await rc.hmget(self.hub.redis, self.turn_key, ["status", "attempt"])
                at_rest = status is None or status in FINAL_STATUSES
            future.set_result(at_rest)
        except (RedisError, OSError) as exc:
            log.info("looking at a quiet stream's turn failed: %s", exc)
            self.hub.metrics.redis_errors.inc()
            future.set_exception(exc)  # its readers fail as their own look would have
        finally:
            if not future.done():  # cancelled, the hub closing: its readers end and resume
                future.set_exception(HubClosed())
        if future.exception() is not None or future.result():
            self.running = None
            parked, self.parked = self.parked, []
            self.in_order = True
            for subscription in parked:
                subscription.ticked = True
                subscription.wake()

    def unpark(self, subscription: Subscription) -> None:
        with contextlib.suppress(ValueError):
            self.parked.remove(subscription)

    async def run(self) -> None:
        redis = self.hub.blocking_redis
        after: Cursor | None = self.start
        failures = 0
        try:
            # Not only cancellation ends the loop (redis-py may swallow one mid-XREAD): the last
            # reader leaving, or the hub closing, does.
            while self.subscriptions and not self.hub.closed:
                try:
                    if after is None:
                        tail = await rc.last_entry_id(redis, self.key)
                        after = self.read_after = Cursor.after(tail) if tail else ORIGIN
                        self.seen = after if tail else None
                    reply = await rc.xread(
                        redis, self.key, after.entry_id, 1000, FEED_BLOCK_MS, undecoded=self.bare
                    )
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
                if self.bare:
                    entries = [Entry.place(cast(bytes, i)) for i, _ in reply]
                else:
                    entries = [Entry.from_redis(i, f) for i, f in reply]
                batch = Batch(after, entries)
                after = self.read_after = self.seen = entries[-1].cursor
                if batch.ends:
                    self.running = None  # the attempt ended: whether the turn rests is asked
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
                cpu, wall = time.thread_time(), time.perf_counter()
                self.publish(batch)
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                pause = pause_after(cpu, wall, self.hub.linger_s)
                if pause:
                    await asyncio.sleep(pause)  # (its cancellation does not pass through Redis)
        except Exception:
            log.exception("stream feed %s failed", self.key)
        finally:
            # However it ended (a bug, not Redis; a shutdown), no reader is left waiting for a
            # feed that is gone: their clients resume.
            for subscription in self.subscriptions:
                subscription.close()
            self.hub.forget(self)


def _retrieved(future: asyncio.Future[bool]) -> None:
    if not future.cancelled():
        future.exception()


class Hub:
    """All feeds of one process."""

    def __init__(
        self,
        blocking_redis: Redis,
        metrics: Metrics,
        redis: Redis | None = None,
        *,
        linger_s: float = 0.0,
    ) -> None:
        self.blocking_redis = blocking_redis
        self.redis = redis if redis is not None else blocking_redis  # for short calls
        self.metrics = metrics
        self.linger_s = linger_s  # the longest a feed rests after a hand-over (see pause_after)
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
        """Heartbeats for the parked readers whose quiet time is up (:mod:`broker.ticker`)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._tick_s)
            beat(self._feeds.values(), loop.time(), self._tick_s)

    def _start(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def subscribe(
        self,
        key: str,
        start: Cursor | None = None,
        turn_key: str | None = None,
        *,
        seen: bool = False,
        bare: bool = False,
        running: str | None = None,
    ) -> Subscription:
        """Join (or start, reading after ``start``; by default the stream's tail) the feed of one
        stream.

        With ``turn_key``, the feed looks up the turn's state after each batch holding an
        ``end`` event, for all its readers at once. With ``seen``, ``start`` is an entry the
        subscriber read from the stream (not only a place a client asked for): a feed started
        there has seen it (see :meth:`seen`). With ``bare``, the feed's entries are their places
        only (no kind, data or frame): for a stream whose payloads are bytes, not text. With
        ``running`` (a status not at rest the subscriber read before the events it read up to
        ``start``), a feed started here vouches for the turn (see :meth:`running_at`).
        """
        feed = self._feeds.get(key)
        if feed is None or feed.task is None or feed.task.done():
            feed = _Feed(self, key, start, turn_key, seen and start is not None, bare, running)
            self._feeds[key] = feed
            self.metrics.live_streams.set(len(self._feeds))
        subscription = Subscription(feed)
        if self.closed:
            subscription.close()
        feed.subscriptions.add(subscription)
        if feed.task is None:
            feed.task = self._start(feed.run(), f"feed {key}")
        return subscription

    def seen(self, key: str) -> Cursor | None:
        """The newest entry of stream ``key`` that its running feed in this process has read
        (None: no feed, or none read yet): the stream up to it will never change."""
        feed = self._live(key)
        return None if feed is None else feed.seen

    def covers(self, key: str, cursor: Cursor) -> bool:
        """Whether a running feed of stream ``key`` has read nothing past ``cursor``: a reader
        that joins it now gets every entry past ``cursor`` from it, and needs no replay."""
        feed = self._live(key)
        read_after = None if feed is None else feed.read_after
        return read_after is not None and read_after.key <= cursor.key

    def running_at(self, key: str, cursor: Cursor) -> str | None:
        """The status (not at rest) of the turn of stream ``key`` if its running feed stands at
        ``cursor`` and vouches for the turn (else None): its first reader saw that status
        before it began reading, and it read no ``end`` since, nor did a look find the turn at
        rest. A turn comes to rest only with an ``end`` as its stream's last event (its keys
        expire only after that), so a reader at ``cursor`` meets that rest through the feed."""
        feed = self._live(key)
        if feed is None or feed.running is None or feed.read_after is None:
            return None
        return feed.running if feed.read_after.key == cursor.key else None

    def _live(self, key: str) -> _Feed | None:
        feed = self._feeds.get(key)
        if feed is None or feed.task is None or feed.task.done():
            return None
        return feed

    @property
    def readers(self) -> int:
        """The subscriptions of every feed in this process."""
        return sum(len(feed.subscriptions) for feed in self._feeds.values())

    def unsubscribe(self, subscription: Subscription) -> None:
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
