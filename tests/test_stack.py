"""The compose stack, up and watched: every dashboard panel lit, alerts delivered, a worker lost.

Runs when BROKER_TEST_STACK is set (scripts/image-ci sets it, with the images built and Compose
v2 installed); otherwise every test here is skipped. The stack is compose.yaml with
compose.host.yaml (the host's network: CI's dockerd has no bridge) and tests/stack/compose.ci.yaml
(this machine's images, one-second scrapes, the rules' durations shortened, a receiver that
records what Alertmanager sends). The dashboards' queries are read from grafana/dashboards.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import get_turn, read_sse, start_turn, text_of, wait_final, wait_until
from tests.test_grafana import RULES, all_dashboard_queries

if not os.environ.get("BROKER_TEST_STACK"):
    pytest.skip(
        "BROKER_TEST_STACK is not set: scripts/image-ci brings the stack up and runs these",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parent.parent
DOCKER = os.environ.get("DOCKER") or shutil.which("docker") or "docker"
PROJECT = "broker-ci-stack"
FILES = ("compose.yaml", "compose.host.yaml", "tests/stack/compose.ci.yaml")
APIS = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
PROMETHEUS = "http://127.0.0.1:9090"
RECEIVER = "http://127.0.0.1:9095"
# compose.host.yaml's ports (Redis, the brokers, Prometheus, Alertmanager) and the receiver's.
PORTS = (6379, 8001, 8002, 8003, 9090, 9093, 9095)
# The rules' durations divided by this: 5m windows become 5 s, a 10m `for` 10 s.
SHORTEN = 60
# Grafana's own variables, as a dashboard opened on "last 5 minutes" would fill them in.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__range": "5m",
    "$job": "broker",
    "$instance": ".*",
}
# Histograms every load below feeds: their quantiles must be numbers, not NaN.
MEASURED = ("broker_append_seconds", "broker_delivery_lag_seconds", "broker_upstream_first_token")


def compose(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    files = [arg for name in FILES for arg in ("-f", name)]
    done = subprocess.run(
        [DOCKER, "compose", "-p", PROJECT, *files, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"docker compose {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def shortened(text: str) -> str:
    """The rule file with every duration (range windows and ``for:``) divided by SHORTEN."""

    def seconds(match: re.Match[str]) -> str:
        number, unit = int(match["number"]), match["unit"]
        total = number * {"s": 1, "m": 60, "h": 3600}[unit]
        return f"{match['before']}{max(1, total // SHORTEN)}s{match['after']}"

    text = re.sub(r"(?P<before>\[)(?P<number>\d+)(?P<unit>[smh])(?P<after>\])", seconds, text)
    return re.sub(r"(?P<before>\bfor: )(?P<number>\d+)(?P<unit>[smh])(?P<after>\s)", seconds, text)


def test_the_rules_are_shortened_not_rewritten() -> None:
    original = RULES.read_text()
    short = shortened(original)
    for expected in ("[5s]", "[15s]", "for: 10s"):
        assert expected in short
    assert re.sub(r"\d+[smh]\b", "D", short) == re.sub(r"\d+[smh]\b", "D", original)


def busy(port: int) -> bool:
    with socket.socket() as probe:
        # As the servers bind: a port that only has connections closing is free to them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    taken = [port for port in PORTS if busy(port)]
    assert not taken, f"the stack's ports {taken} are in use on this machine"
    with tempfile.TemporaryDirectory(prefix="broker-stack-rules-") as rules:
        Path(rules, "broker.rules.yml").write_text(shortened(RULES.read_text()))
        os.chmod(rules, 0o755)
        env = {"BROKER_STACK_RULES": rules}
        os.environ.update(env)
        try:
            compose("up", "--detach", "--no-build", "--wait", "--wait-timeout", "120", env=env)
            wait_until(lambda: targets_up() == 3, timeout=30, interval=0.2)
            yield
        finally:
            print(compose("logs", "--no-color", "--tail", "40", env=env))
            compose("down", "--volumes", "--timeout", "30", env=env)
            os.environ.pop("BROKER_STACK_RULES", None)


def prometheus(expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{PROMETHEUS}/api/v1/query", params={"query": expr}, timeout=10)
    assert response.status_code == 200, response.text
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


def targets_up() -> int:
    try:
        return sum(float(s["value"][1]) == 1 for s in prometheus('up{job="broker"}'))
    except httpx.TransportError:
        return 0


def received() -> list[dict[str, Any]]:
    """Every alert the receiver was sent, flattened from Alertmanager's groups, in order."""
    payloads = httpx.get(f"{RECEIVER}/alerts", timeout=5).json()
    return [alert for payload in payloads for alert in payload["alerts"]]


