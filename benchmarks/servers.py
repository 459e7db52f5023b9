"""The processes under test: a private Redis on a loopback port (or a 3-primary Redis Cluster of
them, with or without replicas) and a ``broker serve`` child.

All are children of the benchmark and get a parent-death signal, so a benchmark killed with
SIGKILL leaves nothing running. Process figures (RSS, CPU time) come from ``/proc``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import redis
from redis.crc import key_slot

from broker.embedded_redis import die_with_parent, find_server_binary, server_command

REPO = Path(__file__).resolve().parent.parent
KEY_PREFIX = "bench"

SLOTS = 16384
BUS_PORT_OFFSET = 10000  # a cluster node's bus port is its port plus this
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ServerError(RuntimeError):
    """A server under test did not start or died."""


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def free_port_pair() -> int:
    """A loopback port that was free a moment ago, as was its cluster bus port."""
    for _ in range(200):
        port = free_port()
        if port + BUS_PORT_OFFSET > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + BUS_PORT_OFFSET))
            except OSError:
                continue
        return port
    raise ServerError("no free port with a free cluster bus port")


def _stop(process: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a live process (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM), 0 when unreadable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0); False when not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def system_busy_seconds() -> float:
    """CPU time spent by the whole machine (all cores) outside idle and iowait."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields[:8]]
    return (sum(values) - values[3] - values[4]) / _CLOCK_TICKS


class RedisServers(Protocol):
    """The Redis under test: one server, or a cluster of primaries.

    ``client()`` is for commands on one slot (a cluster client routes them); what must see every
    node (statistics, flushing, scans) goes to ``nodes()``, one plain client per primary.
    Replicas, if any, are listed by ``replica_links``; ``pids`` has them too.
    """

    binary: str

    @property
    def topology(self) -> str: ...  # "single", "cluster-<primaries>[x<replicas>]"

    @property
    def url(self) -> str: ...  # the broker's BROKER_REDIS_URL

    @property
    def pids(self) -> list[int]: ...

    @property
    def ports(self) -> list[int]: ...  # one per primary, in the order of ``nodes()``

    @property
    def replica_links(self) -> list[tuple[int, int]]: ...  # (replica's port, its primary's)

    def client(self) -> redis.Redis: ...

    def nodes(self) -> list[redis.Redis]: ...

    def replica_nodes(self) -> list[redis.Redis]: ...  # one per replica, as ``replica_links``

    def port_for(self, key: str) -> int: ...  # the port of the node that serves ``key``

    def version(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class RedisServer:
    """A Redis-compatible server on ``127.0.0.1:<free port>``, no persistence, noeviction.

    With ``cluster_node`` it starts in cluster mode, with no slots: :class:`LocalCluster` joins it.
    ``options`` are more ``--name value`` arguments for the server.
    """

    topology = "single"

    def __init__(
        self,
        binary: str | None = None,
        *,
        cluster_node: bool = False,
        options: Sequence[str] = (),
    ) -> None:
        self.binary = find_server_binary(binary)
        self.cluster_node = cluster_node
        self.options = tuple(options)
        self.port = 0
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise ServerError("Redis is not running")
        return self._process.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid]

    @property
    def ports(self) -> list[int]:
        return [self.port]

    @property
    def replica_links(self) -> list[tuple[int, int]]:
        return []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def nodes(self) -> list[redis.Redis]:
        return [self.client()]

    def replica_nodes(self) -> list[redis.Redis]:
        return []

    def port_for(self, key: str) -> int:
        return self.port

    def start(self, timeout: float = 10.0) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="bench-redis-"))
        self.port = free_port_pair() if self.cluster_node else free_port()
        args = server_command(
            self.binary, self._dir, "--bind", "127.0.0.1", "--port", str(self.port)
        )
        if self.cluster_node:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += self.options
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        client = self.client()
        try:
            while True:
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return
                if self._process.poll() is not None or time.monotonic() > deadline:
                    log = (self._dir / "server.log").read_text(errors="replace")[-500:]
                    self.stop()
                    raise ServerError(f"{self.binary} did not start: {log.strip()}")
                time.sleep(0.01)
        finally:
            client.close()

    def version(self) -> str:
        """``<server name> <version>``, e.g. ``valkey 9.1.2`` or ``redis 7.0.15``."""
        client = self.client()
        try:
            info = client.info("server")
        finally:
            client.close()
        name = str(info.get("server_name", "redis"))
        version = info.get(f"{name}_version", info.get("redis_version", "?"))
        return f"{name} {version}"

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            _stop(process, 5)
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """The slots split into ``primaries`` contiguous ranges, as ``redis-cli --cluster create``
    splits them: 0-5460, 5461-10922, 10923-16383 for three."""
    ranges: list[tuple[int, int]] = []
    first = 0
    for i in range(primaries):
        last = SLOTS - 1 if i == primaries - 1 else round((i + 1) * SLOTS / primaries - 1)
        ranges.append((first, last))
        first = last + 1
    return ranges


