"""The HTTP server's own floor: what an open SSE response costs uvicorn with nothing behind it.

The same uvicorn the broker runs (uvloop, httptools), serving a bare ASGI app in a process of its
own: each ``GET`` gets an SSE head and one comment, then the app waits for the client to leave.
``idle_connections`` raw-socket clients (the idle workload's, over its viewer processes) open a
connection each and stay. Measured on the server process:

* its RSS per open connection (RSS with every connection open, less before): the part of the
  idle workload's per-connection figure that no change to the broker can take away;
* its CPU per connection while they attach: the part of an attach's cost (the join workload's)
  that is the HTTP server's, before any broker code runs; and each connection's attach time
  in that storm (connect to response head), p99: what the same clients see of a server that
  does nothing else;
* its RSS once every client left and it gave memory back as the broker does (a full collection,
  then ``malloc_trim``: ``broker.memory.give_back``), over RSS before they came.

A candidate server is measured the same way beside it when it is installed: granian (a Rust
HTTP server with an ASGI interface, ``pip install granian``), serving the same app on one
worker with uvloop and a single-threaded runtime. Its figures are ``floor.granian_*``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from benchmarks.fanout import _recv, client_processes, shares
from benchmarks.figures import percentile
from benchmarks.harness import Context, Outcome
from benchmarks.idle import attach_histogram, settle, viewer_process
from benchmarks.servers import REPO, cpu_seconds, status_kib
from broker.memory import give_back

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
HEAD: Message = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")],
}
FIRST: Message = {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}


GIVE_BACK = "/give-back"  # the path that makes the server give memory back, then answers
DONE: Message = {"type": "http.response.body", "body": b"", "more_body": False}


async def app(
    scope: Scope,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """An SSE response that says one comment and stays open until its client leaves; at
    ``GIVE_BACK``, memory given back as the broker gives it, and an empty answer."""
    if scope["type"] == "lifespan":  # (granian's lifespan: nothing to start)
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    if scope["path"] == GIVE_BACK:
        give_back()
        await send({**HEAD, "headers": [(b"content-length", b"0")]})
        await send(DONE)
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
        uvicorn_figures, details = _measure(ctx, "uvicorn")
        values = {f"floor.{name}": value for name, value in uvicorn_figures.items()}
        if granian_command(0) is not None:
            granian_figures, details["granian"] = _measure(ctx, "granian")
            values |= {f"floor.granian_{name}": v for name, v in granian_figures.items()}
        return Outcome(values=values, details=details)


def granian_command(port: int) -> list[str] | None:
    """The candidate server's command for :func:`app` on ``port``; None when not installed."""
    binary = shutil.which("granian")
    if binary is None or importlib.util.find_spec("granian") is None:
        return None
    return [
        binary,
        *("--interface", "asgi", "--host", "127.0.0.1", "--port", str(port)),
        *("--loop", "uvloop", "--runtime-mode", "st", "--workers", "1", "--no-ws"),
        *("--backlog", "4096", "--backpressure", "100000", "--log-level", "warning"),
        "benchmarks.floor:app",
    ]


def _worker_pid(server: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """The process that serves: granian's worker (its only child), once it has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{server.pid}/task/{server.pid}/children") as children:
                found = children.read().split()
        except OSError:
            return server.pid
        if found:
            return int(found[0])
        time.sleep(0.05)
    return server.pid


def _measure(ctx: Context, kind: str) -> tuple[dict[str, float], dict[str, Any]]:
    """One server's floor: its figures (without the ``floor.`` prefix) and details."""
    sizes = ctx.sizes
    connections = sizes.idle_connections
    port = _free_port()
    command = (
        [sys.executable, "-m", "benchmarks.floor", "serve", str(port)]
        if kind == "uvicorn"
        else granian_command(port)
    )
    assert command is not None
    server = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
        preexec_fn=_raise_file_limit,
    )
    try:
        _wait_listening(port, server)
        pid = server.pid if kind == "uvicorn" else _worker_pid(server)
        rss_before = settle(lambda: status_kib(pid, "VmRSS"), steady_s=sizes.settle_s) / 1024
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
            time.sleep(sizes.settle_s)  # the last responses' first writes are out
            rss_loaded = status_kib(pid, "VmRSS") / 1024
            for conn in pipes:
                conn.send("measure")
            for conn in pipes:
                conn.send("stop")
            results = [_recv(conn, 120, "result")[1] for conn in pipes]
        time.sleep(sizes.settle_s)  # the server saw every client leave
        with urllib.request.urlopen(f"{base_url}{GIVE_BACK}", timeout=30) as answer:
            answer.read()
        rss_after = settle(lambda: status_kib(pid, "VmRSS"), steady_s=sizes.settle_s) / 1024
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    attached = sum(r["connections"] for r in results)
    if attached <= 0:
        raise RuntimeError(f"no connection attached to the {kind} floor server: {results}")
    figures = {
        "rss_per_connection_kib": (rss_loaded - rss_before) * 1024 / attached,
        "attach_cpu_ms_per_connection": (cpu1 - cpu0) * 1000 / attached,
        "attach_p99_ms": percentile(attach_histogram(results), 99) or 0.0,
        "rss_after_over_before": rss_after / rss_before,
    }
    details = {
        "connections": attached,
        "failed": sum(r["failed"] for r in results),
        "attach_s": round(attach_s, 2),
        "rss_mib": {
            "before": round(rss_before, 1),
            "loaded": round(rss_loaded, 1),
            "after": round(rss_after, 1),
        },
        "server_cpu_s_attaching": round(cpu1 - cpu0, 3),
    }
    return figures, details


def _raise_file_limit() -> None:
    """In the server's process: as many open files as the hard limit allows (10,000 sockets)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the bare-uvicorn floor server")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("port", type=int)
    serve(parser.parse_args().port)
