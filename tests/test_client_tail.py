"""`python -m broker_client tail` on a turn already at rest, against a real broker.

Regression (issue 14): `tail STREAM --offset now` on a finished stream printed `status: unknown`
and exited 1. The broker answers such a read with 204 (nothing follows the resume point), and
the command now reports the turn's real final status, with the documented exit codes.
"""

from __future__ import annotations

import pytest

from broker_client.__main__ import main
from tests.conftest import RunningBroker
from tests.helpers import read_sse, start_turn, wait_final


def tail(broker: RunningBroker, *argv: str) -> int:
    return main(["tail", *argv, "--url", broker.base_url, "--max-retries", "2"])


@pytest.mark.parametrize("offset", ["now", "last id"])
def test_tail_of_a_complete_turn_after_its_end_reports_complete_and_exits_0(
    broker: RunningBroker, offset: str, capsys: pytest.CaptureFixture[str]
) -> None:
    turn = start_turn(broker.base_url, "tail-c", turn_id="done", tokens=5, tokens_per_s=0)
    final = wait_final(broker.base_url, "done")
    assert final["status"] == "complete"
    stored = read_sse(broker.base_url, turn["stream_id"])
    resume = "now" if offset == "now" else stored.events[-1].id
    assert read_sse(broker.base_url, turn["stream_id"], offset=resume).events == []  # a 204

    assert tail(broker, turn["stream_id"], "--offset", resume) == 0
    out, err = capsys.readouterr()
    assert out == ""  # no text came after the resume point
    assert err.splitlines() == [
        "[nothing after this point: the turn is at rest]",
        f"status: complete{_reason(final)}",
    ]


def test_tail_of_an_interrupted_turn_after_its_end_reports_interrupted_and_exits_1(
    broker: RunningBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    turn = start_turn(
        broker.base_url,
        "tail-i",
        turn_id="broken",
        tokens=10,
        tokens_per_s=0,
        fail_after_deltas=3,
    )
    final = wait_final(broker.base_url, "broken")
    assert final["status"] == "interrupted"

    assert tail(broker, turn["stream_id"], "--offset", "now", "--quiet") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"status: interrupted{_reason(final)}\n"  # --quiet: the status line alone
    assert _reason(final)  # the reason is named, e.g. "(upstream_error)"


def test_tail_from_the_start_still_prints_the_text_and_the_status(
    broker: RunningBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    turn = start_turn(broker.base_url, "tail-s", turn_id="whole", tokens=6, tokens_per_s=0)
    final = wait_final(broker.base_url, "whole")
    assert tail(broker, turn["stream_id"]) == 0
    out, err = capsys.readouterr()
    assert out == final["canonical"]["text"] + "\n"
    assert "nothing after this point" not in err
    assert err.endswith(f"status: complete{_reason(final)}\n")


def _reason(turn: dict[str, object]) -> str:
    attempts = turn["attempts"]
    assert isinstance(attempts, list)
    reason = attempts[-1].get("reason")
    return f" ({reason})" if reason else ""
