"""Durable Streams forks, read by reference: a fork records its source, its fork point and its
chain, and reads what it inherits from its sources' streams; the sources stay (pinned) while
forks read them, through deletion and expiry, and go with their last fork. Against a real
Redis, through the service and its scripts called one by one (see test_durable_store.py)."""

from __future__ import annotations

from typing import cast

from redis.asyncio import Redis

from broker.durable_store import Appended, CreateRequest, DurableStore, ForkRequest
from broker.durable_store.keys import ds_digest
from broker.durable_store.protocol import offset_of
from broker.durable_store.replies import CreateReply, Removed, SourceMissing, StreamMade
from broker.durable_store.scripts import Fork
from broker.frames import ORIGIN
from tests.test_durable_store import TEXT, _append, _refusal, _store, _texts, store

__all__ = ["store"]  # the fixture


def _fork(source: str, offset: str | None = None, sub: int = 0) -> CreateRequest:
    return CreateRequest(fork=ForkRequest(source, offset, sub))


async def _stream_keys(aredis: Redis, store: DurableStore, path: str) -> list[str]:
    """Which of the stream's own keys are in Redis."""
    keys = store._keys("t", path)
    return [key.rsplit(":", 1)[1] for key in keys.with_forks if await aredis.exists(key)]


async def _refs(aredis: Redis, store: DurableStore) -> dict[str, str]:
    return cast(dict[str, str], await aredis.hgetall(store._space.refs("t")))


async def test_a_fork_reads_across_its_fork_point_and_copies_nothing(
    store: DurableStore, aredis: Redis
) -> None:
    await store.create("t", "src", TEXT, b"a")
    at = await store.append("t", "src", _append(b"b"))
    await store.append("t", "src", _append(b"c"))
    assert isinstance(at, Appended)
    await store.create("t", "f", _fork("src", offset_of(at.tail)), b"x")
    await store.append("t", "src", _append(b"d"))
    await store.append("t", "f", _append(b"y"))
    assert await _texts(store, "f") == ["a", "b", "x", "y"]
    assert await _texts(store, "src") == ["a", "b", "c", "d"]
    # Its own data holds its own appends only; its offsets go on from the fork point.
    assert await aredis.xlen(store._keys("t", "f").data) == 2
    first = (await store.read("t", "f", ORIGIN)).items[0][0]
    assert [p for _, p in (await store.read("t", "f", first)).items] == [b"b", b"x", b"y"]
    places = [place.key for place, _ in (await store.read("t", "f", ORIGIN)).items]
    assert places == sorted(places)
    assert places[1] == at.tail.key


async def test_a_read_of_a_fork_pages_across_its_fork_point(aredis: Redis) -> None:
    store, hub = await _store(aredis, ds_max_read_bytes=1_024)
    try:
        await store.create("t", "src", TEXT, b"s" * 600)
        await store.append("t", "src", _append(b"t" * 600))
        await store.create("t", "f", _fork("src"), b"u" * 600)
        pages, after = [], ORIGIN
        while True:
            read = await store.read("t", "f", after)
            pages.append([payload[:1] for _, payload in read.items])
            after = read.after
            if read.up_to_date:
                break
        assert pages == [[b"s"], [b"t"], [b"u"]]
    finally:
        await hub.close()


async def test_a_fork_of_a_fork_reads_through_its_chain(store: DurableStore) -> None:
    await store.create("t", "src", TEXT, b"a")
    at_b = await store.append("t", "src", _append(b"b"))
    await store.append("t", "src", _append(b"c"))
    assert isinstance(at_b, Appended)
    await store.create("t", "f1", _fork("src", offset_of(at_b.tail)), b"x")
    await store.create("t", "f2", _fork("f1"), b"y")
    assert await _texts(store, "f2") == ["a", "b", "x", "y"]
    at_a = (await store.read("t", "f1", ORIGIN)).items[0][0]
    # Forked inside what f1 inherits: f1's own appends are not its; a sub-offset of an
    # inherited append.
    await store.create("t", "f3", _fork("f1", offset_of(at_a), 1))
    assert await _texts(store, "f3") == ["a", "b"]
    await store.append("t", "f1", _append(b"z"))
    assert await _texts(store, "f2") == ["a", "b", "x", "y"]
    assert (await store.meta("t", "f2")).chain[1:] == ((ds_digest("src"), at_b.tail.entry_id),)


