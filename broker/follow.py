"""One follow of a turn's stream: the replay from Redis, the hand-over to the live feed, and
live batches, without gap or duplicate (see :mod:`broker.reader`, which starts each follow)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from broker.fanout import Batch, Hub, Subscription
from broker.frames import CAUGHT_UP, HEARTBEAT, CaughtUp, Chunk, Cursor, Entry, Heartbeat
from broker.pages import Page, StoredPages, end_indexes
from broker.vocabulary import FINAL_STATUSES


class Follow:
    """One follow of a turn's stream (``key``; its turn's hash ``turn_key``): where it stands
    (``cursor``), whether it is over (``ended``: it reached an ``end`` that ends the read), and
    its reads of Redis, through ``pages`` and the process's feeds (``hub``).

    ``at_rest(attempt)`` says whether the turn is at rest (on that ``end``'s attempt, when one
    is given); ``look(subscription, first, max_age_s)`` whether it is, for a reader that just
    joined its feed (``first``) or whose stream was quiet for a heartbeat."""

    __slots__ = (
        "_at_rest",
        "_hub",
        "_look",
        "_pages",
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
        keys: tuple[str, str],
        cursor: Cursor,
        *,
        at_rest: Callable[[int | None], Awaitable[bool]],
        look: Callable[[Subscription, bool, float], Awaitable[bool]],
        keep: bool,
        shared: bool = False,
    ) -> None:
        self._pages, self._hub = pages, hub
        self._at_rest, self._look = at_rest, look
        self.key, self.turn_key = keys
        self.cursor = cursor
        self.keep = keep
        self.shared = shared  # full pages are shared with the next readers (broker.pages)
        self.ended = False
        self.dry = False  # the last replay ended on an empty page (see stored)

    async def stored(self) -> AsyncIterator[Chunk]:
        """The stored events past the cursor, a chunk per page, up to an ``end`` that ends the
        read; the cursor moves past each chunk as it is yielded.

        Without ``keep`` the chunks hold their frames only, and no event is referenced here
        while a chunk is out: a reader whose client is slow to take a page holds that page's
        bytes, not its events' objects (several times their size; a full page's objects are
        kept for the next readers, a moment and within a bound: :mod:`broker.pages`).
        """
        pages = self._pages
        count = pages.next_count(None)
        self.dry = False
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

    async def live(
        self, subscription: Subscription, look: bool, heartbeat_s: float, *, caught_up: bool
    ) -> AsyncIterator[Chunk | Heartbeat | CaughtUp]:
        """The read once it joined its stream's feed (``subscription``): live batches, a
        catch-up from Redis whenever the reader fell behind the feed, heartbeats when the
        stream is quiet, until an ``end`` that ends the read. ``look``: whether to look at the
        turn before the first wait (:meth:`broker.reader.Streams.follow_chunks` says when it
        need not)."""
        catch_up, first_look = not subscription.covers(self.cursor), True
        while True:
            if catch_up:
                async for chunk in self.stored():
                    yield chunk
                if self.ended:
                    return
            if look and await self._look(subscription, first_look, heartbeat_s):
                # Final before we looked: anything past the cursor ends with the `end` event.
                async for chunk in self.stored():
                    yield chunk
                return
            first_look = False
            if caught_up:
                yield CAUGHT_UP
            subscription.cursor = self.cursor
            batches = await subscription.get_all(heartbeat_s)
            self.cursor = subscription.cursor  # moved on by the feed's direct writes
            # Too slow for the live tape: catch up from Redis, which has everything, a page at
            # a time (never all it missed at once: a page is read only when its client took the
            # last), then take the tape again from where it stands.
            catch_up, look = subscription.overflowed, False
            subscription.overflowed = False
            if batches is not None:
                taken = await self.take(batches)
                if taken is not None:
                    yield taken
                if self.ended:
                    return
            elif not catch_up:
                yield HEARTBEAT
                look = True  # a quiet stream: its turn may have come to rest

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
            if await self._at_rest(entries[index].attempt()):
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
