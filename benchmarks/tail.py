"""The live tail from the model's emit, and what it costs, over a matrix of viewers and paces.

For each cell (``viewers`` x deltas/s), one turn of the simulated model with ``stamp`` on (each
delta's text starts with the time the model emitted it) is read live by that many SSE viewers
(the fan-out's viewer processes, :mod:`benchmarks.fanout`): the lag is arrival minus emit, so
everything between the model and the viewer counts, the append's wait included. The viewers
attach before the turn's first delta (the fan-out's blocker turn holds the broker's only worker
slot meanwhile). The cost is the broker's and Redis's CPU over the turn's steady middle (a
fifth of the turn, at most half a second, left out at each end) per 1,000 deltas delivered in it
(deltas appended in the window x viewers).

The headline figures are the cell with the most viewers and the one with the fewest, both at
the pace nearest 100 deltas/s (a join storm's, and a lone reader's); the whole matrix is in the
JSON (``details.cells``) and printed to stderr as the run goes.
"""

from __future__ import annotations

import collections
import os
import sys
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
from benchmarks.harness import KEYS, Context, Outcome, wait_status, xlen
from benchmarks.servers import commandstats
from benchmarks.sse import turn_body
from benchmarks.workloads import warm_up
from broker.vocabulary import FINAL_STATUSES

HEADLINE_PACE = 100.0  # deltas/s of the headline cells (the join storm's)
EDGE_S = 0.5  # at most this much of the turn's start and end is left out of the CPU window