def grafana_query(expr: str) -> str:
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda item: -len(item[0])):
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    return expr


def test_compose_v2_accepts_every_compose_file() -> None:
    version = subprocess.run(
        [DOCKER, "compose", "version", "--short"], capture_output=True, text=True, check=True
    ).stdout
    assert version.strip().lstrip("v").startswith("2."), version
    for files in (
        ["compose.yaml"],
        ["compose.yaml", "compose.host.yaml"],
        ["compose.cluster.yaml"],
    ):
        flags = [arg for name in files for arg in ("-f", name)]
        done = subprocess.run(
            [DOCKER, "compose", *flags, "config", "--quiet"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, f"{files}: {done.stderr}"


def run_load() -> None:
    """Turns through both API replicas: plain ones, duplicates, resumed reads, live reads and a
    stopped one."""
    for number in range(12):
        api = APIS[number % 2]
        turn = start_turn(api, f"load-{number}", tokens=8, tokens_per_s=0, seed=number)
        start_turn(api, f"load-{number}", turn_id=turn["turn_id"], tokens=8, tokens_per_s=0,
                   seed=number)  # fmt: skip
        cut = read_sse(APIS[0], turn["stream_id"], stop_after=3)
        read_sse(APIS[1], turn["stream_id"], last_event_id=cut.last_id)
    for number in range(4):  # read live, as they are generated: the delivery lag
        turn = start_turn(APIS[number % 2], f"live-{number}", tokens=20, tokens_per_s=50)
        assert read_sse(APIS[1 - number % 2], turn["stream_id"]).ended_by_server
    slow = start_turn(APIS[0], "load-stop", tokens=200, tokens_per_s=20)
    httpx.post(f"{APIS[1]}/v1/turns/{slow['turn_id']}/cancel", timeout=10)
    wait_final(APIS[0], slow["turn_id"])


@pytest.mark.timeout(300)  # the stack comes up (at most 2 minutes) before it
def test_a_load_lights_every_dashboard_panel(stack: None) -> None:
    run_load()
    queries = all_dashboard_queries()
    assert len(queries) > 40

    def dark() -> list[str]:
        found: list[str] = []
        for where, expr in queries:
            result = prometheus(grafana_query(expr))
            if not result:
                found.append(f"{where}: no data")
            elif any(name in expr for name in MEASURED) and not any(
                math.isfinite(float(series["value"][1])) for series in result
            ):
                found.append(f"{where}: only NaN")
        return found

    try:
        wait_until(lambda: not dark(), timeout=30, interval=1)
    except AssertionError:
        pytest.fail("panels without data:\n" + "\n".join(dark()))


WANTED = ("BrokerRetryRatioHigh", "BrokerAttemptsExhausted")
# From the burst's start: the rules' shortened `for` is 10 s, and evaluations are every second.
FIRE_WITHIN_S = 90
RESOLVE_WITHIN_S = 90


def alert_states() -> dict[str, set[str]]:
    """Alert name -> the statuses (firing, resolved) the receiver was sent for it."""
    seen: dict[str, set[str]] = {}
    for alert in received():
        seen.setdefault(alert["labels"]["alertname"], set()).add(alert["status"])
    return seen


def all_reached(status: str) -> bool:
    states = alert_states()
    return all(status in states.get(name, set()) for name in WANTED)


def failing_turns(count: int, first: int) -> None:
    """Turns whose first upstream call fails (one silent retry) and turns whose every allowed
    call fails (attempts exhausted), alternating, through both API replicas."""
    for number in range(first, first + count):
        fails = 1 if number % 2 else 9
        start_turn(APIS[number % 2], f"burst-{number}", tokens=3, tokens_per_s=0,
                   fail_before_first=fails)  # fmt: skip
        time.sleep(0.1)


@pytest.mark.timeout(300)  # a burst until the alerts fire, then a bounded wait for resolution
def test_upstream_failures_fire_alerts_through_alertmanager_and_they_resolve(
    stack: None,
) -> None:
    started = time.monotonic()
    sent = 0
    # The burst goes on until both alerts reached the receiver (the ratio must hold for the
    # rule's `for`), within a bound; then it stops, and both must resolve.
    while not all_reached("firing"):
        assert time.monotonic() - started < FIRE_WITHIN_S, f"not fired: {alert_states()}"
        failing_turns(10, sent)
        sent += 10
    fired_after = time.monotonic() - started
    for alert in received():
        if alert["labels"]["alertname"] in WANTED and alert["status"] == "firing":
            assert alert["labels"]["job"] == "broker"
            assert alert["labels"]["severity"] == "warning"
            for field in ("summary", "description"):
                text = alert["annotations"][field]
                assert text, field
                assert "{{" not in text, text
                assert "<no value>" not in text, text
    exhausted = [a for a in received() if a["labels"]["alertname"] == "BrokerAttemptsExhausted"]
    assert exhausted[0]["labels"]["code"] == "upstream_unavailable"
    burst_ended = time.monotonic()
    wait_until(lambda: all_reached("resolved"), timeout=RESOLVE_WITHIN_S, interval=1)
    print(f"{sent} failing turns; fired {fired_after:.0f} s after the burst began, resolved "
          f"{time.monotonic() - burst_ended:.0f} s after it ended")  # fmt: skip


@pytest.mark.timeout(300)  # the stack goes down after it
def test_a_killed_worker_hands_its_turn_over_and_the_generation_completes(stack: None) -> None:
    tokens = 60
    turn = start_turn(APIS[0], "kill-worker", tokens=tokens, tokens_per_s=10, seed=7)
    stream = f"{APIS[1]}/v1/streams/{turn['stream_id']}"

    def delivered() -> int:
        page = httpx.get(stream, params={"format": "json"}, timeout=5).json()
        return sum(event["event"] == "delta" for event in page["events"])

    wait_until(lambda: delivered() >= 5, timeout=20)
    compose("kill", "worker")
    assert get_turn(APIS[1], turn["turn_id"])["status"] == "streaming"
    compose("start", "worker")
    # The new worker process takes the job over once the lease runs out: text was delivered,
    # so the attempt ends interrupted (worker_lost) and the reader continues it.
    final = wait_final(APIS[1], turn["turn_id"], timeout=60)
    assert final["status"] == "interrupted", final
    assert final["attempts"][-1]["reason"] == "worker_lost", final
    response = httpx.post(
        f"{APIS[0]}/v1/turns/{turn['turn_id']}/attempts", json={"strategy": "continue"}, timeout=10
    )
    assert response.status_code in (200, 201, 202), response.text
    final = wait_final(APIS[1], turn["turn_id"], timeout=60)
    assert final["status"] == "complete", final
    read = read_sse(APIS[1], turn["stream_id"])
    assert read.events[-1].event == "end"
    assert read.events[-1].data["status"] == "complete"
    assert len({event.id for event in read.events}) == len(read.events)
    assert text_of(read.events)
