"""Durable Streams: append and read throughput on the protocol side, next to the reference server.

``python -m benchmarks.durable`` starts its own Redis and ``broker serve``, and the protocol's
reference server (``@durable-streams/server``, pinned in ``benchmarks/durable-reference``: run
``npm ci`` there, or ``scripts/npm-ci``; it keeps streams in memory) on free ports, and drives
both with the same client, one server at a time:

* **append**: ``--writers`` clients, each on its own connection and stream (with ``--shared``,
  all on one stream: concurrent writers of one stream), POST ``--appends`` bodies of
  ``--bytes`` bytes one after another (each waits for its answer): appends per second in
  total, and the latency of one append (p50, p99);
* **read**: the same clients each read their stream from the start (catch-up) ``--reads``
  times: appends and MiB delivered per second;
* the server's CPU seconds per 1,000 appends, and the client's own CPU (if it nears one core,
  the client is what limits the figures: it speaks HTTP/1.1 on plain sockets to stay cheap);
* **storage** (the broker only, figures that do not depend on the machine's load): the Redis
  bytes per stored payload byte of a binary stream (``MEMORY USAGE`` of its data key over its
  payload bytes; 64-byte and 4 KiB appends), and the Redis memory a fork of an 8 MiB stream
  adds (``used_memory`` after the fork's ``PUT`` less before; the median of five forks).

Each figure is the median of ``--repeat`` runs, with its range. Nothing here is a pass/fail test;
the figures go to stdout (and ``--json PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson
import redis

from benchmarks.profiling import Profiler, summary
from benchmarks.servers import KEY_PREFIX, REPO, Broker, RedisServer, cpu_seconds, free_port
from broker.durable_store.keys import KeySpace

REFERENCE = REPO / "benchmarks" / "durable-reference"


@dataclass
class Run:
    """One run against one server."""

    appends_per_s: float = 0.0
    append_p50_ms: float = 0.0
    append_p99_ms: float = 0.0
    reads_per_s: float = 0.0  # appends delivered by catch-up reads, per second
    read_mib_per_s: float = 0.0
    server_cpu_ms_per_1000: float = 0.0
    client_cpu_share: float = 0.0  # client CPU seconds per wall second (1.0: one core)


@dataclass
class Server:
    name: str
    base: str  # the stream URL prefix
    pid: int
    runs: list[Run] = field(default_factory=list)


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class _Connection:
    """One keep-alive HTTP/1.1 connection on a plain socket: a client cheap enough that the
    servers, not the client, are what is measured (answers carry a Content-Length, or none)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, base: str) -> _Connection:
        parts = urllib.parse.urlsplit(base)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, parts.netloc)

    async def request(
        self, method: str, target: str, body: bytes = b"", headers: str = ""
    ) -> tuple[int, dict[str, str], bytes]:
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: {self.host}\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        fields: dict[str, str] = {}
        while True:
            line = await self.reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        if fields.get("transfer-encoding") == "chunked":
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                parts.append(await self.reader.readexactly(size + 2))
                if size == 0:
                    return status, fields, b"".join(p[:-2] for p in parts)
        length = int(fields.get("content-length", "0"))
        content = await self.reader.readexactly(length) if length else b""
        return status, fields, content

    def close(self) -> None:
        self.writer.close()


async def _writer(connection: _Connection, path: str, body: bytes, count: int) -> list[float]:
    kind = "Content-Type: application/octet-stream\r\n"
    status, _, content = await connection.request("PUT", path, headers=kind)
    if status not in (200, 201):
        raise RuntimeError(f"create answered {status}: {content[:200]!r}")
    latencies = []
    for _ in range(count):
        began = time.perf_counter()
        status, _, content = await connection.request("POST", path, body, kind)
        latencies.append(time.perf_counter() - began)
        if status not in (200, 204):
            raise RuntimeError(f"append answered {status}: {content[:200]!r}")
    return latencies


async def _reader(connection: _Connection, path: str, reads: int, expect: int) -> int:
    total = 0
    for _ in range(reads):
        offset = "-1"
        got = 0
        while True:
            status, fields, content = await connection.request("GET", f"{path}?offset={offset}")
            if status != 200:
                raise RuntimeError(f"a read answered {status}: {content[:200]!r}")
            got += len(content)
            offset = fields["stream-next-offset"]
            if fields.get("stream-up-to-date") == "true":
                break
        if got != expect:
            raise RuntimeError(f"a read brought {got} bytes, not {expect}")
        total += got
    return total