async def test_a_chain_of_forks_is_bounded(store: DurableStore) -> None:
    await store.create("t", "s0", TEXT, b"a")
    for depth in range(1, 17):
        await store.create("t", f"s{depth}", _fork(f"s{depth - 1}"))
    refused = await _refusal(store.create("t", "s17", _fork("s16")))
    assert (refused.status, refused.code) == (400, "bad_fork")
    assert await _texts(store, "s16") == ["a"]


async def test_a_source_deleted_is_read_by_its_forks_and_goes_with_the_last(
    store: DurableStore, aredis: Redis
) -> None:
    await store.create("t", "src", TEXT, b"a")
    await store.append("t", "src", _append(b"b"))
    await store.create("t", "f1", _fork("src"))
    await store.create("t", "f2", _fork("f1"), b"c")
    await store.delete("t", "src")
    await store.delete("t", "f1")  # f2 reads through it: kept, deleted
    assert (await _refusal(store.read("t", "f1", ORIGIN))).status == 410
    assert await _texts(store, "f2") == ["a", "b", "c"]
    assert await _stream_keys(aredis, store, "src") == ["meta", "data", "forks"]
    sizes = store._keys("t", "src").sizes
    assert await aredis.hexists(sizes, ds_digest("src"))  # still charged
    await store.delete("t", "f2")
    for path in ("src", "f1", "f2"):
        assert await _stream_keys(aredis, store, path) == []
        assert not await aredis.hexists(sizes, ds_digest(path))
    assert await _refs(aredis, store) == {}
    assert (await _refusal(store.meta("t", "src"))).status == 404


async def test_a_source_that_expires_is_kept_for_its_forks_then_goes_with_them(
    store: DurableStore, aredis: Redis
) -> None:
    await store.create("t", "src", CreateRequest(content_type="text/plain", ttl_s=600), b"a")
    await store.create("t", "f", CreateRequest(fork=ForkRequest("src"), ttl_s=900))
    keys = store._keys("t", "src")
    # Pinned: its data and forks set have no expiry, its metadata keeps its own.
    assert [await aredis.pttl(k) for k in (keys.data, keys.forks)] == [-1, -1]
    assert await aredis.pttl(keys.meta) > 0
    assert await aredis.zscore(keys.streams, keys.member) == float("inf")
    await store.read("t", "src", ORIGIN)  # a read starts its TTL again: its data stays pinned
    assert await aredis.pttl(keys.data) == -1
    await aredis.delete(keys.meta)  # as its expiry does
    assert (await _refusal(store.read("t", "src", ORIGIN))).status == 404
    assert await _texts(store, "f") == ["a"]
    again = await _refusal(store.create("t", "src", TEXT))  # the path is its forks' still
    assert (again.status, again.code) == (409, "stream_exists")
    await store.delete("t", "f")
    assert await _stream_keys(aredis, store, "src") == []
    assert await aredis.zscore(keys.streams, keys.member) is None
    assert (await store.create("t", "src", TEXT)).created


async def test_a_live_source_whose_last_fork_goes_takes_its_expiry_back(
    store: DurableStore, aredis: Redis
) -> None:
    await store.create("t", "src", CreateRequest(content_type="text/plain", ttl_s=600), b"a")
    await store.create("t", "f", _fork("src"))
    await store.delete("t", "f")
    keys = store._keys("t", "src")
    assert 0 < await aredis.pttl(keys.data) <= 600_000
    assert 0 < (await aredis.zscore(keys.streams, keys.member) or 0) < float("inf")
    assert await aredis.hget(keys.meta, "pin") is None
    assert await _texts(store, "src") == ["a"]


