"""Every Lua script runs on Redis Cluster: all keys of one conversation share one hash slot."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import orjson
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from broker.deps import Deps
from broker.keys import Keys
from broker.lease import TurnWriter
from broker.ledger import Ledger, Slot
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings
from broker.vocabulary import scoped
from tests.conftest import CLUSTER_MODE
from tests.redis_cluster import LocalCluster

# Clusters of its own, of the server the session names: a test of the server too.
pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def cluster_port(request: pytest.FixtureRequest) -> Iterator[int]:
    """A node of the session's cluster on the cluster pass; elsewhere, a cluster of our own."""
    if CLUSTER_MODE:
        session: LocalCluster = request.getfixturevalue("session_cluster")
        yield session.ports[0]
        return
    with LocalCluster(os.environ.get("BROKER_TEST_REDIS_SERVER") or None) as own:
        yield own.ports[0]


@pytest.fixture
async def cluster(cluster_port: int) -> AsyncIterator[Redis]:
    client = RedisCluster(host="127.0.0.1", port=cluster_port, decode_responses=True)
    await client.initialize()
    # The broker's classes take a Redis client; the cluster client speaks the same commands.
    yield cast(Redis, client)
    await client.aclose()


async def test_the_turn_scripts_run_on_a_cluster(cluster: Redis) -> None:
    keys = Keys("cluster")
    scripts = Scripts(cluster)
    conversation, turn = "conv-a", "turn-a"
    record = orjson.dumps({"n": 1, "strategy": "initial"}).decode()
    created = await scripts(
        "create_turn",
        [
            keys.turn(conversation, turn),
            keys.tombstone(conversation, turn),
            keys.conversation_turns(conversation),
        ],
        ["fp", "st_x", conversation, turn, "{}", conversation, record, "text"],
    )
    assert created[0] == "created"
    settings = Settings(max_stream_events=100, lease_ttl_ms=10_000, stream_ttl=60, tombstone_ttl=60)
    writer = TurnWriter(Deps(cluster, scripts, keys, settings, Metrics()), conversation, turn)
    assert (await writer.claim("w1", 1)).result == "claimed"
    assert await writer.release() is True  # handed back: claimed again at once, new token
    assert await writer.release() is False
    assert (await writer.claim("w1", 1)).result == "claimed"
    assert await writer.renew() is False
    ids = await writer.append([("attempt", {"attempt": 1}), ("delta", {"attempt": 1, "text": "a"})])
    assert len(ids) == 2
    promoted = await writer.finish(
        record={"n": 1, "strategy": "initial"},
        status="complete",
        reason=None,
        text="a",
        promote=True,
        base="",
    )
    assert promoted == 1
    turn_key = keys.turn(conversation, turn)
    started = await scripts(
        "start_attempt", [turn_key, keys.events(conversation, turn)], ["regenerate"]
    )
    assert started == ["started", "2"]
    cancelled = await scripts(
        "cancel_turn",
        [
            turn_key,
            keys.events(conversation, turn),
            keys.tombstone(conversation, turn),
            keys.conversation_turns(conversation),
            keys.lease(conversation, turn),
        ],
        [60_000, 60_000],
    )
    assert cancelled[0] == "cancelled"
    assert (await scripts("promote_attempt", [turn_key], [1, "1"]))[0] == "promoted"
    budget = await scripts("take_retry_budget", [keys.retry_budget("s")], [5, 60_000, "m1"])
    assert budget == 1


async def test_the_ledger_scripts_run_on_a_cluster(cluster: Redis) -> None:
    keys = Keys("cluster-ledger")
    settings = Settings(redis_url="unix:///unused", key_prefix="cluster-ledger")
    ledger = Ledger(Deps(cluster, Scripts(cluster), keys, settings, Metrics()))
    slot = Slot("conv-b", "turn-b", "pay", 0)
    claim = await ledger.claim(slot, "f" * 64, {"tool": "pay"})
    assert claim.state == "claimed"
    await ledger.renew(slot, claim.token)
    assert await ledger.finish(slot, claim.token, "completed", {"ok": True})
    replay = await ledger.claim(slot, "f" * 64, {})
    assert (replay.state, replay.payload) == ("completed", {"ok": True})
    rows: list[dict[str, Any]] = await ledger.rows("conv-b", "turn-b")
    assert [row["state"] for row in rows] == ["completed"]


async def test_the_tenant_and_viewer_scripts_run_on_a_cluster(cluster: Redis) -> None:
    keys = Keys("cluster-tenant")
    scripts = Scripts(cluster)
    conversation = scoped("acme", "conv-c")
    tenant_keys = [keys.turn_rate("acme"), keys.live_streams("acme")]
    admitted = await scripts("admit_turn", tenant_keys, [1, 1, 1, 5, f"{conversation} t", 60_000])
    assert admitted[0] == 1
    refused = await scripts("admit_turn", tenant_keys, [1, 1, 1, 5, f"{conversation} u", 60_000])
    assert refused[0] == 0
    assert refused[2] == "rate"
    viewer = keys.viewer(conversation, "jti")
    assert await cluster.set(viewer, "holder", nx=True, px=10_000)
    assert await scripts("renew_viewer", [viewer], ["holder", 10_000]) == 1
    assert await scripts("renew_viewer", [viewer], ["other", 10_000]) == 0
    assert await scripts("release_viewer", [viewer], ["holder"]) == 1


async def test_keys_of_two_conversations_land_in_their_own_slots(cluster: Redis) -> None:
    keys = Keys("cluster")
    cluster_client = cast(RedisCluster, cluster)
    for conversation in ("conv-a", "conv-b", "another"):
        slots = {
            cluster_client.keyslot(key)
            for key in (
                keys.turn(conversation, "t"),
                keys.lease(conversation, "t"),
                keys.events(conversation, "t"),
                keys.tool_slot(conversation, "t", "x", 0),
                keys.conversation_turns(conversation),
            )
        }
        assert len(slots) == 1


async def test_a_command_is_routed_before_the_clients_slot_map_is_built(cluster_port: int) -> None:
    """A client's first command (a stream feed's XREAD on a client that sent nothing yet) finds
    no slot map: redis-py routes it itself, and builds the map, instead of a KeyError."""
    from broker.connection import client, route

    fresh = client(f"redis+cluster://127.0.0.1:{cluster_port}")
    try:
        assert route(fresh, "{c:x}:k") == {}  # (a KeyError before)
        assert await fresh.set("{c:x}:k", "v")
        assert "target_nodes" in route(fresh, "{c:x}:k")  # the map is built now
    finally:
        await fresh.aclose()
