"""Regression test for issue 14, section 2: a few slow readers stalled every reader of a process.

Clients that never read (small receive buffers) on a fast stream kept the broker at full CPU:
the kernel took megabytes per connection before a write waited, so each such reader looked fast
and replayed the stream from Redis, page after page, beside everyone else. Normal readers who
joined later lagged by seconds, and memory grew with every page held for a client that took
nothing. Now a slow client's reader stops reading Redis as soon as its connection is full, and
holds one page's bytes until the send timeout closes it.

The broker runs as its own process, so that its CPU and memory are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import BrokerProcess

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="reads the broker's memory from /proc"
    ),
    # Brokers of its own processes, on the server the session names: a test of the server too.
    pytest.mark.server,
]

SLOW_READERS = 150
NORMAL_READERS = 5
RATE = 2_000  # deltas per second
TOKENS = 12_000  # six seconds of stream
JOIN_AFTER_MS = 2_000  # normal readers join once the stream is this far past the slow ones
# The documented bound (BROKER_SSE_SEND_TIMEOUT_S in docs/settings.md) on what a reader whose
# client takes nothing costs the process.
RSS_PER_SLOW_READER = 512 << 10
ID = re.compile(rb"^id: (\d+)-(\d+)$", re.MULTILINE)


@dataclasses.dataclass
class Reading:
    """What one normal reader received: every event id, its catch-up and the live deltas' lag.

    A reader joins a stream that is two seconds along: it first reads that backlog, and the
    deltas appended meanwhile arrive in one burst behind it. ``catch_up_ms`` is the time from
    joining to the first delta appended after the join; ``lags_ms`` holds the lag of every
    delta appended after that, when the reader is live.
    """

    ids: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    deltas: int = 0
    catch_up_ms: float | None = None
    lags_ms: list[float] = dataclasses.field(default_factory=list)


def _request(stream_id: str) -> bytes:
    return f"GET /v1/streams/{stream_id} HTTP/1.1\r\nHost: broker\r\n\r\n".encode()


async def read_to_end(host: str, port: int, stream_id: str, timeout: float) -> Reading:
    """Read one stream from the start to its ``end``, over a raw connection (chunked body)."""
    reading = Reading()
    joined_ms = time.time() * 1000
    caught_up_ms = joined_ms
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request(stream_id))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        assert head.startswith(b"HTTP/1.1 200"), head
        deadline = time.monotonic() + timeout
        pending = b""
        while True:
            remaining = deadline - time.monotonic()
            size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), remaining)
            size = int(size_line, 16)
            assert size, "the stream ended before its end event"
            body = await asyncio.wait_for(reader.readexactly(size + 2), remaining)
            now_ms = time.time() * 1000
            *frames, pending = (pending + body[:-2]).split(b"\n\n")
            for frame in frames:
                match = ID.search(frame)
                if match is None:
                    continue  # the opening frame, a heartbeat
                entry = (int(match.group(1)), int(match.group(2)))
                reading.ids.append(entry)
                if b"\nevent: delta\n" in frame:
                    reading.deltas += 1
                    if reading.catch_up_ms is None:
                        if entry[0] >= joined_ms:  # the first delta appended after joining
                            reading.catch_up_ms = now_ms - joined_ms
                            caught_up_ms = now_ms
                    elif entry[0] >= caught_up_ms:  # appended once the reader was live
                        reading.lags_ms.append(now_ms - entry[0])
                elif b"\nevent: end\n" in frame:
                    return reading
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


@contextlib.contextmanager
def peak_rss(pid: int) -> Iterator[Callable[[], int]]:
    """The broker's highest RSS while the block runs, sampled every 50 ms by a task."""
    peak = [rss_bytes(pid)]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_bytes(pid))
            await asyncio.sleep(0.05)

    task = asyncio.get_running_loop().create_task(sample())
    try:
        yield lambda: max(peak[0], rss_bytes(pid))
    finally:
        task.cancel()


async def start_turn(client: httpx.AsyncClient, conversation_id: str) -> str:
    body = {
        "conversation_id": conversation_id,
        "messages": [{"role": "user", "content": "go"}],
        "params": {"simulate": {"tokens": TOKENS, "tokens_per_s": RATE}},
    }
    response = await client.post("/v1/turns", json=body)
    assert response.status_code == 201, response.text
    stream_id: str = response.json()["stream_id"]
    return stream_id


