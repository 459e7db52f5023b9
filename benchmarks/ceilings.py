"""Raw-Redis ceilings: what the server itself does on this machine, with no broker in the way.

Commands are encoded once and replayed over plain asyncio connections, with hiredis parsing the
replies, so the client costs as little as Python allows. Each connection keeps ``depth`` commands
in flight (``depth`` 16 is a pipeline of 16, like ``redis-benchmark -P 16``); the figure is replies
per second over a timed window after a short warm-up.

On a cluster each connection goes to the node that serves its key, as a cluster client would
send it, so the many-client figures spread over the primaries as the broker's streams do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Callable, Sequence
from typing import cast

import hiredis
import redis

from benchmarks.servers import RedisServers, delete_matching
from broker.scripts import script_source

# A typical delta as the broker stores it: a 30-byte data field.
PAYLOAD = b'{"attempt":1,"text":" abcdef"}'
assert len(PAYLOAD) == 30

# The smallest fenced append: refuse unless the caller holds the lease's token, then XADD.
FENCED_XADD = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return redis.error_reply('FENCED lease lost')
end
return redis.call('XADD', KEYS[2], '*', 'e', ARGV[2], 'd', ARGV[3])
"""
TOKEN = "42"
MANY_CLIENTS = 50


def command(*parts: bytes | str | int) -> bytes:
    """One command in RESP."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


# A command to send again and again, or the k-th of a sequence (a command that may not repeat,
# such as an append that names how many events came before it).
Request = bytes | Callable[[int], bytes]


class _Batches:
    """The next ``depth`` commands of one request, as one write."""

    def __init__(self, request: Request, depth: int) -> None:
        self._request, self._depth, self._sent = request, depth, 0
        self._fixed = request * depth if isinstance(request, bytes) else None

    def next(self) -> bytes:
        if self._fixed is not None:
            return self._fixed
        assert callable(self._request)
        first, self._sent = self._sent, self._sent + self._depth
        return b"".join(self._request(k) for k in range(first, self._sent))


class _Counter:
    def __init__(self) -> None:
        self.replies = 0
        self.errors = 0
        self.stopping = False
        self.first_error = ""


class _Client(asyncio.Protocol):
    """Replays one command with ``depth`` in flight until told to stop."""

    def __init__(self, request: Request, depth: int, counter: _Counter) -> None:
        self._batches = _Batches(request, depth)
        self._depth = depth
        self._counter = counter
        self._reader = hiredis.Reader()
        self._pending = 0
        self._transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        self._pending = self._depth
        self._transport.write(self._batches.next())

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        counter = self._counter
        while (reply := self._reader.gets()) is not False:
            self._pending -= 1
            counter.replies += 1
            if isinstance(reply, hiredis.ReplyError):
                counter.errors += 1
                counter.first_error = counter.first_error or str(reply)
        if self._pending == 0:
            if counter.stopping:
                assert self._transport is not None
                self._transport.close()
            else:
                self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


# A request and the port of the node it is sent to.
Target = tuple[int, Request]


async def _measure(
    targets: Sequence[Target], depth: int, warmup_s: float, duration_s: float
) -> tuple[int, float, int, str]:
    loop = asyncio.get_running_loop()
    counter = _Counter()
    clients: list[_Client] = []
    for port, request in targets:
        _, client = await loop.create_connection(
            lambda request=request: _Client(request, depth, counter),  # type: ignore[misc]
            "127.0.0.1",
            port,
        )
        clients.append(client)
    await asyncio.sleep(warmup_s)
    began, before = time.perf_counter(), counter.replies
    await asyncio.sleep(duration_s)
    elapsed, done = time.perf_counter() - began, counter.replies - before
    counter.stopping = True
    await asyncio.wait_for(asyncio.gather(*(c.closed for c in clients)), 10)
    return done, elapsed, counter.errors, counter.first_error


def _measure_one(
    port: int, request: Request, depth: int, warmup_s: float, duration_s: float
) -> float:
    """One connection in a plain blocking loop: the cheapest client Python has."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = hiredis.Reader()
        batches = _Batches(request, depth)
        warm_until = time.perf_counter() + warmup_s
        began = 0.0
        replies = 0
        while True:
            sock.sendall(batches.next())
            left = depth
            while left:
                reader.feed(sock.recv(1 << 16))
                while (reply := reader.gets()) is not False:
                    left -= 1
                    if isinstance(reply, hiredis.ReplyError):
                        raise RuntimeError(f"error reply: {reply}")
            now = time.perf_counter()
            if now < warm_until:
                continue
            if not began:
                began = now  # the window opens at the end of a round trip
                continue
            replies += depth
            if now - began >= duration_s:
                return replies / (now - began)


def throughput(targets: Sequence[Target], *, depth: int, duration_s: float) -> float:
    """Replies per second of the requests, one connection each to its port, ``depth`` in flight
    on each."""
    warmup_s = min(0.5, duration_s / 4)
    if len(targets) == 1:
        port, request = targets[0]
        return _measure_one(port, request, depth, warmup_s, duration_s)
    done, elapsed, errors, first = asyncio.run(_measure(targets, depth, warmup_s, duration_s))
    if errors:
        raise RuntimeError(f"{errors} error replies, e.g. {first}")
    return done / elapsed


@dataclasses.dataclass(frozen=True)
class CeilingSizes:
    duration_s: float


def run(
    servers: RedisServers, client: redis.Redis, nodes: list[redis.Redis], sizes: CeilingSizes
) -> dict[str, float]:
    """Every ceiling once; keys are cleaned up after each. ``client`` serves one-slot commands,
    ``nodes`` are one plain client per primary (scripts are loaded on each)."""
    out: dict[str, float] = {}
    request = command("XADD", "ceiling:xadd", "*", "e", "delta", "d", PAYLOAD)
    xadd = [(servers.port_for("ceiling:xadd"), request)]
    out["redis.xadd_1client"] = throughput(xadd, depth=1, duration_s=sizes.duration_s)
    client.delete("ceiling:xadd")
    out["redis.xadd_pipelined16"] = throughput(xadd, depth=16, duration_s=sizes.duration_s)
    client.delete("ceiling:xadd")

    fenced, append = "", ""
    for node in nodes:  # the same SHA on every node
        fenced = str(node.script_load(FENCED_XADD))
        append = str(node.script_load(script_source("append_events")))

    def fenced_request(i: int) -> Target:
        lease, events = f"ceiling:{{{i}}}:lease", f"ceiling:{{{i}}}:events"
        client.hset(lease, "token", TOKEN)
        request = command("EVALSHA", fenced, 2, lease, events, TOKEN, "delta", PAYLOAD)
        return servers.port_for(lease), request

    def append_request(i: int) -> Target:
        lease, events, turn = (f"ceiling:{{{i}}}:{k}" for k in ("lease", "events", "turn"))
        client.hset(lease, mapping={"token": TOKEN, "base": 0})  # as claim_lease leaves it
        client.hset(turn, "status", "streaming")
        # The k-th append names the k events before it, as the broker's writer does.
        return servers.port_for(lease), lambda k: command(
            "EVALSHA", append, 3, lease, events, turn, TOKEN, 10**9, k, "delta", PAYLOAD
        )

    for name, build in (("lua_fenced_xadd", fenced_request), ("append_script", append_request)):
        for clients in (1, MANY_CLIENTS):
            targets = [build(i) for i in range(clients)]
            value = throughput(targets, depth=1, duration_s=sizes.duration_s)
            out[f"redis.{name}_{clients}client{'s' if clients > 1 else ''}"] = value
            delete_matching(nodes, "ceiling:*")
    return out
