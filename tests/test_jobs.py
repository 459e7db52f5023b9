"""The partitioned job queue: a conversation's jobs stay in one partition, partitions spread,
workers take jobs from every partition, reclaim per partition and settle jobs where they came
from; on a cluster, doorbells wake the readers and stops travel on sharded channels."""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from broker import jobs as jobs_module
from broker.connection import as_cluster
from broker.jobs import Job, JobQueue
from broker.keys import JOB_GROUP, Keys, job_partition
from broker.vocabulary import scoped
from tests.conftest import BrokerFactory
from tests.helpers import start_turn, wait_final

_n = itertools.count()
PARTITIONS = 8

# Every test runs the queue the client's own way (one server: one BLOCK read, a classic stop
# channel; a cluster: polled reads and sharded channels) and the cluster way, which one server
# serves too.
MODES = [pytest.param(None, id="own-way"), pytest.param(True, id="cluster-way")]


def conversation_in(partition: int, partitions: int = PARTITIONS) -> str:
    """A conversation id whose jobs go to ``partition``."""
    return next(
        f"conv-{i}"
        for i in itertools.count()
        if job_partition(f"conv-{i}", partitions) == partition
    )


@pytest.fixture(params=MODES)
async def queue(request: pytest.FixtureRequest, aredis: Redis) -> AsyncIterator[JobQueue]:
    keys = Keys(f"jobs{os.getpid()}-{next(_n)}")
    queue = JobQueue(aredis, keys, PARTITIONS, cluster=request.param)
    await queue.ensure_group()
    yield queue
    for stream in queue.streams:
        await aredis.delete(stream)


async def pending(aredis: Redis, stream: str) -> list[dict[str, Any]]:
    reply: list[dict[str, Any]] = await aredis.xpending_range(stream, JOB_GROUP, "-", "+", 100)
    return reply


async def read_all(queue: JobQueue, consumer: str, expected: int) -> list[Job]:
    """Jobs read until ``expected`` arrived (a polled read may answer none after its wait)."""
    got: list[Job] = []
    deadline = time.monotonic() + 10
    while len(got) < expected and time.monotonic() < deadline:
        got += await queue.read(consumer, expected - len(got), 100)
    return got


def test_a_conversations_jobs_always_land_in_one_partition() -> None:
    for conversation in ("conv-1", "tenant-a/conv-1", "c" * 128):
        partitions = {job_partition(conversation, PARTITIONS) for _ in range(10)}
        assert len(partitions) == 1
        (partition,) = partitions
        assert 0 <= partition < PARTITIONS
    # The partition follows the scoped id: two tenants' conversations of one name are apart.
    assert job_partition(scoped("a", "conv-1"), 1024) != job_partition(scoped("b", "conv-1"), 1024)


async def test_every_job_of_one_conversation_goes_to_its_partition(
    queue: JobQueue, aredis: Redis
) -> None:
    conversation = conversation_in(5)
    for attempt in (1, 2, 3):
        await queue.enqueue(conversation, f"turn-{attempt}", attempt)
    lengths = [await aredis.xlen(stream) for stream in queue.streams]
    assert lengths == [0, 0, 0, 0, 0, 3, 0, 0]
    assert queue.stream_of(conversation) == queue.streams[5]


def test_partitions_spread_conversations_evenly() -> None:
    counts = collections.Counter(
        job_partition(scoped("tenant", f"conversation-{i}"), PARTITIONS) for i in range(1_000)
    )
    assert sorted(counts) == list(range(PARTITIONS))
    for partition, count in counts.items():
        assert 80 <= count <= 170, (partition, count)


def test_each_partition_has_a_hash_tag_of_its_own() -> None:
    keys = Keys("broker")
    streams = [keys.job_stream(i) for i in range(PARTITIONS)]
    assert streams[3] == "broker:{jobs:3}"
    tags = {stream[stream.index("{") : stream.index("}") + 1] for stream in streams}
    assert len(tags) == PARTITIONS
    # The doorbell shares its partition's slot; a conversation's stop channel, its own.
    assert keys.job_bell(3) == "broker:{jobs:3}:bell"
    assert keys.stops("t/conv") == "broker:{c:t/conv}:stop"
    assert keys.stop_channel == "broker:stops"


