"""The Durable Streams service's domain rules, against a real Redis: each call returns its
typed result or raises its refusal, with no HTTP in between (the routes and the official suite
are judged in test_durable_streams.py)."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.durable_store import (
    Appended,
    AppendRequest,
    ClosedAgain,
    CreateRequest,
    Duplicate,
    DurableStore,
    ForkRequest,
    service,
)
from broker.durable_store.protocol import offset_of
from broker.errors import BadRequest, BrokerError
from broker.fanout import Hub
from broker.frames import ORIGIN
from broker.keys import Keys
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings

TEXT = CreateRequest(content_type="text/plain")
JSON = CreateRequest(content_type="application/json")
_prefixes = itertools.count()


async def _store(aredis: Redis, **settings: Any) -> tuple[DurableStore, Hub]:
    prefix = f"dsstore{os.getpid()}-{next(_prefixes)}"
    metrics = Metrics()
    deps = Deps(
        aredis,
        Scripts(aredis),
        Keys(prefix),
        Settings(redis_url="unix:///unused", key_prefix=prefix, **settings),
        metrics,
    )
    hub = Hub(aredis, metrics)
    return DurableStore(deps, hub), hub


@pytest.fixture
async def store(aredis: Redis) -> AsyncIterator[DurableStore]:
    made, hub = await _store(aredis)
    yield made
    await hub.close()


def _append(body: bytes = b"", **fields: Any) -> AppendRequest:
    return AppendRequest(content_type=fields.pop("content_type", "text/plain"), body=body, **fields)


async def _refusal(call: Any) -> BrokerError:
    with pytest.raises(BrokerError) as caught:
        await call
    return caught.value


async def _texts(store: DurableStore, path: str, tenant: str | None = "t") -> list[str]:
    read = await store.read(tenant, path, ORIGIN)
    return [payload.decode() for _, payload in read.items]


BINARY = bytes(range(256)) * 4  # every byte value, none of them text


async def test_a_payload_is_kept_as_its_bytes_and_read_back_whole(
    store: DurableStore, aredis: Redis
) -> None:
    octets = CreateRequest(content_type="application/octet-stream")
    made = await store.create("t", "bin", octets, BINARY[:300])
    await store.append("t", "bin", _append(BINARY, content_type="application/octet-stream"))
    read = await store.read("t", "bin", ORIGIN)
    assert [payload for _, payload in read.items] == [BINARY[:300], BINARY]
    assert made.tail == read.items[0][0]
    # In Redis, each payload is its bytes (field b), not a text spelling of them.
    raw = await rc.xrange_bytes(aredis, store._keys("t", "bin").data, "-", "+", 10)
    assert [fields[2:] for _, fields in raw] == [[b"b", BINARY[:300]], [b"b", BINARY]]


async def test_a_stream_written_with_payloads_as_text_is_read_as_its_bytes(
    store: DurableStore, aredis: Redis
) -> None:
    """Streams written before payloads were bytes kept each as the text whose code points are
    its bytes (Latin-1), field d: they read back as the same bytes, and take appends."""
    octets = CreateRequest(content_type="application/octet-stream")
    await store.create("t", "old", octets)
    data = store._keys("t", "old").data
    await aredis.xadd(data, {"e": "m", "d": BINARY.decode("latin-1")})
    await store.append("t", "old", _append(BINARY[:10], content_type="application/octet-stream"))
    read = await store.read("t", "old", ORIGIN)
    assert [payload for _, payload in read.items] == [BINARY, BINARY[:10]]


async def test_a_wait_wakes_on_a_binary_append(store: DurableStore) -> None:
    octets = CreateRequest(content_type="application/octet-stream")
    made = await store.create("t", "bin", octets)
    waiting = asyncio.ensure_future(store.wait("t", "bin", made.tail, 30))
    await store.append("t", "bin", _append(BINARY, content_type="application/octet-stream"))
    await asyncio.wait_for(waiting, 10)
    read = await store.read("t", "bin", made.tail)
    assert [payload for _, payload in read.items] == [BINARY]


async def test_a_put_of_the_same_stream_finds_it_and_another_configuration_is_a_409(
    store: DurableStore,
) -> None:
    made = await store.create("t", "s", TEXT, b"hi")
    again = await store.create("t", "s", TEXT)
    assert (made.created, again.created) == (True, False)
    assert again.tail == made.tail != ORIGIN
    refused = await _refusal(store.create("t", "s", CreateRequest(content_type="text/html")))
    assert (refused.status, refused.code) == (409, "stream_exists")
    assert "content_type" in refused.message
    assert await _texts(store, "s") == ["hi"]  # the data is never touched by a PUT again


async def test_tenants_never_meet_on_a_path(store: DurableStore) -> None:
    await store.create("a", "s", TEXT, b"a's")
    assert (await _refusal(store.read("b", "s", ORIGIN))).status == 404
    assert (await _refusal(store.read(None, "s", ORIGIN))).status == 404
    await store.create("b", "s", TEXT, b"b's")
    assert await _texts(store, "s", "a") == ["a's"]
    assert await _texts(store, "s", "b") == ["b's"]


async def test_an_idempotent_producer_is_answered_not_written_twice(store: DurableStore) -> None:
    await store.create("t", "s", TEXT)
    first = await store.append("t", "s", _append(b"a", producer=("p", 0, 0)))
    again = await store.append("t", "s", _append(b"a", producer=("p", 0, 0)))
    assert isinstance(first, Appended)
    assert again == Duplicate(first.tail, 0, False)
    assert await _texts(store, "s") == ["a"]
    gap = await _refusal(store.append("t", "s", _append(b"c", producer=("p", 0, 2))))
    assert (gap.status, gap.code) == (409, "sequence_gap")
    assert gap.headers == {"Producer-Expected-Seq": "1", "Producer-Received-Seq": "2"}
    not_zero = await _refusal(store.append("t", "s", _append(b"c", producer=("p", 1, 1))))
    assert (not_zero.status, not_zero.code) == (400, "bad_producer")
    assert isinstance(await store.append("t", "s", _append(b"n", producer=("p", 1, 0))), Appended)
    fenced = await _refusal(store.append("t", "s", _append(b"z", producer=("p", 0, 1))))
    assert (fenced.status, fenced.code, fenced.headers) == (
        403,
        "stale_epoch",
        {"Producer-Epoch": "1"},
    )
    assert await _texts(store, "s") == ["a", "n"]


async def test_stream_seq_must_sort_after_the_last(store: DurableStore) -> None:
    await store.create("t", "s", TEXT)
    await store.append("t", "s", _append(b"1", stream_seq="b"))
    behind = await _refusal(store.append("t", "s", _append(b"2", stream_seq="a")))
    assert (behind.status, behind.code) == (409, "sequence_conflict")
    await store.append("t", "s", _append(b"3", stream_seq="ba"))
    assert await _texts(store, "s") == ["1", "3"]


async def test_a_closed_stream_refuses_appends_and_a_second_close_is_idempotent(
    store: DurableStore,
) -> None:
    await store.create("t", "s", TEXT, b"x")
    closed = await store.append("t", "s", AppendRequest(close=True))
    assert isinstance(closed, Appended)
    assert closed.closed
    refused = await _refusal(store.append("t", "s", _append(b"y")))
    assert (refused.status, refused.code) == (409, "stream_closed")
    assert refused.headers["Stream-Closed"] == "true"
    assert await store.append("t", "s", AppendRequest(close=True)) == ClosedAgain(closed.tail)
    read = await store.read("t", "s", ORIGIN)
    assert (read.closed, read.up_to_date, read.after) == (True, True, closed.tail)


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (AppendRequest(), "empty_append"),
        (AppendRequest(body=b"x"), "no_type"),
        (AppendRequest(content_type="application/json", body=b"[]"), "empty_append"),
    ],
)
async def test_an_append_without_anything_to_append_is_a_400(
    store: DurableStore, request_: AppendRequest, code: str
) -> None:
    await store.create("t", "s", JSON)
    refused = await _refusal(store.append("t", "s", request_))
    assert (refused.status, refused.code) == (400, code)


async def test_what_the_stream_refuses_comes_before_a_body_that_is_not_json(
    store: DurableStore,
) -> None:
    bad = AppendRequest(content_type="application/json", body=b"{")
    assert (await _refusal(store.append("t", "nowhere", bad))).status == 404
    await store.create("t", "s", JSON)
    assert (await _refusal(store.append("t", "s", bad))).code == "bad_json"
    await store.append("t", "s", AppendRequest(close=True))
    assert (await _refusal(store.append("t", "s", bad))).code == "stream_closed"


async def test_a_content_type_other_than_the_streams_is_a_409(store: DurableStore) -> None:
    await store.create("t", "s", JSON)
    refused = await _refusal(store.append("t", "s", _append(b"x")))
    assert (refused.status, refused.code) == (409, "type_mismatch")
    kept = await store.append("t", "s", _append(b'[1, {"a": 2}]', content_type="application/json"))
    assert isinstance(kept, Appended)
    assert await _texts(store, "s") == ['1,{"a":2}']


async def test_a_fork_keeps_its_sources_appends_up_to_its_point_and_a_sub_offset(
    store: DurableStore,
) -> None:
    await store.create("t", "src", TEXT, b"one")
    second = await store.append("t", "src", _append(b"two"))
    await store.append("t", "src", _append(b"three"))
    point = CreateRequest(fork=ForkRequest("src", "0000000000000000_0000000000000000", 0))
    assert (await store.create("t", "empty", point)).tail == ORIGIN
    at = offset_of((await store.read("t", "src", ORIGIN)).items[0][0])
    cut = await store.create("t", "cut", CreateRequest(fork=ForkRequest("src", at, 2)))
    assert cut.content_type == "text/plain"  # its source's
    assert await _texts(store, "cut") == ["one", "tw"]
    whole = await store.create("t", "whole", CreateRequest(fork=ForkRequest("src")))
    assert await _texts(store, "whole") == ["one", "two", "three"]
    assert isinstance(second, Appended)
    assert whole.tail.key > second.tail.key


@pytest.mark.parametrize(
    ("fork", "status", "code"),
    [
        (ForkRequest("s"), 400, "bad_fork"),  # itself
        (ForkRequest("nowhere"), 404, "not_found"),
        (ForkRequest("src", "9999999999999999_0000000000000000"), 400, "bad_fork"),
        (ForkRequest("src", "bad"), 400, "bad_offset"),
        (ForkRequest("src", "0000000000000000_0000000000000000", 1), 400, "bad_fork"),
    ],
)
async def test_a_fork_that_cannot_be_made_is_refused(
    store: DurableStore, fork: ForkRequest, status: int, code: str
) -> None:
    await store.create("t", "src", TEXT)
    refused = await _refusal(store.create("t", "s", CreateRequest(fork=fork)))
    assert (refused.status, refused.code) == (status, code)


async def test_a_source_deleted_under_its_forks_stays_marked_until_its_last_fork_goes(
    store: DurableStore,
) -> None:
    await store.create("t", "src", TEXT, b"a")
    await store.create("t", "f1", CreateRequest(fork=ForkRequest("src")))
    await store.create("t", "f2", CreateRequest(fork=ForkRequest("src")))
    await store.delete("t", "src")
    for call in (store.read("t", "src", ORIGIN), store.meta("t", "src"), store.delete("t", "src")):
        refused = await _refusal(call)
        assert (refused.status, refused.code) == (410, "deleted")
    forked = await _refusal(store.create("t", "f3", CreateRequest(fork=ForkRequest("src"))))
    assert (forked.status, forked.code) == (409, "source_deleted")
    again = await _refusal(store.create("t", "src", TEXT))
    assert (again.status, again.code) == (409, "stream_exists")
    await store.delete("t", "f1")
    assert (await _refusal(store.meta("t", "src"))).status == 410
    assert await _texts(store, "f2") == ["a"]
    await store.delete("t", "f2")
    assert (await _refusal(store.meta("t", "src"))).status == 404
    assert (await store.create("t", "src", TEXT)).created


async def test_a_tenants_quota_refuses_past_its_streams_and_counts_it(aredis: Redis) -> None:
    store, hub = await _store(aredis, ds_tenant_max_streams=1)
    try:
        await store.create("t", "one", TEXT)
        refused = await _refusal(store.create("t", "two", TEXT))
        assert (refused.status, refused.code) == (429, "stream_quota")
        await store.create("u", "two", TEXT)  # another tenant's share
        await store.delete("t", "one")
        assert (await store.create("t", "two", TEXT)).created
    finally:
        await hub.close()


async def test_a_tenant_appending_past_its_rate_is_told_when_to_retry(aredis: Redis) -> None:
    store, hub = await _store(aredis, ds_tenant_appends_per_s=0.001, ds_tenant_append_burst=2)
    try:
        await store.create("t", "s", TEXT)
        await store.append("t", "s", _append(b"x"))
        refused = await _refusal(store.append("t", "s", _append(b"y")))
        assert (refused.status, refused.code) == (429, "rate_limited")
        assert int(refused.headers["Retry-After"]) > 900
        assert await _texts(store, "s") == ["x"]
    finally:
        await hub.close()


async def test_a_stream_holds_at_most_its_appends(aredis: Redis) -> None:
    store, hub = await _store(aredis, ds_max_appends=2)
    try:
        await store.create("t", "s", TEXT, b"1")
        await store.append("t", "s", _append(b"2"))
        refused = await _refusal(store.append("t", "s", _append(b"3")))
        assert (refused.status, refused.code) == (413, "stream_full")
    finally:
        await hub.close()


async def test_a_read_stops_near_its_byte_limit_and_goes_on_from_there(aredis: Redis) -> None:
    store, hub = await _store(aredis, ds_max_read_bytes=1_024)
    try:
        await store.create("t", "s", TEXT)
        for _ in range(3):
            await store.append("t", "s", _append(b"x" * 600))
        first = await store.read("t", "s", ORIGIN)
        assert (len(first.items), first.up_to_date) == (1, False)
        rest = await store.read_on("t", "s", first.after)
        assert rest is not None
        assert (len(rest.items), rest.up_to_date) == (1, False)
    finally:
        await hub.close()


async def test_a_read_from_the_tail_holds_nothing_and_knows_the_closure(
    store: DurableStore,
) -> None:
    await store.create("t", "s", TEXT, b"a")
    read = await store.read("t", "s", None)
    assert (read.items, read.up_to_date, read.closed, read.waits) == ([], True, False, True)
    assert read.after == read.meta.tail


async def test_a_wait_returns_when_an_append_arrives(store: DurableStore) -> None:
    made = await store.create("t", "s", TEXT)
    waiting = asyncio.ensure_future(store.wait("t", "s", made.tail, 30))
    await store.append("t", "s", _append(b"news"))
    await asyncio.wait_for(waiting, 10)
    read = await store.read("t", "s", made.tail)
    assert [payload for _, payload in read.items] == [b"news"]


async def test_a_wait_with_nothing_new_ends_at_its_timeout(store: DurableStore) -> None:
    made = await store.create("t", "s", TEXT)
    await asyncio.wait_for(store.wait("t", "s", made.tail, 0.05), 10)


async def test_a_sliding_ttl_is_kept_and_inherited_by_a_fork(store: DurableStore) -> None:
    await store.create("t", "s", CreateRequest(content_type="text/plain", ttl_s=600))
    meta = await store.meta("t", "s")
    assert (meta.ttl_s, meta.expires_ms) == (600, None)
    await store.create("t", "f", CreateRequest(fork=ForkRequest("s")))
    assert (await store.meta("t", "f")).ttl_s == 600


async def test_a_body_is_read_only_once_the_fork_is_made_out(store: DurableStore) -> None:
    read: list[bool] = []

    async def body() -> bytes:
        read.append(True)
        return b"x"

    refused = await _refusal(store.create("t", "s", CreateRequest(fork=ForkRequest("no")), body))
    assert refused.status == 404
    assert read == []
    assert (await store.create("t", "s", TEXT, body)).created
    assert read == [True]


async def test_an_open_brokers_streams_have_no_tenant(store: DurableStore) -> None:
    await store.create(None, "s", TEXT, b"open")
    assert await _texts(store, "s", None) == ["open"]
    with pytest.raises(BadRequest):
        await store.create(None, "s", CreateRequest(fork=ForkRequest("s")))


async def test_the_ds_scripts_load_with_their_parts_in_place(aredis: Redis) -> None:
    scripts = Scripts(aredis)
    await scripts.load()
    assert await scripts.loaded()


async def test_a_long_read_takes_growing_pages_and_misses_nothing(aredis: Redis) -> None:
    """Past its first page a read asks for twice as many entries each time (512, 1024, ...),
    up to a cap: every append comes back once, in order, and the read ends up to date; the
    same through a fork, whose first part is its source's."""
    store, hub = await _store(aredis, ds_tenant_appends_per_s=0)
    try:
        await _long_reads(store)
    finally:
        await hub.close()


