"""A tenant's limits on starting work: a token bucket for generations, a cap on live streams.

Both live in one Lua script on the tenant's keys (``admit_turn``), so every API process shares
them. Every generation is charged: a new turn, and each ``continue`` or ``regenerate`` attempt.
A live stream is an attempt queued or generating; its slot is freed when the attempt ends, or
when its deadline passes (a crashed process cannot hold a slot for ever; the worker running the
attempt pushes the deadline forward). A turn that waited for a person gave its slot back: the
worker holds a slot for its resumed attempt before it runs it (:meth:`Admission.hold`), and the
resume waits, queued, for a free one.
"""

from __future__ import annotations

import logging
import math
import time

from redis.exceptions import RedisError

from broker import redis_calls as rc
from broker.deps import Deps
from broker.errors import TooManyRequests
from broker.vocabulary import ACTIVE_STATUSES, TurnStatus, encode_attempt_ref, unscoped

log = logging.getLogger("broker.admission")

# A slot counts until its attempt ends, or until its deadline: long enough to wait in a queue,
# pushed forward while the attempt runs, and short enough that a lost slot comes back.
QUEUED_SLOT_TTL_MS = 3_600_000
RUNNING_SLOT_TTL_MS = 600_000


class Admission:
    """Charges and frees a tenant's limits; ``conversation_id`` is always the scoped id."""

    def __init__(self, deps: Deps) -> None:
        self._redis = deps.redis
        self._scripts = deps.scripts
        self._keys = deps.keys
        self._settings = deps.settings
        self._metrics = deps.metrics

    @property
    def counts_streams(self) -> bool:
        return self._settings.max_streams_per_tenant > 0

    async def admit(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Take a rate token and a live-stream slot for one attempt, or raise 429."""
        settings = self._settings
        if settings.turn_rate_per_s <= 0 and not self.counts_streams:
            return
        tenant, _ = unscoped(conversation_id)
        admitted = await self._scripts.admit_turn(
            rate=self._keys.turn_rate(tenant),
            live=self._keys.live_streams(tenant),
            rate_per_s=settings.turn_rate_per_s,
            burst=settings.turn_burst,
            cost=1,
            max_live=settings.max_streams_per_tenant,
            member=encode_attempt_ref(conversation_id, turn_id, attempt),
            slot_ttl_ms=QUEUED_SLOT_TTL_MS,
        )
        if admitted.admitted:
            return
        retry_after_s = math.ceil(admitted.retry_after_ms / 1000)
        reason = admitted.reason
        self._metrics.turns_refused.labels(reason).inc()
        who = f"tenant {tenant!r}" if tenant else "this broker"
        if reason == "rate":
            raise TooManyRequests(
                f"{who} starts generations faster than BROKER_TURN_RATE_PER_S="
                f"{settings.turn_rate_per_s:g} (burst {settings.turn_burst}); retry in "
                f"{retry_after_s} s",
                retry_after_s=retry_after_s,
                code="rate_limited",
            )
        raise TooManyRequests(
            f"{who} has BROKER_MAX_STREAMS_PER_TENANT={settings.max_streams_per_tenant} turns "
            "queued or generating; wait for one to finish",
            retry_after_s=retry_after_s,
            code="too_many_streams",
        )

    async def hold(self, conversation_id: str, turn_id: str, attempt: int) -> bool:
        """Whether a worker may run a queued attempt: its live-stream slot is held (a turn or a
        new attempt took it when it was admitted), or one is free and taken now (a turn that
        waited for a person let its slot go, and its decision queued it again: it takes no rate
        token, it was charged when it started). False: the tenant has none free, and the
        attempt stays queued until one frees (the worker hands its job back)."""
        if not self.counts_streams:
            return True
        turn = self._keys.turn(conversation_id, turn_id)
        status, current = await rc.hmget(self._redis, turn, ["status", "attempt"])
        if status != TurnStatus.QUEUED or current != str(attempt):
            return True  # not waiting to start: the lease claim settles what it is
        admitted = await self._scripts.admit_turn(
            rate=self._keys.turn_rate(unscoped(conversation_id)[0]),
            live=self._keys.live_streams(unscoped(conversation_id)[0]),
            rate_per_s=self._settings.turn_rate_per_s,
            burst=self._settings.turn_burst,
            cost=0,
            max_live=self._settings.max_streams_per_tenant,
            member=encode_attempt_ref(conversation_id, turn_id, attempt),
            slot_ttl_ms=QUEUED_SLOT_TTL_MS,
        )
        return admitted.admitted

    async def release(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Free one attempt's slot (it ended, or it never started)."""
        if not self.counts_streams:
            return
        key = self._keys.live_streams(unscoped(conversation_id)[0])
        try:
            await self._redis.zrem(key, encode_attempt_ref(conversation_id, turn_id, attempt))
        except (RedisError, OSError) as exc:  # the slot's deadline frees it later
            log.warning("could not free the stream slot of turn %s: %s", turn_id, exc)

    async def release_if_done(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Free the attempt's slot unless that attempt is queued or generating right now."""
        if not self.counts_streams:
            return
        try:
            status, current = await rc.hmget(
                self._redis, self._keys.turn(conversation_id, turn_id), ["status", "attempt"]
            )
        except (RedisError, OSError) as exc:
            log.warning("could not free the stream slot of turn %s: %s", turn_id, exc)
            return
        if status in ACTIVE_STATUSES and current == str(attempt):
            return
        await self.release(conversation_id, turn_id, attempt)

    async def refresh(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Push a running attempt's deadline forward (called now and then by its worker)."""
        if not self.counts_streams:
            return
        key = self._keys.live_streams(unscoped(conversation_id)[0])
        deadline = int(time.time() * 1000) + RUNNING_SLOT_TTL_MS
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {encode_attempt_ref(conversation_id, turn_id, attempt): deadline})
            pipe.pexpire(key, QUEUED_SLOT_TTL_MS)
            await pipe.execute()
