"""BROKER_REPLICA_ACKS: every script's write is followed by WAIT on its connection.

Here on the session's server, which has no replica: each wait ends short after its time, is
reported, and the write stands (WAIT never undoes one). What the setting buys when replicas
exist, and what readers are told meanwhile, is the failover test's
(``tests/test_cluster_topology.py``).
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
from redis.asyncio import Redis

from broker.deps import scripts_for
from broker.keys import Keys
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings, SettingsError

_n = itertools.count()


def budget_key() -> str:
    return Keys(f"acks{os.getpid()}-{next(_n)}").retry_budget("s")


async def test_a_write_waits_for_the_replicas_asked_and_stands_when_they_never_answer(
    aredis: Redis,
) -> None:
    shorts: list[tuple[str, int]] = []
    scripts = Scripts(
        aredis, replica_acks=1, wait_ms=150, on_short=lambda *short: shorts.append(short)
    )
    key = budget_key()
    started = time.monotonic()
    allowed = await scripts.take_retry_budget(
        budget_key=key, budget=5, window_ms=60_000, member="m1"
    )
    waited = time.monotonic() - started
    assert allowed is True
    assert shorts == [("take_retry_budget", 0)]
    assert waited >= 0.14, f"the call did not wait for the replica ({waited:.3f} s)"
    assert await aredis.exists(key) == 1, "the write was undone"


async def test_without_replica_acks_a_write_does_not_wait(aredis: Redis) -> None:
    shorts: list[tuple[str, int]] = []
    scripts = Scripts(aredis, on_short=lambda *short: shorts.append(short))
    assert await scripts.take_retry_budget(
        budget_key=budget_key(), budget=5, window_ms=60_000, member="m1"
    )
    assert shorts == []


async def test_a_script_the_server_lost_is_loaded_again_under_replica_acks(aredis: Redis) -> None:
    scripts = Scripts(aredis, replica_acks=1, wait_ms=1)
    await aredis.script_flush()  # as after a failover: the promoted replica has no scripts
    assert await scripts.take_retry_budget(
        budget_key=budget_key(), budget=5, window_ms=60_000, member="m1"
    )


async def test_short_waits_are_counted_per_script(aredis: Redis) -> None:
    metrics = Metrics()
    settings = Settings(replica_acks=2, replica_wait_ms=20)
    scripts = scripts_for(aredis, settings, metrics)
    for member in ("a", "b"):
        await scripts.take_retry_budget(
            budget_key=budget_key(), budget=5, window_ms=60_000, member=member
        )
    counted = metrics.registry.get_sample_value(
        "broker_replica_waits_short_total", {"script": "take_retry_budget"}
    )
    assert counted == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [("BROKER_REPLICA_ACKS", "17"), ("BROKER_REPLICA_ACKS", "-1"), ("BROKER_REPLICA_WAIT_MS", "0")],
)
def test_replica_settings_out_of_range_are_refused(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"{name} must be from"):
        Settings.from_env({name: value})
