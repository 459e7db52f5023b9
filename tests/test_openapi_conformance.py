"""schemathesis, with every check it has, finds no failure against a secured broker.

The run covers every operation of ``/openapi.json`` in every phase (coverage, fuzzing,
stateful): no 5xx, every status, content type, header and body as documented (each SSE event
against its event type's schema), schema-valid requests accepted and invalid ones refused, and
no operation answering without the API key. It runs the pinned schemathesis command line, with
``tests/openapi/schemathesis.toml`` (what JSON Schema cannot say, in words) and
``tests/openapi/hooks.py`` (the rules across parameters, kept by the generated requests).
``BROKER_OPENAPI_EXAMPLES`` and ``BROKER_OPENAPI_SEED`` set the examples per operation and the
seed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningBroker, start_broker

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

KEY = "key-conformance-0123456789abcdef"
ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "openapi" / "schemathesis.toml"
EXAMPLES = int(os.environ.get("BROKER_OPENAPI_EXAMPLES", "25"))
SEED = int(os.environ.get("BROKER_OPENAPI_SEED", "19"))


@pytest.fixture(scope="module")
def secured(redis_url: str) -> Iterator[RunningBroker]:
    broker = start_broker(
        redis_url,
        api_keys=f"conformance={KEY}",
        max_body_bytes=65_536,
        turn_rate_per_s=50,
        turn_burst=50,
        max_streams_per_tenant=8,
        simulate_max_tokens_per_s=0,
    )
    try:
        yield broker
    finally:
        broker.stop()


def schemathesis(broker: RunningBroker, workdir: Path, *options: str) -> str:
    """Run ``schemathesis run`` on the broker's document; its report, after asserting that it
    passed."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(CONFIG),
        "run",
        f"{broker.base_url}/openapi.json",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--workers",
        "2",
        "--request-timeout",
        "20",
        "--generation-database",
        "none",
        "--no-color",
        *options,
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.openapi.hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-30_000:]
    return report


@pytest.mark.timeout(300)
def test_every_check_in_every_phase_finds_nothing(secured: RunningBroker, tmp_path: Path) -> None:
    report = schemathesis(
        secured, tmp_path, "--checks", "all", "--max-examples", str(EXAMPLES), "--seed", str(SEED)
    )
    tested = re.search(r"Tested: (\d+)", report)
    assert tested is not None, report
    assert int(tested.group(1)) >= 20, report
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅ {phase}\b", report), (phase, report)
    assert re.search(r"(\d+) generated, \1 passed", report), report
