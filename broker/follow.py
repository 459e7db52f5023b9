"""One follow of a turn's stream: the replay from Redis, the hand-over to the live feed, and
live batches, without gap or duplicate (see :mod:`broker.reader`, which starts each follow)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.fanout import Batch, Hub, Subscription
from broker.frames import Chunk, Cursor, Entry
from broker.pages import Page, StoredPages, end_indexes
from broker.vocabulary import FINAL_STATUSES


async def turn_at_rest(redis: Redis, turn_key: str, end_attempt: int | None = None) -> bool:
    """Whether the turn of hash ``turn_key`` is final (and, given an ``end``, still on that
    end's attempt)."""
    status, attempt = await rc.hmget(redis, turn_key, ["status", "attempt"])
    if status is None:
        return True  # expired under the reader: nothing more will come
    if status not in FINAL_STATUSES:
        return False
    return end_attempt is None or str(end_attempt) == attempt


class Follow:
    """One follow of a turn's stream (``key``; its turn's hash ``turn_key``): where it stands
    (``cursor``), whether it is over (``ended``: it reached an ``end`` that ends the read), and
    its reads of Redis (``redis``, and ``pages``) and of the process's feeds (``hub``).

    The loop that drives it is :meth:`broker.reader.Streams.follow_chunks`: one async
    generator per reader, which a quiet reader stays suspended in (another generator layer
    would cost every quiet connection its frame)."""

    __slots__ = (
        "_hub",
        "_pages",
        "_redis",
        "cursor",
        "dry",
        "ended",
        "keep",
        "key",
        "shared",
        "turn_key",
    )

    def __init__(
        self,
        pages: StoredPages,
        hub: Hub,
        redis: Redis,
        keys: tuple[str, str],
        cursor: Cursor,
        *,
        keep: bool,
        shared: bool = False,
    ) -> None:
        self._pages, self._hub, self._redis = pages, hub, redis
        self.key, self.turn_key = keys
        self.cursor = cursor
        self.keep = keep
        self.shared = shared  # full pages are shared with the next readers (broker.pages)
        self.ended = False
        self.dry = False  # the last replay ended on an empty page (see stored)

    async def stored(self, *, replay: bool = False) -> AsyncIterator[Chunk]:
        """The stored events past the cursor, a chunk per page, up to an ``end`` that ends the
        read; the cursor moves past each chunk as it is yielded.

        Without ``keep`` the chunks hold their frames only, and no event is referenced here
        while a chunk is out: a reader whose client is slow to take a page holds that page's
        bytes, not its events' objects (several times their size; a full page's objects are
        kept for the next readers, a moment and within a bound: :mod:`broker.pages`).

        A shared follow's ``replay`` (before it joins its stream's feed) reads nothing when that
        feed here has read nothing past the cursor: once the follow joins it (no await
        between), everything past the cursor comes from the feed.
        """
        pages = self._pages
        count = pages.next_count(None)
        self.dry = False
        if replay and self.shared and self._hub.covers(self.key, self.cursor):
            return
        while True:
            entries, more = await pages.page(
                self.key,
                self.cursor,
                "+",
                count,
                shared=self.shared,
                bound=self._hub.seen(self.key) if self.shared else None,
            )
            if not entries:
                self.dry = True  # (an empty page is never kept: this one was read)
                return
            stop = await self._ending(entries)
            if stop is None and not self.keep and isinstance(entries, Page):
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
            count = pages.next_count(count)

    async def look(self, subscription: Subscription, first: bool, max_age_s: float) -> bool:
        """Whether the turn is at rest, for a reader that just joined (``first``: its own look)
        or whose stream was quiet for a heartbeat: then the feed's look, shared by all its
        readers (see :meth:`~broker.fanout._Feed.shared_look`)."""
        if first:
            return await turn_at_rest(self._redis, self.turn_key)
        look = subscription.feed.shared_look(asyncio.get_running_loop().time(), max_age_s)
        # Shielded: a reader that goes away does not cancel the others' look.
        return await asyncio.shield(look)

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
        pages, after, entries = self._pages, self.cursor, []
        count = pages.next_count(None)
        while True:
            page, more = await pages.page(self.key, after, until.entry_id, count)
            if page:
                after = page[-1].cursor
                entries += page
            if not more:
                return entries
            count = pages.next_count(count)

    async def _ending(self, entries: Sequence[Entry]) -> int | None:
        """The length of ``entries`` up to an ``end`` that ends the read (the turn is at rest
        on that attempt), or None when the read goes on."""
        for index in end_indexes(entries):
            if await turn_at_rest(self._redis, self.turn_key, entries[index].attempt()):
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
