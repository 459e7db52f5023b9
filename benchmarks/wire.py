"""Bytes on the wire per delta, with and without gzip, and what the compressor costs per batch.

``python -m benchmarks.wire`` measures, in this order:

* **4-character deltas** (the issue's typical answer): the broker's own frames
  (``frames.Entry``) of an English text cut in 4-character deltas, 40 ms apart, written through
  the broker's ``GzipStream`` one delta per write (a live reader at 25 tokens/s), several per
  write (a fast model's group-committed batches), as ``?batch_ms=`` windows group them (an
  opt-in delay), and all in one (a replay). Next to them the
  floor of any SSE encoding that keeps an id per event (``id:`` and the text, nothing else), to
  judge whether a compact encoding could earn its place, and brotli and zstd when their Python
  packages are importable (they are not dependencies of the broker).
* **A live broker**: its own Redis and ``broker serve``, one simulated turn, three raw-socket
  readers attached before the first delta: one asking for gzip, one not, and one asking for
  gzip and ``?batch_ms=`` (``--batch-ms``, 150). Every byte after
  the request is counted: the response head, the chunked framing and the (coded) body. The
  simulated model's deltas are its words (about 7 bytes), so its ratio is not the
  4-character one; the live run checks that the offline figures are what the server sends.
* **Cost**: the time of one ``GzipStream.write`` per batch (1 and 8 live events, and a 4,096-event
  replay page), the memory one stream's compressor holds, and the heartbeat's coded size.

Nothing here is a pass/fail test; the figures go to stdout (and ``--json PATH``).
"""

from __future__ import annotations

import argparse
import importlib
import random
import socket
import statistics
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson

from benchmarks.servers import Broker, RedisServer
from broker.compression import GzipStream
from broker.frames import Entry
from broker.sse import PING

TARGET_RATIO = 3.0  # a typical answer of 4-character deltas: at most 3x its text bytes, coded
BUDGET_MS = 1.0  # the compressor's added latency per batch
DELTA_CHARS = 4
PACE_MS = 40  # 25 tokens/s
BATCH_WINDOWS_MS = (50, 100, 150, 250)  # the ?batch_ms= of the offline rows
# Our own words, for deltas that are prose rather than random letters.
PROSE = (
    "A phone in a tunnel loses its connection halfway through an answer. When it comes back "
    "it sends the id of the last event it saw, and the broker replays exactly what it missed, "
    "no gap and no duplicate, then hands it over to the live answer as the model writes it. "
    "A second tab watches the same answer at the same time, and a retried request attaches to "
    "the running generation instead of paying for a second one. Every event is kept in Redis "
    "before any reader sees it, so a broker that is killed loses nothing it acknowledged. "
)

Encoder = Callable[[bytes], bytes]


