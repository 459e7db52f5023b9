"""Long polls: what a crowd of polling clients costs, against the same crowd on SSE.

``python -m benchmarks.longpoll`` starts its own Redis and ``broker serve``, then runs one slow
simulated turn twice: once read by ``--clients`` long-polling clients (each polls
``?format=json&offset=<its next_offset>&wait=25`` in a loop until ``closed``), once by the same
number of SSE readers. For each it reports:

* the delivery lag: from an event's entry time (its id's milliseconds, the Redis server's clock,
  on this machine) to the moment a client has it, p50 and p99 over every event and client;
* the Redis commands the broker sent during the turn (``INFO commandstats``, scripts' inner
  calls included), per delta and per client and delta, and the ``XREAD``s among them: a waiting
  poll rides its stream's per-process feed, so those should not grow with the clients;
* the requests the pollers made, per client and delta (a poll answers at the first new batch,
  so a poller makes about one request per batch it sees).

Nothing here is a pass/fail test; the figures go to stdout (and ``--json PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from benchmarks.servers import Broker, RedisServer, commandstats


@dataclass
class Crowd:
    """What one crowd of readers of one turn saw and cost."""

    mode: str
    clients: int
    deltas: int = 0
    lags_ms: list[float] = field(default_factory=list, repr=False)
    requests: int = 0
    commands: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        lags = sorted(self.lags_ms)
        total = sum(self.commands.values())
        per_delta = total / self.deltas if self.deltas else 0.0
        return {
            "mode": self.mode,
            "clients": self.clients,
            "deltas": self.deltas,
            "lag_p50_ms": statistics.median(lags) if lags else None,
            "lag_p99_ms": lags[int(0.99 * (len(lags) - 1))] if lags else None,
            "redis_commands": total,
            "redis_commands_per_delta": round(per_delta, 2),
            "redis_commands_per_client_delta": round(per_delta / self.clients, 3),
            "xreads_per_delta": round(self.commands.get("xread", 0) / max(self.deltas, 1), 2),
            "requests_per_client_delta": round(
                self.requests / max(self.clients * self.deltas, 1), 2
            ),
            "seconds": round(self.seconds, 2),
            "top_commands": dict(sorted(self.commands.items(), key=lambda kv: -kv[1])[:6]),
        }


def entry_ms(offset: str) -> float:
    return float(int(offset.partition("-")[0]))


async def poller(base_url: str, path: str, crowd: Crowd) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        await poll_loop(http, path, crowd)


async def poll_loop(http: httpx.AsyncClient, path: str, crowd: Crowd) -> None:
    offset = "-1"
    while True:
        response = await http.get(path, params={"format": "json", "offset": offset, "wait": "25"})
        crowd.requests += 1
        page = response.json()
        now = time.time() * 1000
        for event in page["events"]:
            if event["event"] == "delta":
                crowd.lags_ms.append(now - entry_ms(event["id"]))
        offset = page["next_offset"]
        if page["closed"]:
            return


async def sse_reader(base_url: str, path: str, crowd: Crowd) -> None:
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as http,
        http.stream("GET", path) as response,
    ):
        crowd.requests += 1
        kind, offset = "", ""
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                offset = line[4:]
            elif line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind == "delta":
                crowd.lags_ms.append(time.time() * 1000 - entry_ms(offset))
            elif line.startswith("data: ") and kind == "end":
                return


async def run_crowd(
    broker: Broker, redis: RedisServer, mode: str, args: argparse.Namespace
) -> Crowd:
    crowd = Crowd(mode, args.clients)
    body = {
        "conversation_id": f"longpoll-{mode}",
        "messages": [{"role": "user", "content": "Tell me about tunnels"}],
        # The first delta waits, so that every client is waiting before it.
        "params": {
            "simulate": {
                "tokens": args.tokens,
                "tokens_per_s": args.pace,
                "first_delta_after_ms": args.settle_ms,
            }
        },
    }
    # A client each, as phones are: one client with a pool of hundreds of connections measures
    # its pool (httpx's, under hundreds of requests at once) more than the broker.
    async with httpx.AsyncClient(base_url=broker.base_url, timeout=60) as http:
        turn = (await http.post("/v1/turns", json=body)).json()
        path = f"/v1/streams/{turn['stream_id']}"
        nodes = redis.nodes()
        before = commandstats(nodes)
        started = time.monotonic()
        read = poller if mode == "long-poll" else sse_reader
        await asyncio.gather(*(read(broker.base_url, path, crowd) for _ in range(args.clients)))
        crowd.seconds = time.monotonic() - started
        after = commandstats(nodes)
        for node in nodes:
            node.close()
    crowd.commands = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    crowd.commands = {k: v for k, v in crowd.commands.items() if v > 0}
    crowd.deltas = args.tokens
    return crowd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--clients", type=int, default=200, help="readers of the turn")
    parser.add_argument("--tokens", type=int, default=40, help="deltas of the turn")
    parser.add_argument("--pace", type=float, default=5.0, help="deltas a second (default 5)")
    parser.add_argument(
        "--settle-ms", type=int, default=1500, help="the wait before the first delta"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    redis = RedisServer()
    redis.start()
    broker = Broker(redis.url, concurrency=8, env={"BROKER_MAX_CONNECTIONS": "10000"})
    results: dict[str, Any] = {"clients": args.clients, "tokens": args.tokens, "pace": args.pace}
    try:
        broker.start()
        for mode in ("long-poll", "sse"):
            crowd = asyncio.run(run_crowd(broker, redis, mode, args))
            results[mode] = crowd.summary()
    finally:
        broker.stop()
        redis.stop()
    print(
        f"{args.clients} clients of one turn of {args.tokens} deltas at {args.pace:g}/s "
        f"(one broker process, one Redis)"
    )
    keys = (
        "lag_p50_ms",
        "lag_p99_ms",
        "redis_commands_per_delta",
        "redis_commands_per_client_delta",
        "xreads_per_delta",
        "requests_per_client_delta",
    )
    print(f"  {'figure':<34} {'long-poll':>12} {'sse':>12}")
    for key in keys:
        values = [results[mode][key] for mode in ("long-poll", "sse")]
        shown = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in values]
        print(f"  {key:<34} {shown[0]:>12} {shown[1]:>12}")
    for mode in ("long-poll", "sse"):
        print(f"  {mode} commands: {results[mode]['top_commands']}")
    if args.json:
        with open(args.json, "wb") as out:
            out.write(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
