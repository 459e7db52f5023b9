"""Many quiet SSE connections: ``idle_connections`` readers over ``idle_streams`` live turns that
say nothing, spread over a few viewer processes.

Each turn has written its ``attempt`` event and then waits (the simulated provider's
``first_delta_after_ms``) for longer than the run, so every connection hears heartbeats only.
The viewers are raw asyncio sockets (cheap enough for thousands per process) that note when each
heartbeat arrives. Measured, on the broker process:

* its RSS per open connection (RSS with every connection open and quiet, less before);
* its CPU over a quiet window of ``idle_window_s``, and the Redis commands run meanwhile, per
  stream and per connection, per heartbeat period: they must follow the streams, not the
  connections;
* the longest silence any connection saw, against the promise (a heartbeat period plus a quarter
  of it, at most the ticker's 0.25 s);
* the open storm: the broker's and Redis's CPU while every connection opens, per connection,
  and each connection's attach time (from its connect to its response head), p50 and p99;
* after every client left: RSS against before the load, its open file descriptors and the
  Redis connections, against their baseline (as a difference and as a ratio).

The viewer processes talk to the benchmark over pipes:

    viewer -> ("ready",)
    bench  -> (paths, heartbeat_s)
    viewer -> ("attached",)          every connection's response head arrived (or it failed)
    bench  -> "measure"              the quiet window starts: silences count from here
    bench  -> "stop"                 close every connection
    viewer -> ("result", {...})
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import resource
import time
from multiprocessing.connection import Connection
from typing import Any, cast

import httpx

from benchmarks.fanout import _recv, client_processes, shares
from benchmarks.figures import percentile
from benchmarks.harness import Context, Outcome, Sizes, wait_status
from benchmarks.servers import commandstats, status_kib
from benchmarks.sse import turn_body
from benchmarks.workloads import warm_up
from broker.fanout import TICK_MAX_S

CONNECT_CONCURRENCY = 100  # connections being opened at once, per viewer process
PING = b": ping\n"
SILENT_FOR_MS = 600_000  # the turns' first delta comes after the run is over
# What readers send while quiet: the feeds' blocking reads and the looks at the turns (the
# rest in the window is the silent generations' lease renewals and the job reclaims).
READER_COMMANDS = ("xread", "hmget", "hget", "xrange", "xrevrange", "exists", "get")


class _Quiet(asyncio.Protocol):
    """One SSE read that only notes when bytes arrive, and whether a heartbeat is among them."""

    __slots__ = ("_tail", "began", "group", "head_s", "last", "opened", "transport", "worst")

    def __init__(self, group: _Group, began: float) -> None:
        self.group = group
        self.transport: asyncio.Transport | None = None
        self.opened: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.last = 0.0  # when bytes last arrived
        self.worst = 0.0  # the longest silence inside the measured window
        self.began = began  # when its connect began
        self.head_s = 0.0  # from the connect to the response head's first bytes
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.group.next_request())

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.opened.done():
            self.head_s = now - self.began
            self.opened.set_result(data.startswith(b"HTTP/1.1 200"))
        group = self.group
        if group.measuring_since is not None:
            since = max(self.last, group.measuring_since)
            self.worst = max(self.worst, now - since)
        self.last = now
        seen = self._tail + data
        group.pings += seen.count(PING)
        self._tail = seen[-(len(PING) - 1) :]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_result(False)
        self.group.lost += 1


class _Group:
    def __init__(self, requests: list[bytes]) -> None:
        self.requests = requests
        self.measuring_since: float | None = None
        self.pings = 0
        self.lost = 0
        self._opened = 0

    def next_request(self) -> bytes:
        """The requests round the streams, one connection after the other."""
        request = self.requests[self._opened % len(self.requests)]
        self._opened += 1
        return request


def viewer_process(conn: Connection, base_url: str, connections: int) -> None:
    """The body of one viewer process (``multiprocessing`` target)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, connections + 256)), hard))
    conn.send(("ready",))
    paths, _heartbeat_s = conn.recv()
    url = httpx.URL(base_url)
    host, port = str(url.host), int(url.port or 80)
    requests = [
        f"GET {p} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n\r\n".encode()
        for p in paths
    ]

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        group = _Group(requests)
        slots = asyncio.Semaphore(CONNECT_CONCURRENCY)
        readers: list[_Quiet] = []
        failed = 0

        async def attach(index: int) -> None:
            nonlocal failed
            async with slots:
                try:
                    connecting = time.monotonic()
                    _, reader = await loop.create_connection(
                        lambda: _Quiet(group, connecting), host, port
                    )
                    readers.append(reader)
                    if not await asyncio.wait_for(reader.opened, 60):
                        failed += 1
                except (OSError, TimeoutError):
                    failed += 1

        began = time.monotonic()
        await asyncio.gather(*(attach(i) for i in range(connections)))
        attach_s = time.monotonic() - began
        # Each connection's attach, in whole milliseconds (a histogram travels light).
        heads = collections.Counter(round(r.head_s * 1000) for r in readers if r.head_s > 0)
        conn.send(("attached",))
        await loop.run_in_executor(None, conn.recv)  # "measure"
        group.measuring_since = time.monotonic()
        pings_before, lost_before = group.pings, group.lost
        await loop.run_in_executor(None, conn.recv)  # "stop"
        now = time.monotonic()
        # A connection still silent now has been silent since its last bytes.
        worst = max(
            (max(r.worst, now - max(r.last, group.measuring_since)) for r in readers),
            default=0.0,
        )
        pings = group.pings - pings_before
        lost = group.lost - lost_before
        for reader in readers:
            if reader.transport is not None:
                reader.transport.close()
        await asyncio.sleep(0)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "connections": len(readers) - failed,
            "failed": failed,
            "attach_s": round(attach_s, 2),
            "attach_ms": dict(heads),
            "silence_max_s": round(worst, 3),
            "pings": pings,
            "lost_while_quiet": lost,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        }

    result = asyncio.run(run())
    conn.send(("result", result))
    conn.close()


