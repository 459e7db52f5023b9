"""One turn paced at 100 deltas/s watched by a thousand SSE viewers, spread over a few processes.

Each viewer process opens its share of connections (raw asyncio sockets, see
:mod:`benchmarks.sse`) and records, for every delta, the Redis time of its append (the entry id's
millisecond part) and the wall-clock time it arrived. A viewer whose read fails reattaches with
``Last-Event-ID``, as a real client does. The benchmark process talks to the viewer processes
over pipes:

    viewer -> ("ready",)                     imported, waiting for the stream
    bench  -> (stream_id, pace)
    viewer -> ("attached", [ms, ...])        every viewer's response is open (or it gave up), and
                                             when each head arrived (wall-clock ms)
    viewer -> ("done",)                      every viewer read its `end` (or gave up)
    bench  -> first_ms                       when the first delta was appended
    viewer -> ("result", {...})

The viewers attach before the turn writes its first delta, so what is measured is the live
fan-out: the broker runs with one worker slot, held by a slow *blocker* turn until every viewer
is attached, and the turn under test starts when the blocker is cancelled. Redis commands per
delta are counted between two snapshots in the steady state (a warm-up after the first delta,
until a second before the last), so attaching and leaving viewers are left out.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import multiprocessing
import random
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import httpx
import redis

from benchmarks.figures import percentile
from benchmarks.harness import (
    KEYS,
    Context,
    Outcome,
    count_deltas,
    delta_span,
    wait_status,
    xlen,
)
from benchmarks.servers import commandstats, reset_peak_rss, status_kib
from benchmarks.sse import SSEReader, entry_ms, open_sse, turn_body
from benchmarks.workloads import warm_up
from broker.vocabulary import FINAL_STATUSES

CONNECT_CONCURRENCY = 50  # connections being opened at once, per viewer process
MAX_REATTACHES = 5
LAG_BUCKETS_PER_MS = 10  # lag histograms have 0.1 ms buckets
SLOW_MS = 500.0  # a live delta this late makes its viewer a slow one (reported apart)
LOOP_TICK_S = 0.01  # a viewer process's loop watch sleeps this long at a time


def emitted_ms(data: bytes, otherwise: float) -> float:
    """When the model emitted a stamped delta (``params.simulate.stamp``: its text starts with
    the emit time in microseconds since the epoch and a space), in ms; ``otherwise`` when the
    frame's data holds no stamp."""
    start = data.find(b'"text":"')
    if start < 0:
        return otherwise
    start += 8
    end = data.find(b" ", start)
    try:
        return int(data[start:end]) / 1000
    except ValueError:
        return otherwise


class _Viewer:
    __slots__ = ("attached_ms", "deltas", "ended", "group", "last_id", "slow_after_s", "worst_ms")

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.deltas = 0
        self.last_id = b""
        self.ended = False
        # When its first response head arrived (ms): a viewer that joins a running stream
        # replays what came before, and only the deltas appended after count for the lag.
        self.attached_ms = 0.0
        self.worst_ms = 0.0  # its worst live lag
        # How long after it attached its first live delta later than SLOW_MS came (None: none).
        self.slow_after_s: float | None = None

    def on_head(self, now: float) -> None:
        """Its response head arrived: the first time, the deltas appended from now on are live
        (those of the same read included)."""
        if not self.attached_ms:
            self.attached_ms = now * 1000

    def on_events(self, events: list[tuple[bytes, bytes, bytes]], now: float) -> bool:
        group = self.group
        last_id = self.last_id
        now_ms = now * 1000
        stamped = group.stamped
        for event_id, event, data in events:
            if event_id <= last_id:
                group.out_of_order += 1
                continue
            last_id = event_id
            if event == b"delta":
                sent_ms: float = entry_ms(event_id)
                if stamped:  # the lag counts from the model's emit, not from the append
                    sent_ms = emitted_ms(data, sent_ms)
                if sent_ms >= self.attached_ms:
                    lag = now_ms - sent_ms
                    group.index.append(self.deltas)
                    group.sent_ms.append(int(sent_ms))
                    group.lag_ms.append(lag)
                    if lag > self.worst_ms:
                        self.worst_ms = lag
                        if lag > SLOW_MS and self.slow_after_s is None:
                            self.slow_after_s = (sent_ms - self.attached_ms) / 1000
                self.deltas += 1
            elif event == b"end":
                self.ended = True
                break
        self.last_id = last_id
        return self.ended


