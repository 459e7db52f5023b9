"""Every figure the suite reports: its unit, its target, and what bounds it.

The targets are the issue's, for one broker process on 2 cores with Redis on loopback. A
``reference`` is a figure quoted in the issue as measured on this kind of machine (raw Redis, or the
``resumable-stream`` Node package), shown for comparison only: it is not measured by this suite.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Final, Literal

Better = Literal["higher", "lower"]

WORKLOADS: Final = (
    "redis",
    "one_stream",
    "many_streams",
    "fanout",
    "join",
    "tail",
    "replay",
    "late_reader",
    "memory",
    "idle",
    "floor",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    """One reported number; ``target`` is met when the median is on the ``better`` side."""

    name: str
    unit: str
    description: str
    better: Better
    target: float | None = None
    ceiling: str | None = None  # the raw-Redis figure that bounds this one
    reference: float | None = None
    reference_note: str = ""
    optional: bool = False  # measured only where its tool is installed (a candidate server)

    @property
    def workload(self) -> str:
        return self.name.split(".", 1)[0]

    def meets(self, value: float) -> bool | None:
        """Whether ``value`` meets the target; None when the figure has no target."""
        if self.target is None:
            return None
        return value >= self.target if self.better == "higher" else value <= self.target


FIGURES: Final = (
    Figure(
        "redis.xadd_1client",
        "ops/s",
        "XADD of a 30-byte delta, 1 client, 1 in flight",
        "higher",
        reference=19_300,
        reference_note="raw Redis",
    ),
    Figure(
        "redis.xadd_pipelined16",
        "ops/s",
        "XADD of a 30-byte delta, 1 client, pipelined x16",
        "higher",
        reference=172_000,
        reference_note="raw Redis",
    ),
    Figure(
        "redis.lua_fenced_xadd_1client",
        "ops/s",
        "a Lua script checks a fencing token then XADDs, 1 client",
        "higher",
        reference=17_500,
        reference_note="raw Redis",
    ),
    Figure(
        "redis.lua_fenced_xadd_50clients",
        "ops/s",
        "the same fenced XADD from 50 clients, one stream each",
        "higher",
        reference=47_700,
        reference_note="raw Redis",
    ),
    Figure(
        "redis.append_script_1client",
        "ops/s",
        "the broker's own append_events.lua with one event, 1 client",
        "higher",
    ),
    Figure(
        "redis.append_script_50clients",
        "ops/s",
        "the broker's own append_events.lua with one event, 50 clients",
        "higher",
    ),
    Figure(
        "one_stream.deltas_per_s",
        "deltas/s",
        "1 turn at full speed read by 1 SSE reader: deltas / (last delta read - POST sent)",
        "higher",
        target=6_500,
        ceiling="redis.append_script_1client",
        reference=3_260,
        reference_note="resumable-stream",
    ),
    Figure(
        "one_stream.writer_deltas_per_s",
        "deltas/s",
        "the same turn as Redis saw it: deltas / (last - first delta entry id time)",
        "higher",
        ceiling="redis.append_script_1client",
    ),
    Figure(
        "many_streams.deltas_per_s",
        "deltas/s",
        "100 turns at full speed, no readers: all deltas / span of their entry id times",
        "higher",
        target=60_000,  # round two's target, at BROKER_WORKER_CONCURRENCY's default
        ceiling="redis.append_script_50clients",
    ),
    Figure(
        "fanout.missing",
        "deltas",
        "1 turn at 100 deltas/s, 1000 SSE viewers: deltas some viewer never got",
        "lower",
        target=0,
    ),
    Figure(
        "fanout.lag_p50_ms",
        "ms",
        "delivery lag (read time - XADD time), median over viewers x deltas",
        "lower",
    ),
    Figure(
        "fanout.lag_p99_ms",
        "ms",
        "delivery lag, 99th percentile",
        "lower",
        target=100,
        reference=4_765,
        reference_note="resumable-stream",
    ),
    Figure(
        "fanout.redis_commands_per_delta",
        "cmds",
        "INFO commandstats calls (scripts' inner calls included) per delta, steady state",
        "lower",
    ),
    Figure(
        "fanout.redis_client_commands_per_delta",
        "cmds",
        "commands clients sent (MONITOR, scripts' inner calls left out) per delta, steady state",
        "lower",
        target=2,
        reference=1_004,
        reference_note="resumable-stream",
    ),
    Figure(
        "fanout.broker_rss_peak_mib",
        "MiB",
        "broker peak RSS (VmHWM) during the fan-out",
        "lower",
        target=150,
    ),
    Figure(
        "fanout.append_rate_per_s",
        "deltas/s",
        "the pace the writer kept: (deltas - 1) / (last - first delta's append time); 100 asked",
        "higher",
        target=95,
    ),
    Figure(
        "join.missing",
        "deltas",
        "1,000 viewers join a turn at 100 deltas/s, spread over 1 s: deltas some viewer missed",
        "lower",
        target=0,
    ),
    Figure(
        "join.lag_p99_ms",
        "ms",
        "the same: arrival - append time, for deltas appended after each viewer attached, p99",
        "lower",
        target=150,
    ),
    Figure(
        "join.attach_cpu_ms_per_viewer",
        "ms",
        "broker CPU of the attaches, per viewer: the join window's less the turn's own and the "
        "live fan-out to viewers attached already",
        "lower",
        target=0.5,
    ),
    Figure(
        "join.window_cpu_ms_per_viewer",
        "ms",
        "broker CPU the join window adds to the turn's own, per viewer, live fan-out included",
        "lower",
    ),
    Figure(
        "join.attach_commands_per_viewer",
        "commands",
        "Redis commands (script calls included) the join window adds, per attaching viewer",
        "lower",
        target=2,
    ),
    Figure(
        "tail.missing",
        "deltas",
        "every cell of viewers x deltas/s (stamped turns, read live): deltas some viewer missed",
        "lower",
        target=0,
    ),
    Figure(
        "tail.lag_p50_ms",
        "ms",
        "the most viewers at 100 deltas/s: arrival - the model's emit (the delta's stamp), p50",
        "lower",
    ),
    Figure(
        "tail.lag_p99_ms",
        "ms",
        "the same, p99 (issue 41: the best anchor's, the Durable Streams server's 28 from send)",
        "lower",
        target=28,
    ),
    Figure(
        "tail.cpu_ms_per_1000",
        "ms",
        "the same cell: broker + Redis CPU per 1,000 deltas delivered (steady window)",
        "lower",
        target=3,
    ),
    Figure(
        "tail.lag_p99_ms_fewest",
        "ms",
        "the fewest viewers (1) at 100 deltas/s: arrival - emit, p99",
        "lower",
    ),
    Figure(
        "tail.cpu_ms_per_1000_fewest",
        "ms",
        "the same cell: broker + Redis CPU per 1,000 deltas delivered",
        "lower",
    ),
    Figure(
        "replay.missing",
        "deltas",
        "deltas some replaying viewer did not get",
        "lower",
        target=0,
    ),
    Figure(
        "replay.events_per_s",
        "events/s",
        "events delivered in total while 1,000 viewers replay a finished 2,000-delta turn",
        "higher",
        target=250_000,
    ),
    Figure(
        "replay.broker_rss_peak_mib",
        "MiB",
        "broker RSS at its peak during the replay",
        "lower",
        target=200,
    ),
    Figure(
        "replay.broker_rss_after_mib",
        "MiB",
        "broker RSS once every replaying client left (settled)",
        "lower",
        target=150,
    ),
    Figure(
        "late_reader.first_event_ms",
        "ms",
        "resume from the middle of a finished 10k-event stream: connect to first event, p50",
        "lower",
        target=5,
        reference=4.2,
        reference_note="resumable-stream, first byte",
    ),
    Figure(
        "late_reader.catchup_events_per_s",
        "events/s",
        "the same read: events / (end event - first event)",
        "higher",
        target=100_000,
    ),
    Figure(
        "memory.bytes_per_delta",
        "B",
        "MEMORY USAGE of an events stream / entries, 4-character tokens",
        "lower",
        target=64,
    ),
    Figure(
        "memory.bytes_per_delta_simulated",
        "B",
        "the same for a stream the broker wrote with the simulated provider's text",
        "lower",
    ),
    Figure(
        "idle.rss_per_connection_kib",
        "KiB",
        "broker RSS per quiet SSE connection: (RSS with them all open - before) / connections",
        "lower",
        target=12,
    ),
    Figure(
        "idle.broker_cpu_cores",
        "cores",
        "broker CPU while every connection is open and quiet",
        "lower",
        target=0.05,
    ),
    Figure(
        "idle.redis_commands_per_stream_period",
        "commands",
        "Redis commands in the quiet window per stream and heartbeat period (feeds, leases, looks)",
        "lower",
    ),
    Figure(
        "idle.reader_commands_per_connection_period",
        "commands",
        "the readers' own (XREAD, HMGET, page reads) per connection and period: O(streams) << 1",
        "lower",
        target=0.1,
    ),
    Figure(
        "idle.silence_past_promise_s",
        "s",
        "the longest silence a connection heard, less the promise (period + min(period/4, 0.25 s))",
        "lower",
        target=0,
    ),
    Figure(
        "idle.rss_after_over_before",
        "x",
        "broker RSS once every client left, over RSS before they came",
        "lower",
        target=1.25,
    ),
    Figure(
        "idle.open_cpu_ms_per_connection",
        "ms",
        "broker and Redis CPU while the connections open (first connect to last response "
        "head), per connection",
        "lower",
        target=0.24,
    ),
    Figure(
        "idle.attach_p99_ms",
        "ms",
        "each connection's connect to its response head's first bytes during the open storm, p99",
        "lower",
        target=110,
    ),
    Figure(
        "idle.fds_after_over_before",
        "x",
        "broker open files once every client left and two pool trims ran, over before",
        "lower",
        target=1.05,
    ),
    Figure(
        "idle.fds_after_minus_before",
        "fds",
        "broker open files once every client left, less before (back to baseline)",
        "lower",
        target=4,
    ),
    Figure(
        "idle.redis_clients_after_minus_before",
        "clients",
        "Redis connections once every client left, less before (back to baseline)",
        "lower",
        target=4,
    ),
    Figure(
        "floor.rss_per_connection_kib",
        "KiB",
        "RSS per open SSE connection of a bare ASGI app on the broker's uvicorn (no broker code)",
        "lower",
    ),
    Figure(
        "floor.attach_cpu_ms_per_connection",
        "ms",
        "CPU per connection while they attach, same bare app: the HTTP server's own share",
        "lower",
    ),
    Figure(
        "floor.attach_p99_ms",
        "ms",
        "same bare app: each connection's connect to response head while they attach, p99",
        "lower",
    ),
    Figure(
        "floor.rss_after_over_before",
        "x",
        "same bare app: RSS once every client left and it gave memory back as the broker "
        "does (full collection, malloc_trim), over RSS before they came",
        "lower",
    ),
    Figure(
        "floor.granian_rss_per_connection_kib",
        "KiB",
        "the candidate server (granian, ASGI, one worker, uvloop): RSS per open connection of "
        "the same bare app (when granian is installed)",
        "lower",
        optional=True,
    ),
    Figure(
        "floor.granian_attach_cpu_ms_per_connection",
        "ms",
        "the candidate server: CPU per connection while they attach (when installed)",
        "lower",
        optional=True,
    ),
    Figure(
        "floor.granian_attach_p99_ms",
        "ms",
        "the candidate server: attach p99 in the same storm (when installed)",
        "lower",
        optional=True,
    ),
    Figure(
        "floor.granian_rss_after_over_before",
        "x",
        "the candidate server: RSS once every client left, over before (when installed)",
        "lower",
        optional=True,
    ),
)

BY_NAME: Final = {figure.name: figure for figure in FIGURES}


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    """The repeats of one figure."""

    median: float
    low: float
    high: float
    samples: tuple[float, ...]


def summarize(samples: Sequence[float]) -> Summary | None:
    if not samples:
        return None
    return Summary(statistics.median(samples), min(samples), max(samples), tuple(samples))


def percentile(histogram: dict[int, int], q: float) -> float | None:
    """Nearest-rank percentile of a histogram of integer buckets; None when it is empty."""
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = min(total, max(1, math.ceil(q / 100 * total)))
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return float(bucket)
    return float(max(histogram))
