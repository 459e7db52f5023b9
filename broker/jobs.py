"""The job queue: generation jobs on a Redis stream read by the workers' consumer group, and the
stop channel that reaches the worker running an attempt.

The API side only enqueues and publishes; the worker side reads, reclaims, refreshes and settles.
This room imports only the ground floor (keys, vocabulary, typed Redis calls), so an API-role
process never loads the generation side.

A job stays pending in the group until its attempt is settled. A worker that dies leaves it
pending; another takes it over with ``XAUTOCLAIM`` once it has been idle past the reclaim time. A
live worker keeps its jobs' idle time low (:meth:`JobQueue.touch`) with its lease heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from broker import redis_calls as rc
from broker.keys import JOB_GROUP, Keys
from broker.vocabulary import decode_attempt_ref, encode_attempt_ref

log = logging.getLogger("broker.jobs")


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One generation job: run ``attempt`` of a turn. ``conversation_id`` is the scoped id."""

    job_id: str
    conversation_id: str
    turn_id: str
    attempt: int

    @classmethod
    def parse(cls, job_id: str, fields: dict[str, str]) -> Job | None:
        """The job of a stream entry; None when the entry is malformed (it is dropped)."""
        try:
            return cls(job_id, fields["conversation_id"], fields["turn_id"], int(fields["attempt"]))
        except (KeyError, ValueError):
            return None


class JobQueue:
    """The job stream and the stop channel of one key prefix."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self._redis = redis
        self._stream = keys.jobs
        self._channel = keys.stop_channel
        self._reclaim_cursor = "0-0"

    async def enqueue(self, conversation_id: str, turn_id: str, attempt: int) -> str:
        """Put a job for one attempt of a turn on the queue; its job id."""
        job = {"conversation_id": conversation_id, "turn_id": turn_id, "attempt": attempt}
        return str(await self._redis.xadd(self._stream, job))  # type: ignore[arg-type]

    async def ensure_group(self) -> None:
        """Create the workers' consumer group (and the job stream) if they do not exist yet."""
        try:
            await self._redis.xgroup_create(self._stream, JOB_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(
        self, consumer: str, count: int, block_ms: int
    ) -> list[tuple[str, dict[str, str]]]:
        """Up to ``count`` new jobs for ``consumer``, waiting up to ``block_ms`` for one."""
        return await rc.xreadgroup(self._redis, JOB_GROUP, consumer, self._stream, count, block_ms)

    async def reclaim(
        self, consumer: str, idle_ms: int, count: int
    ) -> tuple[list[tuple[str, dict[str, str]]], list[str]]:
        """Jobs idle past ``idle_ms`` (their worker stopped refreshing them), now
        ``consumer``'s, and the ids of pending jobs whose entries were deleted meanwhile.

        Redis scans only COUNT x 10 pending entries per call: the queue walks the whole list
        with a cursor across calls, or dead jobs behind many live ones would never be reached.
        """
        cursor, claimed, deleted = await rc.xautoclaim(
            self._redis, self._stream, JOB_GROUP, consumer, idle_ms, count, self._reclaim_cursor
        )
        self._reclaim_cursor = cursor
        return claimed, deleted

    async def touch(self, consumer: str, job_id: str) -> None:
        """Reset a job's idle time, so that no other worker reclaims a live job."""
        await self._redis.xclaim(self._stream, JOB_GROUP, consumer, 0, [job_id], justid=True)

    async def hand_back(self, consumer: str, job_id: str, idle_ms: int) -> None:
        """Make a job look abandoned at once, so that the next reclaim pass takes it; when
        Redis is away, it is reclaimed once it idles instead."""
        with contextlib.suppress(RedisError, OSError):
            await self._redis.xclaim(
                self._stream, JOB_GROUP, consumer, 0, [job_id], idle=idle_ms, justid=True
            )

    async def done(self, job_id: str) -> None:
        """Settle a job: acknowledged and deleted."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xack(self._stream, JOB_GROUP, job_id)
            pipe.xdel(self._stream, job_id)
            await pipe.execute()

    async def publish_stop(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Tell the worker running ``attempt`` of a turn to stop, wherever it runs."""
        await self._redis.publish(
            self._channel, encode_attempt_ref(conversation_id, turn_id, attempt)
        )

    async def listen_for_stops(
        self,
        redis: Redis,
        on_stop: Callable[[str, str, int], None],
        stopping: asyncio.Event,
    ) -> None:
        """Call ``on_stop(conversation_id, turn_id, attempt)`` for each stop notification
        until ``stopping`` is set, subscribing again after a connection error.

        ``redis`` is a client whose connections may block (the subscription holds one). A
        missed message is not lost: the stop flag is durable, and appends and heartbeats check
        it.
        """
        while not stopping.is_set():
            pubsub = redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                while not stopping.is_set():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None:
                        on_stop(*decode_attempt_ref(str(message["data"])))
            except (RedisError, OSError) as exc:
                log.warning("stop notifications interrupted: %s; resubscribing in 1 s", exc)
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py
