"""Appends to one stream that arrive together share one ``ds_append`` call, and each is still
answered on its own (broker/durable_store/groups.py), against a real Redis (a cluster too, with
``BROKER_TEST_CLUSTER=1``)."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from broker.deps import Deps
from broker.durable_store import Appended, AppendRequest, CreateRequest, Duplicate, DurableStore
from broker.durable_store.groups import MAX_APPENDS, _cut
from broker.durable_store.scripts import OneAppend
from broker.errors import BrokerError
from broker.fanout import Hub
from broker.frames import ORIGIN
from broker.keys import Keys
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings

TEXT = CreateRequest(content_type="text/plain")
COMMON_ARGS = 5  # ds_append's ARGV before its appends
PER_APPEND = 7  # and each append's
_prefixes = itertools.count()


class CountedScripts(Scripts):
    """The process's scripts, counting the appends of each ``ds_append`` call sent alone, and
    the pipelines of several streams' calls."""

    def __init__(self, redis: Redis) -> None:
        super().__init__(redis)
        self.groups: list[int] = []
        self.pipelines = 0

    def registered(self, name: str) -> AsyncScript:
        if name == "ds_append":  # (asked once per pipeline of several streams' calls)
            self.pipelines += 1
        return super().registered(name)

    async def __call__(
        self, name: str, keys: list[str], args: list[Any], *, replicated: bool = True
    ) -> Any:
        if name == "ds_append":
            self.groups.append((len(args) - COMMON_ARGS) // PER_APPEND)
        return await super().__call__(name, keys, args, replicated=replicated)


@pytest.fixture
async def counted(aredis: Redis) -> AsyncIterator[tuple[DurableStore, CountedScripts]]:
    prefix = f"dsgroups{os.getpid()}-{next(_prefixes)}"
    metrics = Metrics()
    scripts = CountedScripts(aredis)
    settings = Settings(redis_url="unix:///unused", key_prefix=prefix)
    hub = Hub(aredis, metrics)
    yield DurableStore(Deps(aredis, scripts, Keys(prefix), settings, metrics), hub), scripts
    await hub.close()


def _text(body: bytes, **fields: Any) -> AppendRequest:
    return AppendRequest(content_type="text/plain", body=body, **fields)


async def _outcomes(store: DurableStore, requests: list[AppendRequest]) -> list[Any]:
    """Each request's answer (its result, or its refusal's code), sent all at once."""
    done = await asyncio.gather(
        *(store.append("t", "s", request) for request in requests), return_exceptions=True
    )
    return [error.code if isinstance(error, BrokerError) else error for error in done]


async def _texts(store: DurableStore) -> list[str]:
    read = await store.read("t", "s", ORIGIN)
    return [payload.decode() for _, payload in read.items]


async def test_concurrent_appenders_share_a_call_and_each_gets_its_own_offset_in_order(
    counted: tuple[DurableStore, CountedScripts],
) -> None:
    store, scripts = counted
    await store.create("t", "s", TEXT)
    bodies = [f"m{n}".encode() for n in range(60)]
    done = await _outcomes(store, [_text(body) for body in bodies])
    assert all(isinstance(one, Appended) and not one.closed for one in done)
    tails = [one.tail.offset for one in done]
    assert tails == sorted(tails)
    assert len(set(tails)) == len(tails)
    assert await _texts(store) == [body.decode() for body in bodies]  # nothing lost or doubled
    # They arrived in the same turn of the event loop: one call took them all.
    assert scripts.groups == [60]


async def test_a_producers_sequence_is_checked_per_append_inside_a_group(
    counted: tuple[DurableStore, CountedScripts],
) -> None:
    store, scripts = counted
    await store.create("t", "s", TEXT)
    done = await _outcomes(
        store,
        [
            _text(b"lead"),
            _text(b"a", producer=("p", 0, 0)),
            _text(b"b", producer=("p", 0, 1)),
            _text(b"b", producer=("p", 0, 1)),  # sent twice: answered, not written
            _text(b"d", producer=("p", 0, 3)),  # skips 2
            _text(b"e", producer=("p", 0, 2)),
            _text(b"z", producer=("p", 1, 1)),  # a new epoch starts at 0
            _text(b"plain"),
        ],
    )
    assert scripts.groups == [8]
    assert isinstance(done[1], Appended)
    assert isinstance(done[2], Appended)
    assert done[3] == Duplicate(done[2].tail, 1, False)
    assert done[4:7] == ["sequence_gap", done[5], "bad_producer"]
    assert isinstance(done[5], Appended)
    assert isinstance(done[7], Appended)
    assert await _texts(store) == ["lead", "a", "b", "e", "plain"]


async def test_a_close_in_the_middle_of_a_group_refuses_only_what_follows_it(
    counted: tuple[DurableStore, CountedScripts],
) -> None:
    store, scripts = counted
    await store.create("t", "s", TEXT)
    done = await _outcomes(
        store,
        [
            _text(b"a"),
            _text(b"b"),
            _text(b"c", close=True),
            _text(b"d"),
            AppendRequest(close=True),  # a second close: idempotent
        ],
    )
    assert scripts.groups == [5]
    assert [type(one).__name__ for one in done[:3]] == ["Appended"] * 3
    assert done[2].closed
    assert not done[1].closed
    assert done[3] == "stream_closed"
    assert done[4].tail == done[2].tail  # ClosedAgain, at the close's tail
    read = await store.read("t", "s", ORIGIN)
    assert [payload for _, payload in read.items] == [b"a", b"b", b"c"]
    assert read.closed


async def test_an_appender_that_leaves_takes_nothing_from_the_others(
    counted: tuple[DurableStore, CountedScripts],
) -> None:
    store, scripts = counted
    await store.create("t", "s", TEXT)
    lead = asyncio.ensure_future(store.append("t", "s", _text(b"lead")))
    await asyncio.sleep(0)  # (the lead's call is under way)
    leaving = asyncio.ensure_future(store.append("t", "s", _text(b"left")))
    staying = asyncio.ensure_future(store.append("t", "s", _text(b"stays")))
    await asyncio.sleep(0)
    leaving.cancel()
    assert isinstance(await lead, Appended)
    assert isinstance(await staying, Appended)
    assert leaving.cancelled()
    # The one that left before its group went out is not appended.
    assert await _texts(store) == ["lead", "stays"]
    assert scripts.groups == [1, 1]


async def test_writers_of_different_streams_share_one_round_trip(
    counted: tuple[DurableStore, CountedScripts], aredis: Redis
) -> None:
    """Appends to sixteen streams that arrive in the same turn go in one pipeline, a call per
    stream, each answered as alone: a refusal (a stream that does not exist) stays its own."""
    store, scripts = counted
    paths = [f"w{n}" for n in range(16)]
    for path in paths:
        await store.create("t", path, TEXT)
    await aredis.script_flush()  # the server lost its scripts: the pipeline loads and resends
    calls = [store.append("t", path, _text(path.encode())) for path in [*paths, "missing"]]
    done = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(one, Appended) for one in done[:16])
    assert isinstance(done[16], BrokerError)
    assert done[16].code == "not_found"
    assert scripts.pipelines == 1
    assert scripts.groups == []  # none went alone
    for path in paths:
        read = await store.read("t", path, ORIGIN)
        assert read.payloads == [path.encode()]
    # Once the stream's call is back, the next append of a stream goes at once, alone.
    assert isinstance(await store.append("t", "w0", _text(b"again")), Appended)
    assert scripts.groups == [1]


@pytest.mark.parametrize(
    ("sizes", "first"),
    [
        ([1, 1, 1], 3),
        ([1] * (MAX_APPENDS + 5), MAX_APPENDS),
        ([5 * 1024 * 1024, 1], 1),  # one past the bytes goes alone
        ([3 * 1024 * 1024, 2 * 1024 * 1024], 1),
        ([1024 * 1024] * 4 + [1], 4),
        ([1024 * 1024] * 3 + [1, 1], 5),
    ],
)
def test_a_group_is_cut_at_its_appends_or_its_bytes(sizes: list[int], first: int) -> None:
    loop = asyncio.new_event_loop()
    try:
        waiting = [
            (OneAppend("t", b"x" * size, False, None, ""), loop.create_future()) for size in sizes
        ]
        group, rest = _cut(waiting)
    finally:
        loop.close()
    assert (len(group), len(rest)) == (first, len(sizes) - first)