class LocalCluster:
    """A Redis Cluster of ``primaries`` primaries, each with ``replicas`` replicas, every node a
    :class:`RedisServer` in cluster mode.

    The slots are split in contiguous ranges over the primaries (``CLUSTER ADDSLOTSRANGE``, Redis
    >= 7.0), every node meets the first, and each replica is told its primary (``CLUSTER
    REPLICATE``). ``start`` returns once every node sees all slots served and every replica of
    every range, and each replica's link to its primary is up (its first sync done)."""

    def __init__(self, binary: str | None = None, *, primaries: int = 3, replicas: int = 0) -> None:
        if primaries < 1 or replicas < 0:
            raise ValueError("a cluster needs at least one primary, and replicas >= 0")
        self.binary = find_server_binary(binary)
        self.primaries = primaries
        self.replicas = replicas
        self.servers: list[RedisServer] = []  # the primaries
        self.replica_servers: list[tuple[RedisServer, RedisServer]] = []  # (replica, primary)
        self._ranges = slot_ranges(primaries)
        # A primary starts a replica's first (diskless) sync at once, not after 5 s in case
        # more replicas come.
        self._options = ("--repl-diskless-sync-delay", "0")

    @property
    def topology(self) -> str:
        if self.replicas:
            return f"cluster-{self.primaries}x{self.replicas}"
        return f"cluster-{self.primaries}"

    @property
    def url(self) -> str:
        # The primaries only: the cluster client learns of the replicas from them.
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    @property
    def pids(self) -> list[int]:
        return [server.pid for server in self.servers] + [
            replica.pid for replica, _ in self.replica_servers
        ]

    @property
    def ports(self) -> list[int]:
        return [server.port for server in self.servers]

    @property
    def replica_links(self) -> list[tuple[int, int]]:
        return [(replica.port, primary.port) for replica, primary in self.replica_servers]

    def client(self) -> redis.Redis:
        """A cluster client, typed as the single-server one: only one-slot commands go to it."""
        cluster = redis.RedisCluster(
            host="127.0.0.1", port=self.servers[0].port, decode_responses=True
        )
        return cast(redis.Redis, cluster)

    def nodes(self) -> list[redis.Redis]:
        return [server.client() for server in self.servers]

    def replica_nodes(self) -> list[redis.Redis]:
        return [replica.client() for replica, _ in self.replica_servers]

    def port_for(self, key: str) -> int:
        slot = key_slot(key.encode())
        for server, (low, high) in zip(self.servers, self._ranges, strict=True):
            if low <= slot <= high:
                return server.port
        raise AssertionError(f"slot {slot} is in no range")

    def version(self) -> str:
        return self.servers[0].version()

    def start(self, timeout: float = 30.0) -> None:
        try:
            for _ in range(self.primaries):
                server = RedisServer(self.binary, cluster_node=True, options=self._options)
                self.servers.append(server)
                server.start()
            for primary in self.servers:
                for _ in range(self.replicas):
                    replica = RedisServer(self.binary, cluster_node=True, options=self._options)
                    self.replica_servers.append((replica, primary))
                    replica.start()
            self._join(timeout)
        except BaseException:
            self.stop()
            raise

    def _join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        primaries = self.nodes()
        replicas = self.replica_nodes()
        everyone = primaries + replicas
        try:
            for node, (low, high) in zip(primaries, self._ranges, strict=True):
                node.cluster("ADDSLOTSRANGE", str(low), str(high))
            others = self.servers[1:] + [replica for replica, _ in self.replica_servers]
            for server in others:
                primaries[0].cluster("MEET", "127.0.0.1", str(server.port))
            self._wait(
                deadline,
                f"the nodes did not meet in {timeout} s",
                lambda: all(self._met(n) for n in everyone),
            )
            ids = {
                server.port: str(node.cluster("MYID"))
                for server, node in zip(self.servers, primaries, strict=True)
            }
            for (_, primary), node in zip(self.replica_servers, replicas, strict=True):
                node.cluster("REPLICATE", ids[primary.port])
            self._wait(
                deadline,
                f"the cluster did not converge in {timeout} s",
                lambda: (
                    all(self._converged(node) for node in everyone)
                    and all(self._linked(node) for node in replicas)
                ),
            )
        finally:
            for node in everyone:
                node.close()

    @staticmethod
    def _wait(deadline: float, what: str, done: Callable[[], bool]) -> None:
        while not done():
            if time.monotonic() > deadline:
                raise ServerError(what)
            time.sleep(0.02)

    def _met(self, node: redis.Redis) -> bool:
        info: dict[str, Any] = node.cluster("INFO")
        return int(info["cluster_known_nodes"]) == self.primaries * (1 + self.replicas)

    def _converged(self, node: redis.Redis) -> bool:
        """``node`` sees every slot served and every range with all its replicas (what a
        cluster client learns of the topology, from whichever node it asks)."""
        info: dict[str, Any] = node.cluster("INFO")
        if not (
            info["cluster_state"] == "ok"
            and int(info["cluster_known_nodes"]) == self.primaries * (1 + self.replicas)
            and int(info["cluster_slots_ok"]) == SLOTS
        ):
            return False
        # CLUSTER SLOTS: [first slot, last slot, primary, replica, ...] per range.
        ranges: list[list[Any]] = node.cluster("SLOTS")
        return len(ranges) == self.primaries and all(
            len(served) - 2 == 1 + self.replicas for served in ranges
        )

    @staticmethod
    def _linked(node: redis.Redis) -> bool:
        info: dict[str, Any] = node.info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def stop(self) -> None:
        replicas, self.replica_servers = self.replica_servers, []
        for replica, _ in replicas:
            replica.stop()
        servers, self.servers = self.servers, []
        for server in servers:
            server.stop()


