"""Viewers who join an answer that is already running: ``viewers`` SSE readers attach, spread
over ``join_over_s``, to a turn paced at ``fanout_pace`` deltas/s that started a second before.

Each viewer reads from the start: it replays what came before it joined, then follows live. Its
lag is counted for the deltas appended after its response head arrived (a replayed delta's
"lag" is only how late the viewer came). The viewer processes are the fan-out's
(:mod:`benchmarks.fanout`), told to stagger their connects.

The attach storm's cost is what the join window adds to a stream with no viewers: the broker's
CPU and the Redis commands (calls inside scripts included) from the first connect to the last
attach, less the same turn's own rate measured for a second just before, divided by the
viewers. Its CPU figure also leaves out the live fan-out to the viewers attached already (the
fan-out workload's cost, not the attaches'): the rate the broker runs at for a second once all
follow, less the turn's own, per viewer, times the viewer-seconds they were attached in the
window. The window's whole CPU per viewer is reported beside it.
"""

from __future__ import annotations

import collections
import time
from multiprocessing.connection import Connection
from typing import Any

import httpx

from benchmarks.fanout import (
    LAG_BUCKETS_PER_MS,
    _all_done,
    _first_delta_ms,
    _recv,
    client_processes,
    shares,
    viewer_process,
)
from benchmarks.figures import percentile
from benchmarks.harness import KEYS, Context, Outcome, count_deltas, wait_status, xlen
from benchmarks.servers import commandstats, cpu_seconds
from benchmarks.sse import turn_body
from benchmarks.workloads import warm_up
from broker.vocabulary import FINAL_STATUSES

JOIN_OVER_S = 1.0
BASELINE_S = 1.0  # the turn alone, before anyone joins: what the join window is compared with
RUNNING_FOR_S = 1.0  # how long the turn has run when the first viewer joins
STEADY_S = 1.0  # every viewer attached: the live fan-out's own rate, after the join window


def _calls(ctx: Context) -> int:
    return sum(commandstats(ctx.nodes).values())


