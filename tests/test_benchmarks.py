"""The benchmark suite runs end to end and reports every figure (never how fast anything is)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.figures import FIGURES, WORKLOADS

# The workload that CI's pass on Debian's redis-server runs too (with --redis-server): the
# others are tools run once, in the first pass (they exercise the broker only as its
# functional tests do, and took a minute of that pass's workers).
ON_EVERY_SERVER = "many_streams"

REPO = Path(__file__).resolve().parent.parent

# The figures the issue sets targets for: the catalogue must keep them.
ISSUE_FIGURES = {
    "one_stream.deltas_per_s",
    "many_streams.deltas_per_s",
    "fanout.missing",
    "fanout.lag_p99_ms",
    "fanout.redis_commands_per_delta",
    "fanout.broker_rss_peak_mib",
    "late_reader.first_event_ms",
    "late_reader.catchup_events_per_s",
    "memory.bytes_per_delta",
    "redis.xadd_1client",
    "redis.xadd_pipelined16",
    "redis.lua_fenced_xadd_1client",
    "redis.lua_fenced_xadd_50clients",
}


def test_the_catalogue_has_every_figure_the_issue_asks_for() -> None:
    names = {figure.name for figure in FIGURES}
    assert names >= ISSUE_FIGURES
    assert {figure.workload for figure in FIGURES} == set(WORKLOADS)


@pytest.mark.single_node("the benchmarks start single servers of their own")
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "workload",
    [
        pytest.param(name, marks=[pytest.mark.server] if name == ON_EVERY_SERVER else [])
        for name in WORKLOADS
    ],
)
def test_a_smoke_run_reports_a_number_for_every_figure(tmp_path: Path, workload: str) -> None:
    # One workload a test, so that workers share them out; together they are the whole run.
    out = tmp_path / "results.json"
    command = [sys.executable, "-m", "benchmarks", "--smoke", "--repeat", "1", "--json", str(out)]
    command += ["--only", workload]
    server = os.environ.get("BROKER_TEST_REDIS_SERVER")
    if server:  # CI's pass on Debian's redis-server
        command += ["--redis-server", server]
    run = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=220, check=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.read_text())
    assert results["profile"] == "smoke"
    for section in ("machine", "software", "sizes", "workloads"):
        assert results[section], section
    assert results["software"]["commit"]
    figures = [figure for figure in FIGURES if figure.workload == workload]
    assert figures
    for figure in figures:
        name, entry = figure.name, results["figures"][figure.name]
        if figure.optional and entry["median"] is None:
            continue  # its tool is not installed here
        assert isinstance(entry["median"], int | float), name
        assert math.isfinite(entry["median"]), name
        assert entry["min"] <= entry["median"] <= entry["max"], name
    assert list(results["workloads"]) == [workload]
    assert all(not entry["error"] for entry in results["workloads"].values())
    # The table names every figure too.
    for name in (figure.name for figure in figures):
        assert name in run.stdout


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"attempt":1,"text":"1765130000123456 the stream"}', 1765130000123.456),
        (b'{"attempt":1,"text":"the stream"}', -1.0),  # no stamp: the append's time
        (b'{"attempt":1}', -1.0),
    ],
)
def test_a_stamped_delta_says_when_the_model_emitted_it(data: bytes, expected: float) -> None:
    from benchmarks.fanout import emitted_ms

    assert emitted_ms(data, -1.0) == pytest.approx(expected)
