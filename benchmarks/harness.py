"""What every workload shares: run sizes, the servers under test, outcomes, Redis look-ups."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Final, Protocol, cast

import redis

from benchmarks.servers import KEY_PREFIX, Broker, CpuMeter, RedisServers
from broker.keys import Keys
from broker.vocabulary import FINAL_STATUSES

KEYS: Final = Keys(KEY_PREFIX)
Node = redis.Redis  # a plain client of one server (``Context.redis`` hides the module's name)
DELTA: Final = "delta"


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    """How big each workload is; ``PROFILES`` has the full, quick and smoke runs."""

    ceiling_s: float  # seconds per raw-Redis figure
    one_stream_tokens: int
    streams: int
    stream_tokens: int
    viewers: int
    viewer_processes: int
    fanout_tokens: int
    fanout_pace: float  # deltas per second
    late_events: int  # events in the finished stream a late reader resumes
    late_tries: int
    memory_entries: int
    idle_connections: int
    idle_streams: int
    idle_window_s: float  # the quiet window measured
    idle_heartbeat_s: float  # the broker's BROKER_SSE_HEARTBEAT_S for it
    idle_pool_trim_s: float  # its BROKER_POOL_TRIM_S (the default, 30, but in smoke runs)
    idle_baseline_s: float  # the idle streams run unread this long before the baseline
    settle_s: float  # how long a process's RSS, files or connections must hold still to count
    replay_viewers: int  # readers that replay one finished turn at once
    replay_tokens: int  # that turn's deltas
    tail_viewers: tuple[int, ...]  # the live tail's matrix: viewers of one turn...
    tail_rates: tuple[float, ...]  # ... x its pace in deltas/s
    tail_seconds: float  # how long each cell's turn runs


PROFILES: Final = {
    "full": Sizes(
        ceiling_s=2.0,
        one_stream_tokens=20_000,
        streams=100,
        stream_tokens=1_000,
        viewers=1_000,
        viewer_processes=4,
        fanout_tokens=1_500,
        fanout_pace=100.0,
        late_events=10_000,
        late_tries=20,
        memory_entries=10_000,
        idle_connections=10_000,
        idle_streams=100,
        idle_window_s=45.0,
        idle_heartbeat_s=15.0,
        idle_pool_trim_s=30.0,
        idle_baseline_s=8.0,
        settle_s=3.0,
        replay_viewers=1_000,
        replay_tokens=2_000,
        tail_viewers=(1, 10, 100, 1_000),
        tail_rates=(10.0, 100.0, 1_000.0),
        tail_seconds=3.0,
    ),
    "quick": Sizes(
        ceiling_s=0.75,
        one_stream_tokens=5_000,
        streams=100,
        stream_tokens=200,
        viewers=1_000,
        viewer_processes=4,
        fanout_tokens=400,
        fanout_pace=100.0,
        late_events=5_000,
        late_tries=10,
        memory_entries=5_000,
        idle_connections=10_000,
        idle_streams=100,
        idle_window_s=32.0,
        idle_heartbeat_s=15.0,
        idle_pool_trim_s=30.0,
        idle_baseline_s=8.0,
        settle_s=3.0,
        replay_viewers=1_000,
        replay_tokens=2_000,
        tail_viewers=(1, 10, 100, 1_000),
        tail_rates=(10.0, 100.0, 1_000.0),
        tail_seconds=2.0,
    ),
    "smoke": Sizes(
        ceiling_s=0.2,
        one_stream_tokens=300,
        streams=10,
        stream_tokens=50,
        viewers=20,
        viewer_processes=2,
        fanout_tokens=40,
        fanout_pace=100.0,
        late_events=1_000,
        late_tries=3,
        memory_entries=500,
        idle_connections=200,
        idle_streams=10,
        idle_window_s=3.0,
        idle_heartbeat_s=1.0,
        idle_pool_trim_s=1.0,
        idle_baseline_s=1.0,
        settle_s=0.5,
        replay_viewers=20,
        replay_tokens=100,
        tail_viewers=(1, 10),
        tail_rates=(10.0, 100.0),
        tail_seconds=1.0,
    ),
}


@dataclasses.dataclass
class Outcome:
    """One repeat of a workload: its figures, and what explains them."""

    values: dict[str, float]
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Context:
    """The servers under test and the sizes of this run.

    ``redis`` serves commands on one slot (on a cluster, a cluster client that routes them);
    ``nodes`` has one plain client per primary, for what must see every node;
    ``replica_nodes`` one per replica (none without replicas).
    """

    redis_server: RedisServers
    redis: redis.Redis
    nodes: list[Node]
    broker: Broker
    sizes: Sizes
    run_id: str
    replica_nodes: list[Node] = dataclasses.field(default_factory=list)

    def meter(self, client_pids: Sequence[int | None] = ()) -> CpuMeter:
        """CPU use from now on; ``client_pids`` are client processes besides this one."""
        pids = [pid for pid in client_pids if pid is not None]
        return CpuMeter(self.broker.pid, self.redis_server.pids, pids)

    def turn_id(self, workload: str, repeat: int, index: int = 0) -> str:
        return f"{workload}-{self.run_id}-{repeat}-{index}"


class Workload(Protocol):
    """A workload: ``prepare`` once per broker, then ``once`` per repeat."""

    name: str
    worker_concurrency: int  # the broker's BROKER_WORKER_CONCURRENCY

    def prepare(self, ctx: Context) -> None: ...

    def once(self, ctx: Context, repeat: int) -> Outcome: ...


def wait_final(
    client: redis.Redis, turns: Sequence[tuple[str, str]], timeout: float
) -> dict[str, str]:
    """Poll Redis (not the broker) until every ``(conversation, turn)`` is at rest."""
    deadline = time.monotonic() + timeout
    while True:
        with client.pipeline(transaction=False) as pipe:
            for conversation_id, turn_id in turns:
                pipe.hget(KEYS.turn(conversation_id, turn_id), "status")
            statuses = [str(s) for s in pipe.execute()]
        if all(s in FINAL_STATUSES for s in statuses):
            return {turn: status for (_, turn), status in zip(turns, statuses, strict=True)}
        if time.monotonic() > deadline:
            waiting = sum(s not in FINAL_STATUSES for s in statuses)
            raise TimeoutError(f"{waiting} of {len(turns)} turns not at rest after {timeout} s")
        time.sleep(0.1)


Entries = list[tuple[str, dict[str, str]]]


def xrange(client: redis.Redis, key: str, start: str, end: str = "+", count: int = 1000) -> Entries:
    """``XRANGE`` with the reply typed as our clients decode it."""
    return cast(Entries, client.xrange(key, start, end, count=count))


def xrevrange(client: redis.Redis, key: str, count: int) -> Entries:
    return cast(Entries, client.xrevrange(key, "+", "-", count=count))


def xlen(client: redis.Redis, key: str) -> int:
    return int(client.xlen(key))


def wait_status(
    client: redis.Redis, conversation_id: str, turn_id: str, wanted: Sequence[str], timeout: float
) -> str:
    """Poll Redis until the turn's status is one of ``wanted``."""
    deadline = time.monotonic() + timeout
    key = KEYS.turn(conversation_id, turn_id)
    while True:
        status = str(client.hget(key, "status"))
        if status in wanted:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"turn {turn_id} is {status}, not {'/'.join(wanted)}")
        time.sleep(0.02)


