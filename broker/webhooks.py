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
        if not self.config.enabled:
            return
        turn_key = self._keys.turn(conversation_id, turn_id)
        tenant = unscoped(conversation_id)[0]
        if self.config.tenant_url(tenant) is None and not await rc.hget(
            self._redis, turn_key, "notify"
        ):
            return  # neither the tenant nor the turn has a target
        job_id = await self.queue.enqueue(conversation_id, turn_id, attempt)
        await self._redis.hset(turn_key, f"webhook_job:{attempt}", job_id)
