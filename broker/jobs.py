"""The job queue: generation jobs on partitioned Redis streams read by the workers' consumer
group, and the stop notifications that reach the worker running an attempt.

The API side only enqueues and publishes; the worker side reads, reclaims, refreshes and settles.
This room imports only the ground floor (keys, vocabulary, typed Redis calls), so an API-role
process never loads the generation side.

The queue is ``job_partitions`` streams, each in a slot of its own; a conversation's jobs all go
to one of them (:func:`broker.keys.job_partition`). A job stays pending in the group of its
partition until its attempt is settled. A worker that dies leaves it pending; another takes it
over with ``XAUTOCLAIM`` once it has been idle past the reclaim time. A live worker keeps its
jobs' idle time low (:meth:`JobQueue.touch`) with its lease heartbeat.

How a worker waits for jobs depends on the server:

* one server: one ``XREADGROUP ... BLOCK`` over every partition, on one connection;
* a cluster refuses a read of keys in different slots, and a blocking connection per partition
  per process would not scale: the worker waits for doorbells, sharded Pub/Sub messages that
  :meth:`JobQueue.enqueue` sends in the partition's slot, and reads, without blocking, only the
  partitions whose doorbell rang (and those that had more jobs than it took). Once every
  :data:`BELL_WAIT_S` it reads every partition (in one pipeline, sent per node), so a missed
  doorbell costs at most that; and a partition's key takes a few commands per job, not one per
  job of every partition.

Stop notifications go on one classic channel on a single server, and on a cluster on each
conversation's own sharded channel, which a worker subscribes to while it runs one of the
conversation's turns. A missed notification is not lost either way: the stop flag is durable,
and appends and heartbeats check it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterPubSub
from redis.exceptions import RedisClusterException, RedisError

from broker import redis_calls as rc
from broker.connection import as_cluster, route
from broker.keys import JOB_GROUP, Keys, job_partition
from broker.vocabulary import decode_attempt_ref, encode_attempt_ref

log = logging.getLogger("broker.jobs")

# On a cluster: how often a worker reads every partition, whatever the doorbells said (the
# longest a job whose doorbell was missed waits).
BELL_WAIT_S = 1.0
# On a cluster, the subscriber waits this long on each node in turn (redis-py reads one node's
# connection at a time): a doorbell or a stop is seen within this times the nodes but one.
BELL_POLL_S = 0.05
# After a subscription failed (Redis away, a failover), the subscriber tries again this late.
RESUBSCRIBE_S = 1.0
# What a subscription raises when Redis is away, or a cluster's slot map is being rebuilt.
SUBSCRIPTION_ERRORS = (RedisError, RedisClusterException, OSError)


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One generation job: run ``attempt`` of a turn. ``conversation_id`` is the scoped id;
    ``stream`` the partition the job was read from, where it is refreshed and settled. A
    notification job of an approval request (``broker.webhooks``) names its ``approval_id``;
    ``resumed``: the attempt of a turn that waited for a person, queued again by a decision (it
    let its tenant's stream slot go while it waited, and takes one again before it runs)."""

    stream: str
    job_id: str
    conversation_id: str
    turn_id: str
    attempt: int
    approval_id: str | None = None
    resumed: bool = False

    @classmethod
    def parse(cls, stream: str, job_id: str, fields: rc.Fields | None) -> Job | None:
        """The job of a stream entry; None when the entry is malformed (it is dropped)."""
        if not fields:
            return None
        values = rc.fields_dict(fields)
        try:
            return cls(
                stream,
                job_id,
                values["conversation_id"],
                values["turn_id"],
                int(values["attempt"]),
                values.get("approval"),
                values.get("resumed") == "1",
            )
        except (KeyError, ValueError):
            return None


def _stream_entries(reply: Any) -> list[tuple[str, rc.RawEntries]]:
    """``(stream, entries)`` of an XREADGROUP reply, in RESP2 (a list) or RESP3 (a dict)."""
    if not reply:
        return []
    items = reply.items() if isinstance(reply, dict) else reply
    return [(str(stream), cast(rc.RawEntries, entries)) for stream, entries in items]


