"""The replay-to-live hand-over, driven batch by batch: overlaps are dropped, gaps are filled."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from broker import redis_calls as rc
from broker.connection import client, is_cluster_url
from broker.deps import Deps
from broker.fanout import QUEUE_LIMIT, TRIM_EVERY, Batch, Hub, _Feed
from broker.frames import CaughtUp, Chunk, Entry, Heartbeat
from broker.keys import Keys
from broker.metrics import Metrics
from broker.reader import Location, Streams
from broker.scripts import Scripts
from broker.settings import Settings

_n = itertools.count()


@pytest.fixture
def manual_feeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Feeds that never read Redis: the test hands batches to subscriptions itself."""

    async def idle(self: _Feed) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(_Feed, "run", idle)


async def setup(aredis: Redis) -> tuple[Streams, Hub, Keys, Location]:
    prefix = f"handover{os.getpid()}-{next(_n)}"
    keys = Keys(prefix)
    settings = Settings(
        redis_url="unix:///unused", key_prefix=prefix, json_page_size=3, sse_replay_page=3
    )
    metrics = Metrics()
    hub = Hub(aredis, metrics)
    location = Location("st_" + "0" * 32, "c", "t")
    await aredis.hset(keys.turn("c", "t"), mapping={"status": "streaming", "attempt": "1"})
    return Streams(Deps(aredis, Scripts(aredis), keys, settings, metrics), hub), hub, keys, location


async def add(aredis: Redis, key: str, kind: str, data: dict[str, object]) -> Entry:
    fields = {"e": kind, "d": orjson.dumps({"attempt": 1, **data}).decode()}
    stored: dict[FieldT, EncodableT] = {"e": fields["e"], "d": fields["d"]}
    entry_id = await aredis.xadd(key, stored)
    return Entry.from_redis(str(entry_id), fields)


async def take(follow: AsyncIterator[object], n: int) -> list[Entry]:
    out = []
    for _ in range(n):
        item = await asyncio.wait_for(anext(follow), 5)
        assert isinstance(item, Entry)
        out.append(item)
    return out


@pytest.mark.usefixtures("manual_feeds")
async def test_overlapping_batches_are_deduplicated_and_gaps_filled(aredis: Redis) -> None:
    streams, hub, keys, location = await setup(aredis)
    key = keys.events("c", "t")
    stored = [await add(aredis, key, "delta", {"text": str(i)}) for i in range(5)]
    follow = streams.follow(location, "0-0")
    assert [e.entry_id for e in await take(follow, 5)] == [e.entry_id for e in stored]
    # Live phase: the reader now waits on its subscription.
    wait = asyncio.ensure_future(anext(follow))
    await asyncio.sleep(0)
    (subscription,) = hub._feeds[key].subscriptions
    stored += [await add(aredis, key, "delta", {"text": str(i)}) for i in range(5, 9)]
    # A batch overlapping what replay delivered: only the new entry may come out.
    subscription.feed.publish(Batch(stored[2].entry_id, stored[3:6]))
    first_live = await asyncio.wait_for(wait, 5)
    assert isinstance(first_live, Entry)
    assert first_live.entry_id == stored[5].entry_id
    # A batch that starts past the reader's position: the gap is read from Redis first.
    subscription.feed.publish(Batch(stored[7].entry_id, stored[8:9]))
    assert [e.entry_id for e in await take(follow, 3)] == [e.entry_id for e in stored[6:9]]
    # The terminal event of a turn at rest ends the read.
    end = await add(aredis, key, "end", {"status": "complete", "reason": None})
    await aredis.hset(keys.turn("c", "t"), "status", "complete")
    subscription.feed.publish(Batch(stored[8].entry_id, [end]))
    assert (await take(follow, 1))[0].kind == "end"
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(follow), 5)
    assert key not in hub._feeds or not hub._feeds[key].subscriptions


@pytest.mark.usefixtures("manual_feeds")
async def test_a_reader_that_falls_off_the_tape_catches_up_from_redis(aredis: Redis) -> None:
    streams, hub, keys, location = await setup(aredis)
    key = keys.events("c", "t")
    first = await add(aredis, key, "attempt", {"strategy": "initial"})
    follow = streams.follow(location, "0-0")
    assert (await take(follow, 1))[0].entry_id == first.entry_id
    wait = asyncio.ensure_future(anext(follow))
    await asyncio.sleep(0)
    (subscription,) = hub._feeds[key].subscriptions
    later = [await add(aredis, key, "delta", {"text": str(i)}) for i in range(6)]
    for _ in range(2 * QUEUE_LIMIT):  # more batches than the feed keeps, all of them bogus
        subscription.feed.publish(Batch(first.entry_id, []))
    assert subscription.feed.base > subscription.index  # its place fell off the tape
    got = [await asyncio.wait_for(wait, 5), *await take(follow, 5)]
    assert [e.entry_id for e in got if isinstance(e, Entry)] == [e.entry_id for e in later]
    assert len(got) == len(later)
    await follow.aclose()


