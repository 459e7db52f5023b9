"""The built container image, run: probes, a streamed turn, a resumed read, a drain on stop.

Runs when BROKER_TEST_IMAGE names a built image (scripts/image-ci builds one and sets it, with
DOCKER_HOST pointing at its own dockerd); otherwise every test here is skipped. The containers
use the host's network (``--network host``: CI's dockerd has no bridge) and a Redis-compatible
server this module starts on a free loopback port; each runs as the image's user with a
read-only root filesystem and a tmpfs on /tmp, as the deployment docs advise.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from broker.embedded_redis import find_server_binary
from tests.conftest import free_port
from tests.helpers import get_turn, read_sse, start_turn, text_of, wait_final, wait_until

IMAGE = os.environ.get("BROKER_TEST_IMAGE", "")
if not IMAGE:
    pytest.skip(
        "BROKER_TEST_IMAGE is not set: scripts/image-ci builds the image and runs these",
        allow_module_level=True,
    )

DOCKER = os.environ.get("DOCKER") or shutil.which("docker") or "docker"
LABEL = "broker-ci=image"
# docker stop's grace period for the drain test: the broker drains for BROKER_DRAIN_TIMEOUT_S
# (10 s by default), then closes its streams and exits.
GRACE_S = 30
IMAGE_USER = "broker"
IMAGE_UID = "10001"


def docker(*args: str, timeout: float = 60, check: bool = True) -> str:
    done = subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check:
        assert done.returncode == 0, f"docker {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout.strip()


@dataclasses.dataclass(frozen=True)
class Container:
    name: str
    base_url: str

    def logs(self) -> str:
        done = subprocess.run([DOCKER, "logs", self.name], capture_output=True, text=True)
        return done.stdout + done.stderr

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False


def run_container(redis_url: str, name: str, *env: str) -> Container:
    port = free_port()
    settings = (f"BROKER_REDIS_URL={redis_url}", "BROKER_HOST=127.0.0.1", f"BROKER_PORT={port}")
    flags = [f"--env={item}" for item in (*settings, *env)]
    docker(
        "run", "--detach", "--name", name, "--label", LABEL, "--network", "host",
        "--read-only", "--tmpfs", "/tmp", *flags, IMAGE,
    )  # fmt: skip
    container = Container(name, f"http://127.0.0.1:{port}")
    try:
        wait_until(container.ready, timeout=30, interval=0.1)
    except AssertionError:
        pytest.fail(f"{name} never became ready:\n{container.logs()}")
    return container


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Redis-compatible server on a loopback TCP port the containers reach."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="broker-image-redis-") as directory:
        server = subprocess.Popen(
            [find_server_binary(os.environ.get("BROKER_TEST_REDIS_SERVER")),
             "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"redis://127.0.0.1:{port}/0"
            with redis.Redis.from_url(url) as client:
                wait_until(lambda: _pings(client), timeout=10, interval=0.05)
            yield url
        finally:
            server.terminate()
            server.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture(scope="module")
def containers(redis_url: str) -> Iterator[tuple[Container, Container]]:
    """A broker doing everything and an API-only broker, on one Redis."""
    suffix = os.urandom(3).hex()
    names = [f"broker-all-{suffix}", f"broker-api-{suffix}"]
    try:
        first = run_container(redis_url, names[0])
        second = run_container(redis_url, names[1], "BROKER_ROLE=api")
        yield first, second
    finally:
        for name in names:
            docker("rm", "--force", name, check=False)


def test_the_probes_answer(containers: tuple[Container, Container]) -> None:
    for container in containers:
        assert httpx.get(f"{container.base_url}/healthz", timeout=5).json() == {"status": "ok"}
        assert httpx.get(f"{container.base_url}/readyz", timeout=5).status_code == 200


def test_it_runs_as_the_image_user_on_a_read_only_root(
    containers: tuple[Container, Container],
) -> None:
    name = containers[0].name
    assert docker("inspect", "--format", "{{.Config.User}}", name) == IMAGE_USER
    assert docker("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", name) == "true"
    assert docker("exec", name, "id", "-u") == IMAGE_UID
    refused = subprocess.run(
        [DOCKER, "exec", name, "touch", "/opt/broker/written"], capture_output=True, timeout=30
    )
    assert refused.returncode != 0
    assert b"Read-only file system" in refused.stderr


def test_the_image_has_no_compiler_pip_or_package_lists() -> None:
    found = docker(
        "run", "--rm", "--network", "host", "--entrypoint", "sh", IMAGE, "-c",
        "command -v gcc cc pip pip3; ls /var/lib/apt/lists; ls /root/.cache 2>/dev/null; true",
    )  # fmt: skip
    assert found == ""


def test_a_turn_streams_to_its_end(containers: tuple[Container, Container]) -> None:
    first, second = containers
    turn = start_turn(first.base_url, "image-1", tokens=12, tokens_per_s=0, seed=1)
    read = read_sse(second.base_url, turn["stream_id"])
    assert read.ended_by_server
    assert read.events[-1].event == "end"
    assert read.events[-1].data["status"] == "complete"
    # The other tests may run after this one: the container starts again, as a restart would.
    docker("start", first.name)
    wait_until(first.ready, timeout=30, interval=0.1)
    assert sum(event.event == "delta" for event in read.events) == 12


def test_a_reader_cut_and_resumed_through_the_other_container_sees_no_gap(
    containers: tuple[Container, Container],
) -> None:
    first, second = containers
    turn = start_turn(first.base_url, "image-2", tokens=30, tokens_per_s=60, seed=2)
    cut = read_sse(first.base_url, turn["stream_id"], stop_after=6)
    assert not cut.ended_by_server
    rest = read_sse(second.base_url, turn["stream_id"], last_event_id=cut.last_id)
    assert rest.ended_by_server
    whole = read_sse(first.base_url, turn["stream_id"])
    assert [e.id for e in cut.events + rest.events] == [e.id for e in whole.events]
    assert text_of(cut.events + rest.events) == text_of(whole.events)
    assert whole.events[-1].data["status"] == "complete"


def test_healthcheck_reports_healthy(containers: tuple[Container, Container]) -> None:
    name = containers[0].name
    wait_until(
        lambda: docker("inspect", "--format", "{{.State.Health.Status}}", name) == "healthy",
        timeout=40,
        interval=0.5,
    )


def test_docker_stop_drains_a_live_generation(
    containers: tuple[Container, Container],
) -> None:
    """SIGTERM reaches the broker (exec form, PID 1): the running generation finishes within
    the drain, the process exits 0 inside the grace period, and no event is lost."""
    first, second = containers
    tokens = 40
    turn = start_turn(first.base_url, "image-3", tokens=tokens, tokens_per_s=10, seed=3)
    stream = f"{second.base_url}/v1/streams/{turn['stream_id']}"

    def delivered() -> int:
        page = httpx.get(stream, params={"format": "json"}, timeout=5).json()
        return sum(event["event"] == "delta" for event in page["events"])

    wait_until(lambda: delivered() >= 3, timeout=15)
    assert get_turn(second.base_url, turn["turn_id"])["status"] == "streaming"
    started = time.monotonic()
    docker("stop", "--time", str(GRACE_S), first.name, timeout=GRACE_S + 30)
    took = time.monotonic() - started
    assert docker("inspect", "--format", "{{.State.ExitCode}}", first.name) == "0", first.logs()
    assert took < GRACE_S, f"stopped after {took:.1f} s: killed, not drained"
    final = wait_final(second.base_url, turn["turn_id"])
    assert final["status"] == "complete", final
    read = read_sse(second.base_url, turn["stream_id"])
    assert sum(event.event == "delta" for event in read.events) == tokens
    assert len({event.id for event in read.events}) == len(read.events)
    assert read.events[-1].event == "end"
    assert read.events[-1].data["status"] == "complete"
    # The other tests may run after this one: the container starts again, as a restart would.
    docker("start", first.name)
    wait_until(first.ready, timeout=30, interval=0.1)
