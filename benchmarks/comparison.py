"""What ``python -m benchmarks.compare`` reads off the wire and prints, as pure functions.

Three systems speak three framings of the same generation: the broker (``event: delta``, an
``id:`` per event, its ``end``), vercel/resumable-stream behind our route (the same shape; an
event's id is the character count up to its end, the package's ``skipCharacters``) and the
Durable Streams reference server (``event: data`` per message, no ``id:``; an ``event: control``
after each batch carries the next offset and, at the close, ``streamClosed``). Every delta's text
starts with its producer's emit (or send) time in microseconds since the epoch and a space: the
lag is counted from there.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import orjson

Kind = Literal["broker", "resumable-stream", "durable-streams"]
SYSTEMS: Final[tuple[Kind, ...]] = ("broker", "resumable-stream", "durable-streams")

# The first 16-digit number followed by a space in an event's data: the stamp (µs since the
# epoch has 16 digits from 2001 to 2286).
STAMP: Final = re.compile(rb"(?<![0-9])([0-9]{16}) ")
LAG_BUCKETS_PER_MS: Final = 10  # lag histograms have 0.1 ms buckets


def stamp_us(data: bytes) -> int | None:
    """The emit time a delta's data carries, or None."""
    found = STAMP.search(data)
    return int(found.group(1)) if found else None


def delta_event(kind: Kind) -> bytes:
    """The SSE event name of a delta in ``kind``'s framing."""
    return b"data" if kind == "durable-streams" else b"delta"


@dataclasses.dataclass(frozen=True, slots=True)
class Control:
    """A Durable Streams control event: where to resume, and whether the stream is closed."""

    next_offset: str
    closed: bool


def control(data: bytes) -> Control | None:
    """A Durable Streams ``event: control`` payload, or None when it is not one."""
    try:
        fields = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("streamNextOffset"), str):
        return None
    return Control(fields["streamNextOffset"], fields.get("streamClosed") is True)


def resume(kind: Kind, path: str, cursor: str) -> tuple[str, str | None]:
    """The request path and ``Last-Event-ID`` that read ``path`` on from ``cursor`` ("" = the
    start): the broker and our resumable-stream route take the header, Durable Streams an
    ``offset`` in the query."""
    if kind == "durable-streams":
        base = path.split("?", 1)[0]
        return f"{base}?offset={cursor or '-1'}&live=sse", None
    return path, cursor or None


def lag_bucket(arrived_s: float, stamp: int) -> int:
    """The 0.1 ms histogram bucket of a delta that arrived at ``arrived_s`` (wall clock)."""
    return int(max(0.0, arrived_s * 1e6 - stamp) / 1000 * LAG_BUCKETS_PER_MS)


def per_thousand(cpu_s: float, delivered: int) -> float:
    """Milliseconds of CPU per 1,000 deltas delivered."""
    return cpu_s * 1000 / max(1, delivered) * 1000


def end_to_end_rate(deltas: int, first_stamp_us: int, last_arrived_s: float) -> float:
    """Deltas per second from the first delta's emit to the last one's arrival."""
    return deltas / max(1e-6, last_arrived_s - first_stamp_us / 1e6)


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One figure of the table."""

    key: str
    label: str
    spec: str  # a format spec for the median and the range
    better: Literal["higher", "lower", ""] = ""


ROWS: Final = (
    Row("join.lag_p50_ms", "join storm: live lag p50 from emit (ms)", ",.1f", "lower"),
    Row("join.lag_p99_ms", "join storm: live lag p99 from emit (ms)", ",.1f", "lower"),
    Row(
        "join.cpu_ms_per_1000", "join storm: server+Redis CPU ms / 1,000 delivered", ",.2f", "lower"
    ),
    Row("join.missing", "join storm: deltas some viewer missed", ",.0f", "lower"),
    Row("join.client_cores", "join storm: viewers' own CPU (cores)", ",.2f"),
    Row(
        "quiet.cpu_ms_per_connection",
        "quiet: server+Redis CPU ms / connection opened",
        ",.3f",
        "lower",
    ),
    Row("quiet.attach_p99_ms", "quiet: attach p99 during the storm (ms)", ",.1f", "lower"),
    Row(
        "quiet.rss_per_connection_kib",
        "quiet: server RSS per open connection (KiB)",
        ",.1f",
        "lower",
    ),
    Row(
        "quiet.fds_after_over_before", "quiet: server fds after the crowd / before", ",.2f", "lower"
    ),
    Row(
        "quiet.rss_after_over_before", "quiet: server RSS after the crowd / before", ",.2f", "lower"
    ),
    Row("quiet.failed", "quiet: connections that failed", ",.0f", "lower"),
    Row("quiet.client_cores", "quiet: clients' own CPU while opening (cores)", ",.2f"),
    Row("late.deltas_per_s", "late reader: catch-up deltas/s", ",.0f", "higher"),
    Row("late.first_event_ms", "late reader: first delta (ms)", ",.2f", "lower"),
    Row("full.deltas_per_s", "full speed: deltas/s, first emit to last read", ",.0f", "higher"),
    Row("full.writer_deltas_per_s", "full speed: the producer's own deltas/s", ",.0f", "higher"),
    Row("full.client_cores", "full speed: reader's own CPU (cores)", ",.2f"),
)
SCHEDULES: Final = {"join": "a", "quiet": "b", "late": "c", "full": "d"}


def cell(samples: Sequence[float], spec: str) -> str:
    """``median [min-max]`` of a figure's repeats; ``-`` when none was measured."""
    values = [v for v in samples if math.isfinite(v)]
    if not values:
        return "-"
    median = format(statistics.median(values), spec)
    if len(values) == 1:
        return median
    return f"{median} [{format(min(values), spec)}-{format(max(values), spec)}]"


def table(
    figures: Mapping[str, Mapping[str, Sequence[float]]],
    notes: Mapping[str, Mapping[str, str]] | None = None,
    systems: Sequence[str] = SYSTEMS,
) -> str:
    """The figures (``figures[row key][system]`` = repeats) as one table, a row per figure
    some system measured; ``notes[row key][system]`` marks a shown cell (``*``, ``**``, ...)
    and is listed below the table."""
    notes = notes or {}
    width = max(len(row.label) for row in ROWS) + 2
    cells: list[tuple[str, list[str]]] = []
    marks: list[str] = []
    for row in ROWS:
        measured = figures.get(row.key, {})
        if not any(measured.get(s) for s in systems):
            continue
        line = []
        for system in systems:
            text = cell(measured.get(system, ()), row.spec)
            note = notes.get(row.key, {}).get(system)
            if note:
                marks.append(f"  {'*' * (len(marks) + 1)} {system}, {row.label}: {note}")
                text = f"{text} {'*' * len(marks)}"
            line.append(text)
        cells.append((row.label, line))
    column = max([len(s) + 2 for s in systems] + [len(c) + 2 for _, line in cells for c in line])
    out = [f"{'figure':{width}}" + "".join(f"{s:>{column}}" for s in systems)]
    out += [f"{label:{width}}" + "".join(f"{c:>{column}}" for c in line) for label, line in cells]
    return "\n".join(out + marks)