async def _one_run(server: Server, args: argparse.Namespace) -> Run:
    body = os.urandom(args.bytes)
    run = Run()
    base = urllib.parse.urlsplit(server.base)
    paths = [f"{base.path}/bench-{uuid.uuid4().hex[:12]}-{i}" for i in range(args.writers)]
    if args.shared:  # every writer appends to one stream (they share its script calls)
        paths = [paths[0]] * args.writers
    connections = [await _Connection.open(server.base) for _ in paths]
    try:
        cpu0, client0, wall0 = cpu_seconds(server.pid), time.process_time(), time.perf_counter()
        lists = await asyncio.gather(
            *(_writer(c, p, body, args.appends) for c, p in zip(connections, paths, strict=True))
        )
        wall = time.perf_counter() - wall0
        appends = args.writers * args.appends
        run.appends_per_s = appends / wall
        latencies = [v for values in lists for v in values]
        run.append_p50_ms = _percentile(latencies, 0.5) * 1000
        run.append_p99_ms = _percentile(latencies, 0.99) * 1000
        run.server_cpu_ms_per_1000 = (cpu_seconds(server.pid) - cpu0) * 1000 / appends * 1000
        client_write = time.process_time() - client0
        expect = args.appends * args.bytes * (args.writers if args.shared else 1)
        client1, wall1 = time.process_time(), time.perf_counter()
        delivered = await asyncio.gather(
            *(_reader(c, p, args.reads, expect) for c, p in zip(connections, paths, strict=True))
        )
        read_wall = time.perf_counter() - wall1
        run.reads_per_s = sum(delivered) / args.bytes / read_wall
        run.read_mib_per_s = sum(delivered) / read_wall / 2**20
        client_cpu = client_write + time.process_time() - client1
        run.client_cpu_share = client_cpu / (wall + read_wall)
    finally:
        for connection in connections:
            connection.close()
    return run


# Forks of the 8 MiB stream measured, one after another: the median is the figure (the server
# allocates a few dozen KiB once, around the first, that no later fork adds).
FORKS = 5


@dataclass
class Storage:
    """What the broker's streams cost in Redis."""

    per_byte_64: float = 0.0  # Redis bytes per payload byte, 64-byte binary appends
    per_byte_4k: float = 0.0  # the same, 4 KiB binary appends
    fork_kib: float = 0.0  # Redis memory a fork of an 8 MiB stream adds, KiB (median)


async def _fill(connection: _Connection, path: str, size: int, count: int) -> None:
    kind = "Content-Type: application/octet-stream\r\n"
    status, _, content = await connection.request("PUT", path, headers=kind)
    if status not in (200, 201):
        raise RuntimeError(f"create answered {status}: {content[:200]!r}")
    for _ in range(count):
        status, _, content = await connection.request("POST", path, os.urandom(size), kind)
        if status not in (200, 204):
            raise RuntimeError(f"append answered {status}: {content[:200]!r}")


async def _storage(base_url: str, client: redis.Redis) -> Storage:
    """The storage figures (see the module) of the broker at ``base_url`` (its streams' URL
    prefix), whose Redis ``client`` reaches."""
    base = urllib.parse.urlsplit(base_url).path
    space = KeySpace(KEY_PREFIX)
    storage = Storage()
    connection = await _Connection.open(base_url)
    try:
        for size, count, name in ((64, 4_096, "per_byte_64"), (4_096, 256, "per_byte_4k")):
            stream = f"storage-{uuid.uuid4().hex[:12]}"
            await _fill(connection, f"{base}/{stream}", size, count)
            used = int(client.memory_usage(space.data(None, stream), samples=0) or 0)
            setattr(storage, name, used / (size * count))
        source = f"storage-{uuid.uuid4().hex[:12]}"
        await _fill(connection, f"{base}/{source}", 65_536, 128)  # 8 MiB
        fork = f"Stream-Forked-From: {base}/{source}\r\n"
        added = []
        for index in range(FORKS):
            before = int(client.info("memory")["used_memory"])
            path = f"{base}/{source}-fork-{index}"
            status, _, content = await connection.request("PUT", path, headers=fork)
            if status != 201:
                raise RuntimeError(f"the fork answered {status}: {content[:200]!r}")
            added.append(int(client.info("memory")["used_memory"]) - before)
        storage.fork_kib = statistics.median(added) / 1024
    finally:
        connection.close()
    return storage


