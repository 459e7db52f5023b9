"""``broker serve --workers N``: N broker processes on one port, supervised.

The supervisor binds the port once and starts N processes (``python -m broker serve``) that
inherit the listening socket: the kernel hands each new connection to one of them, and the
connections a process had not yet taken when it died wait in the socket's queue for the others.
Without ``BROKER_REDIS_URL`` the supervisor starts the embedded server first and hands its URL to
every process. Each process is a whole broker (its own fan-out, generation worker and pools);
what they share lives in Redis, as it does between brokers on several machines. Their metrics
are summed across processes through prometheus_client's multiprocess mode, in a private
directory the supervisor makes (see :mod:`broker.metrics`).

Supervision: a process that exits while the broker runs is started again, after a pause that
grows while processes keep dying young (a start-up that keeps failing does not spin). SIGTERM
or SIGINT drains every process, as a single broker drains, and the supervisor exits 0 when each
of them did; a second SIGINT stops them at once (exit 130, as a single broker). The processes
get SIGTERM if the supervisor itself is killed, and so does the embedded server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from types import FrameType
from typing import Final

from prometheus_client.multiprocess import mark_process_dead

from broker.embedded_redis import EmbeddedRedis, die_with_parent
from broker.settings import MAX_WORKERS, Settings

log = logging.getLogger("broker")

# A process that ran less than this before it exited died young: the next start waits.
YOUNG_S: Final = 10.0
FIRST_PAUSE_S: Final = 0.5
LONGEST_PAUSE_S: Final = 30.0
# How long start-up may take before the supervisor gives up on it.
STARTUP_S: Final = 60.0
# The listening socket's queue: connections that wait for a process to take them.
BACKLOG: Final = 2_048


def worker_count(settings: Settings) -> int:
    """``BROKER_WORKERS`` as a number: ``auto`` is the cores this process may run on."""
    if settings.workers != "auto":
        return int(settings.workers)
    if hasattr(os, "sched_getaffinity"):
        return min(MAX_WORKERS, len(os.sched_getaffinity(0)))
    return min(MAX_WORKERS, os.cpu_count() or 1)


def pause_after(young_deaths: int) -> float:
    """How long to wait before starting a process again, after ``young_deaths`` processes in a
    row died young: none after a process that ran a while, then doubling up to a ceiling."""
    if young_deaths <= 0:
        return 0.0
    return min(LONGEST_PAUSE_S, FIRST_PAUSE_S * 2.0 ** (young_deaths - 1))


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every process serves (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


@dataclasses.dataclass(slots=True)
class _Process:
    popen: subprocess.Popen[bytes]
    ready_pipe: int  # read end: a line when the process serves; -1 once read or gone
    started: float
    ready: bool = False


class Supervisor:
    """Runs ``count`` broker processes on one socket until a signal drains them."""

    def __init__(self, settings: Settings, count: int, environ: Mapping[str, str]) -> None:
        self._settings = settings
        self._count = count
        self._environ = dict(environ)
        self._processes: list[_Process] = []
        self._signals: list[int] = []
        self._selector = selectors.DefaultSelector()
        self._young_deaths = 0
        self._restart_at: float | None = None
        self._metrics_dir = ""
        self._listener: socket.socket | None = None

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT; the exit code (0: every process drained)."""
        embedded: EmbeddedRedis | None = None
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        previous = {
            sig: signal.signal(sig, self._on_signal)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
        }
        old_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        self._selector.register(wake_read, selectors.EVENT_READ, None)
        try:
            if self._settings.redis_url is None:
                embedded = EmbeddedRedis(self._settings.redis_server)
                self._environ["BROKER_REDIS_URL"] = embedded.start()
                log.info("using embedded %s (%s)", embedded.version, embedded.binary)
            self._metrics_dir = tempfile.mkdtemp(prefix="broker-metrics-")
            self._environ["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir
            self._listener = listen(self._settings.host, self._settings.port)
            return self._serve(wake_read)
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for process in self._processes:
                _stop_now(process)
                _close_pipe(self._selector, process)
            self._selector.close()
            os.close(wake_read)
            os.close(wake_write)
            if self._listener is not None:
                self._listener.close()
            if embedded is not None:
                embedded.stop()
            if self._metrics_dir:
                shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGCHLD:
            self._signals.append(sig)

    def _serve(self, wake: int) -> int:
        for _ in range(self._count):
            self._start()
        deadline = time.monotonic() + STARTUP_S
        while not all(p.ready for p in self._processes):
            if self._signals:
                return self._drain(wake)
            if any(p.popen.poll() is not None for p in self._processes):
                log.error("a broker process failed to start; stopping the others")
                return 1
            if time.monotonic() > deadline:
                log.error("the broker processes did not start within %.0f s", STARTUP_S)
                return 1
            self._wait(wake, 1.0)
        assert self._listener is not None
        host, port = self._listener.getsockname()[:2]
        shown = f"[{host}]" if ":" in str(host) else host
        print(f"broker serving on http://{shown}:{port} ({self._count} processes)", flush=True)
        while not self._signals:
            self._supervise()
            self._wait(wake, self._next_timeout())
        return self._drain(wake)

    def _start(self) -> None:
        assert self._listener is not None
        ready_read, ready_write = os.pipe()
        listener = self._listener.fileno()
        command = [sys.executable, "-m", "broker", "serve", "--listen-fd", str(listener)]
        command += ["--ready-fd", str(ready_write)]
        popen = subprocess.Popen(
            command,
            env={**self._environ, "BROKER_WORKERS": "1"},
            pass_fds=(listener, ready_write),
            start_new_session=True,  # signals come from the supervisor, not the terminal
            preexec_fn=die_with_parent,
        )
        os.close(ready_write)
        process = _Process(popen, ready_read, time.monotonic())
        self._processes.append(process)
        self._selector.register(ready_read, selectors.EVENT_READ, process)

    def _wait(self, wake: int, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    os.read(wake, 512)
                continue
            process: _Process = key.data
            line = os.read(key.fd, 64)
            _close_pipe(self._selector, process)
            process.ready = line.startswith(b"ready")
            if process.ready and self._young_deaths:
                log.info("broker process %d serves again", process.popen.pid)

    def _next_timeout(self) -> float:
        if self._restart_at is None:
            return 5.0
        return max(0.0, self._restart_at - time.monotonic())

    def _supervise(self) -> None:
        """Start again what died (after the pause its young deaths call for)."""
        now = time.monotonic()
        for process in list(self._processes):
            code = process.popen.poll()
            if code is None:
                continue
            self._forget(process)
            lived = now - process.started
            self._young_deaths = self._young_deaths + 1 if lived < YOUNG_S else 0
            pause = pause_after(self._young_deaths)
            log.warning(
                "broker process %d exited with code %d after %.1f s; starting another in %.1f s",
                process.popen.pid,
                code,
                lived,
                pause,
            )
            if self._restart_at is None:
                self._restart_at = now + pause
        if self._restart_at is not None and now >= self._restart_at:
            self._restart_at = None
            while len(self._processes) < self._count:
                self._start()

    def _forget(self, process: _Process) -> None:
        self._processes.remove(process)
        _close_pipe(self._selector, process)
        mark_process_dead(process.popen.pid, self._metrics_dir)  # type: ignore[no-untyped-call]

    def _drain(self, wake: int) -> int:
        """Drain every process; a second SIGINT stops them at once."""
        log.info("draining %d broker processes", len(self._processes))
        for process in self._processes:
            _signal(process, signal.SIGTERM)
        handled = len(self._signals)
        deadline = time.monotonic() + self._settings.drain_timeout_s + 20
        interrupted = False
        while any(p.popen.poll() is None for p in self._processes):
            if len(self._signals) > handled:
                handled = len(self._signals)
                if signal.SIGINT in self._signals[handled - 1 :]:
                    interrupted = True
                    for process in self._processes:
                        _signal(process, signal.SIGINT)
            if time.monotonic() > deadline:
                log.warning("broker processes still running after the drain; killing them")
                deadline = float("inf")
                for process in self._processes:
                    _signal(process, signal.SIGKILL)
            self._wait(wake, 0.5)
        if interrupted:
            return 130
        codes = [p.popen.returncode for p in self._processes]
        return 0 if all(code == 0 for code in codes) else 1


def _close_pipe(selector: selectors.BaseSelector, process: _Process) -> None:
    if process.ready_pipe < 0:
        return
    with contextlib.suppress(KeyError, ValueError):
        selector.unregister(process.ready_pipe)
    os.close(process.ready_pipe)
    process.ready_pipe = -1


def _signal(process: _Process, sig: int) -> None:
    if process.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.popen.send_signal(sig)


def _stop_now(process: _Process) -> None:
    """On the way out: no process outlives the supervisor."""
    if process.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.popen.kill()
        process.popen.wait()


def serve_workers(settings: Settings, environ: Mapping[str, str]) -> int:
    """``broker serve`` with ``BROKER_WORKERS`` above 1; the exit code."""
    return Supervisor(settings, worker_count(settings), environ).run()