class JobQueue:
    """The job partitions and the stop notifications of one key prefix.

    ``redis`` serves every call but :meth:`listen`. ``cluster`` chooses the cluster way (polled
    reads with doorbells, sharded stop channels) or the single server's; by default it follows
    ``redis``. One server serves the cluster way too, which tests use.

    ``queue`` names the queue: ``jobs`` (generations) or ``webhooks`` (completion
    notifications, :mod:`broker.webhooks`), each its own partitions with the same consumer
    group. ``bells=False`` sends no doorbells: a queue whose readers poll (on a cluster, every
    :data:`BELL_WAIT_S`) and hear nothing.
    """

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        partitions: int,
        *,
        cluster: bool | None = None,
        queue: str = "jobs",
        bells: bool = True,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._partitions = partitions
        self._cluster = as_cluster(redis) is not None if cluster is None else cluster
        self._ring = bells
        self.streams = tuple(keys.job_stream(i, queue) for i in range(partitions))
        self._bells = {keys.job_bell(i, queue): self.streams[i] for i in range(partitions)}
        # On a cluster: the partitions to read next, their doorbell rang or they had more jobs
        # than the last read took; and when every partition is read again (loop time).
        self._due: set[str] = set()
        self._full_poll_at = 0.0
        # Each partition's XAUTOCLAIM cursor: a pass goes on where the last one stopped.
        self._reclaim_cursors = dict.fromkeys(self.streams, "0-0")
        # Jobs delivered to this consumer beyond what a read asked for (each partition answers
        # up to its COUNT): handed out first by the next read.
        self._held: collections.deque[Job] = collections.deque()
        self._bell = asyncio.Event()
        self._pubsub: PubSub | None = None
        # The sharded stop channels this process listens on, with how many turns want each.
        self._watched: collections.Counter[str] = collections.Counter()

    def stream_of(self, conversation_id: str) -> str:
        """The partition that carries a (scoped) conversation's jobs."""
        return self.streams[job_partition(conversation_id, self._partitions)]

    async def enqueue(
        self,
        conversation_id: str,
        turn_id: str,
        attempt: int,
        approval_id: str | None = None,
        *,
        resumed: bool = False,
    ) -> str:
        """Put a job for one attempt of a turn (or one of its approval requests) on its
        conversation's partition; its job id. ``resumed``: see :class:`Job`."""
        partition = job_partition(conversation_id, self._partitions)
        stream = self.streams[partition]
        job = {"conversation_id": conversation_id, "turn_id": turn_id, "attempt": str(attempt)}
        if approval_id is not None:
            job["approval"] = approval_id
        if resumed:
            job["resumed"] = "1"
        if not self._cluster or not self._ring:
            return str(await self._redis.xadd(stream, job))  # type: ignore[arg-type]
        # The doorbell shares the partition's slot: one round trip. A lost doorbell only delays
        # the job until the next poll, so its failure does not fail the enqueue.
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xadd(stream, job)  # type: ignore[arg-type]
            pipe.spublish(self._keys.job_bell(partition), "")
            job_id, _ = await pipe.execute(raise_on_error=False)
        if isinstance(job_id, Exception):
            raise job_id
        return str(job_id)

    async def ensure_group(self) -> None:
        """Create the workers' consumer group (and the job stream) on every partition that has
        none yet."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xgroup_create(stream, JOB_GROUP, id="0", mkstream=True)
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and "BUSYGROUP" not in str(reply):
                raise reply

    async def read(
        self, consumer: str, count: int, block_ms: int, stopping: asyncio.Event | None = None
    ) -> list[Job]:
        """Up to ``count`` new jobs for ``consumer`` from every partition, waiting up to
        ``block_ms`` (at least 1) for one.

        On a cluster the wait is for a doorbell, at most :data:`BELL_WAIT_S`, and ends early
        when ``stopping`` is set; a read that waited answers no job (the caller reads again).
        """
        if self._held:
            return [self._held.popleft() for _ in range(min(count, len(self._held)))]
        if self._cluster:
            batches = await self._read_due(consumer, count)
            if not any(entries for _, entries in batches):
                wait_s = self._full_poll_at - asyncio.get_running_loop().time()
                await self._wait_for_bell(min(block_ms / 1000, max(0.0, wait_s)), stopping)
                return []
        else:
            per_stream = -(-count // self._partitions)  # at least one each, about count in all
            reply = await self._redis.xreadgroup(
                JOB_GROUP,
                consumer,
                dict.fromkeys(self.streams, ">"),
                count=per_stream,
                block=max(1, block_ms),
            )
            batches = _stream_entries(reply)
        jobs = await self._decode(batches)
        self._held.extend(jobs[count:])
        return jobs[:count]

    async def _read_due(self, consumer: str, count: int) -> list[tuple[str, rc.RawEntries]]:
        """On a cluster: one non-blocking read of each partition due (all of them once every
        :data:`BELL_WAIT_S`), in one pipeline (split per node)."""
        now = asyncio.get_running_loop().time()
        if now >= self._full_poll_at:
            self._full_poll_at = now + BELL_WAIT_S
            streams = list(self.streams)
        else:
            streams = [stream for stream in self.streams if stream in self._due]
        # Cleared before the read: a doorbell from now on makes its partition due again and
        # ends the wait that follows an empty read.
        self._due.clear()
        self._bell.clear()
        if not streams:
            return []
        per_stream = -(-count // len(streams))  # at least one each, about count in all
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                command = ("XREADGROUP", "GROUP", JOB_GROUP, consumer, "COUNT", per_stream)
                pipe.execute_command(*command, "STREAMS", stream, ">", **route(self._redis, stream))
            replies = await pipe.execute()
        batches = [batch for reply in replies for batch in _stream_entries(reply)]
        # A partition that answered all it was asked may hold more: read it again next time.
        self._due.update(stream for stream, entries in batches if len(entries) >= per_stream)
        return batches

    def _wake_all(self) -> None:
        """On a cluster: read every partition at the next read (doorbells may have been missed)."""
        self._full_poll_at = 0.0
        self._bell.set()

    async def _wait_for_bell(self, timeout_s: float, stopping: asyncio.Event | None) -> None:
        waiters = [asyncio.ensure_future(self._bell.wait())]
        if stopping is not None:
            waiters.append(asyncio.ensure_future(stopping.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _decode(self, batches: Iterable[tuple[str, rc.RawEntries]]) -> list[Job]:
        """The jobs of ``(stream, entries)`` batches, taking the partitions in turn (so no
        partition waits behind another's backlog); malformed entries are settled and dropped."""
        columns: list[list[Job]] = []
        for stream, entries in batches:
            jobs: list[Job] = []
            for job_id, fields in entries:
                job = Job.parse(stream, job_id, fields)
                if job is None:
                    log.error("dropping malformed job %s of %s: %r", job_id, stream, fields)
                    await self._settle(stream, [job_id])
                else:
                    jobs.append(job)
            columns.append(jobs)
        return [job for row in itertools.zip_longest(*columns) for job in row if job is not None]

    async def reclaim(self, consumer: str, idle_ms: int, count: int) -> list[Job]:
        """About ``count`` jobs idle past ``idle_ms`` (their worker stopped refreshing them),
        taken from every partition and now ``consumer``'s; beyond ``count``, they are held for
        the next :meth:`read`. Pending jobs whose entries were deleted meanwhile are settled.

        Redis scans only COUNT x 10 pending entries per call: each partition keeps a cursor
        across calls, so the whole pending list is walked, or dead jobs behind many live ones
        would never be reached.
        """
        per_stream = -(-count // self._partitions)
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xautoclaim(
                    stream,
                    JOB_GROUP,
                    consumer,
                    min_idle_time=idle_ms,
                    start_id=self._reclaim_cursors[stream],
                    count=per_stream,
                )
            replies: list[Any] = await pipe.execute()
        batches: list[tuple[str, rc.RawEntries]] = []
        for stream, reply in zip(self.streams, replies, strict=True):
            self._reclaim_cursors[stream] = str(reply[0])
            claimed = cast(rc.RawEntries, reply[1])
            gone = [job_id for job_id, fields in claimed if not fields]  # deleted, Redis 6.2
            deleted = [*cast(list[str], reply[2] if len(reply) > 2 else []), *gone]
            if deleted:
                await self._settle(stream, deleted)  # nothing to run
            batches.append((stream, [(i, f) for i, f in claimed if f]))
        jobs = await self._decode(batches)
        self._held.extend(jobs[count:])
        return jobs[:count]

    async def claim(self, consumer: str, stream: str, job_id: str) -> Job | None:
        """Take one pending job by its id, whoever holds it (it is ``consumer``'s now); None when
        it is settled, deleted or not yet read by anyone."""
        claimed = await self._redis.xclaim(stream, JOB_GROUP, consumer, 0, [job_id])
        for entry_id, fields in cast(rc.RawEntries, claimed or []):
            return Job.parse(stream, str(entry_id), fields)
        return None

    async def touch(self, consumer: str, job: Job) -> None:
        """Reset a job's idle time, so that no other worker reclaims a live job."""
        await self._redis.xclaim(job.stream, JOB_GROUP, consumer, 0, [job.job_id], justid=True)

    async def hand_back(self, consumer: str, job: Job, idle_ms: int) -> None:
        """Make a job look abandoned at once, so that the next reclaim pass takes it; when
        Redis is away, it is reclaimed once it idles instead."""
        with contextlib.suppress(RedisError, OSError):
            await self._redis.xclaim(
                job.stream, JOB_GROUP, consumer, 0, [job.job_id], idle=idle_ms, justid=True
            )

    async def done(self, job: Job) -> None:
        """Settle a job: acknowledged and deleted from its partition."""
        await self._settle(job.stream, [job.job_id])

    async def _settle(self, stream: str, job_ids: list[str]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, JOB_GROUP, *job_ids)
            pipe.xdel(stream, *job_ids)
            await pipe.execute()

    async def publish_stop(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Tell the worker running ``attempt`` of a turn to stop, wherever it runs."""
        message = encode_attempt_ref(conversation_id, turn_id, attempt)
        if self._cluster:
            await self._redis.spublish(self._keys.stops(conversation_id), message)
        else:
            await self._redis.publish(self._keys.stop_channel, message)

    async def watch_stops(self, conversation_id: str) -> None:
        """Receive the stop notifications of a conversation's turns while one runs here, until
        :meth:`unwatch_stops`. Only a cluster needs it (a single server's one channel reaches
        every worker); a failed subscription is left to the durable stop flag."""
        if not self._cluster:
            return
        channel = self._keys.stops(conversation_id)
        self._watched[channel] += 1
        if self._watched[channel] == 1 and self._pubsub is not None:
            try:
                await self._pubsub.ssubscribe(channel)
            except SUBSCRIPTION_ERRORS as exc:
                log.warning("cannot subscribe to %s: %s; the stop flag stays", channel, exc)

    async def unwatch_stops(self, conversation_id: str) -> None:
        """The end of :meth:`watch_stops` for one turn of the conversation."""
        if not self._cluster:
            return
        channel = self._keys.stops(conversation_id)
        self._watched[channel] -= 1
        if self._watched[channel] > 0:
            return
        del self._watched[channel]
        if self._pubsub is not None:
            with contextlib.suppress(*SUBSCRIPTION_ERRORS):
                await self._pubsub.sunsubscribe(channel)

    async def listen(
        self,
        redis: Redis,
        on_stop: Callable[[str, str, int], None],
        stopping: asyncio.Event,
    ) -> None:
        """Call ``on_stop(conversation_id, turn_id, attempt)`` for each stop notification (and
        on a cluster, ring the readers' doorbell for each job enqueued) until ``stopping`` is
        set, subscribing again after a connection error.

        ``redis`` is a client whose connections may block (the subscription holds one, on a
        cluster one per node).
        """
        failed = False
        while not stopping.is_set():
            pubsub = redis.pubsub()
            try:
                if self._cluster:
                    await self._serve_sharded(pubsub, on_stop, stopping, refresh=failed)
                else:
                    await self._serve_classic(pubsub, on_stop, stopping)
            except SUBSCRIPTION_ERRORS as exc:
                log.warning("stop notifications interrupted: %s; resubscribing in 1 s", exc)
                failed = True
                await asyncio.sleep(RESUBSCRIBE_S)
            except Exception:
                # Never let the listener die quietly: stops would wait for the heartbeats.
                log.exception("stop notifications failed; resubscribing in 1 s")
                failed = True
                await asyncio.sleep(RESUBSCRIBE_S)
            finally:
                self._pubsub = None
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py

    async def _serve_classic(
        self, pubsub: PubSub, on_stop: Callable[[str, str, int], None], stopping: asyncio.Event
    ) -> None:
        await pubsub.subscribe(self._keys.stop_channel)
        while not stopping.is_set():
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                on_stop(*decode_attempt_ref(str(message["data"])))

    async def _serve_sharded(
        self,
        pubsub: PubSub,
        on_stop: Callable[[str, str, int], None],
        stopping: asyncio.Event,
        *,
        refresh: bool,
    ) -> None:
        if isinstance(pubsub, ClusterPubSub):
            # The slot map routes each channel to its node. After a failure (a failover, a
            # moved slot) it is read again: a client that ran no command since holds the old.
            if refresh:
                await pubsub.cluster.nodes_manager.initialize()
            else:
                await pubsub.cluster.initialize()
        self._pubsub = pubsub
        for channel in [*sorted(self._bells), *self._watched]:
            await pubsub.ssubscribe(channel)
        self._wake_all()  # jobs may have come while no doorbell was heard: read them all at once
        wait_s = BELL_POLL_S
        while not stopping.is_set():
            message = await self._next_sharded(pubsub, wait_s)
            # Each call answers one message of one node, taking the nodes in turn: after one,
            # look again without waiting, so a node's queue (subscription confirmations too)
            # drains at once instead of one message per round of waits.
            wait_s = BELL_POLL_S if message is None else 0.0
            if message is None or message["type"] != "smessage":
                continue
            stream = self._bells.get(str(message["channel"]))
            if stream is not None:
                self._due.add(stream)
                self._bell.set()
            else:
                on_stop(*decode_attempt_ref(str(message["data"])))

    @staticmethod
    async def _next_sharded(pubsub: PubSub, wait_s: float) -> dict[str, Any] | None:
        """The next message of any node, confirmations included, waiting up to ``wait_s`` on
        each node in turn."""
        if isinstance(pubsub, ClusterPubSub):
            message: dict[str, Any] | None = await pubsub.get_sharded_message(timeout=wait_s)
        else:  # one server serves sharded channels too (Redis 7)
            message = await pubsub.get_message(timeout=wait_s)
        return message