def _start_reference() -> tuple[subprocess.Popen[str], str] | None:
    node = shutil.which("node")
    if node is None or not (REFERENCE / "node_modules" / "@durable-streams" / "server").is_dir():
        return None
    port = free_port()
    process = subprocess.Popen(
        [node, "server.mjs"],
        cwd=REFERENCE,
        env={**os.environ, "DS_PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if "listening" not in line:
        process.kill()
        raise RuntimeError(f"the reference server did not start: {line!r}")
    return process, f"http://127.0.0.1:{port}/v1/stream"


# The floors' modes and their columns' names.
FLOORS: Final = {"memory": "floor: ASGI, memory", "redis": "floor: ASGI + XADD"}


def _start_floor(mode: str, redis_url: str) -> tuple[subprocess.Popen[str], str]:
    """One floor of :mod:`benchmarks.durable_floor`, serving once its port takes connections."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.durable_floor", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--mode", mode, "--redis-url", redis_url],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the {mode} floor did not start: {process.stderr}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            time.sleep(0.05)
            continue
        return process, f"http://127.0.0.1:{port}/v1/stream"
    process.kill()
    raise RuntimeError(f"the {mode} floor did not listen within 20 s")


def _summary(runs: list[Run]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in Run.__dataclass_fields__:
        values = [getattr(run, name) for run in runs]
        out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def _print(servers: list[Server]) -> None:
    rows = [
        ("appends/s", "appends_per_s", "{:,.0f}"),
        ("append p50 (ms)", "append_p50_ms", "{:.2f}"),
        ("append p99 (ms)", "append_p99_ms", "{:.2f}"),
        ("catch-up: appends read/s", "reads_per_s", "{:,.0f}"),
        ("catch-up: MiB/s", "read_mib_per_s", "{:.1f}"),
        ("server CPU ms per 1,000 appends", "server_cpu_ms_per_1000", "{:.0f}"),
        ("client CPU (cores)", "client_cpu_share", "{:.2f}"),
    ]
    print(f"{'figure':34}" + "".join(f"{s.name:>28}" for s in servers))
    for label, name, spec in rows:
        cells = []
        for server in servers:
            values = [getattr(run, name) for run in server.runs]
            median = spec.format(statistics.median(values))
            cells.append(f"{median} [{spec.format(min(values))}-{spec.format(max(values))}]")
        print(f"{label:34}" + "".join(f"{c:>28}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.durable", description=__doc__)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--appends", type=int, default=500, help="appends per writer")
    parser.add_argument("--bytes", type=int, default=64, help="bytes per append")
    parser.add_argument("--reads", type=int, default=5, help="catch-up reads per writer")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--shared", action="store_true", help="every writer appends to one stream, not its own"
    )
    parser.add_argument(
        "--no-floors",
        action="store_true",
        help="leave out the bare ASGI app's columns (benchmarks/durable_floor.py)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample the broker with py-spy during its first run, and print where it spends",
    )
    args = parser.parse_args(argv)
    redis = RedisServer()
    redis.start()
    # The measure is the protocol's own pace: the per-tenant quotas (every client here is one
    # tenant, an open broker's) are off, as an operator sets them for a trusted writer.
    quotas_off = {f"BROKER_DS_TENANT_{name}": "0" for name in ("APPENDS_PER_S", "MAX_BYTES")}
    broker = Broker(redis.url, concurrency=8, env={"BROKER_MAX_CONNECTIONS": "10000", **quotas_off})
    broker.start()
    servers = [Server("broker (Redis)", f"{broker.base_url}/ds/v1/stream", broker.pid)]
    reference = _start_reference()
    if reference is None:
        print("the reference server is not installed (npm ci in benchmarks/durable-reference)")
    else:
        servers.append(Server("reference (memory)", reference[1], reference[0].pid))
    floors = [] if args.no_floors else [_start_floor(m, redis.url) for m in FLOORS]
    for (process, base), mode in zip(floors, FLOORS, strict=False):
        servers.append(Server(FLOORS[mode], base, process.pid))
    try:
        # Round by round, every server once per round: a change in the machine's load falls
        # on every column alike.
        for index in range(args.repeat):
            for server in servers:
                profiler = None
                if args.profile is not None and index == 0 and server.pid == broker.pid:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    profiler = Profiler(broker.pid, args.profile / "durable.txt")
                server.runs.append(asyncio.run(_one_run(server, args)))
                if profiler is not None:
                    print(summary(profiler.stop()))
        print(
            f"{args.writers} writers x {args.appends} appends of {args.bytes} bytes"
            f"{' to one stream' if args.shared else ''}, then "
            f"{args.reads} catch-up reads each; median [range] of {args.repeat} runs"
        )
        _print(servers)
        storage = asyncio.run(_storage(servers[0].base, redis.client()))
        print(
            "broker storage: Redis bytes per payload byte (binary) "
            f"{storage.per_byte_64:.2f} (64 B appends), {storage.per_byte_4k:.2f} (4 KiB); "
            f"a fork of 8 MiB adds {storage.fork_kib:,.0f} KiB"
        )
        if args.json is not None:
            figures = {s.name: _summary(s.runs) for s in servers}
            every = {"args": vars(args) | {"json": None}, **figures, "storage": vars(storage)}
            args.json.write_bytes(orjson.dumps(every))
    finally:
        if reference is not None:
            reference[0].kill()
        for process, _ in floors:
            process.kill()
        broker.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