async def test_a_closed_hub_ends_live_reads_without_an_end_event(aredis: Redis) -> None:
    streams, hub, keys, location = await setup(aredis)
    key = keys.events("c", "t")
    await add(aredis, key, "attempt", {"strategy": "initial"})
    follow = streams.follow(location, "0-0")
    await take(follow, 1)
    wait = asyncio.ensure_future(anext(follow))
    await asyncio.sleep(0.05)
    await hub.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(wait, 5)


async def test_a_reader_arriving_as_the_last_one_leaves_gets_a_live_feed(
    aredis: Redis,
) -> None:
    # Regression: a new subscription could join a feed whose task was already cancelled,
    # and then receive nothing live.
    _streams, hub, keys, _location = await setup(aredis)
    key = keys.events("c", "t")
    first = hub.subscribe(key)
    await asyncio.sleep(0.05)  # the feed is running
    hub.unsubscribe(first)
    second = hub.subscribe(key)  # before the cancelled task has unwound
    assert second.feed is not first.feed
    await asyncio.sleep(0.05)
    entry = await add(aredis, key, "delta", {"text": "live"})
    batches = await second.get_all(5)
    assert batches is not None
    assert [e.entry_id for b in batches for e in b.entries] == [entry.entry_id]
    hub.unsubscribe(second)
    await hub.close()


async def test_events_between_replay_and_joining_the_feed_arrive_without_a_heartbeat(
    aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: a new feed started from the stream's tail when its task first ran, after the
    # reader's replay; events written in between surfaced only with a later event or at the
    # next heartbeat (15 s), and a turn that had just ended had no later event.
    streams, hub, keys, location = await setup(aredis)
    key = keys.events("c", "t")
    await add(aredis, key, "attempt", {"strategy": "initial"})
    written: list[Entry] = []

    async def finish_the_turn() -> None:
        written.extend(
            [
                await add(aredis, key, "delta", {"text": "x"}),
                await add(aredis, key, "end", {"status": "complete", "reason": None}),
            ]
        )
        await aredis.hset(keys.turn("c", "t"), "status", "complete")

    follow = streams.follow(location, "0-0")
    first = await asyncio.wait_for(anext(follow), 5)  # replay
    assert isinstance(first, Entry)
    await finish_the_turn()  # lands after the replay, before the reader joins the feed
    rest = await asyncio.wait_for(collect(follow), 5)  # heartbeats are 15 s apart
    assert [e.entry_id for e in rest if isinstance(e, Entry)] == [e.entry_id for e in written]
    await hub.close()


async def collect(follow: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in follow]


@pytest.mark.usefixtures("manual_feeds")
async def test_a_reader_behind_takes_every_waiting_batch_in_one_write(aredis: Redis) -> None:
    streams, hub, keys, location = await setup(aredis)
    key = keys.events("c", "t")
    first = await add(aredis, key, "attempt", {"strategy": "initial"})
    chunks = streams.follow_chunks(location, "0-0")
    replayed = await asyncio.wait_for(anext(chunks), 5)
    assert [e.entry_id for e in replayed.entries] == [first.entry_id]  # type: ignore[union-attr]
    wait = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0)
    (subscription,) = hub._feeds[key].subscriptions
    later = [await add(aredis, key, "delta", {"text": str(i)}) for i in range(6)]
    # Three batches arrive before the reader runs again: one chunk, one write, in order.
    subscription.feed.publish(Batch(first.entry_id, later[0:2]))
    subscription.feed.publish(Batch(later[1].entry_id, later[2:5]))
    subscription.feed.publish(Batch(later[4].entry_id, later[5:6]))
    chunk = await asyncio.wait_for(wait, 5)
    assert isinstance(chunk, Chunk)
    assert [e.entry_id for e in chunk.entries] == [e.entry_id for e in later]
    assert chunk.data == b"".join(e.frame for e in later)
    await chunks.aclose()


