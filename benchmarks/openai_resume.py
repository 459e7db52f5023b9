"""Time to first event of a Responses resume from the middle of a long response.

``python -m benchmarks.openai_resume`` starts its own Redis and ``broker serve``, makes one
finished response of ``--events`` stored events (10,000 by default), then ``--tries`` times asks
``GET /v1/responses/{id}?stream=true&starting_after=<the middle>`` and times the first body
byte from the request's start. It prints the median (the target is the native resume's,
5 ms) and checks that the first event is the one right after the middle.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time

import httpx
import orjson

from benchmarks.servers import Broker, RedisServer

TARGET_MS = 5.0
# Stored events besides the deltas: attempt, usage, end. Responses events besides the deltas'
# (one each): created, in_progress, the attempt's two, the end's four.
STORED_EXTRA = 3
RESPONSES_EXTRA = 8


def first_event(host: str, port: int, path: str) -> tuple[float, bytes]:
    """(milliseconds from sending ``GET path`` to the end of the first event, that event).

    A bare socket, so that the figure is the broker's and not an HTTP client's.
    """
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n"
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        received = b""
        started = time.perf_counter()
        sock.sendall(request.encode())
        while True:
            chunk = sock.recv(65_536)
            if not chunk:
                raise RuntimeError(f"the broker closed the read: {received[:300]!r}")
            received += chunk
            at = received.find(b"data: ")
            if at >= 0 and received.find(b"\n\n", at) >= 0:
                elapsed = (time.perf_counter() - started) * 1000
                break
    if not received.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the broker answered {received[:200]!r}")
    at = received.find(b"data: ")
    return elapsed, received[at + len(b"data: ") : received.find(b"\n\n", at)]


def middle_offset(http: httpx.Client, stream_id: str, skip: int) -> str:
    """The native offset of stored event number ``skip`` (1-based), through the JSON pages."""
    offset, seen = "-1", 0
    while True:
        page = http.get(f"/v1/streams/{stream_id}", params={"format": "json", "offset": offset})
        events = page.json()["events"]
        if seen + len(events) >= skip:
            return str(events[skip - seen - 1]["id"])
        seen += len(events)
        offset = page.json()["next_offset"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=10_000, help="stored events (default 10k)")
    parser.add_argument("--tries", type=int, default=50, help="timed resumes (default 50)")
    args = parser.parse_args(argv)
    redis = RedisServer()
    redis.start()
    broker = Broker(redis.url, concurrency=16)
    try:
        broker.start()
        tokens = args.events - STORED_EXTRA
        with httpx.Client(base_url=broker.base_url, timeout=120) as http:
            created = http.post(
                "/v1/responses",
                json={
                    "model": "simulated",
                    "input": "a long answer",
                    "broker": {"params": {"simulate": {"tokens": tokens, "tokens_per_s": 0}}},
                },
            )
            created.raise_for_status()
            response = created.json()
            if response["status"] != "completed":
                raise RuntimeError(f"the response ended {response['status']}")
            middle = (tokens + RESPONSES_EXTRA) // 2
            stream_id = http.get(f"/v1/turns/{response['id']}").json()["stream_id"]
            # The stored event whose delta is number `middle` + 1: the same point, natively.
            native_after = middle_offset(http, stream_id, middle + 1 - (RESPONSES_EXTRA - 4))
        host, port = "127.0.0.1", broker.port
        resume = f"/v1/responses/{response['id']}?stream=true&starting_after={middle}"
        native = f"/v1/streams/{stream_id}?offset={native_after}"
        first_seek, _ = first_event(host, port, resume)  # the walk that leaves checkpoints
        first_event(host, port, native)  # warm-up
        times, natives = [], []
        for _ in range(args.tries):
            ms, data = first_event(host, port, resume)
            number = orjson.loads(data)["sequence_number"]
            if number != middle + 1:
                raise RuntimeError(f"resumed at {number}, not {middle + 1}")
            times.append(ms)
            natives.append(first_event(host, port, native)[0])
    finally:
        broker.stop()
        redis.stop()
    p50 = statistics.median(times)
    print(
        f"responses resume after sequence number {middle} of a {args.events}-event response: "
        f"first event p50 {p50:.2f} ms (min {min(times):.2f}, max {max(times):.2f}, "
        f"{args.tries} tries); target <= {TARGET_MS} ms"
    )
    print(f"  the first resume (walks the stream, leaves checkpoints): {first_seek:.2f} ms")
    print(f"  native resume at the same point: p50 {statistics.median(natives):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
