"""The bytes-on-the-wire benchmark runs end to end (its figures are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.single_node("the benchmark starts a single server of its own")
def test_the_wire_benchmark_runs_and_reports_bytes_per_delta() -> None:
    command = [sys.executable, "-m", "benchmarks.wire", "--deltas", "60", "--writes", "200"]
    command += ["--tokens", "20", "--pace", "100"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for line in ("gzip, 1 delta per write (live)", "gzip, live", "identity, live", "p99"):
        assert line in run.stdout, run.stdout
