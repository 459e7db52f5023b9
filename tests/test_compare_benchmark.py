"""The side-by-side benchmark: what it reads off each system's wire and the figures it prints, as
tables; and a smoke run end to end (its figures are printed, never asserted)."""

from __future__ import annotations

import array
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare import _schedules
from benchmarks.compare_viewers import Read
from benchmarks.comparison import (
    Control,
    Kind,
    cell,
    control,
    end_to_end_rate,
    lag_bucket,
    per_thousand,
    resume,
    stamp_us,
    table,
)
from benchmarks.systems import installed

REPO = Path(__file__).resolve().parent.parent
STAMP = 1_796_665_213_886_927  # µs since the epoch, as every producer writes it


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"attempt":1,"text":"1796665213886927  the"}', STAMP),  # the broker's delta
        (b'{"text":"1796665213886927 ing "}', STAMP),  # our resumable-stream route's
        (b"1796665213886927  of ", STAMP),  # a Durable Streams text message
        (b'{"text":"hello"}', None),
        (b'{"text":"17966652138869270 x"}', None),  # 17 digits: not a stamp
        (b'{"text":"179666521388692 x"}', None),  # 15 digits
        (b'{"text":"1796665213886927"}', None),  # no space after it
    ],
)
def test_the_stamp_is_the_first_16_digit_number_before_a_space(
    data: bytes, expected: int | None
) -> None:
    assert stamp_us(data) == expected


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"streamNextOffset":"0_42","streamCursor":"7","upToDate":true}', Control("0_42", False)),
        (b'{"streamNextOffset":"0_43","streamClosed":true}', Control("0_43", True)),
        (b'{"streamClosed":true}', None),
        (b"[1, 2]", None),
        (b"1796665213886927  of ", None),
    ],
)
def test_a_durable_streams_control_event_gives_the_offset_and_the_close(
    data: bytes, expected: Control | None
) -> None:
    assert control(data) == expected


DS = "/v1/stream/k?offset=-1&live=sse"
OFFSET = "0000000000001-0000000001"


@pytest.mark.parametrize(
    ("kind", "path", "cursor", "expected"),
    [
        ("broker", "/v1/streams/s1", "", ("/v1/streams/s1", None)),
        ("broker", "/v1/streams/s1", OFFSET, ("/v1/streams/s1", OFFSET)),
        ("resumable-stream", "/rs/k", "000000000140", ("/rs/k", "000000000140")),
        ("durable-streams", DS, "", (DS, None)),
        ("durable-streams", DS, "0_99", ("/v1/stream/k?offset=0_99&live=sse", None)),
    ],
)
def test_a_read_resumes_from_its_cursor_as_each_system_takes_it(
    kind: Kind, path: str, cursor: str, expected: tuple[str, str | None]
) -> None:
    assert resume(kind, path, cursor) == expected


@pytest.mark.parametrize(
    ("arrived_s", "stamp", "bucket"),
    [
        (1.0005, 1_000_000, 5),  # 0.5 ms late: five 0.1 ms buckets
        (1.0, 1_000_000, 0),
        (0.999, 1_000_000, 0),  # clocks a hair apart never give a negative lag
        (1.25, 1_000_000, 2_500),
    ],
)
def test_the_lag_is_the_arrival_less_the_stamp_in_tenths_of_a_millisecond(
    arrived_s: float, stamp: int, bucket: int
) -> None:
    assert lag_bucket(arrived_s, stamp) == bucket


@pytest.mark.parametrize(
    ("cpu_s", "delivered", "expected"),
    [(2.0, 1_000_000, 2.0), (0.017, 1_000, 17.0), (0.5, 0, 500_000.0)],
)
def test_cpu_per_thousand_delivered(cpu_s: float, delivered: int, expected: float) -> None:
    assert math.isclose(per_thousand(cpu_s, delivered), expected)


def test_the_full_speed_rate_runs_from_the_first_emit_to_the_last_arrival() -> None:
    assert math.isclose(end_to_end_rate(1_000, 1_000_000, 2.0), 1_000.0)
    assert math.isclose(end_to_end_rate(500, 1_000_000, 1.25), 2_000.0)


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([1.0, 3.0, 2.0], "2.0 [1.0-3.0]"),
        ([2.0], "2.0"),
        ([], "-"),
        ([float("nan"), 4.0], "4.0"),
    ],
)
def test_a_cell_is_the_median_and_the_range(samples: list[float], expected: str) -> None:
    assert cell(samples, ",.1f") == expected


