"""The broker on a Redis Cluster whose topology changes under a live turn.

* **A slot migration.** The slot of a conversation whose answer is streaming moves to another
  primary (``CLUSTER SETSLOT ... IMPORTING/MIGRATING``, ``MIGRATE`` of its keys, ``SETSLOT ...
  NODE``) while a reader is attached: the reader gets every event once, in order, and the answer
  it assembles is the turn's.
* **A failover.** Three primaries with a replica each; the primary that owns a streaming
  conversation is killed (SIGKILL) with two readers attached. The broker follows the promoted
  replica without a restart, the readers resume and finish, and the turn reaches a final state.

Each test starts a cluster of its own (the session's may be a single server), so both run in
every pass. Readers are the project's own client, which reattaches from its last event id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis
from redis.crc import key_slot

from broker_client import AttachPolicy, BrokerClient, TurnText
from tests.conftest import RunningBroker, start_broker
from tests.helpers import get_turn, read_sse, start_turn, wait_final, wait_until
from tests.redis_cluster import LocalCluster

# Clusters of its own, of the server the session names: a test of the server too; never the
# session's cluster, so the cluster pass leaves it to the first.
pytestmark = [pytest.mark.server, pytest.mark.own_cluster]

READER = AttachPolicy(max_retries=200, base_delay=0.05, max_delay=0.3, read_timeout=10)


class Reader(threading.Thread):
    """One client attached to a stream in a thread of its own, to the turn's end."""

    def __init__(self, base_url: str, stream_id: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.stream_id = base_url, stream_id
        self.ids: list[str] = []
        # (offset, type, data, wall-clock time of receipt) of every event received
        self.received: list[tuple[str, str, dict[str, Any], float]] = []
        self.text = TurnText()
        self.reconnects = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._read())
        except BaseException as exc:  # reported by the test
            self.error = exc

    async def _read(self) -> None:
        async with BrokerClient(self.base_url, policy=READER) as client:
            async for event in client.attach(self.stream_id, on_reconnect=self._reconnected):
                self.ids.append(event.id)
                self.received.append((event.id, event.type, event.data, time.time()))
                self.text.feed(event)

    def _reconnected(self, _info: Any) -> None:
        self.reconnects += 1


def tag_slot(conversation_id: str, prefix: str) -> int:
    """The slot of a conversation's keys (they share one hash tag)."""
    return int(key_slot(f"{prefix}:{{c:{conversation_id}}}:turns".encode()))


def node_ids(cluster: LocalCluster) -> dict[int, str]:
    """Port -> node id, for every node of ``cluster``."""
    ids: dict[int, str] = {}
    for port, node in zip(cluster.ports, cluster.nodes(), strict=True):
        with node:
            ids[port] = str(node.cluster("MYID"))
    return ids


def owner(cluster: LocalCluster, slot: int) -> int:
    """The port of the primary that serves ``slot``, as the first node sees it."""
    with redis.Redis(port=cluster.ports[0], decode_responses=True) as node:
        for low, high, primary, *_ in node.cluster("SLOTS"):
            if int(low) <= slot <= int(high):
                return int(primary[1])
    raise AssertionError(f"no node serves slot {slot}")


def migrate_slot(cluster: LocalCluster, slot: int, source: int, target: int) -> int:
    """Move ``slot`` with its keys from the primary on port ``source`` to ``target``; the number
    of keys moved."""
    ids = node_ids(cluster)
    moved = 0
    with (
        redis.Redis(port=source, decode_responses=True) as src,
        redis.Redis(port=target, decode_responses=True) as dst,
    ):
        dst.cluster("SETSLOT", str(slot), "IMPORTING", ids[source])
        src.cluster("SETSLOT", str(slot), "MIGRATING", ids[target])
        while keys := src.cluster("GETKEYSINSLOT", str(slot), "10"):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
        for port in cluster.ports:
            with redis.Redis(port=port, decode_responses=True) as node:
                node.cluster("SETSLOT", str(slot), "NODE", ids[target])
    return moved


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster() as started:
        yield started


@pytest.fixture
def cluster_broker(cluster: LocalCluster) -> Iterator[RunningBroker]:
    broker = start_broker(cluster.url)
    try:
        yield broker
    finally:
        broker.stop()


