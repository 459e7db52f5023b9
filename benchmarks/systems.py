"""The three systems ``python -m benchmarks.compare`` measures, behind one small interface.

* **broker**: ``python -m broker serve`` as the other workloads start it
  (:class:`benchmarks.servers.Broker`) on a private Valkey; a stream is a turn of the simulated
  model with ``params.simulate.stamp`` (each delta's text starts with its emit time).
* **resumable-stream**: vercel/resumable-stream (pinned in ``benchmarks/anchors``) behind our
  minimal ``node:http`` route (``benchmarks/anchors/server.mjs``) on a private Valkey of the same
  binary; the route's producer stamps each delta as it makes it.
* **durable-streams**: the protocol's reference server (pinned in
  ``benchmarks/durable-reference``; it keeps streams in memory, no Redis); the producer is an
  HTTP client in a process of its own (:func:`benchmarks.compare_viewers.ds_producer`) that stamps
  each append's send time, one append in flight.

Every system is started fresh for each run of a schedule, with its own Redis, so that CPU,
memory and file descriptors are its own.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import subprocess
import threading
import time
import uuid
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import httpx

import broker
from benchmarks.compare_viewers import ds_producer
from benchmarks.comparison import Kind
from benchmarks.servers import REPO, Broker, RedisServer, ServerError, _stop, free_port
from broker.embedded_redis import die_with_parent
from broker.vocabulary import FINAL_STATUSES

ANCHORS = REPO / "benchmarks" / "anchors"
REFERENCE = REPO / "benchmarks" / "durable-reference"
QUIET_FOR_MS = 600_000  # a quiet broker turn's first delta comes after the run is over
HEARTBEAT_S = 15  # the broker's default; the anchors are given the same period


class System(Protocol):
    """One system under test, started fresh for each run of a schedule."""

    kind: Kind

    @property
    def base_url(self) -> str: ...

    @property
    def server_pid(self) -> int: ...

    @property
    def redis_pids(self) -> list[int]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def open_stream(
        self, key: str, tokens: int, pace: float, *, hold: bool = False, delay_s: float = 0.0
    ) -> str:
        """Start a generation of ``tokens`` deltas at ``pace`` a second (0: full speed), the
        first after ``delay_s``; returns the path that reads it from the start. ``hold``: keep it
        open after its last delta (where the system cannot serve a finished stream)."""
        ...

    def quiet_stream(self, key: str) -> str:
        """A live stream that says nothing for the whole run; returns its read path."""
        ...

    def wait_written(self, key: str, timeout: float) -> None:
        """Until every delta of ``key`` is written (and the stream at rest, unless held)."""
        ...

    def producer_cpu_s(self) -> float:
        """CPU of producers outside the server (Durable Streams' client) since the start."""
        ...


def _node_version() -> str:
    node = shutil.which("node")
    if node is None:
        return "not installed"
    return subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()


def _package_version(folder: Path, name: str) -> str | None:
    try:
        manifest = json.loads((folder / "node_modules" / name / "package.json").read_text())
    except (OSError, ValueError):
        return None
    return str(manifest["version"])


def _spawn_node(folder: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``node server.mjs`` in ``folder``, once it printed ``listening <url>``."""
    node = shutil.which("node")
    if node is None:
        raise ServerError("node is not on the PATH")
    process = subprocess.Popen(
        [node, "server.mjs"],
        cwd=folder,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_parent,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("listening "):
        rest = process.stdout.read() if process.poll() is not None else ""
        _stop(process, 5)
        raise ServerError(f"{folder.name}/server.mjs did not start: {line}{rest}"[:2000])
    # Keep its pipe empty (a full pipe would stall it): nothing more is expected.
    threading.Thread(target=process.stdout.read, name="node-output", daemon=True).start()
    url = line.split()[1].rstrip("/")
    return process, url


def installed(kind: Kind) -> str | None:
    """None when ``kind`` can run here, else what is missing."""
    if kind == "broker":
        return None
    if shutil.which("node") is None:
        return "node is not on the PATH"
    folder, name = (
        (ANCHORS, "resumable-stream")
        if kind == "resumable-stream"
        else (REFERENCE, "@durable-streams/server")
    )
    if _package_version(folder, name) is None:
        return f"{name} is not installed (scripts/npm-ci, or npm ci in {folder.relative_to(REPO)})"
    return None


def versions(kind: Kind, redis_version: str) -> str:
    """What the system is, in one line."""
    if kind == "broker":
        return f"broker {broker.__version__} (python -m broker serve) + {redis_version}"
    node = _node_version()
    if kind == "resumable-stream":
        rs = _package_version(ANCHORS, "resumable-stream")
        client = _package_version(ANCHORS, "redis")
        return (
            f"resumable-stream {rs} + node-redis {client} behind a node:http route "
            f"(benchmarks/anchors/server.mjs), node {node} + {redis_version}"
        )
    ds = _package_version(REFERENCE, "@durable-streams/server")
    return (
        f"@durable-streams/server {ds} (reference server, streams in memory, no Redis), "
        f"node {node}; producer: an HTTP client, one append in flight"
    )


def _get(url: str) -> dict[str, Any]:
    response = httpx.get(url, timeout=30, trust_env=False)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _until(done: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


class BrokerSystem:
    """The broker on a private Valkey (see the module)."""

    kind: Kind = "broker"

    def __init__(self, redis_binary: str | None, concurrency: int, env: dict[str, str]) -> None:
        self.redis = RedisServer(redis_binary)
        self._concurrency = concurrency
        self._env = env
        self._broker: Broker | None = None

    @property
    def _running(self) -> Broker:
        if self._broker is None:
            raise ServerError("the broker is not running")
        return self._broker

    @property
    def base_url(self) -> str:
        return self._running.base_url

    @property
    def server_pid(self) -> int:
        return self._running.pid

    @property
    def redis_pids(self) -> list[int]:
        return self.redis.pids

    def start(self) -> None:
        self.redis.start()
        self._broker = Broker(self.redis.url, concurrency=self._concurrency, env=self._env)
        self._broker.start()

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        self.redis.stop()

    def _post(self, key: str, simulate: dict[str, Any]) -> str:
        body = {
            "conversation_id": key,
            "turn_id": key,
            "messages": [{"role": "user", "content": "benchmark"}],
            "params": {"simulate": simulate},
        }
        response = httpx.post(f"{self.base_url}/v1/turns", json=body, timeout=30, trust_env=False)
        response.raise_for_status()
        return f"/v1/streams/{response.json()['stream_id']}"

    def open_stream(
        self, key: str, tokens: int, pace: float, *, hold: bool = False, delay_s: float = 0.0
    ) -> str:
        simulate = {"tokens": tokens, "tokens_per_s": pace, "stamp": True}
        if delay_s > 0:
            simulate["first_delta_after_ms"] = round(delay_s * 1000)
        return self._post(key, simulate)

    def quiet_stream(self, key: str) -> str:
        path = self._post(
            key, {"tokens": 1, "tokens_per_s": 0, "first_delta_after_ms": QUIET_FOR_MS}
        )
        url = f"{self.base_url}/v1/turns/{key}"
        _until(lambda: _get(url)["status"] == "streaming", 60, f"turn {key} is not streaming")
        return path

    def wait_written(self, key: str, timeout: float) -> None:
        url = f"{self.base_url}/v1/turns/{key}"
        _until(lambda: _get(url)["status"] in FINAL_STATUSES, timeout, f"turn {key} not at rest")

    def producer_cpu_s(self) -> float:
        return 0.0


class ResumableStreamSystem:
    """vercel/resumable-stream behind our route, on a private Valkey (see the module)."""

    kind: Kind = "resumable-stream"

    def __init__(self, redis_binary: str | None) -> None:
        self.redis = RedisServer(redis_binary)
        self._process: subprocess.Popen[str] | None = None
        self._url = ""
        self._tokens: dict[str, int] = {}

    @property
    def base_url(self) -> str:
        return self._url

    @property
    def server_pid(self) -> int:
        if self._process is None:
            raise ServerError("the resumable-stream route is not running")
        return self._process.pid

    @property
    def redis_pids(self) -> list[int]:
        return self.redis.pids

    def start(self) -> None:
        self.redis.start()
        env = {
            "REDIS_URL": f"redis://127.0.0.1:{self.redis.port}",
            "RS_PORT": str(free_port()),
            "RS_HEARTBEAT_MS": str(HEARTBEAT_S * 1000),
        }
        self._process, self._url = _spawn_node(ANCHORS, env)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            _stop(process, 5)
        self.redis.stop()

    def open_stream(
        self, key: str, tokens: int, pace: float, *, hold: bool = False, delay_s: float = 0.0
    ) -> str:
        query = f"tokens={tokens}&pace={pace:g}&delay_ms={round(delay_s * 1000)}"
        query += "&hold=1" if hold else ""
        response = httpx.post(f"{self._url}/rs/{key}?{query}", timeout=30, trust_env=False)
        response.raise_for_status()
        self._tokens[key] = tokens
        return f"/rs/{key}"

    def quiet_stream(self, key: str) -> str:
        response = httpx.post(f"{self._url}/rs/{key}?tokens=0&hold=1", timeout=30, trust_env=False)
        response.raise_for_status()
        return f"/rs/{key}"

    def wait_written(self, key: str, timeout: float) -> None:
        url = f"{self._url}/rs/{key}/state"
        tokens = self._tokens[key]

        def written() -> bool:
            state = _get(url)
            return int(state["written"]) >= tokens

        _until(written, timeout, f"stream {key} not written")

    def finish(self, key: str) -> None:
        httpx.post(f"{self._url}/rs/{key}/finish", timeout=30, trust_env=False).raise_for_status()

    def producer_cpu_s(self) -> float:
        return 0.0


@dataclasses.dataclass
class _Producer:
    process: BaseProcess
    pipe: Connection
    result: dict[str, Any] | None = None


class DurableStreamsSystem:
    """The Durable Streams reference server, fed by a producer process (see the module)."""

    kind: Kind = "durable-streams"

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._url = ""
        self._producers: dict[str, _Producer] = {}
        self._producer_cpu = 0.0

    @property
    def base_url(self) -> str:
        return self._url.rsplit("/v1/stream", 1)[0]

    @property
    def server_pid(self) -> int:
        if self._process is None:
            raise ServerError("the reference server is not running")
        return self._process.pid

    @property
    def redis_pids(self) -> list[int]:
        return []

    def start(self) -> None:
        # Its live reads wait this long before a keep-alive: the broker's heartbeat period.
        env = {"DS_PORT": str(free_port()), "DS_LONG_POLL_MS": str(HEARTBEAT_S * 1000)}
        self._process, url = _spawn_node(REFERENCE, env)
        self._url = f"{url}/v1/stream"

    def stop(self) -> None:
        for producer in self._producers.values():
            producer.process.join(timeout=5)
            if producer.process.is_alive():
                producer.process.kill()
                producer.process.join()
        self._producers.clear()
        process, self._process = self._process, None
        if process is not None:
            _stop(process, 5)

    def _create(self, key: str) -> str:
        response = httpx.put(
            f"{self._url}/{key}",
            headers={"content-type": "text/plain"},
            timeout=30,
            trust_env=False,
        )
        if response.status_code not in (200, 201):
            raise ServerError(f"PUT answered {response.status_code}: {response.text[:200]}")
        return f"/v1/stream/{key}?offset=-1&live=sse"

    def open_stream(
        self, key: str, tokens: int, pace: float, *, hold: bool = False, delay_s: float = 0.0
    ) -> str:
        path = self._create(key)
        mp = multiprocessing.get_context("spawn")
        parent, child = mp.Pipe()
        process = mp.Process(
            target=ds_producer,
            args=(child, f"{self._url}/{key}", tokens, pace, not hold, delay_s),
            name="bench-ds-producer",
            daemon=True,
        )
        process.start()
        child.close()
        if not parent.poll(60) or parent.recv() != ("ready",):
            raise ServerError("the Durable Streams producer did not start")
        parent.send("go")
        self._producers[key] = _Producer(process, parent)
        return path

    def quiet_stream(self, key: str) -> str:
        return self._create(key)

    def wait_written(self, key: str, timeout: float) -> None:
        producer = self._producers[key]
        if producer.result is None:
            if not producer.pipe.poll(timeout):
                raise TimeoutError(f"the producer of {key} did not finish in {timeout:.0f} s")
            message = producer.pipe.recv()
            if not isinstance(message, tuple) or message[0] != "result":
                raise ServerError(f"the producer of {key} sent {message!r}")
            producer.result = message[1]
            self._producer_cpu += float(message[1]["cpu_s"])
        producer.process.join(timeout=10)

    def producer_cpu_s(self) -> float:
        return self._producer_cpu


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"
