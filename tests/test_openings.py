"""A read's opening, and the pages a crowd shares.

A crowd that joins a live answer opens its reads on the pages its first viewers read: events
stored past a read's start are all its opening needs (``reader.Opening.open``), so it asks Redis
nothing, and every reader of a kept page writes the same joined frames.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable

import orjson
import pytest
import redis
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.fanout import Hub
from broker.frames import ORIGIN, Chunk, Cursor
from broker.keys import Keys
from broker.metrics import Metrics
from broker.pages import Page, StoredPages
from broker.reader import Location, Streams
from broker.scripts import Scripts
from broker.settings import Settings
from broker.vocabulary import encode_turn_ref
from tests.conftest import command_calls

_n = itertools.count()


async def test_reads_that_open_on_a_kept_page_ask_redis_nothing(
    aredis: Redis, raw_redis: redis.Redis
) -> None:
    streams, keys, location = await _setup(aredis)
    for i in range(70):
        await aredis.xadd(keys.events("c", "t"), {"e": "delta", "d": _data(text=str(i))})
    first = await streams.opening(location, ORIGIN)  # before any page is kept: one round trip
    assert (first.status, first.stored_past, first.open, first.finished) == (
        "streaming",
        True,
        True,
        False,
    )
    await streams.pages.page(keys.events("c", "t"), ORIGIN, "+", 64, shared=True)  # a reader's
    before = {name: command_calls(raw_redis, name) for name in ("hget", "xrange")}
    openings = [await streams.opening(location, ORIGIN) for _ in range(20)]
    assert all(o.stored_past and o.open and not o.finished for o in openings)
    calls = {name: command_calls(raw_redis, name) - before[name] for name in before}
    assert calls == {"hget": 0, "xrange": 0}
    # A read from past the stream's end has no page kept: it asks, and learns the turn's state.
    await aredis.hset(keys.turn("c", "t"), "status", "complete")
    tail = Cursor.after(str(await rc.last_entry_id(aredis, keys.events("c", "t"))))
    late = await streams.opening(location, tail)
    assert (late.status, late.stored_past, late.finished) == ("complete", False, True)


async def test_a_read_opened_on_a_kept_page_meets_the_end_of_a_turn_at_rest(
    aredis: Redis, raw_redis: redis.Redis
) -> None:
    """The opening did not read the status: the read meets the turn's `end`, the stream's last
    event, and asks then whether the turn is at rest (it is: the read ends there)."""
    streams, keys, location = await _setup(aredis)
    events_key = keys.events("c", "t")
    for i in range(70):
        await aredis.xadd(events_key, {"e": "delta", "d": _data(text=str(i))})
    await aredis.xadd(events_key, {"e": "end", "d": _data(status="complete")})
    await aredis.hset(keys.turn("c", "t"), "status", "complete")
    await streams.pages.page(events_key, ORIGIN, "+", 64, shared=True)  # kept, as a crowd's
    before = {name: command_calls(raw_redis, name) for name in ("hget", "hmget")}
    opening = await streams.opening(location, ORIGIN)
    assert (opening.status, opening.open, opening.finished) == (None, True, False)

    async def read_all() -> list[str]:
        kinds = []
        async for item in streams.follow_chunks(location, ORIGIN, opening=opening):
            assert isinstance(item, Chunk)  # (no heartbeat: the read never waits)
            kinds += [entry.kind for entry in item.entries]
        return kinds

    kinds = await asyncio.wait_for(read_all(), 10)
    assert kinds == ["delta"] * 70 + ["end"]
    calls = {name: command_calls(raw_redis, name) - before[name] for name in before}
    assert calls == {"hget": 0, "hmget": 1}  # the end's own question


@pytest.mark.parametrize("kept", [False, True], ids=["read", "kept"])
async def test_a_read_whose_stream_expired_after_its_opening_ends_at_once(
    aredis: Redis, kept: bool
) -> None:
    """The opening saw events stored past the start, so the read would meet their `end`; the
    stream expired before the replay read them. The read learns it from its empty page and
    ends, instead of waiting a heartbeat for an `end` that is gone."""
    streams, keys, location = await _setup(aredis)
    events_key, turn_key = keys.events("c", "t"), keys.turn("c", "t")
    for i in range(70):
        await aredis.xadd(events_key, {"e": "delta", "d": _data(text=str(i))})
    await aredis.xadd(events_key, {"e": "end", "d": _data(status="complete")})
    await aredis.hset(turn_key, "status", "complete")
    if kept:  # a crowd's first page is kept: the opening asks nothing
        await streams.pages.page(events_key, ORIGIN, "+", 64, shared=True)
    opening = await streams.opening(location, ORIGIN)
    assert opening.open
    assert not opening.finished
    await aredis.delete(events_key, turn_key)  # expired, between the opening and the read

    async def read_all() -> int:
        events = 0
        async for item in streams.follow_chunks(location, ORIGIN, opening=opening, heartbeat_s=60):
            assert isinstance(item, Chunk)  # (no heartbeat: the read never waits)
            events += len(item.entries)
        return events

    # What the kept page held is served (it was read less than a page-cache time ago).
    assert await asyncio.wait_for(read_all(), 10) == (64 if kept else 0)


async def _setup(aredis: Redis) -> tuple[Streams, Keys, Location]:
    prefix = f"openings{os.getpid()}-{next(_n)}"
    keys = Keys(prefix)
    settings = Settings(redis_url="unix:///unused", key_prefix=prefix, sse_replay_page=64)
    metrics = Metrics()
    streams = Streams(Deps(aredis, Scripts(aredis), keys, settings, metrics), Hub(aredis, metrics))
    await aredis.hset(keys.turn("c", "t"), mapping={"status": "streaming", "attempt": "1"})
    return streams, keys, Location("st_" + "0" * 32, "c", "t")


def _data(**fields: str) -> str:
    return orjson.dumps({"attempt": 1, **fields}).decode()


async def test_readers_of_a_kept_page_share_its_frames(aredis: Redis) -> None:
    """A crowd replaying a kept page writes one joined copy of its frames, not one each."""
    streams, keys, location = await _setup(aredis)
    for i in range(80):
        await aredis.xadd(keys.events("c", "t"), {"e": "delta", "d": _data(text=str(i))})

    async def first_chunk() -> Chunk:
        reader = streams.follow_chunks(location, ORIGIN, _Sink())
        try:
            item = await asyncio.wait_for(anext(reader), 10)
        finally:
            await reader.aclose()
        assert isinstance(item, Chunk)
        return item

    first, second = await first_chunk(), await first_chunk()
    assert first.data.count(b"event: delta\n") == 64
    assert second.data is first.data


class _Sink:
    """A response that takes nothing directly: the reader yields every chunk."""

    over = False

    def write_now(self, chunk: bytes) -> bool:
        return False


async def test_readers_asking_for_a_page_while_it_is_read_share_that_read(
    aredis: Redis, raw_redis: redis.Redis
) -> None:
    """A crowd that joins at once asks for the same page at the same moment: one XRANGE."""
    streams, keys, _ = await _setup(aredis)
    key = keys.events("c", "t")
    for i in range(30):  # a short page: not kept, so only sharing the read saves a command
        await aredis.xadd(key, {"e": "delta", "d": _data(text=str(i))})
    before = command_calls(raw_redis, "xrange")
    pages = await asyncio.gather(
        *(streams.pages.page(key, ORIGIN, "+", 64, shared=True) for _ in range(10))
    )
    assert command_calls(raw_redis, "xrange") - before == 1
    assert all(page == pages[0] and len(page[0]) == 30 for page in pages)
    assert streams.pages._reading == {}  # nothing left behind


class _FirstReadBreaks(StoredPages):
    """Pages whose first read from Redis breaks, once the others asked for the same page."""

    __slots__ = ("reads",)

    def __init__(self, redis: Redis) -> None:
        super().__init__(redis, replay_page=64, cache_ttl_s=1.0, bounded=True)
        self.reads = 0

    async def _read(self, key: str, after: str, until: str, count: int) -> Page:
        self.reads += 1
        if self.reads == 1:
            await asyncio.sleep(0)  # (the others ask meanwhile)
            raise ConnectionError("the first reader's read broke")
        return await super()._read(key, after, until, count)


async def test_a_shared_read_that_fails_leaves_its_waiters_to_read_for_themselves(
    aredis: Redis,
) -> None:
    _, keys, _ = await _setup(aredis)
    key = keys.events("c", "t")
    await aredis.xadd(key, {"e": "delta", "d": _data(text="a")})
    pages = _FirstReadBreaks(aredis)
    results = await asyncio.gather(
        *(pages.page(key, ORIGIN, "+", 64, shared=True) for _ in range(3)),
        return_exceptions=True,
    )
    assert isinstance(results[0], ConnectionError)
    assert [len(r[0]) for r in results[1:] if isinstance(r, tuple)] == [1, 1]
    assert pages.reads == 3
    assert pages._reading == {}


async def _until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Wait (on the event loop) until ``predicate()`` holds; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"condition not met within {timeout} s")


def _parked(streams: Streams, key: str) -> int:
    feed = streams._hub._feeds.get(key)
    return 0 if feed is None else len(feed.parked)


@pytest.mark.parametrize("stored", [0, 3], ids=["quiet", "begun"])
async def test_a_crowd_after_its_first_viewer_opens_and_joins_without_asking_redis(
    aredis: Redis, raw_redis: redis.Redis, stored: int
) -> None:
    """The stream's feed here vouches for the crowd: it read the events past their start
    (``begun``), or it stands where they start and its first viewer saw the turn running
    (``quiet``, a turn that has said nothing yet). No opening, replay or look: the crowd costs
    Redis nothing, and still reads every event to the turn's `end`."""
    streams, keys, location = await _setup(aredis)
    events_key, turn_key = keys.events("c", "t"), keys.turn("c", "t")
    for i in range(stored):
        await aredis.xadd(events_key, {"e": "delta", "d": _data(text=str(i))})
    kinds: list[list[str]] = []

    async def view() -> None:
        opening = await streams.opening(location, ORIGIN)
        assert opening.open
        assert not opening.finished
        seen: list[str] = []
        kinds.append(seen)
        async for item in streams.follow_chunks(location, ORIGIN, opening=opening, heartbeat_s=60):
            if isinstance(item, Chunk):
                seen += [entry.kind for entry in item.entries]

    first = asyncio.create_task(view())
    await _until(lambda: _parked(streams, events_key) == 1)
    before = {name: command_calls(raw_redis, name) for name in ("hget", "hmget", "xrange")}
    crowd = [asyncio.create_task(view()) for _ in range(20)]
    await _until(lambda: _parked(streams, events_key) == 21)
    calls = {name: command_calls(raw_redis, name) - before[name] for name in before}
    assert calls == {"hget": 0, "hmget": 0, "xrange": 0}
    await aredis.xadd(events_key, {"e": "delta", "d": _data(text="live")})
    await aredis.hset(turn_key, "status", "complete")
    await aredis.xadd(events_key, {"e": "end", "d": _data(status="complete")})
    await asyncio.wait_for(asyncio.gather(first, *crowd), 10)
    assert kinds == [["delta"] * (stored + 1) + ["end"]] * 21