@dataclasses.dataclass
class Live:
    """A reader past its replay of one ``attempt`` event (``first``), waiting on the feed,
    whose response takes direct writes (into ``written``) while ``accept`` says so."""

    streams: Streams
    hub: Hub
    keys: Keys
    key: str
    first: Entry
    chunks: AsyncGenerator[Chunk | Heartbeat | CaughtUp, None]
    wait: asyncio.Future[Any]  # the reader's next chunk
    subscription: Any
    written: list[bytes] = dataclasses.field(default_factory=list)
    accept: bool = True
    over: bool = False  # the response's side of the Sink

    def write_now(self, chunk: bytes) -> bool:
        if self.accept:
            self.written.append(chunk)
        return self.accept

    @property
    def feed(self) -> _Feed:
        feed: _Feed = self.subscription.feed
        return feed


async def live_reader(aredis: Redis) -> Live:
    streams, hub, keys, location = await setup(aredis)
    key = keys.events("c", "t")
    first = await add(aredis, key, "attempt", {"strategy": "initial"})
    live: Live | None = None

    class Response:
        """The reader's response, as the feed sees it: the Live below, once there."""

        @property
        def over(self) -> bool:
            return live is not None and live.over

        def write_now(self, chunk: bytes) -> bool:
            assert live is not None
            return live.write_now(chunk)

    chunks = streams.follow_chunks(location, "0-0", Response())
    await asyncio.wait_for(anext(chunks), 5)  # the replay
    wait = asyncio.ensure_future(anext(chunks))
    live = Live(streams, hub, keys, key, first, chunks, wait, await parked(hub, key))
    return live


async def parked(hub: Hub, key: str) -> Any:
    """The feed's one subscription, once its reader waits on it (past replay and catch-up)."""
    async with asyncio.timeout(5):
        while True:
            feed = hub._feeds.get(key)
            if feed is not None and feed.parked:
                (subscription,) = feed.parked
                return subscription
            await asyncio.sleep(0.001)


@pytest.mark.usefixtures("manual_feeds")
async def test_the_feed_writes_to_a_waiting_reader_that_stands_right_before_a_batch(
    aredis: Redis,
) -> None:
    live = await live_reader(aredis)
    later = [await add(aredis, live.key, "delta", {"text": str(i)}) for i in range(3)]
    feed = live.feed
    feed.publish(Batch(live.first.entry_id, later[0:2]))
    feed.publish(Batch(later[1].entry_id, later[2:3]))
    # Written by the feed itself, one write per batch; the reader still waits, at the new place.
    assert live.written == [b"".join(e.frame for e in later[0:2]), later[2].frame]
    await asyncio.sleep(0.05)
    assert not live.wait.done()
    assert live.subscription.position == later[2].sort_key
    assert feed.tape == []  # its only reader took both: the feed keeps nothing
    # A response that cannot take a write now: the reader is woken and writes it itself.
    live.accept = False
    more = await add(aredis, live.key, "delta", {"text": "3"})
    feed.publish(Batch(later[2].entry_id, [more]))
    chunk = await asyncio.wait_for(live.wait, 5)
    assert [e.entry_id for e in chunk.entries] == [more.entry_id]
    # An `end` is never written by the feed: the reader decides whether its read is over.
    live.accept = True
    wait = asyncio.ensure_future(anext(live.chunks))
    await parked(live.hub, live.key)
    end = await add(aredis, live.key, "end", {"status": "complete", "reason": None})
    await aredis.hset(live.keys.turn("c", "t"), "status", "complete")
    feed.publish(Batch(more.entry_id, [end], rest=("complete", "1")))
    chunk = await asyncio.wait_for(wait, 5)
    assert [e.kind for e in chunk.entries] == ["end"]
    assert len(live.written) == 2
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(live.chunks), 5)


@pytest.mark.usefixtures("manual_feeds")
async def test_a_reader_not_right_before_a_batch_is_woken_instead_of_written_to(
    aredis: Redis,
) -> None:
    live = await live_reader(aredis)
    later = [await add(aredis, live.key, "delta", {"text": str(i)}) for i in range(3)]
    # The batch begins past the reader's place: the gap must come from Redis first.
    live.feed.publish(Batch(later[0].entry_id, later[1:3]))
    chunk = await asyncio.wait_for(live.wait, 5)
    assert live.written == []
    assert [e.entry_id for e in chunk.entries] == [e.entry_id for e in later]