def test_a_slot_migration_under_a_live_reader_loses_and_repeats_nothing(
    cluster: LocalCluster, cluster_broker: RunningBroker
) -> None:
    prefix = cluster_broker.settings.key_prefix
    turn = start_turn(cluster_broker.base_url, "migrating", tokens=120, tokens_per_s=40)
    reader = Reader(cluster_broker.base_url, turn["stream_id"])
    reader.start()
    wait_until(lambda: len(reader.ids) >= 10, timeout=20)
    slot = tag_slot("migrating", prefix)
    source = owner(cluster, slot)
    target = next(port for port in cluster.ports if port != source)
    assert migrate_slot(cluster, slot, source, target) >= 2  # at least the turn and its events
    assert owner(cluster, slot) == target
    reader.join(timeout=60)
    assert not reader.is_alive(), "the reader never finished"
    assert reader.error is None, reader.error
    final = wait_final(cluster_broker.base_url, turn["turn_id"], timeout=30)
    assert final["status"] == "complete"
    assert reader.ids == sorted(set(reader.ids)), "an event came twice or out of order"
    assert reader.text.status == "complete"
    assert reader.text.text == final["canonical"]["text"]
    assert len(reader.ids) >= 120 + 2  # every delta, the attempt event and the end


def knows(node: redis.Redis, node_id: str) -> bool:
    return node_id in str(node.cluster("NODES"))


def synced(node: redis.Redis) -> bool:
    """Whether the replica ``node`` holds its primary's data (its link is up)."""
    return node.info("replication").get("master_link_status") == "up"


def lists_replicas(node: redis.Redis) -> bool:
    """Whether ``node``'s CLUSTER SLOTS gives every slot range a replica."""
    ranges = node.cluster("SLOTS")
    return bool(ranges) and all(len(entry) >= 4 for entry in ranges)


