"""The broker's Redis pools give back what a burst took.

redis-py keeps every connection a pool ever opened: a thousand readers attaching at once leave
a pool of hundreds of idle connections, file descriptors and Redis clients for ever.
``trim_idle_connections`` (run by every broker process every 30 s) closes the idle ones beyond
the most recently used few, and those no call took since its last pass, and the pool opens new
ones when it needs them again.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import httpx
import pytest
import redis

from broker.connection import (
    POOL_KEEP_IDLE,
    POOL_MIN_IDLE,
    client,
    drop_idle_connections,
    trim_idle_connections,
)
from tests.conftest import BrokerFactory, sync_client
from tests.helpers import start_turn, wait_until

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
        # The pool still works, and grows again when it must.
        assert await pool_client.set(key + ":x", "1")
        await asyncio.gather(*(pool_client.blpop([key], timeout=0.2) for _ in range(BURST)))
        assert clients_named(observer, name) == BURST
    finally:
        await pool_client.aclose()
        observer.close()


@pytest.mark.parametrize("wait_s", [None, 5.0], ids=["pool", "waiting-pool"])
async def test_connections_idle_for_a_whole_trim_period_are_closed(
    redis_url: str, wait_s: float | None
) -> None:
    # Both kinds of pool the broker makes (a waiting one for short calls, a plain one for the
    # blocking reads) come back to what the load since the last pass needed.
    name = f"pool-untouched-{next(_names)}"
    pool_client = client(redis_url, wait_s=wait_s)
    pool_client.connection_pool.connection_kwargs["client_name"] = name
    observer = sync_client(redis_url)
    key = f"pool-untouched:{name}"
    idle = pool_client.connection_pool._available_connections
    try:
        await asyncio.gather(*(pool_client.blpop([key], timeout=0.3) for _ in range(BURST)))
        # The first pass after the burst: the burst took every connection, so none is
        # untouched yet; only the cap applies.
        assert await trim_idle_connections(pool_client) == BURST - POOL_KEEP_IDLE
        # Meanwhile the load needs three at once: those are taken, the others sit.
        for _ in range(3):
            await asyncio.gather(*(pool_client.blpop([key], timeout=0.05) for _ in range(3)))
        assert await trim_idle_connections(pool_client) == POOL_KEEP_IDLE - 3
        wait_until(lambda: clients_named(observer, name) <= 3, timeout=5)
        assert clients_named(observer, name) == 3
        assert len(idle) == 3
        # A period with no call at all: down to the floor, and no further on the next.
        assert await trim_idle_connections(pool_client) == 3 - POOL_MIN_IDLE
        assert await trim_idle_connections(pool_client) == 0
        assert len(idle) == POOL_MIN_IDLE
        wait_until(lambda: clients_named(observer, name) <= POOL_MIN_IDLE, timeout=5)
        assert clients_named(observer, name) == POOL_MIN_IDLE
        assert await pool_client.set(key + ":x", "1")
        # Closing the client closes its pool: none of its connections is left on the server.
        await pool_client.aclose()
        wait_until(lambda: clients_named(observer, name) == 0, timeout=5)
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


async def test_a_waiting_pool_serves_more_calls_than_connections_and_each_waiter_is_woken(
    redis_url: str,
) -> None:
    """The waiting pool takes and returns connections past redis-py's own path when nothing
    waits: calls that find every connection busy must still wait for one and be woken as each
    is returned, and the pool must never open more than its bound."""
    pool_client = client(redis_url, max_connections=3, wait_s=5.0)
    pool = pool_client.connection_pool
    key = f"pool-wait:{next(_names)}"
    try:
        # Each call holds its connection for 50 ms: 30 of them on 3 connections take 10 rounds.
        calls = [pool_client.blpop([key], timeout=0.05) for _ in range(30)]
        assert await asyncio.wait_for(asyncio.gather(*calls), 10) == [None] * 30
        assert len(pool._available_connections) + len(pool._in_use_connections) <= 3
        assert not pool._in_use_connections  # every connection came back
        assert await pool_client.set(key, "1")  # and the pool goes on working
        assert await pool_client.get(key) == "1"
    finally:
        await pool_client.aclose()


async def test_a_pool_that_does_not_wait_refuses_past_its_bound_and_keeps_working(
    redis_url: str,
) -> None:
    """As redis-py's own: past ``max_connections`` a call fails at once (it never waits),
    and every connection taken comes back."""
    pool_client = client(redis_url, max_connections=2)
    pool = pool_client.connection_pool
    key = f"pool-bound:{next(_names)}"
    try:
        calls = [pool_client.blpop([key], timeout=0.2) for _ in range(5)]
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        assert outcomes.count(None) == 2
        assert all(isinstance(o, redis.exceptions.ConnectionError) for o in outcomes if o)
        assert not pool._in_use_connections
        assert len(pool._available_connections) == 2
        assert await pool_client.set(key, "1")
    finally:
        await pool_client.aclose()


async def test_a_command_the_socket_takes_whole_is_sent_without_a_task(redis_url: str) -> None:
    """redis-py bounds each send with ``asyncio.wait_for``, a task per command on this Python:
    the broker's connections hand the command to the transport, and wait only when they must."""
    pool_client = client(redis_url)
    loop = asyncio.get_running_loop()
    created: list[object] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    try:
        await pool_client.set("pool-send", "1")  # connected
        loop.set_task_factory(counting)
        for _ in range(50):
            assert await pool_client.get("pool-send") == "1"
        assert created == []
    finally:
        loop.set_task_factory(factory)
        await pool_client.aclose()


