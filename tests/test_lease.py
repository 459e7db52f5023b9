"""Fenced writers: a lease with a fencing token decides who may append to a turn."""

from __future__ import annotations

import asyncio
import itertools
import os
import time

import httpx
import orjson
import pytest
import redis as redis_lib
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.errors import FencedWrite, StopRequested, StreamFull
from broker.keys import Keys
from broker.lease import TurnWriter
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings
from tests.conftest import RunningBroker
from tests.helpers import read_sse, start_turn, wait_until

_n = itertools.count()
RECORD = {"n": 1, "strategy": "initial"}


async def new_turn(aredis: Redis, keys: Keys, scripts: Scripts) -> tuple[str, str]:
    conversation, turn = "c", f"turn-{next(_n)}"
    record = orjson.dumps({"n": 1, "strategy": "initial"}).decode()
    turn_keys = [
        keys.turn(conversation, turn),
        keys.tombstone(conversation, turn),
        keys.conversation_turns(conversation),
    ]
    args = ["fp", "st_x", conversation, turn, "{}", conversation, record, "text"]
    await scripts("create_turn", turn_keys, args)
    return conversation, turn


def writer(scripts: Scripts, keys: Keys, conversation: str, turn: str, ttl_ms: int) -> TurnWriter:
    settings = Settings(max_stream_events=100, lease_ttl_ms=ttl_ms, stream_ttl=60, tombstone_ttl=60)
    return TurnWriter(Deps(scripts.redis, scripts, keys, settings, Metrics()), conversation, turn)


@pytest.fixture
def keys() -> Keys:
    return Keys(f"lease{os.getpid()}-{next(_n)}")


async def test_a_stale_token_is_refused_after_a_takeover(aredis: Redis, keys: Keys) -> None:
    scripts = Scripts(aredis)
    conversation, turn = await new_turn(aredis, keys, scripts)
    old = writer(scripts, keys, conversation, turn, ttl_ms=50)
    claim = await old.claim("worker-a", 1)
    assert claim.result == "claimed"
    await old.append([("delta", {"attempt": 1, "text": "from a"})])
    lease_key = keys.lease(conversation, turn)
    for _ in range(500):  # the lease expires on the server clock
        if not await aredis.exists(lease_key):
            break
        await asyncio.sleep(0.01)
    new = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    takeover = await new.claim("worker-b", 1)
    assert takeover.result == "claimed"
    assert takeover.previous_status == "streaming"
    assert int(takeover.token) > int(claim.token)
    with pytest.raises(FencedWrite):
        await old.append([("delta", {"attempt": 1, "text": "zombie"})])
    with pytest.raises(FencedWrite):
        await old.renew()
    with pytest.raises(FencedWrite):
        await old.finish(
            record=RECORD, status="complete", reason=None, text="", promote=True, base=""
        )
    await new.append([("delta", {"attempt": 1, "text": "from b"})])
    texts = [
        orjson.loads(f["d"])["text"]
        for _, f in await rc.xrange(aredis, keys.events(conversation, turn), "-")
    ]
    assert texts == ["from a", "from b"]


def delta(text: str) -> tuple[str, dict[str, object]]:
    return ("delta", {"attempt": 1, "text": text})


async def cancel(scripts: Scripts, keys: Keys, conversation: str, turn: str) -> list[str]:
    reply = await scripts(
        "cancel_turn",
        [
            keys.turn(conversation, turn),
            keys.events(conversation, turn),
            keys.tombstone(conversation, turn),
            keys.conversation_turns(conversation),
            keys.lease(conversation, turn),
        ],
        [60_000, 60_000],
    )
    return [str(part) for part in reply]


async def test_the_stream_limit_counts_what_came_before_the_lease(
    aredis: Redis, keys: Keys
) -> None:
    # The append checks the length as the lease's base plus its own appends (no XLEN each
    # time): a takeover's base holds what the lost writer appended.
    scripts = Scripts(aredis)
    conversation, turn = await new_turn(aredis, keys, scripts)
    events = keys.events(conversation, turn)
    first = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    assert (await first.claim("worker-a", 1)).result == "claimed"
    await first.append([delta(str(i)) for i in range(60)])
    await aredis.delete(keys.lease(conversation, turn))  # the lease expired
    second = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    assert (await second.claim("worker-b", 1)).result == "claimed"
    assert await aredis.hget(keys.lease(conversation, turn), "base") == "60"
    await second.append([delta(str(i)) for i in range(39)])
    with pytest.raises(StreamFull):
        await second.append([delta("101st"), delta("102nd")])
    assert await aredis.xlen(events) == 99  # nothing of the refused batch
    await second.append([delta("100th")])
    assert await aredis.xlen(events) == 100
    with pytest.raises(StreamFull):
        await second.append([delta("101st")])
    assert await aredis.xlen(events) == 100