async def test_a_feed_that_read_an_end_no_longer_vouches_for_its_turn(
    aredis: Redis, raw_redis: redis.Redis
) -> None:
    """Once the feed read an attempt's `end`, whether the turn rests is a question again: a
    reader from past that `end` opens with a round trip, and learns the turn is at rest."""
    streams, keys, location = await _setup(aredis)
    events_key, turn_key = keys.events("c", "t"), keys.turn("c", "t")
    opening = await streams.opening(location, ORIGIN)
    assert opening.running

    async def view() -> None:
        async for _ in streams.follow_chunks(location, ORIGIN, opening=opening, heartbeat_s=60):
            pass

    reader = asyncio.create_task(view())
    await _until(lambda: _parked(streams, events_key) == 1)
    # An attempt ends, and a new one is queued at once: the first reader reads on.
    await aredis.hset(turn_key, mapping={"status": "queued", "attempt": "2"})
    await aredis.xadd(events_key, {"e": "end", "d": _data(status="interrupted")})
    await _until(lambda: streams._hub.seen(events_key) is not None)
    await _until(lambda: _parked(streams, events_key) == 1)
    tail = streams._hub.seen(events_key)
    assert tail is not None
    assert streams._hub.running_at(events_key, tail) is None
    await aredis.hset(turn_key, "status", "cancelled")
    before = command_calls(raw_redis, "hget")
    late = await streams.opening(location, tail)
    assert command_calls(raw_redis, "hget") - before == 1
    assert (late.status, late.finished) == ("cancelled", True)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)


async def test_the_first_readers_of_a_stream_share_their_opening_round_trip(
    aredis: Redis, raw_redis: redis.Redis
) -> None:
    """A crowd's first readers all arrive before the stream has a feed here: their openings
    at the same place share one round trip (not a Redis connection each)."""
    streams, keys, location = await _setup(aredis)
    before = command_calls(raw_redis, "hget")
    openings = await asyncio.gather(*(streams.opening(location, ORIGIN) for _ in range(10)))
    assert command_calls(raw_redis, "hget") - before == 1
    assert all(o == openings[0] and o.running for o in openings)
    assert streams._opening == {}  # nothing left behind
    # And so do their look-ups of the stream's turn, before the process remembers it.
    await aredis.set(keys.stream_index(location.stream_id), encode_turn_ref("c", "t"))
    before = command_calls(raw_redis, "get")
    found = await asyncio.gather(
        *(streams.locate(location.stream_id, None, check=False) for _ in range(10))
    )
    assert command_calls(raw_redis, "get") - before == 1
    assert found == [location] * 10
    assert streams._locating == {}
