"""Workers and roles: crashed workers' jobs are reclaimed, API-only and worker-only processes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis as redis_lib

from broker.connection import as_cluster
from broker.embedded_redis import EmbeddedRedis
from broker.keys import JOB_GROUP
from broker.lease import TurnWriter
from tests.conftest import BrokerFactory, RunningBroker, start_broker
from tests.helpers import read_sse, start_turn, wait_final


def test_a_dead_workers_job_is_reclaimed_and_run_when_nothing_was_delivered(
    broker_factory: BrokerFactory, raw_redis: redis_lib.Redis
) -> None:
    api = broker_factory(role="api")
    turn = start_turn(api.base_url, turn_id="orphan", tokens=5, tokens_per_s=0)
    keys = api.runtime.keys
    partition = api.runtime.jobs.stream_of("conv-1")
    # A worker takes the job and the lease, then dies before its first event.
    jobs = raw_redis.xreadgroup(JOB_GROUP, "dead-worker", {partition: ">"}, count=1)
    assert jobs, "the turn's job is on its conversation's job partition"
    # It had called the model once: the new worker's call is a silent retry (worker_lost).
    raw_redis.hset(keys.turn("conv-1", "orphan"), mapping={"status": "streaming", "calls:1": 1})
    raw_redis.hset(keys.lease("conv-1", "orphan"), mapping={"token": "1", "owner": "dead-worker"})
    raw_redis.pexpire(keys.lease("conv-1", "orphan"), 100)
    workers = [
        broker_factory(
            role="worker",
            key_prefix=api.settings.key_prefix,
            lease_ttl_ms=300,
            job_reclaim_idle_ms=400,
            retry_backoff_min_ms=1,
            retry_backoff_max_ms=2,
        )
    ]
    final = wait_final(api.base_url, "orphan", timeout=15)
    assert final["status"] == "complete"
    events = read_sse(api.base_url, turn["stream_id"]).events
    assert [e.event for e in events].count("attempt") == 1
    assert raw_redis.xpending(partition, JOB_GROUP)["pending"] == 0
    worker_metrics = workers[0]
    assert worker_metrics.metric("broker_retries_total", '{code="none",reason="worker_lost"}') == 1
    assert worker_metrics.metric("broker_lease_takeovers_total") == 1


def test_an_api_only_broker_queues_and_a_worker_only_broker_generates(
    broker_factory: BrokerFactory,
) -> None:
    api = broker_factory(role="api")
    turn = start_turn(api.base_url, turn_id="split", tokens=4, tokens_per_s=0)
    assert httpx.get(f"{api.base_url}/v1/turns/split", timeout=5).json()["status"] == "queued"
    worker = broker_factory(role="worker", key_prefix=api.settings.key_prefix)
    # A worker-only process serves health and metrics, not the API.
    assert httpx.get(f"{worker.base_url}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{worker.base_url}/v1/turns/split", timeout=5).status_code == 404
    assert read_sse(api.base_url, turn["stream_id"]).events[-1].data["status"] == "complete"


@pytest.mark.server
@pytest.mark.single_node("stops a server of its own under a running broker")
def test_redis_outage_is_503_not_500_and_health_stays_up() -> None:
    with EmbeddedRedis() as server:
        broker = start_broker(server.url)
        try:
            turn = start_turn(broker.base_url, tokens=2, tokens_per_s=0)
            assert httpx.get(f"{broker.base_url}/readyz", timeout=5).status_code == 200
            server.stop()
            body = {"conversation_id": "c", "messages": [{"role": "user", "content": "x"}]}
            for response in (
                httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10),
                httpx.get(f"{broker.base_url}/v1/turns/{turn['turn_id']}", timeout=10),
                httpx.get(f"{broker.base_url}/v1/streams/{turn['stream_id']}", timeout=10),
                httpx.get(f"{broker.base_url}/readyz", timeout=10),
            ):
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "redis_unavailable"
            assert httpx.get(f"{broker.base_url}/healthz", timeout=5).status_code == 200
        finally:
            broker.stop()


def test_blocking_reads_outlast_their_block_time(broker: RunningBroker) -> None:
    # Regression: a socket timeout shorter than XREAD's BLOCK cut every quiet stream after 5 s.
    from broker.fanout import FEED_BLOCK_MS

    blocking = broker.runtime.blocking_redis
    cluster = as_cluster(blocking)
    if cluster is None:
        timeouts = [blocking.connection_pool.connection_kwargs["socket_timeout"]]
    else:  # what the client gives every node's connections (it may not know its nodes yet)
        known = [node.connection_kwargs["socket_timeout"] for node in cluster.get_nodes()]
        timeouts = [cluster.connection_kwargs["socket_timeout"], *known]
    assert timeouts
    assert all(timeout > FEED_BLOCK_MS / 1000 for timeout in timeouts)


def test_a_redis_blip_mid_turn_leaves_the_job_for_a_takeover(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: a Redis error inside a generation was caught as a broker bug and the turn
    # ended failed/internal; the job must stay pending so a worker takes the turn over.
    original = TurnWriter.append
    appends_with_deltas = 0
    deltas_written = 0

    async def flaky(self: TurnWriter, events: list[tuple[str, dict[str, Any]]]) -> list[str]:
        nonlocal appends_with_deltas, deltas_written
        carried = sum(1 for kind, _ in events if kind == "delta")
        if carried:
            appends_with_deltas += 1
            if appends_with_deltas == 3:
                raise redis_lib.exceptions.ConnectionError("simulated blip")
        ids = await original(self, events)
        deltas_written += carried
        return ids

    monkeypatch.setattr(TurnWriter, "append", flaky)
    # No linger, and paced: each delta is its own append, unless a loaded machine hands the
    # writer a few at once (they then share one): the third append with deltas fails.
    broker = broker_factory(lease_ttl_ms=200, job_reclaim_idle_ms=400, append_linger_ms=0)
    turn = start_turn(broker.base_url, turn_id="blip", tokens=10, tokens_per_s=100)
    final = wait_final(broker.base_url, "blip", timeout=15)
    assert final["status"] == "interrupted"
    assert final["attempts"][0]["reason"] == "worker_lost"
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert 2 <= deltas_written < 10
    assert [e.event for e in events].count("delta") == deltas_written
    assert broker.metric("broker_lease_takeovers_total") == 1


def test_a_duplicate_job_of_a_running_turn_starts_no_second_generation(
    broker: RunningBroker, raw_redis: redis_lib.Redis
) -> None:
    """Regression: a worker may claim again a lease it holds (after a lost reply), so a second
    job of the same turn in the same worker (a repeated POST that queued the turn again) took
    the lease from the running generation and called the model a second time."""
    turn = start_turn(broker.base_url, turn_id="twice-queued", tokens=30, tokens_per_s=30)
    jobs = broker.runtime.jobs.stream_of("conv-1")
    entries: Any = raw_redis.xrange(jobs)
    raw_redis.xadd(jobs, entries[0][1])  # the same attempt, queued again while it runs
    final = wait_final(broker.base_url, "twice-queued")
    assert final["status"] == "complete"
    assert [a["n"] for a in final["attempts"]] == [1]
    calls = broker.metric(
        "broker_upstream_requests_total", '{model="simulated",outcome="ok",provider="simulated"}'
    )
    assert calls == 1
    assert broker.metric("broker_fenced_writes_total") == 0
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert [e.event for e in events].count("attempt") == 1