def _slow_viewers(slow: list[tuple[float, float]]) -> dict[str, Any]:
    after = sorted(a for a, _ in slow)
    worst = sorted(w for _, w in slow)
    return {
        "slow_viewers": len(slow),
        "slow_viewers_first_slow_after_attach_s_p50": after[len(after) // 2] if after else None,
        "slow_viewers_worst_lag_ms_p50": worst[len(worst) // 2] if worst else None,
    }


class JoinLive:
    """``viewers`` SSE viewers join a live turn over ``JOIN_OVER_S``."""

    name = "join"
    worker_concurrency = 4

    def prepare(self, ctx: Context) -> None:
        warm_up(ctx)

    def once(self, ctx: Context, repeat: int) -> Outcome:
        sizes = ctx.sizes
        pace = sizes.fanout_pace
        # Long enough that every viewer joins while it runs, and follows it live a while.
        tokens = max(sizes.fanout_tokens, int(pace * (RUNNING_FOR_S + JOIN_OVER_S + STEADY_S + 3)))
        timeout = 2 * tokens / pace + 150
        args = [
            (ctx.broker.base_url, share, timeout)
            for share in shares(sizes.viewers, sizes.viewer_processes)
        ]
        with client_processes(viewer_process, args, "bench-joiners") as (pipes, _):
            return self._drive(ctx, repeat, tokens, pace, pipes)

    def _drive(
        self, ctx: Context, repeat: int, tokens: int, pace: float, pipes: list[Connection]
    ) -> Outcome:
        client, pid = ctx.redis, ctx.broker.pid
        for conn in pipes:
            _recv(conn, 60, "ready")
        turn_id = ctx.turn_id(self.name, repeat)
        key = KEYS.events(turn_id, turn_id)
        with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
            response = http.post(
                "/v1/turns", json=turn_body(turn_id, turn_id, tokens=tokens, tokens_per_s=pace)
            )
            response.raise_for_status()
            stream_id = str(response.json()["stream_id"])
        first_ms = _first_delta_ms(client, key, timeout=30)
        time.sleep(max(0.0, first_ms / 1000 + RUNNING_FOR_S - BASELINE_S - time.time()))
        # The turn alone, no viewer: its own commands and CPU per second.
        base_calls, base_cpu, base_at = _calls(ctx), cpu_seconds(pid), time.monotonic()
        time.sleep(BASELINE_S)
        by_name0 = commandstats(ctx.nodes)
        calls0, cpu0, at0 = sum(by_name0.values()), cpu_seconds(pid), time.monotonic()
        calls_rate = (calls0 - base_calls) / (at0 - base_at)
        cpu_rate = (cpu0 - base_cpu) / (at0 - base_at)
        stored_at_join = xlen(client, key)
        for conn in pipes:
            conn.send((stream_id, pace, JOIN_OVER_S))
        attached_ms: list[float] = []
        for conn in pipes:
            attached_ms += _recv(conn, 120, "attached")[1]
        by_name1 = commandstats(ctx.nodes)
        calls1, cpu1, at1, wall1 = (
            sum(by_name1.values()),
            cpu_seconds(pid),
            time.monotonic(),
            time.time(),
        )
        window_s = at1 - at0
        storm_calls = (calls1 - calls0) - calls_rate * window_s
        storm_cpu_s = (cpu1 - cpu0) - cpu_rate * window_s
        # What the viewers attached already cost meanwhile: the live fan-out, at the rate it
        # runs once they all follow (measured right after), for the viewer-seconds they were
        # attached in the window. It is the fan-out's cost, not the attaches'.
        time.sleep(STEADY_S)
        cpu2, at2 = cpu_seconds(pid), time.monotonic()
        steady_live = xlen(client, key) < tokens  # the turn still ran all along
        per_viewer_cores = ((cpu2 - cpu1) / (at2 - at1) - cpu_rate) / max(1, len(attached_ms))
        viewer_s = sum(max(0.0, wall1 - ms / 1000) for ms in attached_ms)
        live_cpu_s = per_viewer_cores * viewer_s
        done: set[int] = set()
        cancelled = False
        turn_deadline = first_ms / 1000 + 2 * tokens / pace + 5
        if not _all_done(pipes, done, turn_deadline - time.time()):
            with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
                http.post(f"/v1/turns/{turn_id}/cancel").raise_for_status()
            cancelled = True
            if not _all_done(pipes, done, 120):
                raise TimeoutError("viewers did not finish after the turn was cancelled")
        turn_status = wait_status(client, turn_id, turn_id, tuple(FINAL_STATUSES), timeout=60)
        written = count_deltas(client, key)
        results: list[dict[str, Any]] = []
        for conn in pipes:
            conn.send(first_ms)
            results.append(_recv(conn, 60, "result")[1])
        histogram: collections.Counter[int] = collections.Counter()
        for result in results:
            histogram.update({int(k): v for k, v in result["histogram"].items()})
        loop_late: collections.Counter[int] = collections.Counter()
        for result in results:
            loop_late.update({int(k): v for k, v in result["loop_late_ms"].items()})
        failed = sum(r["failed"] for r in results)
        viewers = sum(r["viewers"] for r in results)
        received = sum(r["deltas"] for r in results)
        p50, p99 = percentile(histogram, 50), percentile(histogram, 99)
        if p50 is None or p99 is None:
            raise RuntimeError("no live delta reached a viewer after it joined")
        if failed == viewers:
            raise RuntimeError(f"no viewer could attach: {results[0]['errors']}")
        return Outcome(
            values={
                "join.missing": float(max(0, viewers * written - received)),
                "join.lag_p99_ms": p99 / LAG_BUCKETS_PER_MS,
                "join.attach_cpu_ms_per_viewer": (storm_cpu_s - live_cpu_s) * 1000 / viewers,
                "join.window_cpu_ms_per_viewer": storm_cpu_s * 1000 / viewers,
                "join.attach_commands_per_viewer": storm_calls / viewers,
            },
            details={
                "viewers": viewers,
                "viewers_failed": failed,
                "reattaches": sum(r["reattaches"] for r in results),
                "viewers_ended": sum(r["ended"] for r in results),
                "deltas_written": written,
                "stored_events_at_join": stored_at_join,
                "cancelled_at_deadline": cancelled,
                "turn_status": turn_status,
                "lag_p50_ms": p50 / LAG_BUCKETS_PER_MS,
                "lag_max_ms": max(histogram) / LAG_BUCKETS_PER_MS,
                "live_lag_samples": sum(histogram.values()),
                "join_window_s": round(window_s, 3),
                "baseline_commands_per_s": round(calls_rate, 1),
                "baseline_broker_cpu_cores": round(cpu_rate, 3),
                "storm_commands": round(storm_calls),
                # Per viewer, the turn's own commands in the window included (not subtracted).
                "window_commands_per_viewer_by_name": {
                    name: round((calls - by_name0.get(name, 0)) / viewers, 3)
                    for name, calls in sorted(by_name1.items())
                    if calls > by_name0.get(name, 0)
                },
                "storm_broker_cpu_s": round(storm_cpu_s, 3),
                "live_fanout_cpu_s_in_window": round(live_cpu_s, 3),
                "attached_viewer_s_in_window": round(viewer_s, 1),
                "steady_cores_per_1000_viewers": round(per_viewer_cores * 1000, 3),
                "steady_window_while_live": steady_live,
                "viewer_cpu_s": round(sum(r["cpu_s"] for r in results), 2),
                # How late the viewer processes' loops woke (all processes, the whole run):
                # a live lag near these is the clients' backlog, not the broker's.
                "viewer_loop_late_p99_ms": percentile(loop_late, 99),
                "viewer_loop_late_max_ms": max(loop_late, default=0),
                # Viewers with a live delta later than 500 ms: how many, and for the median
                # one, how long after it attached that delta was appended, and its worst lag.
                **_slow_viewers([v for r in results for v in r["slow_viewers"]]),
                "viewer_loop_late_over_50ms_s": sum(k * n for k, n in loop_late.items() if k > 50)
                / 1000,
                "errors": [e for r in results for e in r["errors"].items()],
            },
        )