async def test_a_stop_reaches_the_next_append_and_a_takeover(aredis: Redis, keys: Keys) -> None:
    scripts = Scripts(aredis)
    conversation, turn = await new_turn(aredis, keys, scripts)
    events = keys.events(conversation, turn)
    first = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    assert (await first.claim("worker-a", 1)).result == "claimed"
    await first.append([delta("a")])
    assert await cancel(scripts, keys, conversation, turn) == ["signalled", "1"]
    with pytest.raises(StopRequested):
        await first.append([delta("after the stop")])
    assert await aredis.xlen(events) == 1
    # The writer died before it saw the stop: the worker that takes over is refused as well.
    await aredis.delete(keys.lease(conversation, turn))
    second = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    claim = await second.claim("worker-b", 1)
    assert (claim.result, claim.stop_requested) == ("claimed", True)
    with pytest.raises(StopRequested):
        await second.append([delta("taken over after the stop")])
    assert await aredis.xlen(events) == 1


async def test_a_lease_claimed_without_a_base_still_checks_the_stream(
    aredis: Redis, keys: Keys
) -> None:
    # A lease claimed by a process of the version before `base` (a rolling upgrade): the append
    # reads the stream's length and the turn's stop flag, as that version did.
    scripts = Scripts(aredis)
    conversation, turn = await new_turn(aredis, keys, scripts)
    lease, events = keys.lease(conversation, turn), keys.events(conversation, turn)
    old = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    assert (await old.claim("worker-a", 1)).result == "claimed"
    await aredis.hdel(lease, "base")
    await aredis.xadd(events, {"e": "delta", "d": "{}"})  # as if by no lease at all
    await old.append([delta(str(i)) for i in range(98)])
    with pytest.raises(StreamFull):
        await old.append([delta("101st"), delta("102nd")])
    assert await aredis.xlen(events) == 99
    await aredis.hset(keys.turn(conversation, turn), "cancel", "1")  # an old cancel_turn
    with pytest.raises(StopRequested):
        await old.append([delta("after the stop")])
    assert await aredis.xlen(events) == 99


async def test_a_live_heartbeating_lease_cannot_be_stolen(aredis: Redis, keys: Keys) -> None:
    scripts = Scripts(aredis)
    conversation, turn = await new_turn(aredis, keys, scripts)
    holder = writer(scripts, keys, conversation, turn, ttl_ms=200)
    assert (await holder.claim("worker-a", 1)).result == "claimed"
    thief = writer(scripts, keys, conversation, turn, ttl_ms=200)
    results = set()
    for _ in range(12):  # 12 x 50 ms: three lease periods, renewed every 50 ms
        await holder.renew()
        results.add((await thief.claim("worker-b", 1)).result)
        await asyncio.sleep(0.05)
    assert results == {"held"}
    await holder.append([("delta", {"attempt": 1, "text": "still mine"})])


async def test_claims_for_a_finished_or_missing_turn_are_refused(aredis: Redis, keys: Keys) -> None:
    scripts = Scripts(aredis)
    conversation, turn = await new_turn(aredis, keys, scripts)
    first = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    await first.claim("worker-a", 1)
    await first.finish(
        record=RECORD, status="complete", reason=None, text="x", promote=True, base=""
    )
    again = writer(scripts, keys, conversation, turn, ttl_ms=10_000)
    assert (await again.claim("worker-b", 1)).result == "stale"
    assert (await again.claim("worker-b", 2)).result == "stale"
    missing = writer(scripts, keys, conversation, "no-such-turn", ttl_ms=10_000)
    assert (await missing.claim("worker-b", 1)).result == "missing"


def test_a_worker_whose_lease_is_taken_over_stops_writing(
    broker: RunningBroker, raw_redis: redis_lib.Redis
) -> None:
    turn = start_turn(broker.base_url, turn_id="stolen", tokens=400, tokens_per_s=50)
    read_sse(broker.base_url, turn["stream_id"], stop_after=3)
    keys = broker.runtime.keys
    lease = keys.lease("conv-1", "stolen")
    # Another worker takes over: a new token, as claim_lease would mint after an expiry.
    token = raw_redis.hincrby(keys.turn("conv-1", "stolen"), "fence", 1)
    raw_redis.hset(lease, mapping={"token": token, "owner": "intruder"})
    events = keys.events("conv-1", "stolen")
    wait_until(lambda: broker.metric("broker_fenced_writes_total") >= 1, 10)
    length = raw_redis.xlen(events)
    # The fenced worker appends nothing more, not even an `end` event: at 50 deltas/s, 0.3 s
    # would have added about 15 entries had it gone on.
    time.sleep(0.3)
    assert raw_redis.xlen(events) == length
    page = httpx.get(
        f"{broker.base_url}/v1/streams/{turn['stream_id']}", params={"format": "json"}, timeout=5
    ).json()
    assert all(e["event"] != "end" for e in page["events"])
    assert raw_redis.hget(lease, "owner") == "intruder"
