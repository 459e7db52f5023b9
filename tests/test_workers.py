"""``broker serve --workers N``: processes on one port, supervised, with metrics summed.

Which process takes a connection is the kernel's choice; the tests make it theirs by stopping
every other process (SIGSTOP) while a connection is opened: a stopped process takes nothing
from the shared socket, so the one left running must.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from broker.settings import MAX_WORKERS, Settings, SettingsError
from broker.workers import LONGEST_PAUSE_S, pause_after, worker_count
from tests.conftest import BrokerProcess
from tests.helpers import Read, read_sse, start_turn, wait_until

# Brokers of their own processes, on the server the session names.
pytestmark = pytest.mark.server

Spawn = Callable[[dict[str, str]], BrokerProcess]


def processes(supervisor: int) -> list[int]:
    """The broker processes a supervisor runs (its embedded server left out)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    found = []
    for pid in map(int, children):
        with contextlib.suppress(OSError):
            if b"--listen-fd" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return sorted(found)


def serving(proc: BrokerProcess, count: int) -> list[int]:
    pids: list[int] = wait_until(lambda: len(p := processes(proc.process.pid)) == count and p, 30)
    return pids


@contextlib.contextmanager
def only(pid: int, among: list[int]) -> Iterator[None]:
    """Every process of ``among`` but ``pid`` stopped: ``pid`` takes the new connections."""
    others = [other for other in among if other != pid]
    for other in others:
        os.kill(other, signal.SIGSTOP)
    try:
        yield
    finally:
        for other in others:
            os.kill(other, signal.SIGCONT)


def metric(base_url: str, name: str) -> float:
    """The sum of a metric's series as ``/metrics`` answers it."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name} ", f"{name}{{"))
    )


def viewing(base_url: str, viewers: int) -> bool:
    return metric(base_url, "broker_stream_viewers") == viewers


class Reader(threading.Thread):
    def __init__(self, base_url: str, stream_id: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.stream_id = base_url, stream_id
        self.read: Read | None = None

    def run(self) -> None:
        self.read = read_sse(self.base_url, self.stream_id, timeout=60)


def test_two_processes_on_one_port_serve_one_turns_readers_and_sum_their_metrics(
    broker_processes: Spawn,
) -> None:
    proc = broker_processes({"BROKER_WORKERS": "2"})
    assert "(2 processes)" in "".join(proc.lines)
    first, second = pids = serving(proc, 2)
    turn = start_turn(proc.base_url, tokens=100, tokens_per_s=25)  # live while readers join
    readers = []
    for pid, viewers in ((first, 1), (second, 2)):
        with only(pid, pids):
            reader = Reader(proc.base_url, turn["stream_id"])
            reader.start()
            readers.append(reader)
            # Counted by the process that took it; the scrape, answered by the same process,
            # sums every process's count.
            wait_until(functools.partial(viewing, proc.base_url, viewers), 20)
    for reader in readers:
        reader.join(60)
    a, b = (reader.read for reader in readers)
    assert a is not None
    assert b is not None
    assert a.events == b.events
    assert a.events[-1].data == {"attempt": 1, "status": "complete", "reason": None}
    # One turn was started, once: whichever process answers, the sum is the broker's.
    for pid in pids:
        with only(pid, pids):
            assert metric(proc.base_url, "broker_turns_started_total") == 1


def test_a_killed_process_is_started_again_and_its_counts_are_kept(
    broker_processes: Spawn,
) -> None:
    proc = broker_processes({"BROKER_WORKERS": "2"})
    first, second = pids = serving(proc, 2)
    with only(first, pids):
        start_turn(proc.base_url, turn_id="before", tokens=2, tokens_per_s=0)
    os.kill(first, signal.SIGKILL)
    newcomer = wait_until(lambda: set(processes(proc.process.pid)) - {first, second}, 30).pop()
    assert processes(proc.process.pid) == sorted([second, newcomer])
    wait_until(lambda: any("starting another" in line for line in proc.lines), 10)
    with only(newcomer, [second, newcomer]):
        start_turn(proc.base_url, turn_id="after", tokens=2, tokens_per_s=0)
        # The dead process's count stays in the sum: counters never go back.
        assert metric(proc.base_url, "broker_turns_started_total") == 2


def test_sigterm_drains_every_process_and_the_supervisor_exits_0(
    broker_processes: Spawn, redis_url: str
) -> None:
    env = {
        "BROKER_WORKERS": "2",
        "BROKER_REDIS_URL": redis_url,
        "BROKER_KEY_PREFIX": f"workers{os.getpid()}",
        "BROKER_DRAIN_TIMEOUT_S": "2",
    }
    proc = broker_processes(env)
    pids = serving(proc, 2)
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    name = b"PROMETHEUS_MULTIPROC_DIR="
    shared = Path(next(v for v in environ if v.startswith(name))[len(name) :].decode())
    assert shared.is_dir()
    long = start_turn(proc.base_url, turn_id="long", tokens=500, tokens_per_s=20)
    seen = read_sse(proc.base_url, long["stream_id"], stop_after=3).events
    assert proc.stop(signal.SIGTERM, timeout=40) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert not shared.exists(), "the metrics directory is removed"
    assert sum("Application shutdown complete" in line for line in proc.lines) == 2
    after = broker_processes({**env, "BROKER_WORKERS": "1", "BROKER_ROLE": "api"})
    events = read_sse(after.base_url, long["stream_id"]).events
    assert events[: len(seen)] == seen
    assert events[-1].data == {"attempt": 1, "status": "interrupted", "reason": "shutdown"}


@pytest.mark.parametrize(
    ("deaths", "pause"), [(0, 0.0), (1, 0.5), (2, 1.0), (3, 2.0), (7, 30.0), (50, 30.0)]
)
def test_a_process_that_keeps_dying_young_is_started_again_ever_more_slowly(
    deaths: int, pause: float
) -> None:
    assert pause_after(deaths) == pause
    assert pause_after(deaths) <= LONGEST_PAUSE_S


def test_workers_is_a_number_or_auto() -> None:
    assert worker_count(Settings.from_env({"BROKER_WORKERS": "3"})) == 3
    assert worker_count(Settings.from_env({})) == 1
    cores = len(os.sched_getaffinity(0))
    assert worker_count(Settings.from_env({"BROKER_WORKERS": "auto"})) == min(cores, MAX_WORKERS)
    for bad in ("0", "65", "two", "-1", "1.5"):
        with pytest.raises(SettingsError, match="BROKER_WORKERS must be auto or from 1 to 64"):
            Settings.from_env({"BROKER_WORKERS": bad})