async def test_a_read_takes_jobs_from_every_partition(queue: JobQueue) -> None:
    for partition in range(PARTITIONS):
        await queue.enqueue(conversation_in(partition), f"turn-{partition}", 1)
    jobs = await read_all(queue, "w1", PARTITIONS)
    assert sorted(job.stream for job in jobs) == sorted(queue.streams)
    for job in jobs:
        assert job.stream == queue.stream_of(job.conversation_id)


async def test_a_resumed_attempts_job_says_so_and_others_do_not(queue: JobQueue) -> None:
    """A decision on a turn's approvals queues its attempt as resumed: the worker takes a
    stream slot for it before it runs (it gave its own back while it waited); no other job."""
    await queue.enqueue(conversation_in(0), "fresh", 1)
    await queue.enqueue(conversation_in(0), "waited", 1, resumed=True)
    jobs = {job.turn_id: job for job in await read_all(queue, "w1", 2)}
    assert (jobs["fresh"].resumed, jobs["waited"].resumed) == (False, True)


async def test_a_read_hands_out_no_more_than_asked_and_keeps_the_rest(queue: JobQueue) -> None:
    # Each partition answers up to its own COUNT: the surplus is held for the next read.
    for partition in range(PARTITIONS):
        for turn in range(3):
            await queue.enqueue(conversation_in(partition), f"turn-{partition}-{turn}", 1)
    first = await read_all(queue, "w1", 5)
    assert len(first) == 5
    assert len({job.stream for job in first}) == 5  # the partitions taken in turn
    rest = await read_all(queue, "w1", 3 * PARTITIONS - 5)
    assert len({(job.stream, job.job_id) for job in first + rest}) == 3 * PARTITIONS


async def test_a_job_abandoned_in_a_later_partition_is_reclaimed(
    queue: JobQueue, aredis: Redis
) -> None:
    conversation = conversation_in(6)
    await queue.enqueue(conversation, "orphan", 1)
    (taken,) = await read_all(queue, "dead-worker", 1)
    assert taken.stream == queue.streams[6]
    await asyncio.sleep(0.05)
    reclaimed = await queue.reclaim("live-worker", idle_ms=20, count=1)
    assert [(job.stream, job.job_id, job.turn_id) for job in reclaimed] == [
        (taken.stream, taken.job_id, "orphan")
    ]
    (entry,) = await pending(aredis, taken.stream)
    assert entry["consumer"] == "live-worker"


async def test_reclaim_walks_every_partitions_pending_list(queue: JobQueue) -> None:
    # Many abandoned jobs in two partitions, reclaimed a few at a time: every one comes back.
    for i in range(30):
        await queue.enqueue(conversation_in(i % 2 + 3), f"turn-{i}", 1)
    assert len(await read_all(queue, "dead-worker", 30)) == 30
    await asyncio.sleep(0.05)
    seen: set[str] = set()
    for _ in range(40):
        seen |= {job.turn_id for job in await queue.reclaim("live-worker", idle_ms=20, count=2)}
        seen |= {job.turn_id for job in await queue.read("live-worker", 2, 1)}
    assert len(seen) == 30


async def test_touch_hand_back_and_done_address_the_jobs_own_partition(
    queue: JobQueue, aredis: Redis
) -> None:
    await queue.enqueue(conversation_in(2), "a", 1)
    await queue.enqueue(conversation_in(7), "b", 1)
    jobs = {job.turn_id: job for job in await read_all(queue, "w1", 2)}
    a, b = jobs["a"], jobs["b"]
    assert (a.stream, b.stream) == (queue.streams[2], queue.streams[7])
    await asyncio.sleep(0.15)
    await queue.touch("w1", a)
    (entry_a,) = await pending(aredis, a.stream)
    (entry_b,) = await pending(aredis, b.stream)
    assert entry_a["time_since_delivered"] < 100 <= entry_b["time_since_delivered"]
    await queue.hand_back("w1", b, 60_000)
    (entry_b,) = await pending(aredis, b.stream)
    assert entry_b["time_since_delivered"] >= 60_000
    await queue.done(a)
    assert await pending(aredis, a.stream) == []
    assert await aredis.xlen(a.stream) == 0
    assert await aredis.xlen(b.stream) == 1  # the other partition is untouched