def test_the_table_shows_measured_rows_and_marks_the_noted_cells() -> None:
    figures = {
        "late.deltas_per_s": {"broker": [100.0, 300.0, 200.0], "resumable-stream": [50.0]},
        "join.lag_p99_ms": {},
    }
    notes = {"late.deltas_per_s": {"resumable-stream": "held open"}}
    lines = table(figures, notes, ("broker", "resumable-stream")).splitlines()
    assert lines[0].split() == ["figure", "broker", "resumable-stream"]
    assert lines[1].startswith("late reader: catch-up deltas/s")
    assert "200 [100-300]" in lines[1]
    assert lines[1].endswith("50 *")
    assert lines[2] == "  * resumable-stream, late reader: catch-up deltas/s: held open"
    assert len(lines) == 3  # the row nobody measured is left out


def _frame(event: bytes, data: bytes, event_id: bytes = b"") -> tuple[bytes, bytes, bytes]:
    return event_id, event, data


@pytest.mark.parametrize(
    ("kind", "events", "deltas", "ended", "cursor"),
    [
        (
            "broker",
            [
                _frame(b"attempt", b'{"n":1}', b"0001"),
                _frame(b"delta", b'{"text":"1796665213886927 a"}', b"0002"),
                _frame(b"delta", b'{"text":"1796665213886927 a"}', b"0002"),  # replayed twice
                _frame(b"delta", b'{"text":"1796665213886928 b"}', b"0003"),
                _frame(b"end", b'{"status":"complete"}', b"0004"),
            ],
            2,
            True,
            "0003",
        ),
        (
            "resumable-stream",
            [_frame(b"delta", b'{"text":"1796665213886927 a"}', b"000000000070")],
            1,
            False,
            "000000000070",
        ),
        (
            "durable-streams",
            [
                _frame(b"data", b"1796665213886927 a"),
                _frame(b"data", b"1796665213886928 b"),
                _frame(b"control", b'{"streamNextOffset":"0_2","upToDate":true}'),
                _frame(b"control", b'{"streamNextOffset":"0_2","streamClosed":true}'),
            ],
            2,
            True,
            "0_2",
        ),
    ],
)
def test_a_read_counts_deltas_and_ends_in_each_framing(
    kind: Kind,
    events: list[tuple[bytes, bytes, bytes]],
    deltas: int,
    ended: bool,
    cursor: str,
) -> None:
    lags: array.array[int] = array.array("q")
    read = Read(kind, expect=10, lags=lags)
    read.on_head(STAMP / 1e6 - 1)  # attached a second before the first emit: every delta is live
    stopped = read.on_events(events, STAMP / 1e6 + 0.00205)
    assert (read.deltas, read.ended, stopped, read.cursor) == (deltas, ended, ended, cursor)
    assert read.first_stamp == STAMP
    assert list(lags) == [20] * deltas  # 2.05 ms and 2.049 ms: the 2.0 ms bucket


def test_a_read_counts_no_lag_for_what_was_emitted_before_it_attached() -> None:
    lags: array.array[int] = array.array("q")
    read = Read("broker", expect=2, lags=lags)
    read.on_head(STAMP / 1e6 + 0.5)
    events = [
        _frame(b"delta", b'{"text":"1796665213886927 a"}', b"1"),  # a replay
        _frame(b"delta", b'{"text":"1796665214886927 b"}', b"2"),  # a second later: live
    ]
    assert read.on_events(events, STAMP / 1e6 + 1.00105)  # the deltas expected came: it stops
    assert list(lags) == [10]


@pytest.mark.parametrize(
    ("only", "expected"),
    [
        (None, ["join", "quiet", "late", "full"]),
        (["d,a"], ["join", "full"]),
        (["late", "b"], ["quiet", "late"]),
    ],
)
def test_schedules_are_named_by_letter_or_word_and_run_in_order(
    only: list[str] | None, expected: list[str]
) -> None:
    assert _schedules(only) == expected


# (Not marked `server`: a benchmark's smoke run, run once, in CI's first pass.)
@pytest.mark.single_node("the benchmark starts servers of its own")
@pytest.mark.timeout(180)
def test_a_smoke_run_of_the_late_reader_prints_a_figure_per_system(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    command = [sys.executable, "-m", "benchmarks.compare", "--smoke", "--only", "c"]
    run = subprocess.run(
        [*command, "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=170
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    systems = [k for k in ("broker", "resumable-stream", "durable-streams") if not installed(k)]
    row = next(line for line in run.stdout.splitlines() if line.startswith("late reader: catch"))
    assert len([c for c in row.split()[4:] if c[0].isdigit()]) == len(systems), row
    results = json.loads(out.read_text())
    assert set(results["figures"]["late.deltas_per_s"]) == set(systems)
    assert all(not run.get("error") for run in results["runs"])
