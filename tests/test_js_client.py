"""Runs the JS client's unit tests (Node's built-in runner), so `pytest` covers them too."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.helpers import missing_tool

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

ROOT = Path(__file__).resolve().parent.parent


def test_js_client_unit_tests() -> None:
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the JS client's tests need Node >= 20)")
    result = subprocess.run(
        [node, "--test", "clients/js/test/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"


def test_the_module_has_one_source_the_broker_serves() -> None:
    """broker/static/js is the one copy: the demo page loads it, `npm pack` copies it into lib/."""
    package = json.loads((ROOT / "clients/js/package.json").read_text())
    assert package["exports"]["."] == {"types": "./lib/index.d.ts", "default": "./lib/index.js"}
    assert package["files"] == ["lib/"]
    assert package["scripts"]["prepack"] == "node copy-sources.js"
    # No module code lives in the package folder itself, only its copy step (lib/ is made by
    # `npm pack` and ignored by git).
    assert [p.name for p in (ROOT / "clients/js").glob("*.js")] == ["copy-sources.js"]
    assert [p.name for p in (ROOT / "clients/js").glob("*.ts")] == []
    assert "lib/" in (ROOT / "clients/js/.gitignore").read_text().split()
    for name in ("sse", "client", "turn", "index"):
        assert (ROOT / f"broker/static/js/{name}.js").is_file()
        assert (ROOT / f"broker/static/js/{name}.d.ts").is_file()
    assert 'from "./js/index.js"' in (ROOT / "broker/static/demo.js").read_text()


def _npm(*args: str, cwd: Path) -> str:
    npm = shutil.which("npm")
    if npm is None:
        missing_tool("npm is not installed (packing the JS client needs Node >= 20 and npm)")
    result = subprocess.run(
        [npm, *args, "--no-audit", "--no-fund", "--offline"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, f"npm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _exports(node: str, cwd: Path, specifier: str) -> list[str]:
    script = f"const m = await import({json.dumps(specifier)}); "
    script += "console.log(JSON.stringify(Object.keys(m).sort()));"
    result = subprocess.run(
        [node, "--input-type=module", "-e", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"import {specifier} failed:\n{result.stderr}"
    names: list[str] = json.loads(result.stdout)
    return names


def test_the_packed_tarball_installs_into_a_clean_folder_and_imports(tmp_path: Path) -> None:
    """Regression: the tarball's entry re-exported ../../broker/static/js and failed to import
    with ERR_MODULE_NOT_FOUND once installed anywhere else."""
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the JS client's tests need Node >= 20)")
    package_dir = ROOT / "clients/js"
    _npm("ci", cwd=package_dir)  # the lock agrees with package.json, or this fails
    packs = tmp_path / "packs"
    packs.mkdir()
    _npm("pack", "--pack-destination", str(packs), cwd=package_dir)
    [tarball] = packs.glob("*.tgz")
    with tarfile.open(tarball) as archive:
        members = sorted(m.name for m in archive.getmembers() if m.isfile())
    sources = sorted(
        p.name for p in (ROOT / "broker/static/js").iterdir() if p.name.endswith((".js", ".ts"))
    )
    assert members == sorted(
        ["package/package.json", "package/README.md", *(f"package/lib/{n}" for n in sources)]
    )
    for name in sources:  # byte for byte what the broker serves
        with tarfile.open(tarball) as archive:
            extracted = archive.extractfile(f"package/lib/{name}")
            assert extracted is not None
            assert extracted.read() == (ROOT / "broker/static/js" / name).read_bytes(), name

    consumer = tmp_path / "consumer"
    consumer.mkdir()
    (consumer / "package.json").write_text(
        json.dumps({"name": "consumer", "private": True, "type": "module"})
    )
    _npm("install", str(tarball), cwd=consumer)
    installed = consumer / "node_modules/@resumable-stream-broker/client"
    assert (installed / "lib/index.d.ts").is_file()
    imported = _exports(node, consumer, "@resumable-stream-broker/client")
    expected = _exports(node, ROOT, (ROOT / "broker/static/js/index.js").as_uri())
    assert imported == expected
    assert {"BrokerClient", "TurnState", "SSEDecoder", "attachEventSource"} <= set(imported)


def test_every_package_json_has_its_lock_beside_it() -> None:
    # Hidden folders are not the project's (a virtualenv in the checkout has package.json files).
    manifests = [
        p
        for p in ROOT.rglob("package.json")
        if "node_modules" not in p.parts
        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    ]
    assert manifests
    for manifest in manifests:
        lock_file = manifest.with_name("package-lock.json")
        assert lock_file.is_file(), f"{manifest.relative_to(ROOT)} has no package-lock.json"
        package, lock = json.loads(manifest.read_text()), json.loads(lock_file.read_text())
        assert lock["lockfileVersion"] >= 2
        assert (lock["name"], lock["version"]) == (package["name"], package["version"])
        root = lock["packages"][""]
        for field in ("dependencies", "devDependencies"):
            assert root.get(field, {}) == package.get(field, {}), f"{lock_file}: {field}"


def lowest_node(engines: str) -> tuple[int, int]:
    """The oldest Node an ``engines.node`` range admits: ``^20.19.0 || >=22.12.0`` -> (20, 19)."""
    found = [re.search(r"(\d+)(?:\.(\d+))?", part) for part in engines.split("||")]
    return min((int(m.group(1)), int(m.group(2) or 0)) for m in found if m is not None)


@pytest.mark.parametrize(
    ("engines", "lowest"),
    [(">=20", (20, 0)), (">= 22.0.0", (22, 0)), ("^20.19.0 || >=22.12.0", (20, 19))],
)
def test_lowest_node_reads_an_engines_range(engines: str, lowest: tuple[int, int]) -> None:
    assert lowest_node(engines) == lowest


def test_the_docs_name_every_locked_package_that_needs_a_newer_node() -> None:
    # Regression (issue 34, finding 12): the README said Node >= 20 while the locked `openai`
    # package declares Node >= 22. What the tests need is on the development page now.
    page = (ROOT / "docs/development.md").read_text()
    client = json.loads((ROOT / "clients/js/package.json").read_text())
    floor = lowest_node(client["engines"]["node"])
    assert f"the JS client needs Node ≥ {floor[0]}" in page
    newer: dict[str, tuple[int, int]] = {}
    for lock_file in sorted((ROOT / "tests/node").glob("*/package-lock.json")):
        for path, package in json.loads(lock_file.read_text())["packages"].items():
            engines = package.get("engines")
            if path and isinstance(engines, dict) and "node" in engines:
                needed = lowest_node(engines["node"])
                if needed[0] > floor[0]:
                    newer[path.rpartition("node_modules/")[2]] = needed
    assert "openai" in newer
    named = {"openai": "`openai`", "ai": "`ai` 7", "@ai-sdk/": "`@ai-sdk/*`"}
    for name, needed in newer.items():
        shown = next((text for prefix, text in named.items() if name.startswith(prefix)), name)
        assert shown in page, f"{name} needs Node {needed}: docs/development.md does not say so"
        assert f"declare Node ≥ {needed[0]}" in page