async def test_a_send_the_server_does_not_take_times_out_and_disconnects() -> None:
    """A server that stops reading: the send waits for the socket, bounded by the socket
    timeout, as redis-py's; the connection is dropped and the next call reconnects."""
    reading = asyncio.Event()
    reading.set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # As much of a server as the client's handshake and PING need.
        while data := await reader.read(65_536):
            if b"HELLO" in data:
                writer.write(b"%1\r\n+proto\r\n:3\r\n")
            elif b"PING" in data:
                writer.write(b"+PONG\r\n")
            if not reading.is_set():
                await asyncio.Event().wait()  # takes nothing more, ever

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool_client = client(f"redis://127.0.0.1:{port}", socket_timeout=0.3)
    try:
        assert await pool_client.ping()
        reading.clear()
        assert await pool_client.ping()  # (answered, then the server stops reading)
        connection = pool_client.connection_pool._available_connections[-1]
        with pytest.raises(redis.TimeoutError, match="writing to socket"):
            await asyncio.wait_for(pool_client.set("k", "x" * 64_000_000), 10)
        assert not connection.is_connected
    finally:
        await pool_client.aclose()
        server.close()


@pytest.mark.parametrize("wait_s", [None, 5.0], ids=["pool", "waiting-pool"])
async def test_a_connection_taken_while_the_idle_ones_are_dropped_is_not_closed_under_its_call(
    redis_url: str, wait_s: float | None
) -> None:
    """Regression: after a Redis error the worker drops the idle connections, and a request
    that took one of them meanwhile had its reply cut ("Connection closed by server", a 503).
    redis-py's ``disconnect`` closes the idle connections in tasks that run a turn later, by
    which time a call may have taken one; the broker takes them out of the pool first."""
    pool_client = client(redis_url, wait_s=wait_s)
    try:
        await asyncio.gather(*(pool_client.ping() for _ in range(4)))  # four idle connections
        dropping = asyncio.create_task(drop_idle_connections(pool_client))
        await asyncio.sleep(0)  # the drop has begun and waits on its closes
        assert await pool_client.set("pool-drop:k", "v")  # takes what the pool has idle
        await dropping
        assert await pool_client.get("pool-drop:k") == "v"
    finally:
        await pool_client.aclose()


CROWD = 240  # readers: more than GIVE_BACK_AFTER_READERS, over as many streams as STREAMS
STREAMS = 24


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _crowd(base_url: str, paths: list[str]) -> list[asyncio.StreamWriter]:
    """CROWD SSE readers round ``paths``, each once its response head arrived."""
    url = httpx.URL(base_url)
    host, port = str(url.host), int(url.port or 80)

    async def attach(path: str) -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return writer

    return list(await asyncio.gather(*(attach(paths[i % len(paths)]) for i in range(CROWD))))


@pytest.mark.single_node("a cluster client's per-node pools are not trimmed (connection.py)")
def test_a_crowd_that_leaves_gives_back_its_redis_connections_at_once(
    broker_factory: BrokerFactory, redis_url: str
) -> None:
    """Each live stream's feed holds a blocking Redis connection: a crowd over STREAMS streams
    grows the pool by as many, which go idle when it leaves. The broker sees the crowd go
    (``CrowdWatch``, every second) and closes every idle connection then, not two trim periods
    (a minute) later: its descriptors and Redis clients come back to what they were before the
    crowd (what the turns' lease renewals take meanwhile aside)."""
    # The regular trim stays out of it; the fast path's pools are the ones trimmed (a stock
    # pool is left alone: connection.trim_idle_connections), so this broker keeps its own.
    broker = broker_factory(pool_trim_s=300.0, fast_path="auto")
    observer = sync_client(redis_url)
    try:
        paths = []
        for i in range(STREAMS):
            turn = start_turn(broker.base_url, f"crowd-{i}", first_delta_after_ms=600_000)
            paths.append(f"/v1/streams/{turn['stream_id']}")
        clients_before = int(observer.info("clients")["connected_clients"])
        fds_before = _open_fds()

        async def come_and_go() -> int:
            writers = await _crowd(broker.base_url, paths)
            loaded = int(observer.info("clients")["connected_clients"])
            # Until the broker has seen the whole crowd (it looks every second).
            crowd = broker.runtime._crowd
            await asyncio.to_thread(wait_until, lambda: crowd.peak >= CROWD)
            for writer in writers:
                writer.close()
            return loaded

        loaded = asyncio.run(come_and_go())
        assert loaded >= clients_before + STREAMS  # a feed's connection per stream
        renewing = 1  # a lease renewal may have a connection out, or opened one since
        wait_until(
            lambda: (
                int(observer.info("clients")["connected_clients"]) <= clients_before + renewing
                and _open_fds() <= fds_before + renewing
            ),
            timeout=10,
        )
    finally:
        observer.close()