async def test_malformed_entries_are_settled_and_dropped(queue: JobQueue, aredis: Redis) -> None:
    await aredis.xadd(queue.streams[1], {"conversation_id": "c"})
    await queue.enqueue(conversation_in(1), "fine", 1)
    jobs = await read_all(queue, "w1", 1)
    assert [job.turn_id for job in jobs] == ["fine"]
    assert await aredis.xlen(queue.streams[1]) == 1


async def test_lost_job_streams_are_recreated_by_ensure_group(
    queue: JobQueue, aredis: Redis
) -> None:
    for stream in queue.streams:
        await aredis.delete(stream)
    with pytest.raises(Exception, match="NOGROUP"):
        await queue.read("w1", 1, 1)
    await queue.ensure_group()
    await queue.ensure_group()  # twice is fine
    await queue.enqueue("conv-1", "t", 1)
    assert len(await read_all(queue, "w1", 1)) == 1


async def cluster_way(aredis: Redis) -> tuple[JobQueue, Keys]:
    """A queue of fresh keys that works the cluster way, its consumer group created."""
    keys = Keys(f"jobs{os.getpid()}-{next(_n)}")
    queue = JobQueue(aredis, keys, PARTITIONS, cluster=True)
    await queue.ensure_group()
    return queue, keys


