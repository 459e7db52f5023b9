"""Runs the JS client's unit tests (Node's built-in runner), so `pytest` covers them too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.helpers import missing_tool

ROOT = Path(__file__).resolve().parent.parent


def test_js_client_unit_tests() -> None:
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the JS client's tests need Node >= 20)")
    result = subprocess.run(
        [node, "--test", "clients/js/test/"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"


def test_static_files_are_one_copy() -> None:
    """clients/js points at the files the broker serves; nothing is duplicated."""
    package = (ROOT / "clients/js/package.json").read_text()
    assert '"./index.js"' in package
    entry = (ROOT / "clients/js/index.js").read_text()
    assert 'export * from "../../broker/static/js/index.js";' in entry
    # The entry only re-exports: the code itself exists once, in broker/static/js.
    assert [p.name for p in (ROOT / "clients/js").glob("*.js")] == ["index.js"]
    assert len([line for line in entry.splitlines() if line.startswith("export")]) == 1
    for name in ("sse", "client", "turn", "index"):
        assert (ROOT / f"broker/static/js/{name}.js").is_file()
        assert (ROOT / f"broker/static/js/{name}.d.ts").is_file()