class ReplicatedCluster(LocalCluster):
    """Three primaries with one replica each: ``replica_of[primary port] = replica port``."""

    def __init__(self, server_args: tuple[str, ...] = (), node_timeout_ms: int = 2000) -> None:
        super().__init__(server_args=server_args, node_timeout_ms=node_timeout_ms)
        self.replica_of: dict[int, int] = {}

    def start(self) -> str:
        url = super().start()
        primaries = list(self.ports)
        ids = node_ids(self)
        for primary in primaries:
            self._start_node()
            replica = self.ports[-1]
            with redis.Redis(port=replica, decode_responses=True) as node:
                node.cluster("MEET", "127.0.0.1", str(primaries[0]))
                wait_until(functools.partial(knows, node, ids[primary]), 20)
                node.cluster("REPLICATE", ids[primary])
                # A replica out of touch for long may not take over: this one always may.
                node.config_set("cluster-replica-validity-factor", 0)
            self.replica_of[primary] = replica
        for replica in self.replica_of.values():
            with redis.Redis(port=replica, decode_responses=True) as node:
                wait_until(functools.partial(synced, node), 20)
        # Every node's slot map lists every replica: a client (the broker's replica reads) that
        # loads it from a node that has not heard of a replica yet would read the primary.
        for port in self.ports:
            with redis.Redis(port=port, decode_responses=True) as node:
                wait_until(functools.partial(lists_replicas, node), 20)
        return url

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (no shutdown, no goodbye to the cluster)."""
        index = self.ports.index(port)
        os.kill(self.pids[index], signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class LiveTurn:
    turn: dict[str, Any]
    readers: list[Reader]
    slot: int  # the conversation's
    primary: int  # the port of the primary serving it


def read_live(
    cluster: LocalCluster, broker: RunningBroker, conversation: str, **simulate: Any
) -> LiveTurn:
    """A turn under way with two readers attached, once both have 10 events."""
    turn = start_turn(broker.base_url, conversation, **simulate)
    readers = [Reader(broker.base_url, turn["stream_id"]) for _ in range(2)]
    for reader in readers:
        reader.start()
    wait_until(lambda: all(len(r.ids) >= 10 for r in readers), timeout=20)
    slot = tag_slot(conversation, broker.settings.key_prefix)
    return LiveTurn(turn, readers, slot, owner(cluster, slot))


def test_a_primary_failover_mid_generation_keeps_readers_resuming_and_ends_the_turn() -> None:
    cluster = ReplicatedCluster()
    with cluster:
        broker = start_broker(cluster.url, lease_ttl_ms=10_000)
        try:
            live = read_live(cluster, broker, "failing-over", tokens=150, tokens_per_s=30)
            turn, readers, slot, primary = live.turn, live.readers, live.slot, live.primary
            replica = cluster.replica_of[primary]
            cluster.kill(primary)
            # The replica takes over once the others count the primary as failed.
            survivor = next(p for p in cluster.ports if p != primary)
            wait_until(lambda: owner_from(survivor, slot) == replica, timeout=30, interval=0.1)
            final = wait_final(broker.base_url, turn["turn_id"], timeout=60)
            for reader in readers:
                reader.join(timeout=60)
                assert not reader.is_alive(), "a reader never finished"
                assert reader.error is None, reader.error
                assert reader.ids == sorted(set(reader.ids)), "an offset came twice"
                assert reader.text.status == final["status"]
            # The turn is at rest and still readable; a new turn on the same slot runs.
            assert final["status"] in ("complete", "interrupted")
            again = start_turn(broker.base_url, "failing-over", tokens=5, tokens_per_s=0)
            assert wait_final(broker.base_url, again["turn_id"], timeout=30)["status"] == "complete"
            assert get_turn(broker.base_url, turn["turn_id"])["status"] == final["status"]
        finally:
            broker.stop()


def test_with_replica_acks_a_failover_loses_no_event_a_reader_was_told() -> None:
    """BROKER_REPLICA_ACKS=1: writes wait for the replica, readers read it. The conversation's
    replica is made to miss the primary's last writes (asleep, its link cut), then the primary
    dies: what those writes appended is lost, but no reader was told it, and every event any
    reader got is in the stream the promoted replica serves."""
    # The replica sleeps for less than the node timeout: a replica the others count as failed
    # drops out of the slot map, and a client that reloads it then reads the primary.
    cluster = ReplicatedCluster(server_args=("--enable-debug-command", "yes"), node_timeout_ms=5000)
    with cluster:
        broker = start_broker(cluster.url, lease_ttl_ms=3_000, replica_acks=1, replica_wait_ms=100)
        try:
            prefix = broker.settings.key_prefix
            live = read_live(cluster, broker, "acked", tokens=200, tokens_per_s=40)
            turn, readers, slot, primary = live.turn, live.readers, live.slot, live.primary
            replica = cluster.replica_of[primary]
            stream = f"{prefix}:{{c:acked}}:events:{turn['turn_id']}"
            with redis.Redis(port=primary, decode_responses=True) as node:
                # The replica stops reading for a while, and its link is cut: what the primary
                # appends from now on, it never sends (the replica, asleep, cannot reconnect).
                asleep = threading.Thread(target=sleep_node, args=(replica, 3.5), daemon=True)
                asleep.start()
                wait_until(lambda: not answers(replica), timeout=5)
                assert node.client_kill_filter(_type="replica") >= 1
                cut = node.xlen(stream)
                wait_until(lambda: node.xlen(stream) >= cut + 3, timeout=10)
                on_primary = {entry_id for entry_id, _ in node.xrange(stream)}
            # Still asleep: it never got those appends, and will not from a dead primary.
            assert not answers(replica), "the replica woke before its primary died"
            cluster.kill(primary)
            asleep.join(timeout=10)
            survivor = next(p for p in cluster.ports if p not in (primary, replica))
            wait_until(lambda: owner_from(survivor, slot) == replica, timeout=30, interval=0.1)
            final = wait_final(broker.base_url, turn["turn_id"], timeout=60)
            for reader in readers:
                reader.join(timeout=60)
                assert not reader.is_alive(), "a reader never finished"
                assert reader.error is None, reader.error
            events = read_sse(broker.base_url, turn["stream_id"], offset="-1").events
            stored = {(e.id, e.event, canonical(e.data)) for e in events}
            # The fault lost writes: appended on the primary, gone from the promoted replica.
            lost = {entry_id_of(offset) for offset in on_primary} - {
                entry_id_of(e.id) for e in events
            }
            assert lost, "the primary's last appends all reached the replica: nothing was at stake"
            for reader in readers:
                seen = {(i, kind, canonical(data)) for i, kind, data, _ in reader.received}
                assert not seen - stored, f"told, then lost: {sorted(seen - stored)[:3]}"
                assert reader.text.status == final["status"]
            assert final["status"] in ("complete", "interrupted")
            assert short_waits(broker.base_url) > 0, "no write waited for the replica in vain"
        finally:
            broker.stop()


def sleep_node(port: int, seconds: float) -> None:
    with redis.Redis(port=port, socket_timeout=seconds + 10) as node:
        node.execute_command("DEBUG", "SLEEP", str(seconds))


def answers(port: int) -> bool:
    """Whether the node on ``port`` answers a PING within 200 ms (on a bare socket: the
    client library would retry a timed-out call until it succeeds)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def entry_id_of(offset: str) -> str:
    """The Redis entry id of a wire offset or of an entry id (``<ms>-<seq>``, unpadded)."""
    ms, _, seq = offset.partition("-")
    return f"{int(ms)}-{int(seq)}"


def canonical(data: Any) -> bytes:
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS)


def short_waits(base_url: str) -> float:
    """The broker's ``broker_replica_waits_short_total``, over every script."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("broker_replica_waits_short_total{")
    )


def owner_from(port: int, slot: int) -> int | None:
    """The primary serving ``slot`` as the node on ``port`` sees it (None: unreachable)."""
    try:
        with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as node:
            for low, high, primary, *_ in node.cluster("SLOTS"):
                if int(low) <= slot <= int(high):
                    return int(primary[1])
    except redis.RedisError:
        return None
    return None