async def test_a_doorbell_wakes_a_cluster_reader_at_once(
    aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a wait longer than the test, only the doorbell can end it early.
    monkeypatch.setattr(jobs_module, "BELL_WAIT_S", 30.0)
    queue, _ = await cluster_way(aredis)
    stopping = asyncio.Event()
    listener = asyncio.create_task(queue.listen(aredis, lambda *_: None, stopping))
    try:
        await asyncio.sleep(0.3)  # subscribed
        reader = asyncio.create_task(queue.read("w1", 1, 60_000, stopping))
        await asyncio.sleep(0.2)
        assert not reader.done()
        started = time.monotonic()
        await queue.enqueue(conversation_in(4), "t", 1)
        await asyncio.wait_for(reader, 5)
        assert time.monotonic() - started < 2
        assert [job.turn_id for job in await queue.read("w1", 1, 100, stopping)] == ["t"]
        # The stop flag ends a wait too.
        reader = asyncio.create_task(queue.read("w1", 1, 60_000, stopping))
        await asyncio.sleep(0.1)
        stopping.set()
        assert await asyncio.wait_for(reader, 5) == []
    finally:
        stopping.set()
        await asyncio.wait_for(listener, 10)


async def bells_subscribed(aredis: Redis, keys: Keys) -> None:
    """Wait until a listener has subscribed to every partition's doorbell (a cluster answers
    per node; a channel counts on its own node only)."""
    channels = [keys.job_bell(i) for i in range(PARTITIONS)]
    cluster = as_cluster(aredis)
    deadline = time.monotonic() + 10
    while True:
        counts = collections.Counter[str]()
        for channel in channels:
            # A cluster is asked on the channel's own node: only it counts the channel's
            # subscribers.
            where = {} if cluster is None else {"target_nodes": cluster.get_node_from_key(channel)}
            for name, n in await aredis.pubsub_shardnumsub(channel, **where):
                counts[name.decode() if isinstance(name, bytes) else name] += int(n)
        if all(counts[channel] > 0 for channel in channels):
            return
        assert time.monotonic() < deadline, f"doorbells not subscribed: {counts}"
        await asyncio.sleep(0.01)


async def test_a_cluster_reader_reads_only_the_partitions_whose_doorbell_rang(
    aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No full read of every partition within the test: only doorbells, and partitions that had
    # more than a read took, make a partition due.
    monkeypatch.setattr(jobs_module, "BELL_WAIT_S", 30.0)
    queue, keys = await cluster_way(aredis)
    quiet, rung = queue.streams[2], queue.streams[5]
    stopping = asyncio.Event()
    listener = asyncio.create_task(queue.listen(aredis, lambda *_: None, stopping))
    try:
        await bells_subscribed(aredis, keys)
        # The first read after subscribing reads every partition (doorbells may have been
        # missed before); this job proves the whole round trip works.
        await queue.enqueue(conversation_in(5), "first", 1)
        assert [job.turn_id for job in await read_all(queue, "w1", 1)] == ["first"]
        # A job whose doorbell never rang waits; a rung partition is read, and read again
        # without a doorbell while it answers as many jobs as asked.
        await aredis.xadd(
            quiet, {"conversation_id": conversation_in(2), "turn_id": "quiet", "attempt": "1"}
        )
        for turn in ("b", "c"):
            await aredis.xadd(
                rung, {"conversation_id": conversation_in(5), "turn_id": turn, "attempt": "1"}
            )
        await queue.enqueue(conversation_in(5), "d", 1)
        got = [job.turn_id for _ in range(3) for job in await read_all(queue, "w1", 1)]
        assert got == ["b", "c", "d"]
        assert await queue.read("w1", 1, 200, stopping) == []
        assert (await aredis.xinfo_groups(quiet))[0]["pending"] == 0
        assert await aredis.xlen(quiet) == 1
    finally:
        stopping.set()
        await asyncio.wait_for(listener, 10)


async def test_a_job_whose_doorbell_was_missed_is_read_by_the_next_full_read(
    aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "BELL_WAIT_S", 0.2)
    keys = Keys(f"jobs{os.getpid()}-{next(_n)}")
    queue = JobQueue(aredis, keys, PARTITIONS, cluster=True)  # no listener: no doorbell at all
    await queue.ensure_group()
    assert await queue.read("w1", 1, 100) == []
    await aredis.xadd(
        queue.streams[2],
        {"conversation_id": conversation_in(2), "turn_id": "missed", "attempt": "1"},
    )
    assert [job.turn_id for job in await read_all(queue, "w1", 1)] == ["missed"]


@pytest.mark.parametrize("cluster", MODES)
async def test_a_stop_reaches_the_listener_of_the_running_turn(
    aredis: Redis, cluster: bool | None
) -> None:
    keys = Keys(f"jobs{os.getpid()}-{next(_n)}")
    queue = JobQueue(aredis, keys, PARTITIONS, cluster=cluster)
    stops: list[tuple[str, str, int]] = []
    stopping = asyncio.Event()
    listener = asyncio.create_task(queue.listen(aredis, lambda *stop: stops.append(stop), stopping))
    try:
        await queue.watch_stops("t/conv")
        await asyncio.sleep(0.3)
        await queue.publish_stop("t/conv", "turn-1", 2)
        await wait_for(lambda: stops == [("t/conv", "turn-1", 2)])
        await queue.unwatch_stops("t/conv")
        await asyncio.sleep(0.3)
        await queue.publish_stop("t/conv", "turn-1", 3)
        await asyncio.sleep(0.3)
        # A single server's one channel reaches every listener; a sharded one only watchers.
        classic = cluster is None and as_cluster(aredis) is None
        assert len(stops) == (2 if classic else 1)
    finally:
        stopping.set()
        await asyncio.wait_for(listener, 10)


async def wait_for(condition: Any, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_worker_takes_jobs_from_every_partition(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    partitions = broker.settings.job_partitions
    turns = [
        start_turn(
            broker.base_url,
            conversation_id=conversation_in(p, partitions),
            turn_id=f"every-{p}",
            tokens=2,
            tokens_per_s=0,
        )
        for p in range(partitions)
    ]
    for turn in turns:
        assert wait_final(broker.base_url, turn["turn_id"])["status"] == "complete"

    async def queued() -> int:
        return sum([await broker.runtime.redis.xlen(s) for s in broker.runtime.jobs.streams])

    deadline = time.monotonic() + 5
    while broker.call(queued()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert broker.call(queued()) == 0  # every job settled on its own partition