class _Group:
    """The viewers of one process and what they saw."""

    def __init__(self, conn: Connection, viewers: int) -> None:
        self.conn = conn
        self.viewers = viewers
        self.index: array.array[int] = array.array("q")  # the delta's rank in its turn
        self.sent_ms: array.array[int] = array.array("q")
        self.lag_ms: array.array[float] = array.array("d")
        self.out_of_order = 0
        self.stamped = False  # the turn's deltas start with their emit time (simulate.stamp)
        self.failed = 0
        self.reattaches = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self._attached: list[float] = []
        self._announced = False

    def attached(self, at_ms: float) -> None:
        self._attached.append(at_ms)
        self._announce()

    def fail(self) -> None:
        self.failed += 1
        self._announce()

    def _announce(self) -> None:
        if not self._announced and len(self._attached) + self.failed >= self.viewers:
            self._announced = True
            self.conn.send(("attached", self._attached))


async def _view(
    viewer: _Viewer,
    slots: asyncio.Semaphore,
    base_url: str,
    path: str,
    deadline: float,
    join_over_s: float = 0.0,
) -> None:
    """Read one stream to its end, reattaching after a failure like a real client; with
    ``join_over_s``, first wait a random part of it (viewers joining one after another)."""
    group = viewer.group
    attached = False
    attempts = 0
    if join_over_s > 0:
        await asyncio.sleep(random.uniform(0, join_over_s))
    while True:
        reader: SSEReader | None = None
        try:
            async with slots:
                resume = viewer.last_id.decode() or None
                reader = await open_sse(
                    base_url, path, viewer.on_events, resume, on_head=viewer.on_head
                )
                status = await asyncio.wait_for(
                    asyncio.shield(reader.opened), deadline - time.monotonic()
                )
            if status == 200 and not attached:
                attached = True
                group.attached(viewer.attached_ms)
            if status == 200:
                await asyncio.wait_for(asyncio.shield(reader.done), deadline - time.monotonic())
            if viewer.ended or status == 204:
                return
            problem = f"HTTP {status}" if status != 200 else (reader.error or "cut before end")
        except TimeoutError:
            group.errors["no end event before the deadline"] += 1
            if not attached:
                group.fail()
            return
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        finally:
            if reader is not None:
                reader.close()
        group.errors[problem[:120]] += 1
        attempts += 1
        if attempts > MAX_REATTACHES:
            if not attached:
                group.fail()
            return
        group.reattaches += 1
        await asyncio.sleep(random.uniform(0.1, 0.5) * attempts)


def viewer_process(conn: Connection, base_url: str, viewers: int, timeout_s: float) -> None:
    """The body of one viewer process (``multiprocessing`` target)."""
    conn.send(("ready",))
    stream_id, pace, *rest = conn.recv()  # (stream_id, pace[, join_over_s[, stamped]])
    join_over_s = float(rest[0]) if rest else 0.0
    group = _Group(conn, viewers)
    group.stamped = bool(rest[1]) if len(rest) > 1 else False
    watchers = [_Viewer(group) for _ in range(viewers)]

    # How late this process's event loop wakes from a short sleep (ms buckets): when it is
    # late, the process is behind on its sockets, and the lag it counts is its own, not the
    # broker's.
    loop_late: collections.Counter[int] = collections.Counter()

    async def watch_loop() -> None:
        while True:
            asked = time.monotonic() + LOOP_TICK_S
            await asyncio.sleep(LOOP_TICK_S)
            loop_late[int(max(0.0, time.monotonic() - asked) * 1000)] += 1

    async def watch() -> None:
        slots = asyncio.Semaphore(CONNECT_CONCURRENCY)
        deadline = time.monotonic() + timeout_s
        path = f"/v1/streams/{stream_id}"
        looking = asyncio.ensure_future(watch_loop())
        try:
            await asyncio.gather(
                *(_view(v, slots, base_url, path, deadline, join_over_s) for v in watchers)
            )
        finally:
            looking.cancel()

    # The viewers share two cores with the broker: keep their own cost per event low.
    try:
        import uvloop
    except ImportError:
        asyncio.run(watch())
    else:
        uvloop.run(watch())
    conn.send(("done",))
    first_ms: int = conn.recv()
    # Lag behind the append (the entry id's time), and behind the pace the turn was asked for:
    # the k-th delta is due k / pace seconds after the first. The second grows when the writer
    # cannot keep its pace, which the first does not show.
    histogram: collections.Counter[int] = collections.Counter()
    behind: collections.Counter[int] = collections.Counter()
    for index, sent, lag in zip(group.index, group.sent_ms, group.lag_ms, strict=True):
        histogram[int(max(0.0, lag) * LAG_BUCKETS_PER_MS)] += 1
        due = first_ms + index * 1000 / pace
        behind[int(max(0.0, sent + lag - due) * LAG_BUCKETS_PER_MS)] += 1
    usage = resource.getrusage(resource.RUSAGE_SELF)
    conn.send(
        (
            "result",
            {
                "viewers": viewers,
                "failed": group.failed,
                "reattaches": group.reattaches,
                "ended": sum(w.ended for w in watchers),
                "deltas": sum(w.deltas for w in watchers),
                "deltas_min": min(w.deltas for w in watchers),
                "deltas_max": max(w.deltas for w in watchers),
                "out_of_order": group.out_of_order,
                "histogram": dict(histogram),
                "behind_schedule": dict(behind),
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "loop_late_ms": dict(loop_late),
                "slow_viewers": [
                    (round(w.slow_after_s, 2), round(w.worst_ms))
                    for w in watchers
                    if w.slow_after_s is not None
                ],
                "errors": dict(group.errors.most_common(5)),
            },
        )
    )
    conn.close()


