"""The dependencies most rooms share, carried as one object instead of five arguments."""

from __future__ import annotations

import dataclasses
import logging
import time

from redis.asyncio import Redis

from broker.keys import Keys
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings

log = logging.getLogger("broker.replication")

SHORT_WAIT_LOG_EVERY_S = 10.0  # a replica away would otherwise log on every write


@dataclasses.dataclass(frozen=True, slots=True)
class Deps:
    """One process's Redis client (non-blocking calls only), its scripts, key builder,
    settings and metrics."""

    redis: Redis
    scripts: Scripts
    keys: Keys
    settings: Settings
    metrics: Metrics

    @classmethod
    def build(cls, redis: Redis, settings: Settings, metrics: Metrics | None = None) -> Deps:
        """The usual set for ``redis``: its scripts registered (waiting for the replicas the
        settings ask for), keys of the settings' prefix."""
        metrics = metrics or Metrics()
        scripts = scripts_for(redis, settings, metrics)
        return cls(redis, scripts, Keys(settings.key_prefix), settings, metrics)


def scripts_for(redis: Redis, settings: Settings, metrics: Metrics) -> Scripts:
    """The scripts on ``redis``, each call waiting for ``BROKER_REPLICA_ACKS`` replicas."""
    short = metrics.replica_waits_short
    logged = [-SHORT_WAIT_LOG_EVERY_S]

    def on_short(script: str, replicas: int) -> None:
        short.labels(script).inc()
        now = time.monotonic()
        if now - logged[0] < SHORT_WAIT_LOG_EVERY_S:
            return
        logged[0] = now
        log.warning(
            "a write (%s) reached %d of BROKER_REPLICA_ACKS=%d replicas within %d ms; a failover "
            "now could lose it (counted in broker_replica_waits_short_total, logged every 10 s)",
            script,
            replicas,
            settings.replica_acks,
            settings.replica_wait_ms,
        )

    return Scripts(
        redis,
        replica_acks=settings.replica_acks,
        wait_ms=settings.replica_wait_ms,
        on_short=on_short,
    )
