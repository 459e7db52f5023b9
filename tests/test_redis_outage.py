"""A Redis that goes away and comes back costs a blip, not the generations (issue 14, 3 and 4).

Each test runs its own server (the session's is shared), on a loopback port it can kill and
start again at the same address: empty, or with its append-only file (``appendfsync always``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from broker.embedded_redis import find_server_binary
from tests.conftest import BrokerProcess, RunningBroker, free_port, start_broker
from tests.helpers import read_sse, start_turn, text_of, wait_until

# Brokers of its own processes, on the server the session names: a test of the server too.
pytestmark = pytest.mark.server

Spawn = Callable[[dict[str, str]], BrokerProcess]


class RestartableRedis:
    """A server of our own that a test kills (SIGKILL) and starts again at the same address."""

    def __init__(self, directory: Path, *, aof: bool) -> None:
        self.binary = find_server_binary(os.environ.get("BROKER_TEST_REDIS_SERVER") or None)
        self.directory = directory
        self.port = free_port()
        self.aof = aof
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.aof else "no",
            "--appendfsync",
            "always",
            "--maxmemory-policy",
            "noeviction",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._accepting, timeout=10)

    def _accepting(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as probe:
                probe.sendall(b"PING\r\n")
                return probe.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def own_redis(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path, aof=getattr(request, "param", False))
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.kill()


@pytest.fixture
def brokers() -> Iterator[list[RunningBroker]]:
    """Brokers a test starts on its own server: stopped at its end."""
    started: list[RunningBroker] = []
    yield started
    for broker in started:
        broker.stop()


def ready(broker: RunningBroker | BrokerProcess) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{broker.base_url}/readyz", timeout=2).status_code == 200
    return False


def final_state(base_url: str, turn_id: str, timeout: float) -> dict[str, Any]:
    def at_rest() -> dict[str, Any] | None:
        with contextlib.suppress(httpx.HTTPError):
            state: dict[str, Any] = httpx.get(f"{base_url}/v1/turns/{turn_id}", timeout=2).json()
            if state.get("status") not in (None, "queued", "streaming"):
                return state
        return None

    state: dict[str, Any] = wait_until(at_rest, timeout=timeout, interval=0.02)
    return state


@pytest.mark.single_node("kills and restarts a server of its own")
def test_the_first_turn_after_redis_comes_back_empty_runs_at_once(
    own_redis: RestartableRedis, broker_processes: Spawn
) -> None:
    broker = broker_processes({"BROKER_REDIS_URL": own_redis.url})  # as deployed (uvloop)
    # Turns at once before the outage: the pool keeps a connection for each, all stale after.
    warm = [start_turn(broker.base_url, f"warm-{n}", tokens=20, tokens_per_s=40) for n in range(8)]
    for turn in warm:
        assert final_state(broker.base_url, turn["turn_id"], 10)["status"] == "complete"
    own_redis.kill()
    own_redis.start()  # empty: no job stream, no consumer group, no scripts
    wait_until(lambda: ready(broker), timeout=10)
    began = time.monotonic()
    turn = start_turn(broker.base_url, tokens=5, tokens_per_s=0)
    # Was ~44 s: the attempt failed on a stale pooled connection and waited for the reclaim.
    assert final_state(broker.base_url, turn["turn_id"], 10)["status"] == "complete"
    assert time.monotonic() - began < 2


class Reader(threading.Thread):
    """Reads a stream to its end as a client would: reattaching after every cut."""

    def __init__(self, base_url: str, stream_id: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.stream_id = base_url, stream_id
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.cuts = 0
        self.done = False

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while not self.done and time.monotonic() < deadline:
            headers = {"Last-Event-ID": self.events[-1][0]} if self.events else {}
            try:
                self._read(headers)
            except (httpx.HTTPError, OSError):
                self.cuts += 1
                time.sleep(0.05)  # the retry: pause a client takes before reconnecting

    def _read(self, headers: dict[str, str]) -> None:
        url = f"{self.base_url}/v1/streams/{self.stream_id}"
        with httpx.stream("GET", url, headers=headers, timeout=10) as response:
            if response.status_code == 204:
                self.done = True
                return
            if response.status_code != 200:
                raise httpx.HTTPError(f"status {response.status_code}")
            fields: dict[str, str] = {}
            for line in response.iter_lines():
                if line:
                    name, _, value = line.partition(": ")
                    fields[name] = value
                    continue
                if "data" in fields:
                    self.events.append(
                        (fields["id"], fields["event"], orjson.loads(fields["data"]))
                    )
                    if fields["event"] == "end":
                        self.done = True
                fields = {}
        raise httpx.HTTPError("cut")  # ended without its end event: reattach

    def text(self) -> str:
        return "".join(str(data["text"]) for _, kind, data in self.events if kind == "delta")


@pytest.mark.single_node("kills and restarts a server of its own")
@pytest.mark.parametrize("own_redis", [True], indirect=True, ids=["aof"])
def test_a_redis_restart_under_running_generations_interrupts_none(
    own_redis: RestartableRedis, brokers: list[RunningBroker]
) -> None:
    broker = start_broker(own_redis.url, lease_ttl_ms=6_000)
    brokers.append(broker)
    turns = [
        start_turn(broker.base_url, conversation_id=f"blip-{n}", tokens=40, tokens_per_s=10)
        for n in range(10)
    ]
    readers = [Reader(broker.base_url, turn["stream_id"]) for turn in turns]
    for reader in readers:
        reader.start()
    wait_until(lambda: all(len(reader.events) >= 5 for reader in readers), timeout=20)
    own_redis.kill()
    time.sleep(1.0)  # the outage itself: Redis is away this long (≤ 3 s)
    own_redis.start()
    for reader in readers:
        reader.join(60)
        assert reader.done
    for turn, reader in zip(turns, readers, strict=True):
        state = final_state(broker.base_url, turn["turn_id"], 20)
        assert state["status"] == "complete", state
        assert [a["status"] for a in state["attempts"]] == ["complete"]
        ids = [event_id for event_id, _, _ in reader.events]
        assert len(ids) == len(set(ids)), "an event was delivered twice"
        assert ids == sorted(ids)
        assert reader.text() == state["canonical"]["text"]
        deltas = [data for _, kind, data in reader.events if kind == "delta"]
        assert len(deltas) == 40
        uninterrupted = read_sse(broker.base_url, turn["stream_id"])  # the stored stream
        assert text_of(uninterrupted.events) == reader.text()
    assert sum(reader.cuts for reader in readers) > 0  # the readers did see the outage


def test_a_crashed_generation_is_taken_over_within_the_lease(
    broker_processes: Spawn, redis_url: str
) -> None:
    lease_ms = 2_000
    env = {
        "BROKER_REDIS_URL": redis_url,
        "BROKER_KEY_PREFIX": f"crash{os.getpid()}",
        "BROKER_LEASE_TTL_MS": str(lease_ms),
    }
    first = broker_processes(env)
    turn = start_turn(first.base_url, turn_id="crashed", tokens=500, tokens_per_s=20)
    read_sse(first.base_url, turn["stream_id"], stop_after=5)  # it streams, from `first`
    second = broker_processes(env)  # a worker that stands by
    first.stop(signal.SIGKILL)
    killed = time.monotonic()
    state = final_state(second.base_url, "crashed", timeout=30)
    # Was ~30 s: the job waited for BROKER_JOB_RECLAIM_IDLE_MS, whatever the lease said.
    assert time.monotonic() - killed < lease_ms / 1000 + 2
    assert state["status"] == "interrupted"
    assert state["attempts"][0]["reason"] == "worker_lost"