class _RssSampler:
    """Samples a process's RSS every 50 ms in a thread; the peak is kept."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, status_kib(self.pid, "VmRSS"))
            self._stop.wait(0.05)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kib / 1024


def _sum(snapshots: list[dict[str, int]]) -> dict[str, int]:
    out: collections.Counter[str] = collections.Counter()
    for snapshot in snapshots:
        out.update(snapshot)
    return dict(out)


def _diff(after: dict[str, int], before: dict[str, int], own: dict[str, int]) -> dict[str, int]:
    """Calls between two snapshots, less ``own`` (the benchmark's calls in between)."""
    out = {name: calls - before.get(name, 0) - own.get(name, 0) for name, calls in after.items()}
    return {name: calls for name, calls in out.items() if calls > 0}


class Monitor:
    """Counts the commands one Redis node runs (``MONITOR``), telling clients' from Lua scripts'
    calls.

    ``INFO commandstats`` counts both alike; MONITOR prefixes a script's calls with ``[0 lua]``.
    Its cost is one copy of each command to this connection: fine at the fan-out's pace. A
    cluster gets one per node, their counts summed. On a replica (``primary_port`` given), what
    arrives over the link from its primary (the primary's writes, replayed) counts as
    ``replication``, not as a client's.
    """

    def __init__(self, port: int, primary_port: int | None = None) -> None:
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._primary = None if primary_port is None else f" 127.0.0.1:{primary_port}".encode()
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.sendall(b"MONITOR\r\n")
        self._thread = threading.Thread(target=self._read, name="redis-monitor", daemon=True)

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)
        self._sock.close()

    def _read(self) -> None:
        pending = b""
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            lines = (pending + data).split(b"\r\n")
            pending = lines.pop()
            for line in lines:
                self._count(line)

    def _count(self, line: bytes) -> None:
        # +1700000000.123456 [0 lua] "XADD" "key" ...  /  +1700... [0 127.0.0.1:5000] "evalsha" ...
        opened, closed = line.find(b"["), line.find(b"] ")
        if not line.startswith(b"+") or opened < 0 or closed < 0:
            return  # +OK, or a reply we do not count
        origin = line[opened:closed]
        source = "client"
        if origin.endswith(b" lua"):
            source = "lua"
        elif self._primary is not None and origin.endswith(self._primary):
            source = "replication"
        command = line[closed + 2 :].split(b" ", 1)[0].strip(b'"').decode().lower()
        self.calls[(source, command)] += 1


def _recv(conn: Connection, timeout: float, expected: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"a viewer process sent no {expected!r} in {timeout:.0f} s")
    message = conn.recv()
    if not isinstance(message, tuple) or message[0] != expected:
        raise RuntimeError(f"a viewer process sent {message!r}, not {expected!r}")
    return message


