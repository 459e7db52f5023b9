"""The HTTP server's own floor: what an open SSE response costs uvicorn with nothing behind it.

The same uvicorn the broker runs (uvloop, httptools), serving a bare ASGI app in a process of its
own: each ``GET`` gets an SSE head and one comment, then the app waits for the client to leave.
``idle_connections`` raw-socket clients (the idle workload's, over its viewer processes) open a
connection each and stay. Measured on the server process:

* its RSS per open connection (RSS with every connection open, less before): the part of the
  idle workload's per-connection figure that no change to the broker can take away;
* its CPU per connection while they attach: the part of an attach's cost (the join workload's)
  that is the HTTP server's, before any broker code runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from benchmarks.fanout import _recv, client_processes, shares
from benchmarks.harness import Context, Outcome
from benchmarks.idle import settle, viewer_process
from benchmarks.servers import cpu_seconds, status_kib

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
HEAD: Message = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")],
}
FIRST: Message = {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}


async def app(
    scope: Scope,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """An SSE response that says one comment and stays open until its client leaves."""
    if scope["type"] != "http":
        return
    await send(HEAD)
    await send(FIRST)
    while (await receive())["type"] != "http.disconnect":
        pass


def serve(port: int) -> None:
    """Serve :func:`app` on loopback as the broker's server would (uvloop, httptools)."""
    import uvicorn
    import uvloop

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="none",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=4096,
    )
    uvloop.run(uvicorn.Server(config).serve())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the floor server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("the floor server did not listen in time")


class Floor:
    """``idle_connections`` SSE connections held open by a bare ASGI app on uvicorn."""

    name = "floor"
    worker_concurrency = 4  # the broker is not used

    def prepare(self, ctx: Context) -> None:
        pass

    def once(self, ctx: Context, repeat: int) -> Outcome:
        sizes = ctx.sizes
        connections = sizes.idle_connections
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.floor", "serve", str(port)],
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            _wait_listening(port, server)
            pid = server.pid
            rss_before = settle(lambda: status_kib(pid, "VmRSS"), steady_s=2) / 1024
            counts = shares(connections, max(1, sizes.viewer_processes))
            base_url = f"http://127.0.0.1:{port}"
            args = [(base_url, count) for count in counts]
            with client_processes(viewer_process, args, "bench-floor-viewers") as (pipes, _):
                for conn in pipes:
                    _recv(conn, 60, "ready")
                cpu0, began = cpu_seconds(pid), time.monotonic()
                for conn in pipes:
                    conn.send((["/sse"], sizes.idle_heartbeat_s))
                for conn in pipes:
                    _recv(conn, 300, "attached")
                cpu1, attach_s = cpu_seconds(pid), time.monotonic() - began
                time.sleep(2.0)  # the last responses' first writes are out
                rss_loaded = status_kib(pid, "VmRSS") / 1024
                for conn in pipes:
                    conn.send("measure")
                for conn in pipes:
                    conn.send("stop")
                results = [_recv(conn, 120, "result")[1] for conn in pipes]
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        attached = sum(r["connections"] for r in results)
        if attached <= 0:
            raise RuntimeError(f"no connection attached to the floor server: {results}")
        return Outcome(
            values={
                "floor.rss_per_connection_kib": (rss_loaded - rss_before) * 1024 / attached,
                "floor.attach_cpu_ms_per_connection": (cpu1 - cpu0) * 1000 / attached,
            },
            details={
                "connections": attached,
                "failed": sum(r["failed"] for r in results),
                "attach_s": round(attach_s, 2),
                "rss_mib": {"before": round(rss_before, 1), "loaded": round(rss_loaded, 1)},
                "server_cpu_s_attaching": round(cpu1 - cpu0, 3),
            },
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the bare-uvicorn floor server")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("port", type=int)
    serve(parser.parse_args().port)
