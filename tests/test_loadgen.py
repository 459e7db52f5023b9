"""``broker loadgen`` against a real broker: every kind of turn ends as intended, metrics agree."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from broker_client import loadgen
from tests.conftest import BrokerFactory, RunningBroker, free_port


def parse(*argv: str) -> argparse.Namespace:
    """Arguments as the ``broker`` CLI parses them once ``loadgen.add_parser`` is wired in."""
    parser = argparse.ArgumentParser(prog="broker")
    loadgen.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["loadgen", *argv])


def counters(broker: RunningBroker) -> dict[str, float]:
    samples = {
        "started": ("broker_turns_started_total", ""),
        "complete": ("broker_turns_finished_total", '{status="complete"}'),
        "interrupted": ("broker_turns_finished_total", '{status="interrupted"}'),
        "cancelled": ("broker_turns_finished_total", '{status="cancelled"}'),
        "failed": ("broker_turns_finished_total", '{status="failed"}'),
        "retries": (
            "broker_retries_total",
            '{code="upstream_unavailable",reason="upstream_error"}',
        ),
        "interruptions": (
            "broker_interruptions_total",
            '{code="upstream_unavailable",reason="upstream_error"}',
        ),
        "cancel_signalled": ("broker_cancels_total", '{result="signalled"}'),
        "cancel_queued": ("broker_cancels_total", '{result="cancelled"}'),
    }
    return {key: broker.metric(name, labels) for key, (name, labels) in samples.items()}


def test_a_mixed_run_ends_every_turn_as_its_kind_intends(
    broker_factory: BrokerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    broker = broker_factory(retry_backoff_min_ms=1, retry_backoff_max_ms=5)
    before = counters(broker)
    capsys.readouterr()  # drop the broker's own start-up line
    # Each turn lasts a second (20 deltas at 20/s); a cancelled one (80 deltas, 4 s) is stopped
    # after 5 deltas were read.
    args = parse(
        "--url",
        broker.base_url,
        "--turns",
        "10",
        "--rate",
        "50",
        "--concurrency",
        "10",
        "--mix",
        "normal=2,retried=2,interrupted=2,cancelled=2,tool=2",
        "--tokens",
        "20",
        "--tokens-per-s",
        "20",
        "--timeout",
        "30",
        "--json",
        "--progress",
    )
    code = loadgen.run(args)
    out, err = capsys.readouterr()
    summary: dict[str, Any] = json.loads(out)
    assert code == 0, out + err
    assert summary["planned"] == summary["finished"] == 10
    assert summary["errors"] == 0
    assert summary["unexpected"] == 0
    assert summary["by_kind"] == {
        kind: {**dict.fromkeys((*loadgen.STATUSES, loadgen.NO_END), 0), status: 2}
        for kind, status in loadgen.EXPECTED.items()
    }
    assert summary["by_status"] == {"complete": 6, "interrupted": 2, "cancelled": 2, "failed": 0}
    assert summary["first_delta_ms"]["n"] == 10
    assert 0 < summary["first_delta_ms"]["p50"] <= summary["first_delta_ms"]["p99"]
    assert summary["tool_errors"] == {"unknown_tool": 2}  # no tools file: refused, then finished
    assert summary["error_events"].get("upstream_unavailable") == 2  # the interrupted ones
    assert "\r" in err  # the progress line was drawn in place...
    assert "10/10" in err  # ...and reached the end

    moved = {key: value - before[key] for key, value in counters(broker).items()}
    assert moved["started"] == 10
    assert (moved["complete"], moved["interrupted"], moved["cancelled"]) == (6, 2, 2)
    assert moved["failed"] == 0
    assert moved["retries"] == 2  # one silent retry per retried turn
    assert moved["interruptions"] == 2
    assert moved["cancel_signalled"] + moved["cancel_queued"] == 2


def test_the_text_summary_names_each_kind(
    broker: RunningBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(
        "--url",
        broker.base_url,
        "--turns",
        "2",
        "--rate",
        "100",
        "--mix",
        "normal,tool",
        "--tokens",
        "8",
        "--tokens-per-s",
        "0",
        "--no-progress",
    )
    assert loadgen.run(args) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "2/2 turns" in out
    table = out.split("\n\n")[1].splitlines()  # the kind x status table
    rows = {line.split()[0]: line.split()[1:] for line in table}
    assert rows["normal"][:2] == ["1", "1"]  # one turn, complete
    assert rows["tool"][:2] == ["1", "1"]
    assert "unknown_tool 1" in out


def test_an_unreachable_broker_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = parse("--url", url, "--turns", "3", "--rate", "100", "--timeout", "5", "--json")
    assert loadgen.run(args) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["errors"] == 3
    assert summary["by_status"]["no_end"] == 3
    assert all(message.startswith("ConnectError") for message in summary["error_messages"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--url", "ftp://127.0.0.1"), "--url"),
        (("--mix", "normal=1,bogus=2"), "unknown turn kind"),
        (("--mix", "normal=1,tools=1"), "unknown turn kind 'tools' (did you mean 'tool'?)"),
        (("--mix", "normal=0"), "positive weight"),
        (("--tokens", "3"), "--tokens"),
        (("--rate", "0"), "--rate"),
        (("--concurrency", "0"), "--concurrency"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert loadgen.run(parse("--turns", "1", *argv)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("broker loadgen: ")
    assert message in err
    assert err.count("\n") == 1


def test_duration_sets_the_number_of_turns() -> None:
    assert loadgen.plan_from_args(parse("--rate", "4", "--duration", "2.5")).turns == 10
    assert loadgen.plan_from_args(parse("--rate", "3", "--turns", "7")).turns == 7
    with pytest.raises(SystemExit):
        parse("--turns", "7", "--duration", "2")  # one bound or the other


def test_the_schedule_follows_the_weights_exactly_and_spreads_kinds() -> None:
    mix = loadgen.parse_mix("normal=5,retried=2,interrupted=1,cancelled=1,tool=1")
    order = loadgen.schedule(mix, 20)
    assert Counter(order) == {
        "normal": 10,
        "retried": 4,
        "interrupted": 2,
        "cancelled": 2,
        "tool": 2,
    }
    assert all(a != b for a, b in itertools.pairwise(order) if a != "normal")  # interleaved
    for turns in range(1, 30):
        counts = Counter(loadgen.schedule(mix, turns))
        assert sum(counts.values()) == turns
        for kind, weight in mix.items():
            assert abs(counts[kind] - turns * weight / 10) < 1


def test_the_docs_mix_parses_and_a_misspelt_kind_names_the_right_one() -> None:
    """Regression: the README said ``tools=1``, a kind that does not exist (it is ``tool``).
    The example lives on the metrics page now."""
    page = (Path(__file__).resolve().parent.parent / "docs/operations/metrics.md").read_text()
    mixes = re.findall(r"--mix ([\w=,]+)", page)
    assert mixes, "docs/operations/metrics.md shows no --mix"
    for mix in mixes:
        assert set(loadgen.parse_mix(mix)) == set(loadgen.KINDS), mix
    with pytest.raises(ValueError, match=r"unknown turn kind 'tools' \(did you mean 'tool'\?\)"):
        loadgen.parse_mix("normal=5,tools=1")
    with pytest.raises(ValueError, match=r"unknown turn kind 'zzz'; known: normal, ") as info:
        loadgen.parse_mix("zzz")
    assert "did you mean" not in str(info.value)


def test_mix_and_percentile_parsing() -> None:
    assert loadgen.parse_mix("tool, normal=3,tool=2") == {"tool": 3, "normal": 3}
    with pytest.raises(ValueError, match="integer"):
        loadgen.parse_mix("normal=x")
    assert loadgen.percentile([], 50) is None
    values = [float(v) for v in range(1, 101)]
    assert loadgen.percentile(values, 50) == 50.0
    assert loadgen.percentile(values, 99) == 99.0
    assert loadgen.percentile([7.0], 99) == 7.0