def attach_histogram(results: list[dict[str, Any]]) -> dict[int, int]:
    """The viewer processes' attach times (whole milliseconds: connections), merged."""
    heads: collections.Counter[int] = collections.Counter()
    for result in results:
        heads.update({int(ms): n for ms, n in result["attach_ms"].items()})
    return dict(heads)


def open_fds(pid: int) -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return 0


def broker_gauge(base_url: str, line_prefix: str) -> float:
    """A sample of the broker's /metrics (the first line starting with ``line_prefix``)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def redis_clients(ctx: Context) -> int:
    return sum(int(node.info("clients")["connected_clients"]) for node in ctx.nodes)


def clients_by_last_command(ctx: Context, idle_s: float) -> dict[str, int]:
    """The Redis connections open now, by the last command each ran; those idle for longer
    than ``idle_s`` are counted under ``"<cmd> (idle)"``."""
    found: collections.Counter[str] = collections.Counter()
    for node in ctx.nodes:
        for client in node.client_list():
            idle = float(client.get("idle", 0)) > idle_s
            found[f"{client.get('cmd', '?')}{' (idle)' if idle else ''}"] += 1
    return dict(found.most_common())


def settle(probe: Any, timeout: float = 30.0, steady_s: float = 3.0) -> float:
    """``probe()`` once it has stopped falling for ``steady_s`` (or at ``timeout``), read at
    least three times in that span."""
    deadline = time.monotonic() + timeout
    best, since = probe(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < steady_s:
        time.sleep(min(0.5, steady_s / 3))
        value = probe()
        if value < best:
            best, since = value, time.monotonic()
    return float(best)


class Idle:
    """``idle_connections`` quiet SSE readers over ``idle_streams`` streams."""

    name = "idle"
    worker_concurrency = 128  # a slot for each stream (at most 100), each turn silent

    # RSS, files and Redis connections are counted from before the crowd: a second repeat on
    # the same broker would start from what the first left (it measured ~0 KiB per connection).
    fresh_broker_each_repeat = True

    def broker_env(self, sizes: Sizes) -> dict[str, str]:
        return {
            "BROKER_SSE_HEARTBEAT_S": f"{sizes.idle_heartbeat_s:g}",
            "BROKER_UPSTREAM_IDLE_TIMEOUT_S": str(SILENT_FOR_MS // 1000 + 60),
            # Room past the readers for the benchmark's own requests (/metrics, cancels).
            "BROKER_MAX_CONNECTIONS": str(sizes.idle_connections + 256),
            "BROKER_POOL_TRIM_S": f"{sizes.idle_pool_trim_s:g}",
        }

    def prepare(self, ctx: Context) -> None:
        warm_up(ctx)

    def once(self, ctx: Context, repeat: int) -> Outcome:
        sizes = ctx.sizes
        streams, connections = sizes.idle_streams, sizes.idle_connections
        heartbeat_s = sizes.idle_heartbeat_s
        pid = ctx.broker.pid
        turns = [ctx.turn_id(self.name, repeat, i) for i in range(streams)]
        paths: list[str] = []
        with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
            for turn_id in turns:
                body = turn_body(turn_id, turn_id, tokens=1, tokens_per_s=0)
                simulate = cast(dict[str, Any], body["params"])["simulate"]
                simulate["first_delta_after_ms"] = SILENT_FOR_MS
                response = http.post("/v1/turns", json=body)
                response.raise_for_status()
                paths.append(f"/v1/streams/{response.json()['stream_id']}")
        for turn_id in turns:
            wait_status(ctx.redis, turn_id, turn_id, ("streaming",), timeout=60)
        # The baseline: the streams exist and run (their leases renewed a few times), nobody
        # reads them.
        time.sleep(sizes.idle_baseline_s)
        rss_before = settle(lambda: status_kib(pid, "VmRSS"), steady_s=sizes.settle_s) / 1024
        fds_before, clients_before = open_fds(pid), redis_clients(ctx)
        counts = shares(connections, max(1, sizes.viewer_processes))
        # Each process's connections go round the streams, starting at its own offset.
        owns = [paths[i % streams :] + paths[: i % streams] for i in range(len(counts))]
        args = [(ctx.broker.base_url, count) for count in counts]
        with client_processes(viewer_process, args, "bench-idle-viewers") as (pipes, processes):
            for conn in pipes:
                _recv(conn, 60, "ready")
            storm = ctx.meter([p.pid for p in processes])
            storm_calls = commandstats(ctx.nodes)
            began = time.monotonic()
            for conn, own in zip(pipes, owns, strict=True):
                conn.send((own, heartbeat_s))
            for conn in pipes:
                _recv(conn, 300, "attached")
            attach_s = time.monotonic() - began
            storm_s = storm.seconds()
            storm_cores = storm.cores()
            storm_calls = {
                name: n - storm_calls.get(name, 0)
                for name, n in commandstats(ctx.nodes).items()
                if n - storm_calls.get(name, 0) > 0 and name != "info"
            }
            clients_storm = redis_clients(ctx)
            viewers = broker_gauge(ctx.broker.base_url, 'broker_stream_viewers{mode="sse"}')
            time.sleep(min(2.0, heartbeat_s))  # the last attaches' replays are written
            for conn in pipes:
                conn.send("measure")
            meter = ctx.meter([p.pid for p in processes])
            calls_before = commandstats(ctx.nodes)
            rss_samples = [status_kib(pid, "VmRSS")]
            window_end = time.monotonic() + sizes.idle_window_s
            while time.monotonic() < window_end:
                time.sleep(min(1.0, max(0.0, window_end - time.monotonic())))
                rss_samples.append(status_kib(pid, "VmRSS"))
            window_s = sizes.idle_window_s
            cpu = meter.cores()
            calls = {
                name: n - calls_before.get(name, 0)
                for name, n in commandstats(ctx.nodes).items()
                if n - calls_before.get(name, 0) > 0
            }
            calls.pop("info", None)  # the benchmark's own
            fds_loaded, clients_loaded = open_fds(pid), redis_clients(ctx)
            for conn in pipes:
                conn.send("stop")
            results = [_recv(conn, 120, "result")[1] for conn in pipes]
        # Every client left: what comes back, once the broker had the time of two passes of its
        # pool trim (BROKER_POOL_TRIM_S) after the last reader went (a connection is closed
        # once a whole period went by without a call taking it).
        steady = sizes.settle_s
        settle(
            lambda: broker_gauge(ctx.broker.base_url, 'broker_stream_viewers{mode="sse"}'),
            steady_s=steady,
        )
        fds_left, clients_left = open_fds(pid), redis_clients(ctx)  # as the crowd left them
        time.sleep(2 * sizes.idle_pool_trim_s + steady)
        rss_after = settle(lambda: status_kib(pid, "VmRSS"), steady_s=steady) / 1024
        fds_after = settle(lambda: open_fds(pid), steady_s=steady)
        clients_after = settle(lambda: redis_clients(ctx), steady_s=steady)
        left_open = clients_by_last_command(ctx, sizes.idle_pool_trim_s)
        with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
            for turn_id in turns:
                http.post(f"/v1/turns/{turn_id}/cancel")
        attached = sum(r["connections"] for r in results)
        if attached <= 0:
            raise RuntimeError(f"no connection attached: {results}")
        rss_loaded = sorted(rss_samples)[len(rss_samples) // 2] / 1024  # the window's median
        periods = window_s / heartbeat_s
        total_calls = sum(calls.values())
        reader_calls = sum(calls.get(name, 0) for name in READER_COMMANDS)
        silence = max(r["silence_max_s"] for r in results)
        promise = heartbeat_s + min(heartbeat_s / 4, TICK_MAX_S)
        heads = attach_histogram(results)
        open_cpu_s = storm_s["broker"] + storm_s["redis"]
        return Outcome(
            values={
                "idle.rss_per_connection_kib": (rss_loaded - rss_before) * 1024 / attached,
                "idle.broker_cpu_cores": cpu["broker"],
                "idle.redis_commands_per_stream_period": total_calls / streams / periods,
                "idle.reader_commands_per_connection_period": reader_calls / attached / periods,
                "idle.silence_past_promise_s": silence - promise,
                "idle.rss_after_over_before": rss_after / rss_before,
                "idle.open_cpu_ms_per_connection": open_cpu_s * 1000 / attached,
                "idle.attach_p99_ms": percentile(heads, 99) or 0.0,
                "idle.fds_after_over_before": fds_after / max(1, fds_before),
                "idle.fds_after_minus_before": fds_after - fds_before,
                "idle.redis_clients_after_minus_before": clients_after - clients_before,
            },
            details={
                "connections": attached,
                "failed": sum(r["failed"] for r in results),
                "lost_while_quiet": sum(r["lost_while_quiet"] for r in results),
                "streams": streams,
                "viewer_processes": len(results),
                "viewers_gauge": viewers,
                "attach_s": round(attach_s, 2),
                "attach_p50_ms": percentile(heads, 50),
                "open_cpu_s": {k: round(v, 3) for k, v in storm_s.items()},
                "open_cpu_cores": storm_cores,
                "open_commands_per_connection": {
                    name: round(n / attached, 3)
                    for name, n in sorted(storm_calls.items(), key=lambda kv: -kv[1])
                },
                "heartbeat_s": heartbeat_s,
                "window_s": window_s,
                "pings_in_window": sum(r["pings"] for r in results),
                "silence_max_s": silence,
                "promised_s": promise,
                "rss_mib": {
                    "before": round(rss_before, 1),
                    "loaded": round(rss_loaded, 1),
                    "after": round(rss_after, 1),
                },
                "fds": {
                    "before": fds_before,
                    "loaded": fds_loaded,
                    "left": fds_left,
                    "after": fds_after,
                },
                "redis_clients": {
                    "before": clients_before,
                    "opened": clients_storm,
                    "loaded": clients_loaded,
                    "left": clients_left,
                    "after": clients_after,
                    "after_by_last_command": left_open,
                },
                "commands_in_window": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
                "cpu_cores": cpu,
                "viewer_cpu_s": round(sum(r["cpu_s"] for r in results), 2),
            },
        )