async def wait_until_past(client: httpx.AsyncClient, stream_id: str, ms: float) -> None:
    """Poll the stream's JSON pages until it holds an event appended at ``ms`` or later."""
    offset = "-1"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        page = (
            await client.get(
                f"/v1/streams/{stream_id}", params={"format": "json", "offset": offset}
            )
        ).json()
        events = page["events"]
        if events and int(events[-1]["id"].partition("-")[0]) >= ms:
            return
        offset = page["next_offset"]
        if page["up_to_date"]:
            await asyncio.sleep(0.02)
    raise AssertionError(f"stream {stream_id} did not reach {ms} within 20 s")


async def normal_readers(
    client: httpx.AsyncClient, host: str, port: int, stream_id: str, since_ms: float
) -> list[Reading]:
    await wait_until_past(client, stream_id, since_ms + JOIN_AFTER_MS)
    return await asyncio.gather(
        *(read_to_end(host, port, stream_id, timeout=30) for _ in range(NORMAL_READERS))
    )


def open_slow_reader(host: str, port: int, stream_id: str) -> socket.socket:
    """A client that asks for the stream and never reads a byte of it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((host, port))
    sock.sendall(_request(stream_id))
    return sock


def lags(readings: list[Reading]) -> tuple[float, float]:
    """The median and 95th percentile of every live delta's lag, in ms."""
    values = [lag for reading in readings for lag in reading.lags_ms]
    assert len(values) > NORMAL_READERS * RATE, "too few live deltas to compare"
    return statistics.median(values), statistics.quantiles(values, n=20)[-1]


def catch_up(readings: list[Reading]) -> float:
    """The slowest reader's catch-up, in ms."""
    values = [reading.catch_up_ms for reading in readings]
    assert all(value is not None for value in values), "a reader never caught up"
    return max(value for value in values if value is not None)


def assert_exactly_once(readings: list[Reading]) -> None:
    for reading in readings:
        assert reading.deltas == TOKENS
        assert all(a < b for a, b in itertools.pairwise(reading.ids)), "duplicate or reordered"
        assert reading.ids == readings[0].ids


async def test_slow_readers_neither_delay_normal_ones_nor_grow_memory_past_the_bound(
    broker_processes: Callable[[dict[str, str]], BrokerProcess],
) -> None:
    broker = broker_processes(
        {"BROKER_SSE_SEND_TIMEOUT_S": "5", "BROKER_SIMULATE_MAX_TOKENS_PER_S": "0"}
    )
    url = urlsplit(broker.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    pid = broker.process.pid
    async with httpx.AsyncClient(base_url=broker.base_url, timeout=10) as client:
        # The control: normal readers of a fast stream, nobody else.
        control_stream = await start_turn(client, "control")
        started = time.time() * 1000
        control = await normal_readers(client, host, port, control_stream, started)
        assert_exactly_once(control)

        # The same beside slow readers who joined two seconds before them.
        stream_id = await start_turn(client, "slow")
        baseline = rss_bytes(pid)
        with peak_rss(pid) as peak:
            started = time.time() * 1000
            slow = [open_slow_reader(host, port, stream_id) for _ in range(SLOW_READERS)]
            try:
                beside_slow = await normal_readers(client, host, port, stream_id, started)
                grown = peak() - baseline
            finally:
                for sock in slow:
                    sock.close()
    assert_exactly_once(beside_slow)
    control_median, control_p95 = lags(control)
    median, p95 = lags(beside_slow)
    # Reading the backlog shares two cores with 150 more connections and with this client: it
    # may take longer than the control's, but not the seconds it took when slow readers
    # replayed the stream beside it.
    assert catch_up(beside_slow) <= 2 * catch_up(control) + 1_000, (
        catch_up(beside_slow),
        catch_up(control),
    )
    # Once live: twice the control, plus a few scheduler ticks of slack.
    assert median <= 2 * control_median + 20, (median, control_median)
    assert p95 <= 2 * control_p95 + 50, (p95, control_p95)
    print("GROWN", grown / SLOW_READERS, baseline)
    assert grown / SLOW_READERS < RSS_PER_SLOW_READER, (
        f"{grown / SLOW_READERS:.0f} B per reader ({grown >> 20} MiB over {baseline >> 20} MiB)"
    )
