"""The side-by-side comparison's readers and the Durable Streams producer, each run as a process of
its own so that its CPU is its own.

A viewer process holds ``viewers`` raw-socket SSE readers (:class:`benchmarks.sse.SSEReader`)
of one system's stream, in that system's framing (:mod:`benchmarks.comparison`). Each reads the
stream from the start, ``tries`` times one after another, each read until it has ``expect``
deltas or the stream ends; a read that breaks resumes from its cursor, as a real client does.
The benchmark talks to it over a pipe:

    viewer -> ("ready",)
    bench  -> {"path", "expect", "join_over_s", "tries", "timeout_s"}
    viewer -> ("result", {...})

The lag of a delta is its arrival (wall clock) less the stamp in its text, counted only for the
deltas emitted after the reader's response head arrived (live ones, not a replay).
"""

from __future__ import annotations

import array
import asyncio
import collections
import random
import resource
import time
import urllib.parse
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.comparison import Kind, control, delta_event, lag_bucket, resume, stamp_us
from benchmarks.sse import SSEReader, open_sse

CONNECT_CONCURRENCY = 50  # connections being opened at once, per viewer process
MAX_RESUMES = 5


class Read:
    """One read of a stream from its start, over as many connections as it takes."""

    __slots__ = (
        "arrivals",
        "attached_at",
        "cursor",
        "delta_name",
        "deltas",
        "ended",
        "expect",
        "first_at",
        "first_stamp",
        "kind",
        "lags",
        "last_at",
        "last_stamp",
        "sent_at",
    )

    def __init__(self, kind: Kind, expect: int, lags: array.array[int]) -> None:
        self.kind = kind
        self.delta_name = delta_event(kind)
        self.expect = expect
        self.lags = lags  # shared by the process's readers: 0.1 ms buckets, live deltas only
        self.cursor = ""  # the broker's and our route's last event id, or Durable Streams' offset
        self.deltas = 0
        self.ended = False
        self.sent_at = 0.0  # wall clock: the first request sent
        self.attached_at = 0.0  # its first response head
        self.first_at = 0.0  # the first delta's arrival
        self.last_at = 0.0
        self.first_stamp = 0
        self.last_stamp = 0
        self.arrivals = 0

    def on_head(self, now: float) -> None:
        if not self.attached_at:
            self.attached_at = now

    def on_events(self, events: list[tuple[bytes, bytes, bytes]], now: float) -> bool:
        live_from = self.attached_at * 1e6
        for event_id, event, data in events:
            if event == self.delta_name:
                if event_id:
                    if event_id.decode() <= self.cursor:
                        continue  # a replayed duplicate
                    self.cursor = event_id.decode()
                stamp = stamp_us(data) or 0
                if not self.deltas:
                    self.first_at, self.first_stamp = now, stamp
                self.deltas += 1
                self.last_at, self.last_stamp = now, stamp
                if stamp >= live_from:
                    self.lags.append(lag_bucket(now, stamp))
                if self.deltas >= self.expect:
                    self.ended = True
            elif event == b"control":
                found = control(data)
                if found is not None:
                    self.cursor = found.next_offset
                    self.ended = self.ended or found.closed
            elif event == b"end":
                self.ended = True
            if self.ended:
                return True
        return False

    def summary(self) -> dict[str, Any]:
        return {
            "deltas": self.deltas,
            "ended": self.ended,
            "sent_at": self.sent_at,
            "attached_at": self.attached_at,
            "first_at": self.first_at,
            "last_at": self.last_at,
            "first_stamp": self.first_stamp,
            "last_stamp": self.last_stamp,
        }


