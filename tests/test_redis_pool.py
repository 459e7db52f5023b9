"""The broker's Redis pools give back what a burst took.

redis-py keeps every connection a pool ever opened: a thousand readers attaching at once leave
a pool of hundreds of idle connections, file descriptors and Redis clients for ever.
``trim_idle_connections`` (run by every broker process every 30 s) closes the idle ones beyond
the most recently used few, and the pool opens new ones when it needs them again.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import redis

from broker.connection import POOL_KEEP_IDLE, client, trim_idle_connections
from tests.conftest import sync_client
from tests.helpers import wait_until

pytestmark = pytest.mark.single_node("a cluster client's per-node pools are left alone")
BURST = 40
_names = itertools.count()


def clients_named(observer: redis.Redis, name: str) -> int:
    return sum(1 for c in observer.client_list() if c.get("name") == name)


async def test_a_burst_of_connections_is_trimmed_to_the_few_most_recently_used(
    redis_url: str,
) -> None:
    name = f"pool-trim-{next(_names)}"
    pool_client = client(redis_url)
    pool_client.connection_pool.connection_kwargs["client_name"] = name  # to count them by
    observer = sync_client(redis_url)
    key = f"pool-trim:{name}"
    try:
        # A burst: BURST commands in flight at once take BURST connections.
        await asyncio.gather(*(pool_client.blpop([key], timeout=0.3) for _ in range(BURST)))
        assert clients_named(observer, name) == BURST
        # (redis-py's list of idle connections: the trim depends on it, in the pinned version.)
        assert len(pool_client.connection_pool._available_connections) == BURST
        assert await trim_idle_connections(pool_client) == BURST - POOL_KEEP_IDLE
        # The server drops a closed connection from its list once it has read the close.
        wait_until(lambda: clients_named(observer, name) <= POOL_KEEP_IDLE, timeout=5)
        assert clients_named(observer, name) == POOL_KEEP_IDLE
        assert await trim_idle_connections(pool_client) == 0  # nothing beyond the few
        # The pool still works, and grows again when it must.
        assert await pool_client.set(key + ":x", "1")
        await asyncio.gather(*(pool_client.blpop([key], timeout=0.2) for _ in range(BURST)))
        assert clients_named(observer, name) == BURST
    finally:
        await pool_client.aclose()
        observer.close()


async def test_a_new_connection_costs_no_client_setinfo(redis_url: str) -> None:
    # A burst opens hundreds of connections: each costs its handshake and nothing more.
    name = f"pool-setinfo-{next(_names)}"
    observer = sync_client(redis_url)
    pool_client = client(redis_url)
    pool_client.connection_pool.connection_kwargs["client_name"] = name
    try:
        await pool_client.ping()
        info = next(c for c in observer.client_list() if c.get("name") == name)
        assert info.get("lib-name", "") == ""
        assert info.get("lib-ver", "") == ""
    finally:
        await pool_client.aclose()
        observer.close()
