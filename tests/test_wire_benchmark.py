"""The standalone benchmarks (bytes on the wire, long polls) run end to end; their figures are
printed, never asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Brokers of its own processes. Not marked `server`: a benchmark's smoke run exercises the broker
# only as the functional tests do, so CI runs it once, in the first pass.

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.single_node("the benchmark starts a single server of its own")
def test_the_wire_benchmark_runs_and_reports_bytes_per_delta() -> None:
    command = [sys.executable, "-m", "benchmarks.wire", "--deltas", "60", "--writes", "200"]
    command += ["--tokens", "20", "--pace", "100"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for line in ("gzip, 1 delta per write (live)", "gzip, live", "identity, live", "p99"):
        assert line in run.stdout, run.stdout


@pytest.mark.single_node("the benchmark starts a single server of its own")
def test_the_long_poll_benchmark_runs_and_reports_both_crowds() -> None:
    command = [sys.executable, "-m", "benchmarks.longpoll", "--clients", "5", "--tokens", "5"]
    command += ["--pace", "20", "--settle-ms", "500"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for line in ("long-poll", "sse", "lag_p99_ms", "redis_commands_per_client_delta"):
        assert line in run.stdout, run.stdout