async def test_a_fork_that_expires_gives_its_reference_back_on_the_tenants_next_write(
    store: DurableStore, aredis: Redis
) -> None:
    await store.create("t", "src", TEXT, b"a")
    await store.create("t", "f", CreateRequest(fork=ForkRequest("src"), ttl_s=600))
    await store.delete("t", "src")  # soft: f reads it
    fork = store._keys("t", "f")
    # As its expiry does, and its score a few seconds past.
    await aredis.delete(fork.meta, fork.data)
    await aredis.zadd(fork.streams, {fork.member: 1_000})
    assert await _stream_keys(aredis, store, "src") == ["meta", "data", "forks"]
    await store.create("t", "other", TEXT)  # any write of the tenant prunes what expired
    assert await _stream_keys(aredis, store, "src") == []
    assert await _refs(aredis, store) == {}
    assert await aredis.hkeys(fork.sizes) == [ds_digest("other")]


async def _ds_create_fork(store: DurableStore, path: str, fork: Fork) -> CreateReply:
    """ds_create of a fork, called as the service calls it once its plan is made."""
    return await store._scripts.create(
        store._keys("t", path),
        store._keys("t", fork.source),
        content_type="text/plain",
        ttl_s=None,
        expires_ms=None,
        expires_at=None,
        closed=False,
        body=b"",
        incarnation="i",
        raw_content_type="text/plain",
        quota=store.quota,
        fork=fork,
    )


async def test_each_step_of_a_fork_is_one_script_and_leaves_no_reference_behind(
    store: DurableStore, aredis: Redis
) -> None:
    """A fork's making, its reference and its source's pin are one ds_create call; its deletion
    and the giving back of its reference one ds_delete call: no moment between them. A fork
    planned on a source that goes before its script runs is refused whole."""
    await store.create("t", "src", TEXT, b"a")
    plan = await store._fork(store._keys("t", "f"), ForkRequest("src"))
    await store.delete("t", "src")  # between the plan and the script
    made = await _ds_create_fork(store, "f", plan.signature)
    assert isinstance(made, SourceMissing)
    assert await _stream_keys(aredis, store, "f") == []
    assert await _refs(aredis, store) == {}
    # Made: the fork, its reference and the pin, in the one call.
    await store.create("t", "src", TEXT, b"a")
    plan = await store._fork(store._keys("t", "f"), ForkRequest("src"))
    made = await _ds_create_fork(store, "f", plan.signature)
    assert isinstance(made, StreamMade)
    assert made.created
    source = store._keys("t", "src")
    assert await aredis.smembers(source.forks) == {"f"}
    assert await _refs(aredis, store) == {ds_digest("f"): f"{ds_digest('src')} f"}
    assert await aredis.hget(source.meta, "pin") == "1"
    # Deleted: the fork and its reference, and its deleted source with it, in the one call.
    await store.delete("t", "src")
    assert isinstance(await store._scripts.delete(store._keys("t", "f")), Removed)
    assert await _stream_keys(aredis, store, "f") == []
    assert await _stream_keys(aredis, store, "src") == []
    assert await _refs(aredis, store) == {}


async def test_a_fork_made_by_copy_before_still_gives_its_reference_back(
    store: DurableStore, aredis: Redis
) -> None:
    """A fork made before forks read by reference holds a copy, and its reference is in its
    source's forks set only: its deletion gives it back in a second script (ds_fork_ref)."""
    await store.create("t", "src", TEXT, b"a")
    await store.create("t", "old", TEXT, b"a")  # as a copy was made
    await aredis.hset(store._keys("t", "old").meta, mapping={"ff": "src", "fo": "0-0"})
    await aredis.sadd(store._keys("t", "src").forks, "old")
    await store.delete("t", "src")
    assert (await _refusal(store.meta("t", "src"))).status == 410
    assert await _texts(store, "old") == ["a"]
    await store.delete("t", "old")
    assert await _stream_keys(aredis, store, "src") == []
    assert (await _refusal(store.meta("t", "src"))).status == 404