async def _long_reads(store: DurableStore) -> None:
    await store.create("t", "long", TEXT)
    bodies = [str(n).encode() for n in range(3_000)]
    for start in range(0, len(bodies), 250):
        batch = bodies[start : start + 250]
        await asyncio.gather(*(store.append("t", "long", _append(body)) for body in batch))
    read = await store.read("t", "long", ORIGIN)
    assert sorted(read.payloads, key=int) == bodies
    assert len(set(read.payloads)) == len(bodies)
    assert read.up_to_date
    assert read.after == read.items[-1][0]
    await store.create("t", "long-fork", CreateRequest(fork=ForkRequest(source="long")))
    await store.append("t", "long-fork", _append(b"own"))
    forked = await store.read("t", "long-fork", ORIGIN)
    assert forked.payloads == [*read.payloads, b"own"]
    assert forked.up_to_date


async def _both(store: DurableStore, path: str, after: Any = ORIGIN) -> tuple[Any, Any]:
    """The same read with each append's place (entry by entry) and without (in Redis)."""
    return (
        await store.read("t", path, after, places=True),
        await store.read("t", path, after, places=False),
    )


async def test_a_catch_up_read_in_redis_gives_what_a_read_entry_by_entry_gives(
    store: DurableStore, aredis: Redis
) -> None:
    """``ds_read`` (a catch-up's read, no places) against the read entry by entry: the same
    bytes, the same place after them, the same tail and close, for a plain stream, a JSON
    one, a closed one, one read from its middle, a fork, and text kept by older releases."""
    await store.create("t", "plain", TEXT, b"a")
    for body in (b"bb", b"", b"ccc"):
        if body:
            await store.append("t", "plain", _append(body))
    await store.create("t", "json", JSON, b"[1,2]")
    await store.append("t", "json", _append(b'{"x": 3}', content_type="application/json"))
    await store.create("t", "closed", TEXT, b"end")
    await store.append("t", "closed", _append(b"!", close=True))
    await store.create("t", "fork", CreateRequest(fork=ForkRequest(source="plain")))
    await store.append("t", "fork", _append(b"own"))
    octets = CreateRequest(content_type="application/octet-stream")
    await store.create("t", "old", octets, b"new")
    data = store._keys("t", "old").data
    await aredis.xadd(data, {"e": "m", "d": BINARY.decode("latin-1")})
    for path in ("plain", "json", "closed", "fork"):
        placed, paged = await _both(store, path)
        assert paged.payloads == placed.payloads, path
        assert paged.payloads
        assert (paged.after, paged.up_to_date, paged.closed) == (
            placed.after,
            placed.up_to_date,
            placed.closed,
        ), path
        assert paged.ids == [] if path != "fork" else paged.ids == placed.ids
    middle = (await store.read("t", "plain", ORIGIN)).items[0][0]
    placed, paged = await _both(store, "plain", middle)
    assert paged.payloads == placed.payloads == [b"bb", b"ccc"]
    assert paged.after == placed.after
    # Text kept by an older release stops the page before it; the client reads on from there,
    # and that read goes entry by entry.
    paged = await store.read("t", "old", ORIGIN, places=False)
    assert (paged.payloads, paged.up_to_date) == ([b"new"], False)
    rest = await store.read("t", "old", paged.after, places=False)
    assert (rest.payloads, rest.up_to_date) == ([BINARY], True)


async def test_a_catch_up_read_in_redis_stops_at_its_bytes_and_its_entries(
    aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read stops before the append that would pass ``BROKER_DS_MAX_READ_BYTES`` (the first
    is taken whatever its size), and after ``PAGE_ENTRIES`` appends; neither is the tail, and
    reading on from where it stopped gives the rest."""
    store, hub = await _store(aredis, ds_max_read_bytes=1_024, ds_tenant_appends_per_s=0)
    monkeypatch.setattr(service, "PAGE_ENTRIES", 3)
    try:
        await store.create("t", "s", TEXT, b"x" * 2_000)
        for body in (b"a" * 600, b"b" * 600, b"c", b"d", b"e", b"f"):
            await store.append("t", "s", _append(body))
        seen, after, reads = [], ORIGIN, 0
        while True:
            read = await store.read("t", "s", after, places=False)
            seen.extend(read.payloads)
            after, reads = read.after, reads + 1
            if read.up_to_date:
                break
        assert seen == [b"x" * 2_000, b"a" * 600, b"b" * 600, b"c", b"d", b"e", b"f"]
        assert reads == 4  # 2,000 alone; 600 alone; 600, c, d (3 appends); e, f at the tail
    finally:
        await hub.close()