def viewer_processes(viewers: int, most: int) -> int:
    """Client processes for ``viewers``: one for a few, up to ``most`` for a thousand."""
    return max(1, min(most, (viewers + 249) // 250, viewers))


class LiveTail:
    """Each cell of ``tail_viewers`` x ``tail_rates``: one stamped turn read live by the viewers."""

    name = "tail"
    worker_concurrency = 1  # the blocker turn holds it while the viewers attach

    def prepare(self, ctx: Context) -> None:
        warm_up(ctx)

    def once(self, ctx: Context, repeat: int) -> Outcome:
        sizes = ctx.sizes
        cells: list[dict[str, Any]] = []
        index = 0
        for viewers in sizes.tail_viewers:
            for rate in sizes.tail_rates:
                index += 1
                cell = self._cell(ctx, repeat, index, viewers, rate)
                cells.append(cell)
                print(
                    f"  tail {viewers:>5} viewers x {rate:>6g}/s: lag p50 {cell['lag_p50_ms']} "
                    f"p99 {cell['lag_p99_ms']} ms, {cell['cpu_ms_per_1000']} ms CPU per 1,000 "
                    f"delivered, {cell['deltas_per_append']} deltas per append, "
                    f"{cell['deltas_per_read']} per read, viewers' CPU "
                    f"{cell['viewer_cores']} cores",
                    file=sys.stderr,
                    flush=True,
                )
        pace = min(sizes.tail_rates, key=lambda r: abs(r - HEADLINE_PACE))
        at_pace = [c for c in cells if c["rate"] == pace]
        many = max(at_pace, key=lambda c: c["viewers"])
        one = min(at_pace, key=lambda c: c["viewers"])
        missing = sum(c["missing"] for c in cells)
        return Outcome(
            values={
                "tail.missing": float(missing),
                "tail.lag_p50_ms": many["lag_p50_ms"],
                "tail.lag_p99_ms": many["lag_p99_ms"],
                "tail.cpu_ms_per_1000": many["cpu_ms_per_1000"],
                "tail.lag_p99_ms_fewest": one["lag_p99_ms"],
                "tail.cpu_ms_per_1000_fewest": one["cpu_ms_per_1000"],
            },
            details={
                "headline_many": [many["viewers"], pace],
                "headline_fewest": [one["viewers"], pace],
                "cells": cells,
            },
        )

    def _cell(
        self, ctx: Context, repeat: int, index: int, viewers: int, rate: float
    ) -> dict[str, Any]:
        seconds = ctx.sizes.tail_seconds
        tokens = max(10, round(rate * seconds))
        processes = viewer_processes(viewers, ctx.sizes.viewer_processes)
        timeout = 2 * tokens / rate + 150
        args = [(ctx.broker.base_url, share, timeout) for share in shares(viewers, processes)]
        with client_processes(viewer_process, args, "bench-tail") as (pipes, procs):
            pids = [p.pid for p in procs if p.pid is not None]
            return self._drive(ctx, repeat, index, viewers, rate, tokens, pipes, pids)

    def _drive(
        self,
        ctx: Context,
        repeat: int,
        index: int,
        viewers: int,
        rate: float,
        tokens: int,
        pipes: list[Connection],
        viewer_pids: list[int],
    ) -> dict[str, Any]:
        client = ctx.redis
        for conn in pipes:
            _recv(conn, 60, "ready")
        turn_id = ctx.turn_id(self.name, repeat, 2 * index)
        blocker_id = ctx.turn_id(self.name, repeat, 2 * index + 1)
        key = KEYS.events(turn_id, turn_id)
        with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
            blocker = turn_body(blocker_id, blocker_id, tokens=100_000, tokens_per_s=10)
            http.post("/v1/turns", json=blocker).raise_for_status()
            wait_status(client, blocker_id, blocker_id, ("streaming",), timeout=30)
            body = turn_body(turn_id, turn_id, tokens=tokens, tokens_per_s=rate, stamp=True)
            response = http.post("/v1/turns", json=body)
            response.raise_for_status()
            stream_id = str(response.json()["stream_id"])
            for conn in pipes:
                conn.send((stream_id, rate, 0.0, True))
            for conn in pipes:
                _recv(conn, 120, "attached")
            time.sleep(0.3)  # the last viewers' reads go from their opening to live
            http.post(f"/v1/turns/{blocker_id}/cancel").raise_for_status()
        first_ms = _first_delta_ms(client, key, timeout=30)
        duration = (tokens - 1) / rate
        edge = min(EDGE_S, duration / 5)
        window_start, window_end = first_ms / 1000 + edge, first_ms / 1000 + duration - edge
        time.sleep(max(0.0, window_start - time.time()))
        entries_before, calls_before = xlen(client, key), commandstats(ctx.nodes)
        pids = [ctx.broker.pid, *ctx.redis_server.pids]
        cpu_before = [_cpu_s(pid) for pid in pids]
        viewers_before = sum(_cpu_s(pid) for pid in viewer_pids)
        began = time.monotonic()
        time.sleep(max(0.0, window_end - time.time()))
        cpu = [_cpu_s(pid) - before for pid, before in zip(pids, cpu_before, strict=True)]
        viewer_cpu = sum(_cpu_s(pid) for pid in viewer_pids) - viewers_before
        elapsed = time.monotonic() - began
        entries = xlen(client, key) - entries_before
        calls = commandstats(ctx.nodes)
        scripts = calls.get("evalsha", 0) - calls_before.get("evalsha", 0)
        reads = calls.get("xread", 0) - calls_before.get("xread", 0)
        done: set[int] = set()
        turn_deadline = first_ms / 1000 + 2 * tokens / rate + 5
        cancelled = False
        if not _all_done(pipes, done, turn_deadline - time.time()):
            with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
                http.post(f"/v1/turns/{turn_id}/cancel").raise_for_status()
            cancelled = True
            if not _all_done(pipes, done, 120):
                raise TimeoutError("viewers did not finish after the turn was cancelled")
        wait_status(client, turn_id, turn_id, tuple(FINAL_STATUSES), timeout=60)
        written = tokens if not cancelled else None
        results: list[dict[str, Any]] = []
        for conn in pipes:
            conn.send(first_ms)
            results.append(_recv(conn, 60, "result")[1])
        histogram: collections.Counter[int] = collections.Counter()
        for result in results:
            histogram.update({int(k): v for k, v in result["histogram"].items()})
        attached = viewers - sum(r["failed"] for r in results)
        received = sum(r["deltas"] for r in results)
        p50, p99 = percentile(histogram, 50), percentile(histogram, 99)
        if p50 is None or p99 is None or entries <= 0 or attached <= 0:
            raise RuntimeError(f"no live delta reached a viewer ({viewers} x {rate}/s)")
        delivered = entries * attached
        return {
            "viewers": viewers,
            "rate": rate,
            "tokens": tokens,
            "viewer_processes": len(results),
            "viewers_failed": viewers - attached,
            "missing": max(0, attached * tokens - received) if written else 0,
            "cancelled_at_deadline": cancelled,
            "lag_p50_ms": p50 / LAG_BUCKETS_PER_MS,
            "lag_p99_ms": p99 / LAG_BUCKETS_PER_MS,
            "lag_max_ms": max(histogram) / LAG_BUCKETS_PER_MS,
            "cpu_ms_per_1000": round(sum(cpu) * 1e6 / delivered, 3),
            "broker_cores": round(cpu[0] / elapsed, 4),
            "redis_cores": round(sum(cpu[1:]) / elapsed, 4),
            "viewer_cores": round(viewer_cpu / elapsed, 3),
            "window_s": round(elapsed, 3),
            "deltas_in_window": entries,
            # Script calls are the turn's appends (and lease renewals); XREADs its feed's reads.
            "deltas_per_append": round(entries / max(1, scripts), 2),
            "deltas_per_read": round(entries / max(1, reads), 2),
            "errors": [e for r in results for e in r["errors"].items()],
        }


def _cpu_s(pid: int) -> float:
    """CPU time of a live process, every thread's, in seconds, to the nanosecond (from
    ``schedstat``: ``/proc/<pid>/stat`` counts clock ticks, too coarse for a quiet cell);
    0 when it is gone."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
    except (OSError, ValueError):
        pass
    return total / 1e9
