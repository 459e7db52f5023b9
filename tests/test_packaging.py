"""The Dockerfile, compose.yaml and Prometheus config agree with each other and with the code.

No container engine is needed: the files are parsed and checked against the repository (paths
that are copied or mounted exist), the CLI (the image's command parses) and the settings (ports,
roles, Redis URL). The Dockerfile parser understands what our Dockerfile uses: continuation
lines, comments, and the exec (JSON) form of CMD, ENTRYPOINT and HEALTHCHECK.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from broker.__main__ import _parser, serve_settings
from broker.settings import ROLES, Settings
from tests.helpers import missing_tool

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
ALERTMANAGER_CONFIG = "/etc/alertmanager/alertmanager.yml"
ALERTMANAGER_PORT = 9093
# Measured: after the drain, closing open streams and Redis and exiting take about 1.5 s.
EXIT_AFTER_DRAIN_S = 1.5


def dockerfile() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        name, _, rest = line.partition(" ")
        instructions.append((name.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def only(instruction: str) -> str:
    found = [rest for name, rest in dockerfile() if name == instruction]
    assert len(found) == 1, f"expected one {instruction}, found {len(found)}"
    return found[0]


def exec_form(text: str) -> list[str]:
    """The JSON array of an exec-form instruction (the shell form is refused: no signals)."""
    value = json.loads(text)
    assert isinstance(value, list), f"not the exec form: {text}"
    assert all(isinstance(item, str) for item in value)
    return [str(item) for item in value]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def broker_services() -> dict[str, dict[str, Any]]:
    """The services built from this repository's Dockerfile."""
    return {name: svc for name, svc in services().items() if "build" in svc}


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(str(item).partition("=")[::2] for item in env)
    return {str(k): str(v) for k, v in env.items()}


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> repository path of each ``./...`` volume of a service."""
    mounts: dict[str, str] = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith(("./", "../", "/")):
            mounts[target] = posixpath.normpath(source)
    return mounts


def host_path(mounts: dict[str, str], container_path: str) -> Path | None:
    """Where a container path of a service lives in the repository, if it is bind-mounted."""
    for target, source in sorted(mounts.items(), key=lambda m: -len(m[0])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return ROOT / source / posixpath.relpath(container_path, target)
    return None


def container_port() -> int:
    exposed = only("EXPOSE").split()
    assert len(exposed) == 1, exposed
    return int(exposed[0].removesuffix("/tcp"))


def published(mapping: object) -> tuple[str, str, str]:
    """``(host address, host port, container port)`` of a short-syntax port mapping."""
    parts = str(mapping).split(":")
    assert 2 <= len(parts) <= 3, f"unexpected port mapping {mapping!r}"
    if len(parts) == 2:
        return "0.0.0.0", parts[0], parts[1]  # Docker's default: every interface
    return parts[0], parts[1], parts[2]


def duration_s(text: str) -> float:
    """A Compose duration such as ``30s``, ``1m30s`` or ``1.5m``, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    assert parts, "an empty duration"
    return sum(float(number) * units[unit] for number, unit in parts)


def prometheus_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "grafana/prometheus.yml").read_text())
    return data


# --- the Dockerfile -------------------------------------------------------------------------


def _ignored(path: str, patterns: list[str]) -> bool:
    """``.dockerignore`` semantics: the last matching pattern wins; a parent's match counts."""
    ignored = False
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = posixpath.normpath(pattern.removeprefix("!").strip("/"))
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            ignored = not negated
    return ignored


