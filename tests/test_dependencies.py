"""Development and test dependencies are locked; runtime dependencies stay ranges.

Regression (issue 14, section 7): with open floors a newer hypothesis that ships its own types
turned `mypy --strict` red on a fresh machine. Everything CI installs comes from
constraints.txt, which scripts/lock rebuilds.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)$")


def locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"not an exact pin: {line!r}"
        name = canonicalize_name(match["name"])
        assert name not in pins, f"{name} is pinned twice"
        pins[name] = match["version"]
    return pins


def project(path: str) -> dict[str, object]:
    data: dict[str, object] = tomllib.loads((ROOT / path).read_text())["project"]
    return data


def requirements(path: str, extra: str | None = None) -> list[Requirement]:
    table = project(path)
    if extra is None:
        raw = table["dependencies"]
    else:
        extras = table["optional-dependencies"]
        assert isinstance(extras, dict)
        raw = extras[extra]
    assert isinstance(raw, list)
    return [Requirement(str(item)) for item in raw]


def test_every_dependency_is_pinned_exactly_and_satisfies_its_range() -> None:
    pins = locked()
    wanted = [
        *requirements("pyproject.toml"),
        *requirements("pyproject.toml", "test"),
        *requirements("clients/python/pyproject.toml"),
    ]
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside {requirement}"
        )
    # The projects themselves are installed editable and never pinned.
    assert "resumable-stream-broker" not in pins
    assert "broker-client" not in pins


def test_runtime_dependencies_stay_ranges() -> None:
    for path in ("pyproject.toml", "clients/python/pyproject.toml"):
        for requirement in requirements(path):
            operators = {spec.operator for spec in requirement.specifier}
            assert operators <= {">=", "<", "!=", "~="}, f"{path}: {requirement} is pinned"


def test_dependencies_whose_internals_the_broker_uses_are_bounded_above() -> None:
    """A release of these may change what the broker reaches into: it comes in only by a
    raised bound, the lock and the tests, never by itself on a fresh install."""
    bounded = {
        canonicalize_name(requirement.name): requirement
        for requirement in requirements("pyproject.toml")
        if any(spec.operator == "<" for spec in requirement.specifier)
    }
    assert {"redis", "uvicorn"} <= set(bounded), sorted(bounded)
    pins = locked()
    for name in map(canonicalize_name, ("redis", "uvicorn")):
        assert bounded[name].specifier.contains(pins[name]), f"{name} {pins[name]} is outside"


def test_ci_and_the_readme_install_through_the_lock() -> None:
    install = "pip install -e '.[test]' -e ./clients/python -c constraints.txt"
    readme = (ROOT / "README.md").read_text()
    development = (ROOT / "docs/development.md").read_text()
    assert install in readme
    assert install in development
    ci = (ROOT / ".ci/run").read_text().replace("\\\n", " ")
    commands = [shlex.split(line) for line in ci.splitlines() if "pip install" in line]
    assert len(commands) == 1
    words = commands[0]
    assert words[words.index("-c") + 1] == "constraints.txt"
    assert {"-e", ".[test]", "./clients/python"} <= set(words)
    # Node packages come from their locks, through the script humans run too.
    assert "scripts/npm-ci" in ci
    npm_ci = (ROOT / "scripts/npm-ci").read_text()
    assert "npm ci" in npm_ci
    assert "npm install" not in ci + npm_ci
    assert "scripts/npm-ci" in development


def test_the_refresh_command_exists_and_is_documented() -> None:
    script = ROOT / "scripts/lock"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "freeze --exclude-editable" in text
    assert "-e '.[test]' -e ./clients/python" in text
    assert "PIP_CONFIG_FILE=/dev/null" in text  # local pip configuration takes no part
    development = (ROOT / "docs/development.md").read_text()
    assert re.search(r"^scripts/lock\s+#", development, re.M)
    assert re.search(r"^scripts/lock --keep\s+#", development, re.M)
    assert '"${keep[@]}"' in text  # --keep installs through the current constraints


def test_this_environment_runs_the_locked_versions() -> None:
    """What the checks ran with is what the lock says (install with `-c constraints.txt`)."""
    drift = {}
    for name, version in locked().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. a package only another platform needs
        if installed != version:
            drift[name] = f"{installed} installed, {version} locked"
    assert not drift, f"reinstall with -c constraints.txt: {drift}"