def four_char_deltas(count: int) -> list[str]:
    text = PROSE * (count * DELTA_CHARS // len(PROSE) + 1)
    return [text[i : i + DELTA_CHARS] for i in range(0, count * DELTA_CHARS, DELTA_CHARS)]


def entry_ids(count: int, seed: int = 7) -> list[str]:
    """Redis entry ids ``PACE_MS`` apart (a few ms of jitter), from a recent server time."""
    rng, ms, ids = random.Random(seed), 1_796_045_845_245, []
    for _ in range(count):
        ms += PACE_MS + rng.randint(-3, 3)
        ids.append(f"{ms}-0")
    return ids


def broker_frames(deltas: Sequence[str]) -> list[bytes]:
    """The frames the broker sends for these deltas, rendered by the broker itself."""
    frames = []
    for entry_id, text in zip(entry_ids(len(deltas)), deltas, strict=True):
        data = orjson.dumps({"attempt": 1, "text": text}).decode()
        frames.append(Entry.from_redis(entry_id, ["e", "delta", "d", data]).frame)
    return frames


def floor_frames(deltas: Sequence[str]) -> list[bytes]:
    """The least an SSE frame with a resumable id can hold: the id and the text."""
    frames = []
    for entry_id, text in zip(entry_ids(len(deltas)), deltas, strict=True):
        offset = Entry.from_redis(entry_id, ["e", "delta", "d", "{}"]).offset
        frames.append(f"id: {offset}\ndata: {text}\n\n".encode())
    return frames


def gzip_encoder() -> Encoder:
    return GzipStream().write


def partial_flush_encoder() -> Encoder:
    """gzip flushed with Z_PARTIAL_FLUSH: no empty stored block per write, but only decoders
    that consume every bit they are given see all of a write; the broker does not use it."""
    deflate = zlib.compressobj(6, zlib.DEFLATED, 16 + 12, 5)
    return lambda data: deflate.compress(data) + deflate.flush(zlib.Z_PARTIAL_FLUSH)


def other_encoders() -> dict[str, Callable[[], Encoder]]:
    """brotli and zstd, flushed per write as an event stream must be, when importable."""
    found: dict[str, Callable[[], Encoder]] = {}
    try:
        brotli: Any = importlib.import_module("brotli")
    except ImportError:
        pass
    else:

        def brotli_encoder() -> Encoder:
            compressor = brotli.Compressor(quality=5, lgwin=16)
            return lambda data: bytes(compressor.process(data) + compressor.flush())

        found[f"br (brotli {brotli.__version__}, q5)"] = brotli_encoder
    try:
        zstandard: Any = importlib.import_module("zstandard")
    except ImportError:
        pass
    else:

        def zstd_encoder() -> Encoder:
            compressor = zstandard.ZstdCompressor(level=3).compressobj()
            flush = zstandard.COMPRESSOBJ_FLUSH_BLOCK
            return lambda data: bytes(compressor.compress(data) + compressor.flush(flush))

        found[f"zstd (zstandard {zstandard.__version__}, level 3)"] = zstd_encoder
    return found


def coded_bytes(frames: Sequence[bytes], per_write: int, encoder: Encoder | None) -> int:
    """Body bytes of ``frames`` written ``per_write`` at a time (0: all in one write)."""
    size = per_write or len(frames)
    return coded_batches([frames[i : i + size] for i in range(0, len(frames), size)], encoder)


def windows(frames: Sequence[bytes], window_ms: int) -> list[Sequence[bytes]]:
    """``frames`` (``PACE_MS`` apart, as ``entry_ids``) as ``?batch_ms=window_ms`` writes them:
    each write holds the events that came within ``window_ms`` of the first it held."""
    stamps = [int(entry_id.partition("-")[0]) for entry_id in entry_ids(len(frames))]
    batches: list[Sequence[bytes]] = []
    first = 0
    for i in range(1, len(frames) + 1):
        if i == len(frames) or stamps[i] - stamps[first] >= window_ms:
            batches.append(frames[first:i])
            first = i
    return batches


def coded_batches(batches: Sequence[Sequence[bytes]], encoder: Encoder | None) -> int:
    """Body bytes of ``batches`` of frames, one write each."""
    writes = [b"".join(batch) for batch in batches]
    opening = b"retry: 1000\n\n"  # every stream starts with it; the gzip header goes with it
    if encoder is None:
        return sum(map(len, writes))
    encoder(opening)
    return sum(len(encoder(write)) for write in writes)


@dataclass
class Row:
    case: str
    bytes_per_delta: float
    ratio: float  # body bytes over text bytes


def offline_rows(count: int) -> list[Row]:
    deltas = four_char_deltas(count)
    text_bytes = sum(len(d.encode()) for d in deltas)
    frames, floor = broker_frames(deltas), floor_frames(deltas)
    rows: list[Row] = []

    def add(case: str, total: int) -> None:
        rows.append(Row(case, total / count, total / text_bytes))

    add("identity, broker frames", coded_bytes(frames, 1, None))
    for per_write, name in (
        (1, "1 delta per write (live)"),
        (2, "2 per write"),
        (4, "4 per write"),
    ):
        add(f"gzip, {name}", coded_bytes(frames, per_write, gzip_encoder()))
    add("gzip, 8 per write", coded_bytes(frames, 8, gzip_encoder()))
    add("gzip, all in one write (replay)", coded_bytes(frames, 0, gzip_encoder()))
    for window_ms in BATCH_WINDOWS_MS:
        batched = coded_batches(windows(frames, window_ms), gzip_encoder())
        add(f"gzip, ?batch_ms={window_ms} (live, opt-in)", batched)
    add("identity, floor (id + text only)", coded_bytes(floor, 1, None))
    add("gzip, floor, 1 per write", coded_bytes(floor, 1, gzip_encoder()))
    # Where a live delta's bytes go: without its id line, and the text with no frame at all.
    no_id = [frame.split(b"\n", 1)[1] for frame in frames]
    add("gzip, broker frames without id, 1 per write", coded_bytes(no_id, 1, gzip_encoder()))
    text_only = [delta.encode() for delta in deltas]
    add("gzip, the text alone, 1 per write", coded_bytes(text_only, 1, gzip_encoder()))
    add(
        "gzip, partial flush (not used), 1 per write",
        coded_bytes(frames, 1, partial_flush_encoder()),
    )
    for name, make in other_encoders().items():
        add(f"{name}, 1 per write", coded_bytes(frames, 1, make()))
    return rows


# --- cost -------------------------------------------------------------------------------------


@dataclass
class Cost:
    batch: str
    bytes_in: int
    p50_us: float
    p99_us: float
    max_us: float


def write_cost(frames: Sequence[bytes], per_write: int, writes: int) -> Cost:
    """The time of ``GzipStream.write`` for batches of ``per_write`` frames, on one stream."""
    stream = GzipStream()
    stream.write(b"retry: 1000\n\n")
    batches = [
        b"".join(frames[(i * per_write + j) % len(frames)] for j in range(per_write))
        for i in range(writes)
    ]
    times = []
    clock = time.perf_counter_ns
    for batch in batches:
        started = clock()
        stream.write(batch)
        times.append((clock() - started) / 1000)
    times.sort()
    return Cost(
        f"{per_write} event(s)",
        len(batches[0]),
        statistics.median(times),
        times[int(len(times) * 0.99)],
        times[-1],
    )


def stream_memory_kib(streams: int = 200) -> float:
    """What one stream's compressor holds, once it has written (zlib allocates through Python)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [GzipStream() for _ in range(streams)]
    for stream in kept:
        stream.write(PING)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held / streams / 1024


def ping_bytes() -> list[int]:
    stream = GzipStream()
    stream.write(b"retry: 1000\n\n")
    return [len(stream.write(PING)) for _ in range(3)]


def flush_bytes() -> int:
    """What a write of nothing costs: the sync flush alone."""
    stream = GzipStream()
    stream.write(b"retry: 1000\n\n")
    return len(stream.write(b""))


# --- a live broker ----------------------------------------------------------------------------


@dataclass
class WireRead:
    """Every byte one raw-socket read of a stream received, by kind."""

    gzip: bool
    head: int = 0
    framing: int = 0  # chunk sizes and their CRLFs
    body: int = 0  # as sent: coded when gzip
    writes: int = 0
    deltas: int = 0
    text_bytes: int = 0
    arrivals: dict[str, float] = field(default_factory=dict)  # event id -> perf_counter
    coded: bool = False  # the response said Content-Encoding: gzip


def read_wire(port: int, path: str, *, gzip: bool, result: WireRead) -> None:
    """Read ``path`` to its end with a bare socket, counting what arrives (HTTP/1.1 chunked)."""
    coding = "Accept-Encoding: gzip\r\n" if gzip else ""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n{coding}\r\n"
    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
    buffer, text = b"", b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request.encode())
        while b"\r\n\r\n" not in buffer:
            buffer += _recv(sock)
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        result.head = len(head) + 4
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the broker answered {head[:200]!r}")
        result.coded = b"\r\ncontent-encoding: gzip" in head.lower()
        while True:
            while b"\r\n" not in buffer:
                buffer += _recv(sock)
            size_line, _, buffer = buffer.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            while len(buffer) < size + 2:
                buffer += _recv(sock)
            data, buffer = buffer[:size], buffer[size + 2 :]
            result.framing += len(size_line) + 4
            if size == 0:
                break
            arrived = time.perf_counter()
            result.body += size
            result.writes += 1
            text += decoder.decompress(data) if decoder is not None else data
            *frames, text = text.split(b"\n\n")
            for frame in frames:
                _count(frame, arrived, result)


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65_536)
    if not data:
        raise RuntimeError("the broker closed the connection mid-response")
    return data


def _count(frame: bytes, arrived: float, result: WireRead) -> None:
    fields = dict(line.split(b": ", 1) for line in frame.split(b"\n") if b": " in line)
    if fields.get(b"event") != b"delta":
        return
    result.deltas += 1
    result.text_bytes += len(orjson.loads(fields[b"data"])["text"].encode())
    result.arrivals[fields[b"id"].decode()] = arrived


def live_reads(
    broker: Broker, tokens: int, pace: float, batch_ms: int
) -> tuple[WireRead, WireRead, WireRead, WireRead]:
    """A gzip, an identity and a batched gzip (``?batch_ms=``) reader of one live turn, and a
    gzip replay of it afterwards."""
    body = {
        "conversation_id": f"wire-{pace}",
        "messages": [{"role": "user", "content": "Tell me about tunnels"}],
        # The first delta waits, so that both readers are attached before it.
        "params": {
            "simulate": {"tokens": tokens, "tokens_per_s": pace, "first_delta_after_ms": 800}
        },
    }
    with httpx.Client(base_url=broker.base_url, timeout=30) as http:
        turn = http.post("/v1/turns", json=body).json()
    path = f"/v1/streams/{turn['stream_id']}"
    coded, plain, batched = WireRead(gzip=True), WireRead(gzip=False), WireRead(gzip=True)
    readers = [
        threading.Thread(target=read_wire, args=(broker.port, p), kwargs={"gzip": g, "result": r})
        for p, g, r in (
            (path, True, coded),
            (path, False, plain),
            (f"{path}?batch_ms={batch_ms}", True, batched),
        )
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=tokens / max(pace, 1) + 60)
    replay = WireRead(gzip=True)
    read_wire(broker.port, path, gzip=True, result=replay)
    return coded, plain, batched, replay


def added_latency_ms(coded: WireRead, plain: WireRead) -> float:
    """Median over the same events of when the gzip reader had each minus the identity one."""
    gaps = [
        (at - plain.arrivals[event_id]) * 1000
        for event_id, at in coded.arrivals.items()
        if event_id in plain.arrivals
    ]
    return statistics.median(gaps) if gaps else float("nan")


# --- the report -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--deltas", type=int, default=400, help="deltas of the offline answer")
    parser.add_argument("--tokens", type=int, default=200, help="deltas of the live turn")
    parser.add_argument("--pace", type=float, default=25.0, help="live tokens/s (default 25)")
    parser.add_argument("--writes", type=int, default=20_000, help="timed writes per batch size")
    parser.add_argument(
        "--batch-ms", type=int, default=150, help="the live batched reader's ?batch_ms="
    )
    parser.add_argument("--no-live", action="store_true", help="skip the live broker")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}

    rows = offline_rows(args.deltas)
    results["four_char_deltas"] = [asdict(row) for row in rows]
    print(f"{args.deltas} deltas of {DELTA_CHARS} characters, {PACE_MS} ms apart; body bytes")
    print(f"  {'case':<46} {'B/delta':>8} {'x text':>7}")
    for row in rows:
        print(f"  {row.case:<46} {row.bytes_per_delta:>8.1f} {row.ratio:>6.2f}x")
    live_row = next(row for row in rows if row.case == "gzip, 1 delta per write (live)")
    met = "met" if live_row.ratio <= TARGET_RATIO else "NOT met"
    print(f"  target <= {TARGET_RATIO}x at one delta per write: {met} ({live_row.ratio:.2f}x)")
    for row in rows:
        if "?batch_ms=" in row.case:
            met = "met" if row.ratio <= TARGET_RATIO else "NOT met"
            print(f"  target <= {TARGET_RATIO}x with {row.case.split()[1]}: {met}")

    frames = broker_frames(four_char_deltas(4096))
    costs = [write_cost(frames, n, args.writes) for n in (1, 8)]
    costs.append(write_cost(frames, 4096, 20))  # a full replay page (BROKER_SSE_REPLAY_PAGE)
    results["write_cost"] = [asdict(cost) for cost in costs]
    memory, pings, flush = stream_memory_kib(), ping_bytes(), flush_bytes()
    results.update(stream_memory_kib=memory, ping_bytes=pings, flush_bytes=flush)
    print("\nGzipStream.write per batch (one stream, sync flush)")
    for cost in costs:
        print(
            f"  {cost.batch:<16} {cost.bytes_in:>8} B in: p50 {cost.p50_us:8.1f} us, "
            f"p99 {cost.p99_us:8.1f} us, max {cost.max_us:8.1f} us"
        )
    live_costs = [cost for cost in costs if cost.batch in ("1 event(s)", "8 event(s)")]
    worst = max(cost.p99_us for cost in live_costs) / 1000
    print(f"  live batches' p99 {worst:.3f} ms: budget {BUDGET_MS} ms per batch")
    print(f"  one stream's compressor holds {memory:.1f} KiB; a heartbeat codes to {pings} bytes")
    print(f"  the sync flush alone (a write of nothing) is {flush} bytes")

    if not args.no_live:
        redis = RedisServer()
        redis.start()
        broker = Broker(redis.url, concurrency=8)
        try:
            broker.start()
            coded, plain, batched, replay = live_reads(
                broker, args.tokens, args.pace, args.batch_ms
            )
        finally:
            broker.stop()
            redis.stop()
        results["live"] = {
            "tokens": args.tokens,
            "pace": args.pace,
            "gzip": asdict(coded) | {"arrivals": len(coded.arrivals)},
            "identity": asdict(plain) | {"arrivals": len(plain.arrivals)},
            "batch_ms": args.batch_ms,
            "gzip_batched": asdict(batched) | {"arrivals": len(batched.arrivals)},
            "batched_latency_ms_p50": added_latency_ms(batched, plain),
            "replay_gzip": asdict(replay) | {"arrivals": len(replay.arrivals)},
            "added_latency_ms_p50": added_latency_ms(coded, plain),
        }
        print(f"\nlive broker: {args.tokens} simulated deltas at {args.pace:g}/s, raw sockets")
        print(f"  {'read':<18} {'B/delta body':>13} {'x text':>7} {'+framing':>9} {'writes':>7}")
        for name, read in (
            ("identity, live", plain),
            ("gzip, live", coded),
            (f"gzip, batch {args.batch_ms} ms", batched),
            ("gzip, replay", replay),
        ):
            if not read.deltas:
                raise RuntimeError(f"the {name} read saw no delta")
            if read.gzip and not read.coded:
                raise RuntimeError(f"the {name} read was not compressed")
            per_delta = read.body / read.deltas
            wire = (read.body + read.framing) / read.deltas
            ratio = read.body / read.text_bytes
            print(f"  {name:<18} {per_delta:>13.1f} {ratio:>6.2f}x {wire:>9.1f} {read.writes:>7}")
        average = plain.text_bytes / plain.deltas
        print(f"  the simulated deltas average {average:.1f} bytes of text")
        behind = added_latency_ms(coded, plain)
        print(
            f"  the gzip reader had each event after the identity one by {behind:.3f} ms (median)"
        )
        held = added_latency_ms(batched, plain)
        print(f"  the batched reader had each event {held:.1f} ms after the identity one (median)")

    if args.json:
        with open(args.json, "wb") as out:
            out.write(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