def commandstats(nodes: Iterable[redis.Redis]) -> dict[str, int]:
    """Calls per command since the servers started, summed over ``nodes``, less INFO and MONITOR
    (the benchmark's)."""
    out: collections.Counter[str] = collections.Counter()
    for node in nodes:
        info: dict[str, Any] = node.info("commandstats")
        for name, stats in info.items():
            if name not in ("cmdstat_info", "cmdstat_monitor"):
                out[name.removeprefix("cmdstat_")] += int(stats["calls"])
    return dict(out)


def delete_matching(nodes: Iterable[redis.Redis], pattern: str) -> int:
    """Delete the keys matching ``pattern`` on every node, one key per command (a cluster node
    refuses a DEL of keys in different slots); returns how many."""
    deleted = 0
    for node in nodes:
        keys = list(node.scan_iter(pattern, count=1000))
        with node.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.unlink(key)
            pipe.execute()
        deleted += len(keys)
    return deleted


class Broker:
    """``python -m broker serve`` against our Redis, on a free port, logging warnings only."""

    def __init__(
        self, redis_url: str, *, concurrency: int, env: Mapping[str, str] | None = None
    ) -> None:
        self.redis_url = redis_url
        self.concurrency = concurrency
        self.extra_env = dict(env or {})
        self.port = 0
        self.lines: collections.deque[str] = collections.deque(maxlen=5000)
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise ServerError("the broker is not running")
        return self._process.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self.port = free_port()
        # The broker must see only our settings, not those of whoever runs the benchmark.
        env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
        env.update(
            {
                "BROKER_REDIS_URL": self.redis_url,
                "BROKER_HOST": "127.0.0.1",
                "BROKER_PORT": str(self.port),
                "BROKER_KEY_PREFIX": KEY_PREFIX,
                "BROKER_LOG_LEVEL": "WARNING",
                "BROKER_WORKER_CONCURRENCY": str(self.concurrency),
                "BROKER_MAX_STREAM_EVENTS": "1000000",
                "BROKER_DRAIN_TIMEOUT_S": "2",
                # The data path is measured, not the admission limits: no rate limit on new turns,
                # and a live-stream cap well above what any workload opens.
                "BROKER_TURN_RATE_PER_S": "0",
                "BROKER_MAX_STREAMS_PER_TENANT": "10000",
                "PYTHONUNBUFFERED": "1",
                **self.extra_env,
            }
        )
        self._process = subprocess.Popen(
            [sys.executable, "-m", "broker", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
            preexec_fn=die_with_parent,
        )
        started = threading.Event()
        self._reader = threading.Thread(
            target=self._drain, args=(self._process, started), name="broker-output", daemon=True
        )
        self._reader.start()
        if not started.wait(timeout) or self._process.poll() is not None:
            output = "\n".join(self.lines)
            self.stop()
            raise ServerError(f"the broker did not start:\n{output[-2000:]}")

    def _drain(self, process: subprocess.Popen[str], started: threading.Event) -> None:
        """Keep the pipe empty (a full pipe would stall the broker) and spot the start line."""
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line.rstrip())
            if "serving on http://" in line:
                started.set()
        started.set()  # the process ended: let start() see it

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def rss_mib(self) -> float:
        return status_kib(self.pid, "VmRSS") / 1024

    def peak_rss_mib(self) -> float:
        return status_kib(self.pid, "VmHWM") / 1024

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            _stop(process, 20)
        if self._reader is not None:
            self._reader.join(timeout=5)
            self._reader = None