async def test_a_feed_that_fails_ends_its_reads(
    aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    streams, hub, keys, location = await setup(aredis)
    key = keys.events("c", "t")
    await add(aredis, key, "attempt", {"strategy": "initial"})

    async def broken(*args: object, **kwargs: object) -> object:
        raise KeyError("an unexpected reply")

    monkeypatch.setattr("broker.redis_calls.xread", broken)
    follow = streams.follow(location, "0-0")
    await take(follow, 1)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(follow), 5)  # ended, not left waiting
    await hub.close()


@pytest.mark.parametrize("protocol", [2, 3])
async def test_stream_reads_accept_both_reply_shapes(
    aredis: Redis, redis_url: str, protocol: int
) -> None:
    # The broker's clients answer stream reads as Redis sends them (a flat field list); a client
    # with redis-py's own parsing answers dicts. Events come out the same from both.
    _streams, _hub, keys, _location = await setup(aredis)
    key = keys.events("c", "t")
    await aredis.xadd(key, {"e": "delta", "d": '{"text": "a"}'})
    await aredis.xadd(key, {"d": '{"text": "b"}', "e": "delta", "x": "1"})  # unusual order
    if is_cluster_url(redis_url):  # which takes no options: its client speaks its default
        if protocol != 2:
            pytest.skip("a cluster URL sets no protocol: the [2] case reads with its default")
        broker_client = client(redis_url)
    else:
        broker_client = client(f"{redis_url}{'&' if '?' in redis_url else '?'}protocol={protocol}")
    try:
        raw = await rc.xrange_raw(broker_client, key, "-")
        parsed = await rc.xrange_raw(aredis, key, "-")
        assert isinstance(raw[0][1], list)
        assert isinstance(parsed[0][1], dict)
        from_raw = [Entry.from_redis(i, f) for i, f in raw]
        assert from_raw == [Entry.from_redis(i, f) for i, f in parsed]
        assert [(e.kind, e.data) for e in from_raw] == [
            ("delta", '{"text": "a"}'),
            ("delta", '{"text": "b"}'),
        ]
        assert await rc.xrange(broker_client, key, "-") == await rc.xrange(aredis, key, "-")
        fed = await rc.xread(broker_client, key, "0-0", 10, 10)
        assert [Entry.from_redis(i, f) for i, f in fed] == from_raw
    finally:
        await broker_client.aclose()


@pytest.mark.usefixtures("manual_feeds")
async def test_the_tape_keeps_what_the_slowest_reader_has_not_taken(aredis: Redis) -> None:
    live = await live_reader(aredis)
    feed, hub = live.feed, live.hub
    slow = hub.subscribe(live.key)  # joined, never takes anything: pins the tape
    entries = [await add(aredis, live.key, "delta", {"text": str(i)}) for i in range(TRIM_EVERY)]
    after = live.first.entry_id
    for entry in entries:
        feed.publish(Batch(after, [entry]))
        after = entry.entry_id
    assert len(live.written) == TRIM_EVERY  # the fast reader got every batch directly
    assert feed.end - feed.base == len(feed.tape) == TRIM_EVERY  # all kept for the slow one
    hub.unsubscribe(slow)
    more = await add(aredis, live.key, "delta", {"text": "x"})
    feed.publish(Batch(after, [more]))
    assert feed.tape == []  # the one reader left has everything
    await hub.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(live.wait, 5)  # a closed hub ends the read


@pytest.mark.usefixtures("manual_feeds")
async def test_a_response_that_fails_a_direct_write_leaves_the_others_alone(
    aredis: Redis,
) -> None:
    live = await live_reader(aredis)

    class Broken:
        over = False

        def write_now(self, chunk: bytes) -> bool:
            raise RuntimeError("a broken response")

    live.subscription.sink = Broken()
    entry = await add(aredis, live.key, "delta", {"text": "a"})
    live.feed.publish(Batch(live.first.entry_id, [entry]))
    # The failing response's reader is woken and writes the batch itself; the feed goes on.
    chunk = await asyncio.wait_for(live.wait, 5)
    assert [e.entry_id for e in chunk.entries] == [entry.entry_id]
    assert live.feed.task is not None
    assert not live.feed.task.done()


@pytest.mark.usefixtures("manual_feeds")
async def test_a_closed_hub_ends_reads_the_feed_writes_to(aredis: Redis) -> None:
    live = await live_reader(aredis)
    entry = await add(aredis, live.key, "delta", {"text": "a"})
    live.feed.publish(Batch(live.first.entry_id, [entry]))
    assert live.written == [entry.frame]
    await live.hub.close()  # shutdown: the reader, still waiting, ends; its client resumes
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(live.wait, 5)
