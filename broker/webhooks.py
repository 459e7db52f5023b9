"""Completion webhooks, the API side: a turn's ``notify`` target, and the watch that makes its
notification a durable job before the attempt can end.

A turn is watched when it names its own URL (``notify.url``, stored on the turn hash as
``notify``) or its tenant has one configured (``BROKER_WEBHOOK_URLS``, ``BROKER_WEBHOOK_URL``).
Each attempt of a watched turn gets one job on the ``webhooks`` queue, a :class:`JobQueue` of
its own partitions, added *before* the attempt's generation job: whatever happens to the
attempt, its notification is already in Redis. The worker side (:mod:`broker.notifier`) keeps
the job pending until the attempt is at rest, then sends it; a crash anywhere leaves the job
pending for another worker.

The job's id is kept on the turn hash (``webhook_job:<attempt>``) so that a worker that ends
the attempt can take the job at once instead of waiting for its next look.

A tool call of a watched turn that waits for a person gets a job of its own, naming its
approval (:meth:`Webhooks.watch_approval`, called by the ledger each time the request is met,
so a crash right after the request loses nothing): it is sent at once (``approval.requested``),
so that an app can tell its user on another device.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.jobs import JobQueue
from broker.keys import Keys
from broker.vocabulary import unscoped
from broker.webhook_config import MAX_URL_CHARS, WebhookConfig

QUEUE = "webhooks"


class NotifyRequest(BaseModel):
    """A turn's ``notify``: where the broker POSTs once each attempt of the turn is at rest."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(
        min_length=1,
        max_length=MAX_URL_CHARS,
        description="an http:// or https:// URL whose host and port BROKER_WEBHOOK_HOSTS allows "
        "(80 and 443 for an entry without a port) and whose addresses are public unless the "
        "operator allows others; receives a signed JSON POST (Standard Webhooks)",
    )


def webhook_queue(redis: Redis, keys: Keys, partitions: int) -> JobQueue:
    """The notifications' queue: ``partitions`` streams ``<prefix>:{webhooks:<i>}``, polled
    (no doorbells: a notification waits for its turn anyway)."""
    return JobQueue(redis, keys, partitions, queue=QUEUE, bells=False)


class Webhooks:
    """Watches attempts whose turn has a notify target."""

    def __init__(self, redis: Redis, keys: Keys, queue: JobQueue, config: WebhookConfig) -> None:
        self._redis = redis
        self._keys = keys
        self.queue = queue
        self.config = config

    def check(self, url: str | None) -> str:
        """A turn's ``notify.url`` checked (400, 422), or "" when the turn names none."""
        return "" if url is None else self.config.turn_url(url)

    async def watch(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        """Queue the notification of ``attempt``'s end if the turn has a target (a scoped
        conversation id); nothing when webhooks are off."""
        if not await self._has_target(conversation_id, turn_id):
            return  # webhooks are off, or neither the tenant nor the turn has a target
        job_id = await self.queue.enqueue(conversation_id, turn_id, attempt)
        turn_key = self._keys.turn(conversation_id, turn_id)
        await self._redis.hset(turn_key, f"webhook_job:{attempt}", job_id)

    async def watch_approval(self, conversation_id: str, turn_id: str, approval_id: str) -> None:
        """Queue the notification that a tool call of the turn waits for a person, if the turn
        has a target (sent at once; a request met again queues it again, and a second job of a
        delivered one is settled unsent); nothing when webhooks are off."""
        if await self._has_target(conversation_id, turn_id):
            await self.queue.enqueue(conversation_id, turn_id, 0, approval_id=approval_id)

    async def _has_target(self, conversation_id: str, turn_id: str) -> bool:
        """Whether webhooks are on and the turn (or its tenant) has a target."""
        if not self.config.enabled:
            return False
        if self.config.tenant_url(unscoped(conversation_id)[0]) is not None:
            return True
        turn_key = self._keys.turn(conversation_id, turn_id)
        return bool(await rc.hget(self._redis, turn_key, "notify"))