async def _read(
    read: Read,
    base_url: str,
    path: str,
    slots: asyncio.Semaphore,
    deadline: float,
    errors: collections.Counter[str],
) -> int:
    """Read to the end, resuming after a failure; returns how many times it resumed."""
    resumes = 0
    read.sent_at = time.time()
    while True:
        reader: SSEReader | None = None
        problem = ""
        status = 0
        try:
            async with slots:
                target, last_event_id = resume(read.kind, path, read.cursor)
                reader = await open_sse(
                    base_url, target, read.on_events, last_event_id, on_head=read.on_head
                )
                status = await asyncio.wait_for(
                    asyncio.shield(reader.opened), deadline - time.monotonic()
                )
            if status == 200:
                await asyncio.wait_for(asyncio.shield(reader.done), deadline - time.monotonic())
            if read.ended:
                return resumes
            problem = f"HTTP {status}" if status != 200 else (reader.error or "cut before end")
        except TimeoutError:
            errors["no end before the deadline"] += 1
            return resumes
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        finally:
            if reader is not None:
                reader.close()
        errors[problem[:120]] += 1
        if status == 204 or resumes >= MAX_RESUMES:
            return resumes
        resumes += 1
        await asyncio.sleep(random.uniform(0.05, 0.25) * resumes)


def viewer_process(conn: Connection, kind: Kind, base_url: str, viewers: int) -> None:
    """The body of one viewer process (``multiprocessing`` target)."""
    conn.send(("ready",))
    task: dict[str, Any] = conn.recv()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime  # its own CPU from the task on, not its start-up
    lags: array.array[int] = array.array("q")
    errors: collections.Counter[str] = collections.Counter()
    reads: list[Read] = []
    resumed = 0

    async def viewer(slots: asyncio.Semaphore, deadline: float) -> None:
        nonlocal resumed
        if task["join_over_s"] > 0:
            await asyncio.sleep(random.uniform(0, task["join_over_s"]))
        for _ in range(task["tries"]):
            read = Read(kind, task["expect"], lags)
            reads.append(read)
            resumed += await _read(read, base_url, task["path"], slots, deadline, errors)

    async def run() -> None:
        slots = asyncio.Semaphore(CONNECT_CONCURRENCY)
        deadline = time.monotonic() + task["timeout_s"]
        await asyncio.gather(*(viewer(slots, deadline) for _ in range(viewers)))

    try:
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    conn.send(
        (
            "result",
            {
                "viewers": viewers,
                "deltas": sum(r.deltas for r in reads),
                "ended": sum(r.ended for r in reads),
                "resumes": resumed,
                "lags": dict(collections.Counter(lags)),
                "reads": [r.summary() for r in reads] if len(reads) <= 64 else [],
                "attach_ms": [
                    round((r.attached_at - r.sent_at) * 1000, 2) for r in reads if r.attached_at
                ],
                "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,
                "errors": dict(errors.most_common(5)),
            },
        )
    )
    conn.close()


TOKENS = (" the", " and", "ing ", " of ", " to ", "tion", " a s", "ment", " in ", " is ")


def ds_producer(
    conn: Connection, stream_url: str, tokens: int, pace: float, close: bool, delay_s: float
) -> None:
    """A Durable Streams producer (``multiprocessing`` target): ``tokens`` appends of a stamped
    text at ``pace`` a second (0: one after another), one in flight, the first ``delay_s`` after
    it is told ``"go"`` (it says ``("ready",)`` first), then (with ``close``) the close; answers
    ``("result", {...})``."""
    from benchmarks.durable import _Connection

    conn.send(("ready",))
    conn.recv()

    async def run() -> dict[str, Any]:
        path = urllib.parse.urlsplit(stream_url).path
        connection = await _Connection.open(stream_url)
        kind = "Content-Type: text/plain\r\n"
        await asyncio.sleep(delay_s)
        began = time.monotonic()
        first = last = 0
        try:
            for index in range(tokens):
                if pace > 0:
                    wait = began + index / pace - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                stamp = time.time_ns() // 1000
                first = first or stamp
                last = stamp
                body = f"{stamp} {TOKENS[index % len(TOKENS)]}".encode()
                status, _, content = await connection.request("POST", path, body, kind)
                if status not in (200, 204):
                    raise RuntimeError(f"append answered {status}: {content[:200]!r}")
            if close:
                closing = kind + "Stream-Closed: true\r\n"
                status, _, content = await connection.request("POST", path, b"", closing)
                if status not in (200, 204):
                    raise RuntimeError(f"the close answered {status}: {content[:200]!r}")
        finally:
            connection.close()
        return {"first_stamp": first, "last_stamp": last}

    result = asyncio.run(run())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    conn.send(("result", {**result, "cpu_s": usage.ru_utime + usage.ru_stime}))
    conn.close()