def _all_done(pipes: list[Connection], done: set[int], timeout: float) -> bool:
    """Whether every viewer process said ``done`` (``done`` holds those that did) in time."""
    deadline = time.monotonic() + timeout
    for index, conn in enumerate(pipes):
        if index in done:
            continue
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            return False
        message = conn.recv()
        if message != ("done",):
            raise RuntimeError(f"a viewer process sent {message!r}, not 'done'")
        done.add(index)
    return True


def _first_delta_ms(client: redis.Redis, key: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(RuntimeError):
            return delta_span(client, key, first_only=True)[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no delta in {key} after {timeout} s")
        time.sleep(0.01)


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` shares that differ by at most one."""
    return [total // parts + (i < total % parts) for i in range(parts)]


@contextlib.contextmanager
def client_processes(
    target: Callable[..., None], args: list[tuple[Any, ...]], name: str
) -> Iterator[tuple[list[Connection], list[multiprocessing.process.BaseProcess]]]:
    """One spawned process per entry of ``args``, each called as ``target(pipe, *its args)``;
    yields the benchmark's ends of the pipes and the processes, and reaps them on the way out
    (killed if they do not end within 10 s)."""
    mp = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    processes: list[multiprocessing.process.BaseProcess] = []
    try:
        for own in args:
            parent, child = mp.Pipe()
            started = mp.Process(target=target, args=(child, *own), name=name, daemon=True)
            started.start()
            child.close()
            pipes.append(parent)
            processes.append(started)
        yield pipes, processes
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


class FanOut:
    """1 turn x ``viewers`` SSE viewers, paced at ``fanout_pace`` deltas/s."""

    name = "fanout"
    worker_concurrency = 1  # see the blocker turn in the module docstring

    def prepare(self, ctx: Context) -> None:
        warm_up(ctx)

    def once(self, ctx: Context, repeat: int) -> Outcome:
        sizes = ctx.sizes
        tokens, pace = sizes.fanout_tokens, sizes.fanout_pace
        duration = tokens / pace
        timeout = 2 * duration + 150  # a safety net: the turn is cancelled at 2 x its duration
        args = [
            (ctx.broker.base_url, share, timeout)
            for share in shares(sizes.viewers, sizes.viewer_processes)
        ]
        with client_processes(viewer_process, args, "bench-viewers") as (pipes, processes):
            return self._drive(ctx, repeat, tokens, pace, pipes, [p.pid for p in processes])

    def _drive(
        self,
        ctx: Context,
        repeat: int,
        tokens: int,
        pace: float,
        pipes: list[Connection],
        viewer_pids: list[int | None],
    ) -> Outcome:
        client = ctx.redis
        for conn in pipes:
            _recv(conn, 60, "ready")
        turn_id = ctx.turn_id(self.name, repeat)
        blocker_id = ctx.turn_id(self.name, repeat, 1)
        key = KEYS.events(turn_id, turn_id)
        with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
            # The blocker takes the broker's only worker slot; the turn under test queues.
            blocker = turn_body(blocker_id, blocker_id, tokens=100_000, tokens_per_s=10)
            http.post("/v1/turns", json=blocker).raise_for_status()
            wait_status(client, blocker_id, blocker_id, ("streaming",), timeout=30)
            response = http.post(
                "/v1/turns", json=turn_body(turn_id, turn_id, tokens=tokens, tokens_per_s=pace)
            )
            response.raise_for_status()
            stream_id = str(response.json()["stream_id"])
            hwm_reset = reset_peak_rss(ctx.broker.pid)
            sampler = _RssSampler(ctx.broker.pid)
            whole = ctx.meter(viewer_pids)
            all_before = commandstats(ctx.nodes)
            replicas_before = commandstats(ctx.replica_nodes)
            began = time.time()
            for conn in pipes:
                conn.send((stream_id, pace))
            for conn in pipes:
                _recv(conn, 120, "attached")
            attach_s = time.time() - began
            time.sleep(0.5)  # the last viewers' reads go from replay to live
            http.post(f"/v1/turns/{blocker_id}/cancel").raise_for_status()
        first_ms = _first_delta_ms(client, key, timeout=30)
        # Steady state: after a warm-up, until a second before the last delta (the writer keeps
        # its pace from its first delta), so that the viewers' ends are left out.
        last_at = first_ms / 1000 + (tokens - 1) / pace
        window_start = first_ms / 1000 + min(1.0, tokens / pace / 10)
        window_end = last_at - 1.0
        if window_end - window_start < 0.3:  # tiny runs: take the whole turn
            window_start, window_end = first_ms / 1000, last_at + 0.5
        time.sleep(max(0.0, window_start - time.time()))
        before_by_node = [commandstats([node]) for node in ctx.nodes]
        entries_before = xlen(client, key)
        steady = ctx.meter(viewer_pids)
        with contextlib.ExitStack() as stack:
            monitors = [stack.enter_context(Monitor(port)) for port in ctx.redis_server.ports]
            replica_monitors = [
                stack.enter_context(Monitor(port, primary))
                for port, primary in ctx.redis_server.replica_links
            ]
            time.sleep(max(0.0, window_end - time.time()))
        steady_cpu = steady.cores()
        entries_after = xlen(client, key)
        after_by_node = [commandstats([node]) for node in ctx.nodes]
        monitored: collections.Counter[tuple[str, str]] = collections.Counter()
        for monitor in monitors:
            monitored.update(monitor.calls)
        # Replicas run no scripts: what their clients (the broker's readers, with replica reads)
        # send is what they run for the broker. Their INFO commandstats would count the
        # replication stream too, the primaries' writes a second time, so MONITOR counts them.
        replicas_monitored: collections.Counter[tuple[str, str]] = collections.Counter()
        for monitor in replica_monitors:
            replicas_monitored.update(monitor.calls)
        replica_calls = {
            c: n for (source, c), n in replicas_monitored.items() if source == "client"
        }
        replicated = sum(
            n for (source, _), n in replicas_monitored.items() if source == "replication"
        )
        # A writer that cannot keep its pace is stopped at twice the turn's duration: the
        # viewers then read what was written, and its `end` (cancelled).
        turn_deadline = first_ms / 1000 + 2 * tokens / pace + 5
        cancelled = False
        done: set[int] = set()
        if not _all_done(pipes, done, turn_deadline - time.time()):
            with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
                http.post(f"/v1/turns/{turn_id}/cancel").raise_for_status()
            cancelled = True
            if not _all_done(pipes, done, 120):
                raise TimeoutError("viewers did not finish after the turn was cancelled")
        all_after = commandstats(ctx.nodes)
        replicas_after = commandstats(ctx.replica_nodes)
        turn_status = wait_status(client, turn_id, turn_id, tuple(FINAL_STATUSES), timeout=60)
        stored = xlen(client, key)
        written = count_deltas(client, key)
        span_ms = delta_span(client, key)[1] - first_ms
        whole_cpu = whole.cores()
        rss_sampled = sampler.stop()
        rss_peak = max(rss_sampled, ctx.broker.peak_rss_mib() if hwm_reset else 0.0)
        results: list[dict[str, Any]] = []
        for conn in pipes:
            conn.send(first_ms)
            results.append(_recv(conn, 60, "result")[1])
        histogram: collections.Counter[int] = collections.Counter()
        behind: collections.Counter[int] = collections.Counter()
        for result in results:
            histogram.update({int(k): v for k, v in result["histogram"].items()})
            behind.update({int(k): v for k, v in result["behind_schedule"].items()})
        behind_p50, behind_p99 = percentile(behind, 50), percentile(behind, 99)
        failed = sum(r["failed"] for r in results)
        reattaches = sum(r["reattaches"] for r in results)
        viewers = sum(r["viewers"] for r in results)
        received = sum(r["deltas"] for r in results)
        missing = max(0, viewers * written - received)
        before, after = _sum(before_by_node), _sum(after_by_node)
        steady_calls = collections.Counter(_diff(after, before, own={"xlen": 2}))
        steady_calls.update(replica_calls)
        # How the steady state's commands spread over the nodes (one on a single server).
        by_node = [
            sum(_diff(a, b, own={}).values())
            for a, b in zip(after_by_node, before_by_node, strict=True)
        ]
        steady_deltas = entries_after - entries_before
        steady_total = sum(steady_calls.values())
        whole_calls = _diff(all_after, all_before, own={"xlen": 2})
        whole_total = sum(whole_calls.values())
        monitored_deltas = monitored[("lua", "xadd")] + monitored[("client", "xadd")]
        client_calls = collections.Counter(
            {c: n for (source, c), n in monitored.items() if source == "client"}
        )
        client_calls.update(replica_calls)
        p50, p99 = percentile(histogram, 50), percentile(histogram, 99)
        if p50 is None or p99 is None or steady_deltas <= 0:
            raise RuntimeError("no delta was read in the steady state")
        if failed == viewers:
            raise RuntimeError(f"no viewer could attach: {results[0]['errors']}")
        per_delta = {
            name: round(calls / steady_deltas, 3)
            for name, calls in sorted(steady_calls.items(), key=lambda kv: -kv[1])
        }
        if monitored_deltas <= 0:
            raise RuntimeError("MONITOR saw no XADD in the steady state")
        client_per_delta = {
            name: round(calls / monitored_deltas, 3)
            for name, calls in sorted(client_calls.items(), key=lambda kv: -kv[1])
        }
        client_cpu = sum(r["cpu_s"] for r in results)
        return Outcome(
            values={
                "fanout.missing": float(missing),
                "fanout.lag_p50_ms": p50 / LAG_BUCKETS_PER_MS,
                "fanout.lag_p99_ms": p99 / LAG_BUCKETS_PER_MS,
                "fanout.redis_commands_per_delta": steady_total / steady_deltas,
                "fanout.redis_client_commands_per_delta": (
                    sum(client_calls.values()) / monitored_deltas
                ),
                "fanout.broker_rss_peak_mib": rss_peak,
                "fanout.append_rate_per_s": (written - 1) / max(span_ms, 1) * 1000,
            },
            details={
                "viewers": viewers,
                "viewer_processes": len(results),
                "tokens": tokens,
                "pace": pace,
                "viewers_failed": failed,
                "reattaches": reattaches,
                "viewers_ended": sum(r["ended"] for r in results),
                "deltas_written": written,
                "cancelled_at_deadline": cancelled,
                "deltas_per_viewer_min_max": [
                    min(r["deltas_min"] for r in results),
                    max(r["deltas_max"] for r in results),
                ],
                "out_of_order": sum(r["out_of_order"] for r in results),
                "turn_status": turn_status,
                "stored_events": stored,
                "attach_s": round(attach_s, 3),
                "lag_samples": sum(histogram.values()),
                # What the broker delivered: the fan-out's capacity when the writer falls behind.
                "frames_per_s": round(
                    sum(histogram.values()) / max(span_ms, 1) * 1000 if written > 1 else 0.0
                ),
                "lag_max_ms": max(histogram) / LAG_BUCKETS_PER_MS,
                "behind_schedule_ms_p50_p99": [
                    (behind_p50 or 0) / LAG_BUCKETS_PER_MS,
                    (behind_p99 or 0) / LAG_BUCKETS_PER_MS,
                ],
                "steady_deltas": steady_deltas,
                "commands_per_delta_by_name": per_delta,
                "steady_commands_by_node": by_node,
                # With replicas: what the broker sent each replica, and what its primary's link
                # replayed on the replicas, per delta.
                "steady_client_commands_by_replica": [
                    sum(n for (source, _), n in m.calls.items() if source == "client")
                    for m in replica_monitors
                ],
                "replica_client_commands_per_delta_by_name": {
                    name: round(calls / monitored_deltas, 3)
                    for name, calls in sorted(replica_calls.items(), key=lambda kv: -kv[1])
                },
                "replicated_commands_per_delta": round(replicated / monitored_deltas, 3),
                "client_commands_per_delta_by_name": client_per_delta,
                "steady_window_s": round(window_end - window_start, 2),
                # The primaries only: with replica reads, the viewers' replays and reads went
                # to the replicas, whose INFO counts (the primaries' writes replayed included)
                # follow, by name, over the whole turn.
                "commands_per_delta_whole_turn": round(whole_total / max(written, 1), 3),
                "replica_commands_whole_turn": dict(
                    sorted(
                        _diff(replicas_after, replicas_before, own={}).items(),
                        key=lambda kv: -kv[1],
                    )
                ),
                "rss_sampled_peak_mib": round(rss_sampled, 1),
                "cpu_cores_steady": steady_cpu,
                "cpu_cores": whole_cpu,
                "viewer_cpu_s": round(client_cpu, 2),
                "errors": [e for r in results for e in r["errors"].items()],
            },
        )
