"""The dependencies most rooms share, carried as one object instead of five arguments."""

from __future__ import annotations

import dataclasses

from redis.asyncio import Redis

from broker.keys import Keys
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings


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
        """The usual set for ``redis``: its scripts registered, keys of the settings' prefix."""
        return cls(redis, Scripts(redis), Keys(settings.key_prefix), settings, metrics or Metrics())
