"""The broker as a process: killed mid-answer, embedded server lifecycle, start-up checks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from broker.embedded_redis import EmbeddedRedis
from tests.conftest import BrokerProcess, spawn_broker
from tests.helpers import get_turn, read_sse, start_turn, text_of, wait_until

# Brokers of its own processes, on the server the session names: a test of the server too.
pytestmark = pytest.mark.server

Spawn = Callable[[dict[str, str]], BrokerProcess]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; it only waits for its parent to reap it.
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(") ")[-1][:1] != "Z"


def test_sigkill_mid_generation_loses_no_acknowledged_event(
    broker_processes: Spawn, redis_url: str
) -> None:
    env = {
        "BROKER_REDIS_URL": redis_url,
        "BROKER_KEY_PREFIX": f"kill{os.getpid()}",
        "BROKER_LEASE_TTL_MS": "500",
        "BROKER_JOB_RECLAIM_IDLE_MS": "1000",
    }
    first = broker_processes(env)
    turn = start_turn(first.base_url, turn_id="killed", tokens=500, tokens_per_s=50)
    seen = read_sse(first.base_url, turn["stream_id"], stop_after=10).events
    first.stop(signal.SIGKILL)
    second = broker_processes(env)
    serving = time.monotonic()
    replay = read_sse(second.base_url, turn["stream_id"], timeout=20)
    # Taken over within lease + reclaim idle + one reclaim sweep of the new process. Counted
    # from when it serves: how long a process takes to start is the machine's, not the broker's.
    assert time.monotonic() - serving < 10
    assert replay.events[: len(seen)] == seen
    # The new process's worker reclaims the job; text already reached readers, so the turn is
    # interrupted, never silently continued or restarted.
    end = replay.events[-1]
    assert end.event == "end"
    assert end.data == {"attempt": 1, "status": "interrupted", "reason": "worker_lost"}
    state = httpx.get(f"{second.base_url}/v1/turns/killed", timeout=5).json()
    assert state["status"] == "interrupted"
    assert state["attempts"][0]["status"] == "partial"


def embedded_pid(proc: BrokerProcess) -> tuple[int, Path]:
    line = next(line for line in proc.lines if "embedded redis started" in line)
    pid = int(re.search(r"pid=(\d+)", line).group(1))  # type: ignore[union-attr]
    socket_path = Path(re.search(r"socket=(\S+)", line).group(1))  # type: ignore[union-attr]
    return pid, socket_path


def no_redis_env() -> dict[str, str]:
    os.environ.pop("BROKER_REDIS_URL", None)
    return {"BROKER_REDIS_URL": ""}


@pytest.mark.single_node("the embedded server is one server by design")
def test_embedded_server_starts_and_stops_with_the_broker(broker_processes: Spawn) -> None:
    proc = broker_processes(no_redis_env())
    pid, socket_path = embedded_pid(proc)
    assert alive(pid)
    assert socket_path.exists()
    turn = start_turn(proc.base_url, tokens=3, tokens_per_s=0)
    assert read_sse(proc.base_url, turn["stream_id"]).events[-1].event == "end"
    assert proc.stop(signal.SIGTERM) == 0
    wait_until(lambda: not alive(pid), 10)
    assert not socket_path.parent.exists(), "the private directory is removed"


@pytest.mark.single_node("the embedded server is one server by design")
def test_embedded_server_dies_with_a_killed_broker(broker_processes: Spawn) -> None:
    proc = broker_processes(no_redis_env())
    pid, _ = embedded_pid(proc)
    assert alive(pid)
    proc.stop(signal.SIGKILL)
    wait_until(lambda: not alive(pid), 10)


@pytest.mark.single_node("the embedded server is one server by design")
def test_embedded_server_logs_its_binary_and_version(broker_processes: Spawn) -> None:
    proc = broker_processes(no_redis_env())
    started = next(line for line in proc.lines if "embedded redis started" in line)
    assert re.search(r"binary=\S+server", started)
    assert re.search(r"version=(Valkey|Redis) \d+\.\d+", started)


@pytest.fixture
def terminal_broker() -> Iterator[BrokerProcess]:
    """``broker serve`` on its embedded server, a foreground job of a terminal of its own."""
    proc = spawn_broker(no_redis_env(), own_group=True)
    try:
        yield proc
    finally:
        if proc.process.poll() is None:
            os.killpg(proc.process.pid, signal.SIGKILL)  # the group this test started
            proc.process.wait(timeout=10)


class Follower:
    """An SSE reader following a stream in a thread, keeping every line it got."""

    def __init__(self, base_url: str, stream_id: str) -> None:
        self.lines: list[str] = []
        url = f"{base_url}/v1/streams/{stream_id}"
        self.thread = threading.Thread(target=self._follow, args=(url,), daemon=True)
        self.thread.start()

    def _follow(self, url: str) -> None:
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("GET", url, timeout=httpx.Timeout(60)) as response,
        ):
            self.lines.extend(response.iter_lines())

    def events(self) -> list[str]:
        return [line.removeprefix("event: ") for line in self.lines if line.startswith("event: ")]


def ctrl_c(proc: BrokerProcess) -> None:
    """What a terminal does on Ctrl-C: SIGINT to every process of the foreground group."""
    os.killpg(proc.process.pid, signal.SIGINT)


@pytest.mark.single_node("the embedded server is one server by design")
def test_ctrl_c_drains_on_the_embedded_server_then_stops_it(
    terminal_broker: BrokerProcess,
) -> None:
    # Regression (issue 34, finding 9): the embedded server shared the broker's process group,
    # so a terminal's Ctrl-C stopped it first: the drain met a dead Redis for 8.7 s of
    # warnings, and a live reader's stream ended without its `end`.
    proc = terminal_broker
    pid, socket_path = embedded_pid(proc)
    turn = start_turn(proc.base_url, tokens=30, tokens_per_s=15)  # ends inside the drain
    follower = Follower(proc.base_url, turn["stream_id"])
    wait_until(lambda: "delta" in follower.events(), 10)
    signalled = len(proc.lines)
    ctrl_c(proc)
    assert proc.process.wait(timeout=30) == 0
    proc.output_read()  # (the last lines may still be on their way when the process is gone)
    follower.thread.join(10)
    assert follower.events()[-1] == "end"
    end = follower.lines.index("event: end")
    assert follower.lines[end + 1] == 'data: {"attempt":1,"status":"complete","reason":null}'
    after = proc.lines[signalled:]
    assert not [line for line in after if "WARNING" in line or "Traceback" in line], after
    ended = next(i for i, line in enumerate(after) if "ended complete" in line)
    stopped = next(i for i, line in enumerate(after) if "embedded redis stopped" in line)
    assert ended < stopped, "the embedded server stopped before the drain was over"
    wait_until(lambda: not alive(pid), 10)
    assert not socket_path.parent.exists(), "the private directory is removed"


@pytest.mark.single_node("the embedded server is one server by design")
def test_a_second_ctrl_c_exits_at_once_without_a_traceback(
    terminal_broker: BrokerProcess,
) -> None:
    # Regression (issue 34, finding 9): a second Ctrl-C during the drain printed a traceback.
    proc = terminal_broker
    pid, socket_path = embedded_pid(proc)
    turn = start_turn(proc.base_url, tokens=500, tokens_per_s=10)  # outlasts the drain's 10 s
    follower = Follower(proc.base_url, turn["stream_id"])
    wait_until(lambda: "delta" in follower.events(), 10)
    ctrl_c(proc)
    wait_until(lambda: any("draining:" in line for line in proc.lines), 10)
    ctrl_c(proc)
    assert proc.process.wait(timeout=5) == 130  # the drain would take 10 s
    proc.output_read()
    output = "".join(proc.lines)
    assert "Traceback" not in output
    assert "broker: interrupted again: exiting without the drain" in output
    wait_until(lambda: not alive(pid), 10)
    assert not socket_path.parent.exists(), "the private directory is removed"


def test_unreachable_redis_url_fails_with_one_clear_line() -> None:
    env = {**os.environ, "BROKER_REDIS_URL": "redis://127.0.0.1:1/0"}
    result = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("broker: cannot connect to Redis at redis://127.0.0.1:1/0")
    assert "Traceback" not in result.stderr


def test_bad_settings_fail_with_one_clear_line() -> None:
    env = {
        **os.environ,
        "BROKER_REDIS_URL": "http://user:hunter2@example.invalid",
        "BROKER_PORT": "0",
    }
    result = subprocess.run(
        [sys.executable, "-m", "broker", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "broker: BROKER_REDIS_URL must start with redis://, rediss://, unix://, "
        "redis+cluster:// or rediss+cluster://, "
        "not http:// (the URL is not repeated: it may hold a password)"
    )
    assert "hunter2" not in result.stderr


@pytest.mark.single_node("sets an evicting policy on a server of its own")
def test_an_evicting_redis_gets_a_loud_warning(broker_processes: Spawn) -> None:
    import redis

    with EmbeddedRedis(os.environ.get("BROKER_TEST_REDIS_SERVER") or None) as server:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        proc = broker_processes({"BROKER_REDIS_URL": server.url})
        warning = wait_until(
            lambda: next((line for line in proc.lines if "maxmemory-policy" in line), None), 5
        )
        assert "WARNING" in warning
        assert "allkeys-lru" in warning
        metrics = httpx.get(f"{proc.base_url}/metrics", timeout=5).text
        assert "broker_redis_eviction_policy_safe 0.0" in metrics
        proc.stop()


def test_sigterm_drains_then_interrupts_running_generations(
    broker_processes: Spawn, redis_url: str
) -> None:
    env = {
        "BROKER_REDIS_URL": redis_url,
        "BROKER_KEY_PREFIX": f"drain{os.getpid()}",
        # Room for the short turn on a loaded machine; the long one needs 25 s.
        "BROKER_DRAIN_TIMEOUT_S": "2",
    }
    proc = broker_processes(env)
    long = start_turn(proc.base_url, turn_id="long", tokens=500, tokens_per_s=20)
    short = start_turn(proc.base_url, turn_id="short", tokens=4, tokens_per_s=20)
    seen = read_sse(proc.base_url, long["stream_id"], stop_after=3).events
    # Both are running (a turn not started yet would be handed back, not drained).
    read_sse(proc.base_url, short["stream_id"], stop_after=2)
    assert proc.stop(signal.SIGTERM) == 0
    # The short turn finished inside the grace period; the long one was interrupted.
    after = spawn_reader(env, broker_processes)
    short_events = read_sse(after, short["stream_id"]).events
    assert short_events[-1].data["status"] == "complete"
    long_events = read_sse(after, long["stream_id"]).events
    assert long_events[: len(seen)] == seen
    assert long_events[-1].data == {"attempt": 1, "status": "interrupted", "reason": "shutdown"}


def test_sigterm_hands_back_a_generation_that_delivered_nothing_yet(
    broker_processes: Spawn, redis_url: str
) -> None:
    # A generation stopped by a shutdown before its first delta is not ended: the next worker
    # takes it over and retries it silently, as after a crash before the first delta.
    env = {
        "BROKER_REDIS_URL": redis_url,
        "BROKER_KEY_PREFIX": f"handback{os.getpid()}",
        "BROKER_DRAIN_TIMEOUT_S": "0.2",
        "BROKER_JOB_RECLAIM_IDLE_MS": "60000",  # the hand-back, not idling, makes it reclaimable
    }
    first = broker_processes(env)
    turn = start_turn(
        first.base_url,
        turn_id="slow-start",
        tokens=12,
        tokens_per_s=0,
        first_delta_after_ms=60_000,
    )
    wait_until(lambda: get_turn(first.base_url, "slow-start")["status"] == "streaming", 10)
    assert first.stop(signal.SIGTERM) == 0
    assert any("handed back" in line for line in first.lines)
    second = broker_processes(env)  # reclaims as it starts
    events = read_sse(second.base_url, turn["stream_id"]).events
    assert [e.event for e in events].count("end") == 1
    assert events[-1].data == {"attempt": 1, "status": "complete", "reason": None}
    whole = read_sse(second.base_url, turn["stream_id"], offset="-1").events
    assert text_of(whole) == get_turn(second.base_url, "slow-start")["canonical"]["text"]
    assert len([e for e in whole if e.event == "delta"]) == 12


def spawn_reader(env: dict[str, str], spawn: Spawn) -> str:
    """An API-only process on the same Redis, to read what the stopped one left."""
    return spawn({**env, "BROKER_ROLE": "api"}).base_url
