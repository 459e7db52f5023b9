"""A crowd replays a finished answer: ``viewers`` SSE readers connect at once to a turn of
``replay_tokens`` deltas that has ended, and each reads it from the start to its ``end``.

Measured on the broker process: the events delivered in total per second (from the crowd's
first connect to its last ``end``), its RSS peak during the replay (sampled every 50 ms), and
its RSS once every client left, against before. The viewer processes are the fan-out's
(:mod:`benchmarks.fanout`); their CPU is reported, since on two cores they share the machine
with the broker and Redis.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import httpx

from benchmarks.fanout import (
    _all_done,
    _recv,
    _RssSampler,
    client_processes,
    shares,
    viewer_process,
)
from benchmarks.harness import KEYS, Context, Outcome, count_deltas, wait_status
from benchmarks.servers import cpu_seconds, status_kib
from benchmarks.sse import turn_body
from benchmarks.workloads import warm_up

SETTLE_S = 10.0  # how long RSS may take to come back once the crowd left
SETTLED_MIB = 2.0  # RSS is settled when it moved less than this over a second


class Replay:
    """``viewers`` SSE viewers replay a finished turn of ``replay_tokens`` deltas at once."""

    name = "replay"
    worker_concurrency = 4

    def prepare(self, ctx: Context) -> None:
        warm_up(ctx)

    def once(self, ctx: Context, repeat: int) -> Outcome:
        sizes = ctx.sizes
        turn_id = ctx.turn_id(self.name, repeat)
        with httpx.Client(base_url=ctx.broker.base_url, timeout=30, trust_env=False) as http:
            body = turn_body(turn_id, turn_id, tokens=sizes.replay_tokens, tokens_per_s=0)
            response = http.post("/v1/turns", json=body)
            response.raise_for_status()
            stream_id = str(response.json()["stream_id"])
        wait_status(ctx.redis, turn_id, turn_id, ("complete",), timeout=120)
        written = count_deltas(ctx.redis, KEYS.events(turn_id, turn_id))
        timeout = 120.0
        args = [
            (ctx.broker.base_url, share, timeout)
            for share in shares(sizes.replay_viewers, sizes.viewer_processes)
        ]
        with client_processes(viewer_process, args, "bench-replayers") as (pipes, processes):
            pids = [p.pid for p in processes if p.pid is not None]
            return self._drive(ctx, stream_id, written, timeout, pipes, pids)

    def _drive(
        self,
        ctx: Context,
        stream_id: str,
        written: int,
        timeout: float,
        pipes: list[Connection],
        viewer_pids: list[int],
    ) -> Outcome:
        pid = ctx.broker.pid
        for conn in pipes:
            _recv(conn, 60, "ready")
        rss_before = status_kib(pid, "VmRSS") / 1024
        sampler = _RssSampler(pid)
        cpu0, began = cpu_seconds(pid), time.monotonic()
        viewers0 = sum(cpu_seconds(p) for p in viewer_pids)
        for conn in pipes:
            conn.send((stream_id, 1.0))  # no join spread: the whole crowd at once
        for conn in pipes:
            _recv(conn, timeout, "attached")
        done: set[int] = set()
        finished = _all_done(pipes, done, timeout)
        elapsed = time.monotonic() - began
        cpu_s = cpu_seconds(pid) - cpu0
        viewer_cpu_s = sum(cpu_seconds(p) for p in viewer_pids) - viewers0
        peak = sampler.stop()
        if not finished:
            raise TimeoutError(f"the replay did not end in {timeout:.0f} s")
        results: list[dict[str, Any]] = []
        for conn in pipes:
            conn.send(0)  # (the lag base: no delta here is live)
            results.append(_recv(conn, 60, "result")[1])
        viewers = sum(r["viewers"] for r in results)
        received = sum(r["deltas"] for r in results)
        rss_after, settled_s = _settled_rss(pid)
        return Outcome(
            values={
                "replay.missing": float(max(0, viewers * written - received)),
                "replay.events_per_s": received / elapsed,
                "replay.broker_rss_peak_mib": peak,
                "replay.broker_rss_after_mib": rss_after,
            },
            details={
                "viewers": viewers,
                "viewers_failed": sum(r["failed"] for r in results),
                "viewers_ended": sum(r["ended"] for r in results),
                "reattaches": sum(r["reattaches"] for r in results),
                "deltas_written": written,
                "deltas_received": received,
                "replay_s": round(elapsed, 3),
                "broker_cpu_s": round(cpu_s, 2),
                "broker_cpu_cores": round(cpu_s / elapsed, 2),
                "viewer_cpu_s": round(viewer_cpu_s, 2),
                "viewer_cpu_cores": round(viewer_cpu_s / elapsed, 2),
                "rss_before_mib": round(rss_before, 1),
                "rss_settled_after_s": round(settled_s, 1),
                "errors": [e for r in results for e in r["errors"].items()],
            },
        )


def _settled_rss(pid: int) -> tuple[float, float]:
    """The broker's RSS once it stopped falling (or after ``SETTLE_S``), and how long that took."""
    began = time.monotonic()
    last = status_kib(pid, "VmRSS") / 1024
    while time.monotonic() - began < SETTLE_S:
        time.sleep(1.0)
        now = status_kib(pid, "VmRSS") / 1024
        if abs(last - now) < SETTLED_MIB:
            return now, time.monotonic() - began
        last = now
    return last, time.monotonic() - began