def test_every_copied_path_exists_and_reaches_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # What a stage copies from another stage is not in the build context.
    copies = [rest for name, rest in dockerfile() if name == "COPY" and "--from" not in rest]
    assert copies
    for rest in copies:
        args = [arg for arg in shlex.split(rest) if not arg.startswith("--")]
        for source in args[:-1]:
            path = ROOT / source
            assert path.exists(), f"COPY {source}: no such file in the repository"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for file in files:
                relative = file.relative_to(ROOT).as_posix()
                if "__pycache__" in relative:
                    assert _ignored(relative, patterns)
                    continue
                assert not _ignored(relative, patterns), f"{relative} is in .dockerignore"
    # The package data must be in the image: the Lua scripts are loaded at start.
    assert not _ignored("broker/lua/append_events.lua", patterns)
    assert _ignored(".git/config", patterns)
    assert _ignored("tests/conftest.py", patterns)


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions by stage (each from its FROM)."""
    found: list[list[tuple[str, str]]] = []
    for name, rest in dockerfile():
        if name == "FROM":
            found.append([])
        if found:
            found[-1].append((name, rest))
    return found


def test_the_image_is_built_on_a_pinned_base_in_two_stages() -> None:
    """Issue 38: ``python:3.11-slim`` was a moving tag. The base is a build argument whose
    default names one dated base (made by scripts/debian-base from Debian's archive)."""
    base = [rest for name, rest in dockerfile() if name == "ARG" and rest.startswith("BASE=")]
    assert len(base) == 1
    default = base[0].removeprefix("BASE=")
    assert re.search(r"\d{8}|@sha256:[0-9a-f]{64}$", default), f"{default} is not pinned"
    assert "trixie" in default  # Debian's Python 3.13
    build, final = stages()
    assert build[0][1] == "${BASE} AS build"
    assert final[0][1] == "${BASE}"
    script = (ROOT / "scripts/debian-base").read_text()
    assert "sed -n 's/^ARG BASE=//p' Dockerfile" in script  # it makes exactly that name


def test_the_image_installs_the_locked_package_and_runs_it_as_a_user() -> None:
    build, final = stages()
    installs = [rest for name, rest in build if name == "RUN" and "pip install" in rest]
    assert len(installs) == 1
    words = shlex.split(installs[0].split("pip install", 1)[1].split("&&")[0])
    assert words[words.index("-c") + 1] == "constraints.txt"  # the locked versions
    assert words[-1] == "/tmp/wheel/*.whl"  # the package itself, not editable, no extras
    # The final stage has Python and the build's virtualenv: no pip, compiler or secret.
    final_text = " ".join(rest for _, rest in final)
    for word in ("pip ", "gcc", "build-essential", "python3-venv", "secret"):
        assert word not in final_text, word
    assert ("COPY", "--from=build /opt/broker /opt/broker") in final
    names = [name for name, _ in final]
    user = only("USER").split(":")[0]
    assert user not in ("root", "0")
    assert names.index("USER") > max(i for i, name in enumerate(names) if name == "RUN")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert exec_form(only("ENTRYPOINT")) == ["broker"]
    assert scripts["broker"] == "broker.__main__:main"


def image_env() -> dict[str, str]:
    """The ENV of the final stage (``NAME=value`` pairs, continuation lines joined)."""
    found: dict[str, str] = {}
    for name, rest in stages()[-1]:
        if name == "ENV":
            found |= dict(pair.split("=", 1) for pair in shlex.split(rest))
    return found


def test_the_command_parses_and_every_port_is_the_settings_port() -> None:
    port = container_port()
    args = _parser().parse_args(exec_form(only("CMD")))
    assert args.command == "serve"
    settings = serve_settings(args, image_env())
    assert settings.host == "0.0.0.0"  # reachable from outside the container
    assert settings.port == port == Settings().port
    healthcheck = only("HEALTHCHECK")
    command = healthcheck[healthcheck.index("CMD ") + 4 :]
    probe = exec_form(command)
    assert probe[:2] == ["python", "-c"]  # the image has no curl
    compile(probe[2], "<healthcheck>", "exec")
    # The probe asks the port the broker binds: BROKER_PORT, which a container may move.
    assert "os.environ['BROKER_PORT']" in probe[2]
    url = urlsplit(re.findall(r"https?://[^'\"\s]+", probe[2])[0] % image_env()["BROKER_PORT"])
    assert (url.hostname, url.port, url.path) == ("127.0.0.1", port, "/healthz")


# --- compose.yaml ---------------------------------------------------------------------------


def test_every_mounted_path_exists() -> None:
    for name, service in services().items():
        build = service.get("build")
        if build is not None:
            context = build if isinstance(build, str) else build.get("context", ".")
            assert (ROOT / context / "Dockerfile").is_file(), f"{name}: no Dockerfile"
        for target, source in bind_mounts(service).items():
            assert (ROOT / source).exists(), f"{name}: {source} (for {target}) is missing"


def test_the_observability_files_are_in_place() -> None:
    """Written alongside this file; compose.yaml and prometheus.yml name exactly these."""
    assert (ROOT / "grafana/provisioning").is_dir()
    assert (ROOT / "grafana/dashboards").is_dir()
    assert list((ROOT / "grafana/dashboards").glob("*.json")), "no dashboards"
    assert (ROOT / "grafana/rules/broker.rules.yml").is_file()


def test_broker_services_have_valid_settings_roles_and_ports() -> None:
    brokers = broker_services()
    assert set(brokers) == {"api-1", "api-2", "worker"}
    port = container_port()
    roles: dict[str, str] = {}
    host_ports: list[str] = []
    for name, service in brokers.items():
        env = environment(service)
        settings = Settings.from_env(env)  # every BROKER_* value is one the broker accepts
        assert env.get("BROKER_ROLE") in ROLES
        roles[name] = settings.role
        assert env.get("BROKER_PORT", str(port)) == str(port)  # the health check's port
        redis_url = urlsplit(str(settings.redis_url))
        assert redis_url.hostname in services(), f"{name}: Redis is not a compose service"
        assert str(services()[redis_url.hostname]["image"]).startswith("redis:")
        assert (redis_url.port or 6379) == 6379
        for mapping in service.get("ports", []):
            _, host, inside = published(mapping)
            assert int(inside) == port
            host_ports.append(host)
    assert roles == {"api-1": "api", "api-2": "api", "worker": "worker"}
    assert sorted(host_ports) == ["8001", "8002"]


def test_every_port_is_published_on_loopback_only() -> None:
    """Regression (issue 14): the API ports, open with auth off, listened on every interface."""
    mappings = [(name, m) for name, svc in services().items() for m in svc.get("ports", [])]
    assert {name for name, _ in mappings} >= {"api-1", "api-2", "prometheus", "grafana"}
    for name, mapping in mappings:
        address, _, _ = published(mapping)
        assert address == "127.0.0.1", f"{name} publishes {mapping!r} beyond loopback"


def test_every_image_is_pinned_to_a_version() -> None:
    """Regression (issue 14): unpinned Prometheus and Grafana images changed under the stack."""
    pulled = {name: str(svc["image"]) for name, svc in services().items() if "build" not in svc}
    assert set(pulled) == {"redis", "prometheus", "alertmanager", "grafana"}
    for name, image in pulled.items():
        repository, _, tag = image.rpartition(":")
        assert repository, f"{name}: {image} has no tag"
        assert "/" not in tag, f"{name}: {image} has no tag"
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: {image} is not an exact version"


def test_brokers_may_drain_before_docker_kills_them() -> None:
    """Regression (issue 14): Docker's default 10 s grace killed a broker mid-drain (drain 10 s,
    then closing streams and exiting, about 11.5 s in all)."""
    for name, service in broker_services().items():
        drain = Settings.from_env(environment(service)).drain_timeout_s
        grace = duration_s(str(service.get("stop_grace_period", "10s")))
        assert grace >= 1.5 * (drain + EXIT_AFTER_DRAIN_S), f"{name}: {grace} s to stop"


def test_redis_keeps_every_event() -> None:
    redis = services()["redis"]
    assert str(redis["image"]).startswith("redis:7.")
    command = redis["command"]
    words = shlex.split(command) if isinstance(command, str) else [str(w) for w in command]
    pairs = dict(zip(words[1::2], words[2::2], strict=False))
    assert words[0] == "redis-server"
    assert pairs.get("--appendonly") == "yes"  # acknowledged events survive a restart
    assert pairs.get("--maxmemory-policy") == "noeviction"  # the broker's requirement
    assert any(str(v).split(":")[1] == "/data" for v in redis.get("volumes", []))


# --- Prometheus and Grafana -----------------------------------------------------------------


def test_prometheus_scrapes_every_broker_on_the_settings_port() -> None:
    mounts = bind_mounts(services()["prometheus"])
    assert mounts[PROMETHEUS_CONFIG] == "grafana/prometheus.yml"
    jobs = {job["job_name"]: job for job in prometheus_config()["scrape_configs"]}
    broker = jobs["broker"]
    assert broker.get("metrics_path", "/metrics") == "/metrics"
    targets = {t for group in broker["static_configs"] for t in group["targets"]}
    assert targets == {f"{name}:{container_port()}" for name in broker_services()}


def test_prometheus_loads_the_rules_and_not_their_unit_tests() -> None:
    mounts = bind_mounts(services()["prometheus"])
    rule_files = prometheus_config()["rule_files"]
    assert rule_files
    matched: set[str] = set()
    for pattern in rule_files:
        # Relative rule paths resolve against the config file's directory.
        inside = posixpath.join(posixpath.dirname(PROMETHEUS_CONFIG), pattern)
        on_host = host_path(mounts, inside)
        assert on_host is not None, f"{inside} is not mounted into the prometheus service"
        assert not fnmatch.fnmatchcase("broker.rules.test.yml", on_host.name)
        matched |= {p.relative_to(ROOT).as_posix() for p in on_host.parent.glob(on_host.name)}
    assert matched == {"grafana/rules/broker.rules.yml"}


def test_prometheus_sends_its_alerts_to_the_alertmanager_service() -> None:
    alerting = prometheus_config()["alerting"]["alertmanagers"]
    targets = {
        t for manager in alerting for group in manager["static_configs"] for t in group["targets"]
    }
    assert targets == {f"alertmanager:{ALERTMANAGER_PORT}"}
    alertmanager = services()["alertmanager"]
    assert [published(m)[2] for m in alertmanager["ports"]] == [str(ALERTMANAGER_PORT)]
    assert "alertmanager" in services()["prometheus"]["depends_on"]
    mounts = bind_mounts(alertmanager)
    assert mounts[ALERTMANAGER_CONFIG] == "grafana/alertmanager.yml"  # the image's default path
    config = yaml.safe_load((ROOT / "grafana/alertmanager.yml").read_text())
    receivers = {receiver["name"] for receiver in config["receivers"]}
    routes = [config["route"], *config["route"].get("routes", [])]
    assert {route["receiver"] for route in routes if "receiver" in route} <= receivers


def test_amtool_accepts_the_alertmanager_config() -> None:
    amtool = os.environ.get("AMTOOL") or shutil.which("amtool")
    if amtool is None:
        missing_tool("amtool not found: set AMTOOL or put it on PATH (.ci/run installs it)")
    done = subprocess.run(
        [amtool, "check-config", str(ROOT / "grafana/alertmanager.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"amtool check-config failed:\n{done.stdout}{done.stderr}"
    assert "SUCCESS" in done.stdout


def test_grafana_mounts_provisioning_and_dashboards_where_they_are_looked_for() -> None:
    grafana = services()["grafana"]
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == "grafana/provisioning"
    assert mounts["/var/lib/grafana/dashboards"] == "grafana/dashboards"
    env = environment(grafana)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    provisioning = ROOT / "grafana/provisioning"
    if not provisioning.is_dir():
        pytest.fail("grafana/provisioning is missing")
    paths: list[str] = []
    urls: list[str] = []
    for file in sorted(provisioning.rglob("*.y*ml")):
        data = yaml.safe_load(file.read_text()) or {}
        paths += [p.get("options", {}).get("path", "") for p in data.get("providers", [])]
        urls += [d.get("url", "") for d in data.get("datasources", [])]
    assert paths, "no dashboard provider"
    for path in paths:  # the provider reads the folder compose.yaml mounts
        assert host_path(mounts, path) == ROOT / "grafana/dashboards"
    prometheus_port = str(services()["prometheus"]["ports"][0]).rpartition(":")[2]
    assert f"http://prometheus:{prometheus_port}" in urls


# --- compose.cluster.yaml -------------------------------------------------------------------


def cluster_services() -> dict[str, dict[str, Any]]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.cluster.yaml").read_text())
    found: dict[str, dict[str, Any]] = data["services"]
    return found


def test_the_cluster_stack_points_its_brokers_at_its_cluster() -> None:
    found = cluster_services()
    brokers = {name: svc for name, svc in found.items() if "build" in svc}
    assert set(brokers) == {"broker-1", "broker-2"}
    nodes = {name for name, svc in found.items() if "--cluster-enabled" in svc.get("command", [])}
    assert len(nodes) == 6  # three primaries, a replica each
    for name, service in brokers.items():
        settings = Settings.from_env(environment(service))
        assert settings.cluster, f"{name}: not a cluster URL"
        named = {item.split(":")[0] for item in str(settings.redis_url).split("://")[1].split(",")}
        assert named <= nodes, f"{name}: {named - nodes} are not cluster nodes"
        assert service["depends_on"]["cluster-init"]["condition"] == (
            "service_completed_successfully"
        )
        for mapping in service.get("ports", []):
            address, _, inside = published(mapping)
            assert address == "127.0.0.1"
            assert int(inside) == container_port()


def test_the_cluster_stack_pins_its_images_and_keeps_every_event() -> None:
    for name, service in cluster_services().items():
        if "build" in service:
            continue
        assert re.fullmatch(r"redis:\d+\.\d+\.\d+", str(service["image"])), name
        command = [str(word) for word in service.get("command", [])]
        if "--cluster-enabled" in command:
            pairs = dict(zip(command[1::2], command[2::2], strict=False))
            assert pairs.get("--appendonly") == "yes", name
            assert pairs.get("--maxmemory-policy") == "noeviction", name


# --- compose.host.yaml ----------------------------------------------------------------------


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: ``!reset`` clears what the file it overrides set."""


ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def host_services() -> dict[str, dict[str, Any]]:
    data: dict[str, Any] = yaml.load((ROOT / "compose.host.yaml").read_text(), ComposeLoader)
    found: dict[str, dict[str, Any]] = data["services"]
    return found


def test_the_host_network_override_puts_every_service_on_loopback_ports_of_its_own() -> None:
    """compose.host.yaml, for machines without a Docker bridge: each service on the host's
    network publishes nothing, binds loopback, and the brokers get distinct ports that
    grafana/prometheus.host.yml scrapes."""
    overrides = host_services()
    assert set(overrides) == set(services())
    ports: dict[str, str] = {}
    for name, service in overrides.items():
        assert service["network_mode"] == "host", name
        if "ports" in services()[name]:
            assert service["ports"] is None, name  # !reset: nothing published
    for name in broker_services():
        env = {**environment(services()[name]), **environment(overrides[name])}
        settings = Settings.from_env(env)
        assert settings.host == "127.0.0.1", name
        assert urlsplit(str(settings.redis_url)).hostname == "127.0.0.1", name
        ports[name] = str(settings.port)
    assert len(set(ports.values())) == len(ports), ports
    redis_command = [str(word) for word in overrides["redis"]["command"]]
    pairs = dict(zip(redis_command[1::2], redis_command[2::2], strict=False))
    assert pairs["--bind"] == "127.0.0.1"
    assert pairs["--appendonly"] == "yes"
    assert pairs["--maxmemory-policy"] == "noeviction"
    config = yaml.safe_load((ROOT / "grafana/prometheus.host.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    assert targets == {f"127.0.0.1:{port}" for port in ports.values()}
    assert config["rule_files"] == prometheus_config()["rule_files"]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        f"127.0.0.1:{ALERTMANAGER_PORT}"
    ]
    mounts = bind_mounts(overrides["prometheus"])
    assert mounts[PROMETHEUS_CONFIG] == "grafana/prometheus.host.yml"
    for name in ("prometheus", "alertmanager"):
        listen = [w for w in overrides[name]["command"] if w.startswith("--web.listen-address=")]
        assert [w.split("=")[1].split(":")[0] for w in listen] == ["127.0.0.1"], name
