"""A read's opening round trip, shared by the reads that open together (``reader._Shared``).

A crowd that joins a live answer opens many reads in each turn of the event loop; they ask
Redis the same thing. A read that is not sent yet is joined by the others that ask for the same;
one that was sent is not (its answer may be older than the joiner's question).
"""

from __future__ import annotations

import asyncio
import itertools
import os

import orjson
import pytest
import redis
from redis.asyncio import Redis

from broker.deps import Deps
from broker.fanout import Hub
from broker.frames import ORIGIN, Chunk
from broker.keys import Keys
from broker.metrics import Metrics
from broker.reader import Location, Streams, _Shared
from broker.scripts import Scripts
from broker.settings import Settings
from tests.conftest import command_calls

_n = itertools.count()


class Gated:
    """A read that counts its calls and answers once its gate opens."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def __call__(self) -> int:
        self.calls += 1
        self.entered.set()
        answer = self.calls
        await self.gate.wait()
        return answer


async def test_reads_asked_together_share_one_read() -> None:
    shared, read, other = _Shared(), Gated(), Gated()
    together = [asyncio.ensure_future(shared.read("a", read)) for _ in range(5)]
    apart = asyncio.ensure_future(shared.read("b", other))
    await asyncio.sleep(0.01)
    read.gate.set()
    other.gate.set()
    assert await asyncio.wait_for(asyncio.gather(*together), 5) == [1] * 5
    assert await asyncio.wait_for(apart, 5) == 1
    assert (read.calls, other.calls) == (1, 1)


async def test_a_read_asked_once_the_first_was_sent_is_its_own() -> None:
    shared, read = _Shared(), Gated()
    first = asyncio.ensure_future(shared.read("a", read))
    await asyncio.wait_for(read.entered.wait(), 5)  # the first read is under way
    second = asyncio.ensure_future(shared.read("a", read))
    await asyncio.sleep(0.01)
    assert read.calls == 2
    read.gate.set()
    assert list(await asyncio.wait_for(asyncio.gather(first, second), 5)) == [1, 2]


async def test_a_joiner_that_is_cancelled_cancels_nobody_else() -> None:
    shared, read = _Shared(), Gated()
    asked = [asyncio.ensure_future(shared.read("a", read)) for _ in range(3)]
    await asyncio.sleep(0.01)
    asked[0].cancel()
    await asyncio.sleep(0.01)
    read.gate.set()
    assert await asyncio.wait_for(asyncio.gather(*asked[1:]), 5) == [1, 1]
    assert asked[0].cancelled()
    assert read.calls == 1


async def test_an_error_reaches_every_joiner() -> None:
    shared = _Shared()

    async def failing() -> int:
        await asyncio.sleep(0)
        raise redis.ConnectionError("gone")

    asked = [asyncio.ensure_future(shared.read("a", failing)) for _ in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*asked, return_exceptions=True), 5)
    assert [type(r) for r in results] == [redis.ConnectionError] * 3
    # The next read asks again.
    read = Gated()
    read.gate.set()
    assert await asyncio.wait_for(shared.read("a", read), 5) == 1


@pytest.mark.parametrize("cached", [False, True], ids=["first-page-unread", "first-page-kept"])
async def test_reads_that_open_together_ask_redis_once_or_not_at_all(
    aredis: Redis, raw_redis: redis.Redis, cached: bool
) -> None:
    streams, keys, location = await _setup(aredis)
    for i in range(64 if cached else 3):
        await aredis.xadd(keys.events("c", "t"), {"e": "delta", "d": _data(text=str(i))})
    if cached:  # a reader replayed the first page, full: it is kept for the next ones
        await streams._page(keys.events("c", "t"), ORIGIN, "+", 64, shared=True)
    before = {name: command_calls(raw_redis, name) for name in ("hget", "xrange")}
    openings = await asyncio.wait_for(
        asyncio.gather(*(streams.opening(location, ORIGIN) for _ in range(50))), 10
    )
    calls = {name: command_calls(raw_redis, name) - before[name] for name in before}
    assert all(o.stored_past and o.open and not o.finished for o in openings)
    if cached:  # events are stored past the start: the status is not needed (Opening.open)
        assert calls == {"hget": 0, "xrange": 0}
        return
    assert {o.status for o in openings} == {"streaming"}
    assert calls == {"hget": 1, "xrange": 1}
    # Once that was answered, the next read asks again: it may be newer.
    await aredis.hset(keys.turn("c", "t"), "status", "complete")
    assert (await streams.opening(location, ORIGIN)).status == "complete"


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
    await streams._page(events_key, ORIGIN, "+", 64, shared=True)  # kept, as a crowd's
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
