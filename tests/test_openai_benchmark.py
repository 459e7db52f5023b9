"""The Responses resume benchmark runs end to end (its figure is printed, never asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# Brokers of its own processes. Not marked `server`: a benchmark's smoke run exercises the broker
# only as the functional tests do, so CI runs it once, in the first pass.

REPO = Path(__file__).resolve().parent.parent


def test_the_resume_benchmark_runs_and_reports_its_median() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.openai_resume", "--events", "400", "--tries", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"first event p50 [0-9.]+ ms", run.stdout), run.stdout
    assert "native resume at the same point" in run.stdout
