"""A turn's stored events, read from Redis a page at a time, and the full pages a process keeps
a moment for the next reader of the same page.

Replay and catch-up read pages that start small and double (``FIRST_PAGE`` up to
``BROKER_SSE_REPLAY_PAGE``: :meth:`StoredPages.next_count`), so that a reader resuming in a long
stream gets its first event soon, and a response asks for the next page only once its client
took the last (:mod:`broker.sse`). A full page is kept for the next readers (:class:`PageCache`):
a crowd that replays a finished answer, or joins a running one, reads each page from Redis once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable, Sequence
from typing import Final

from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.frames import Cursor, Entry

PageKey = tuple[str, str, str, int]  # a page asked of Redis: key, after, until, count
PAGE_CACHE_EVENTS: Final = 8_192  # events of full pages a process keeps (see PageCache)
FIRST_PAGE: Final = 64  # a replay's first page (its first event comes sooner); the next ones double


class Page(list[Entry]):
    """A page of events read from Redis, with what its readers ask of it worked out once, when
    first asked: its frames joined (the write of a reader that takes the whole page), and where
    its ``end`` events are. A page :class:`PageCache` keeps has many readers."""

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
            self._ends = [index for index, entry in enumerate(self) if entry.kind == "end"]
        return self._ends


def end_indexes(entries: Sequence[Entry]) -> list[int]:
    """Where the ``end`` events of ``entries`` are (a :class:`Page` knows its own)."""
    if isinstance(entries, Page):
        return entries.ends
    return [index for index, entry in enumerate(entries) if entry.kind == "end"]


class PageCache:
    """Full pages of stored events this process read lately, for the next reader of the same
    page.

    A full page is kept (as many events as asked for): the events of a stream between two ids
    never change (a turn's stream is only appended to, never trimmed), so it is the same page
    whoever asks. A page that came short may grow and is not kept, unless it was read up to an
    entry that was read already (see :meth:`StoredPages.page`'s ``bound``). A page is kept
    ``ttl_s`` (``BROKER_SSE_PAGE_CACHE_S``) at most, so a stream that expires is not read from
    here for longer than that, and ``PAGE_CACHE_EVENTS`` events in all. A page that finds no
    room once the pages whose time ran out are gone pushes out other streams' pages, oldest
    first, never its own stream's: then it is not kept. (A reader of a stream longer than the
    bound pushed each of its pages out before the next reader of that stream asked for it, and
    every read of it went to Redis; now the next readers take its first ``PAGE_CACHE_EVENTS``
    events from here.)
    """

    __slots__ = ("_events", "_pages", "_ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        # Oldest first, and so in the order their time runs out (one ``ttl_s`` for all).
        self._pages: collections.OrderedDict[PageKey, tuple[float, list[Entry]]] = (
            collections.OrderedDict()
        )
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
        if self._ttl_s <= 0 or page in self._pages:
            return
        pages = self._pages
        while pages:  # the pages whose time ran out go first
            oldest = next(iter(pages.values()))
            if oldest[0] > now:
                break
            pages.popitem(last=False)
            self._events -= len(oldest[1])
        room = PAGE_CACHE_EVENTS - self._events
        if room < len(entries):
            # Other streams' pages make room, oldest first; the stream's own stay their time.
            going = []
            for kept, (_, events) in pages.items():
                if kept[0] != page[0]:
                    going.append(kept)
                    room += len(events)
                    if room >= len(entries):
                        break
            if room < len(entries):
                return
            for kept in going:
                self._drop(kept)
        pages[page] = (now + self._ttl_s, entries)
        self._events += len(entries)

    def _drop(self, page: PageKey) -> None:
        self._events -= len(self._pages.pop(page)[1])


class StoredPages:
    """Pages of turn streams read from ``redis``, full ones shared through a :class:`PageCache`.

    ``bounded``: whether a page may stop at an entry this process's feed read (the feed and the
    pages then read the same server; not so when reads go to a cluster's replicas)."""

    __slots__ = ("_bounded", "_cache", "_reading", "_redis", "_replay_page")

    def __init__(self, redis: Redis, *, replay_page: int, cache_ttl_s: float, bounded: bool):
        self._redis = redis
        self._replay_page = replay_page
        self._cache = PageCache(cache_ttl_s)
        self._bounded = bounded
        # Shared pages being read from Redis now: a reader that asks for one meanwhile waits
        # for that read instead of making its own (a crowd joins at the same moment).
        self._reading: dict[PageKey, asyncio.Future[Page]] = {}

    def next_count(self, count: int | None) -> int:
        """A replay's page sizes: a small first page, then each twice the last, up to
        ``BROKER_SSE_REPLAY_PAGE``.

        A response asks for the next page only once its client took the last: a client that
        stops reading leaves its reader holding one page about the size of what it took.
        """
        return min(FIRST_PAGE if count is None else 2 * count, self._replay_page)

    def kept(self, key: str, after: Cursor) -> bool:
        """Whether the first page of a replay of ``key`` from ``after`` is kept (so events are
        stored past ``after``)."""
        first = (key, after.entry_id, "+", self.next_count(None))
        return self._cache.get(first, time.monotonic()) is not None

    async def page(
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
        ``shared``, a full page is taken from, or kept for, the next readers; with ``bound`` as
        well (an entry this process's feed read, see :meth:`broker.fanout.Hub.seen`), the page
        stops there, and is kept whether full or not: the stream up to an entry that was read
        never changes, so every reader standing at ``after`` while the feed stands at ``bound``
        takes the same short last page (then the feed)."""
        now = time.monotonic()
        asked = (key, after.entry_id, until, count)
        if shared and (kept := self._cache.get(asked, now)) is not None:
            return kept, True
        if shared and self._bounded and until == "+" and bound and bound.key > after.key:
            return await self._bounded_page(asked, bound, now)
        if shared:
            entries = await self._read_once(asked)
        else:
            entries = await self._read(key, after.entry_id, until, count)
        if len(entries) < count:
            if shared and self._bounded and until == "+" and entries:
                # All there was past ``after``: the page up to its last entry never changes,
                # and it is the bounded page of the readers that come once a feed read that
                # far (this reader's own, which it starts there).
                self._cache.put((key, after.entry_id, entries[-1].entry_id, count), entries, now)
            return entries, False
        if shared:
            self._cache.put(asked, entries, now)
        return entries, True

    async def _bounded_page(
        self, asked: PageKey, bound: Cursor, now: float
    ) -> tuple[list[Entry], bool]:
        """The page ``asked`` for, up to ``bound``'s entry (see :meth:`page`)."""
        key, start, _, count = asked
        bounded = (key, start, bound.entry_id, count)
        entries = self._cache.get(bounded, now)
        if entries is None:
            entries = await self._read_once(bounded)
            if entries:
                self._cache.put(bounded, entries, now)
        if len(entries) < count:
            return entries, False  # all there is up to the bound: the feed brings the rest
        self._cache.put(asked, entries, now)  # a full page is the same, bounded or not
        return entries, True

    async def _read_once(self, page: PageKey) -> Page:
        """``page`` read from Redis, once for all the readers that ask for it while it is
        read. A reader whose read failed (or was cancelled) leaves the others to read it
        themselves; nothing here waits on a cancellation reaching a Redis call."""
        pending = self._reading.get(page)
        if pending is not None:
            await asyncio.wait((pending,))  # (raises only this reader's own cancellation)
            if not pending.cancelled():
                return pending.result()
            return await self._read(*page)
        future: asyncio.Future[Page] = asyncio.get_running_loop().create_future()
        self._reading[page] = future
        try:
            entries = await self._read(*page)
        except BaseException:
            future.cancel()  # the waiting readers read for themselves
            raise
        else:
            future.set_result(entries)
        finally:
            del self._reading[page]
        return entries

    async def _read(self, key: str, after: str, until: str, count: int) -> Page:
        """Up to ``count`` events of stream ``key`` past entry ``after``, up to ``until``,
        read from Redis."""
        page = await rc.xrange_raw(self._redis, key, "(" + after, until, count)
        return Page(Entry.from_redis(entry_id, fields) for entry_id, fields in page)