class CpuMeter:
    """CPU used by the broker, Redis (every node of a cluster), this process (and reaped
    children) and everything else."""

    def __init__(
        self, broker_pid: int | None, redis_pids: Sequence[int], client_pids: Sequence[int] = ()
    ) -> None:
        self._broker_pid = broker_pid
        self._redis_pids = list(redis_pids)
        self._client_pids = list(client_pids)
        self._start = self._read()

    def _read(self) -> tuple[float, float, float, float, float]:
        times = os.times()
        own = times.user + times.system + times.children_user + times.children_system
        own += sum(cpu_seconds(pid) for pid in self._client_pids)
        broker = cpu_seconds(self._broker_pid) if self._broker_pid is not None else 0.0
        redis_cpu = sum(cpu_seconds(pid) for pid in self._redis_pids)
        return time.monotonic(), system_busy_seconds(), broker, redis_cpu, own

    def seconds(self) -> dict[str, float]:
        """CPU seconds used since the meter started: broker, redis, client, other."""
        end = self._read()
        system, broker, redis_cpu, client = (end[i] - self._start[i] for i in range(1, 5))
        other = max(0.0, system - broker - redis_cpu - client)
        return {"broker": broker, "redis": redis_cpu, "client": client, "other": other}

    def cores(self) -> dict[str, float]:
        """Cores busy since the meter started: broker, redis, client, other (foreign load)."""
        end = self._read()
        elapsed = max(1e-9, end[0] - self._start[0])
        system, broker, redis_cpu, client = (end[i] - self._start[i] for i in range(1, 5))
        other = max(0.0, system - broker - redis_cpu - client)
        return {
            "broker": round(broker / elapsed, 3),
            "redis": round(redis_cpu / elapsed, 3),
            "client": round(client / elapsed, 3),
            "other": round(other / elapsed, 3),
        }