def entry_kind(fields: dict[str, str]) -> str:
    """The event type of a stored entry (the broker stores it in field ``e``)."""
    return fields.get("e", "")


def delta_span(client: redis.Redis, key: str, *, first_only: bool = False) -> tuple[int, int]:
    """Server times (ms) of the first and the last delta entry of a finished stream.

    With ``first_only`` the stream may still be growing: the first delta's time is returned twice.
    """
    head = xrange(client, key, "-", count=8)
    firsts = [i for i, f in head if entry_kind(f) == DELTA]
    if not firsts:
        raise RuntimeError(f"no delta entries in {key}")
    first = int(str(firsts[0]).split("-")[0])
    if first_only:
        return first, first
    tail = xrevrange(client, key, count=8)
    lasts = [i for i, f in tail if entry_kind(f) == DELTA]
    if not lasts:
        raise RuntimeError(f"no delta entries in {key}")
    return first, int(str(lasts[0]).split("-")[0])


def count_deltas(client: redis.Redis, key: str) -> int:
    """Delta entries in a stream, read page by page."""
    count = 0
    start = "-"
    while True:
        page = xrange(client, key, start, count=2_000)
        count += sum(1 for _, fields in page if entry_kind(fields) == DELTA)
        if len(page) < 2_000:
            return count
        start = "(" + str(page[-1][0])
