"""Durable Streams: append and read throughput on the protocol side, next to the reference server.

``python -m benchmarks.durable`` starts its own Redis and ``broker serve``, and the protocol's
reference server (``@durable-streams/server``, pinned in ``benchmarks/durable-reference``: run
``npm ci`` there, or ``scripts/npm-ci``; it keeps streams in memory) on free ports, and drives
both with the same client, one server at a time:

* **append**: ``--writers`` clients, each on its own connection and stream, POST ``--appends``
  bodies of ``--bytes`` bytes one after another (each waits for its answer): appends per second
  in total, and the latency of one append (p50, p99);
* **read**: the same clients each read their stream from the start (catch-up) ``--reads``
  times: appends and MiB delivered per second;
* the server's CPU seconds per 1,000 appends, and the client's own CPU (if it nears one core,
  the client is what limits the figures).

Each figure is the median of ``--repeat`` runs, with its range. Nothing here is a pass/fail test;
the figures go to stdout (and ``--json PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks.servers import REPO, Broker, RedisServer, cpu_seconds, free_port

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


async def _writer(client: httpx.AsyncClient, url: str, body: bytes, count: int) -> list[float]:
    created = await client.put(url, headers={"content-type": "application/octet-stream"})
    created.raise_for_status()
    latencies = []
    headers = {"content-type": "application/octet-stream"}
    for _ in range(count):
        began = time.perf_counter()
        response = await client.post(url, content=body, headers=headers)
        latencies.append(time.perf_counter() - began)
        if response.status_code not in (200, 204):
            raise RuntimeError(f"append answered {response.status_code}: {response.text[:200]}")
    return latencies


async def _reader(client: httpx.AsyncClient, url: str, reads: int, expect: int) -> int:
    total = 0
    for _ in range(reads):
        offset = "-1"
        got = 0
        while True:
            response = await client.get(url, params={"offset": offset})
            response.raise_for_status()
            got += len(response.content)
            offset = response.headers["stream-next-offset"]
            if response.headers.get("stream-up-to-date") == "true":
                break
        if got != expect:
            raise RuntimeError(f"a read brought {got} bytes, not {expect}")
        total += got
    return total


async def _one_run(server: Server, args: argparse.Namespace) -> Run:
    body = os.urandom(args.bytes)
    limits = httpx.Limits(max_connections=args.writers, max_keepalive_connections=args.writers)
    run = Run()
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        urls = [f"{server.base}/bench-{uuid.uuid4().hex[:12]}-{i}" for i in range(args.writers)]
        cpu0, client0, wall0 = cpu_seconds(server.pid), time.process_time(), time.perf_counter()
        lists = await asyncio.gather(*(_writer(client, u, body, args.appends) for u in urls))
        wall = time.perf_counter() - wall0
        appends = args.writers * args.appends
        run.appends_per_s = appends / wall
        latencies = [v for values in lists for v in values]
        run.append_p50_ms = _percentile(latencies, 0.5) * 1000
        run.append_p99_ms = _percentile(latencies, 0.99) * 1000
        run.server_cpu_ms_per_1000 = (cpu_seconds(server.pid) - cpu0) * 1000 / appends * 1000
        client_write = time.process_time() - client0
        expect = args.appends * args.bytes
        client1, wall1 = time.process_time(), time.perf_counter()
        delivered = await asyncio.gather(*(_reader(client, u, args.reads, expect) for u in urls))
        read_wall = time.perf_counter() - wall1
        run.reads_per_s = args.writers * args.reads * args.appends / read_wall
        run.read_mib_per_s = sum(delivered) / read_wall / 2**20
        client_cpu = client_write + time.process_time() - client1
        run.client_cpu_share = client_cpu / (wall + read_wall)
    return run


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
    print(f"{'figure':34}" + "".join(f"{s.name:>30}" for s in servers))
    for label, name, spec in rows:
        cells = []
        for server in servers:
            values = [getattr(run, name) for run in server.runs]
            median = spec.format(statistics.median(values))
            cells.append(f"{median} [{spec.format(min(values))}-{spec.format(max(values))}]")
        print(f"{label:34}" + "".join(f"{c:>30}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.durable", description=__doc__)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--appends", type=int, default=500, help="appends per writer")
    parser.add_argument("--bytes", type=int, default=64, help="bytes per append")
    parser.add_argument("--reads", type=int, default=5, help="catch-up reads per writer")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    redis = RedisServer()
    redis.start()
    broker = Broker(redis.url, concurrency=8, env={"BROKER_MAX_CONNECTIONS": "10000"})
    broker.start()
    servers = [Server("broker (Redis)", f"{broker.base_url}/ds/v1/stream", broker.pid)]
    reference = _start_reference()
    if reference is None:
        print("the reference server is not installed (npm ci in benchmarks/durable-reference)")
    else:
        servers.append(Server("reference (memory)", reference[1], reference[0].pid))
    try:
        for server in servers:
            for _ in range(args.repeat):
                server.runs.append(asyncio.run(_one_run(server, args)))
        print(
            f"{args.writers} writers x {args.appends} appends of {args.bytes} bytes, then "
            f"{args.reads} catch-up reads each; median [range] of {args.repeat} runs"
        )
        _print(servers)
        if args.json is not None:
            figures = {s.name: _summary(s.runs) for s in servers}
            args.json.write_bytes(orjson.dumps({"args": vars(args) | {"json": None}, **figures}))
    finally:
        if reference is not None:
            reference[0].kill()
        broker.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
