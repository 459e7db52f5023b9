"""The official openai Node SDK against a live broker, under Node's built-in test runner: cut and
resume, an agent loop with function tools, structured output with the parse helpers, images."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import RunningBroker
from tests.helpers import missing_tool

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

FOLDER = Path(__file__).resolve().parent / "node" / "openai"


def test_the_node_sdk_cuts_resumes_calls_tools_and_extracts_json(
    broker: RunningBroker,
) -> None:
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the Node SDK test needs Node >= 20)")
    if not (FOLDER / "node_modules" / "openai").is_dir():
        missing_tool("tests/node/openai has no node_modules: run `npm ci` in it")
    result = subprocess.run(
        [node, "--test", "test/"],
        cwd=FOLDER,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "BROKER_URL": broker.base_url},
    )
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"
    assert "# pass 11" in result.stdout, result.stdout
