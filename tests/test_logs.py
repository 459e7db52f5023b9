"""Structured logs: one JSON object per line, with the ids of the turn it is about."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import orjson
import pytest

from broker.logs import JsonFormatter
from tests.conftest import BrokerProcess
from tests.helpers import read_sse, start_turn, wait_until

# Brokers of its own processes, on the server the session names: a test of the server too.
pytestmark = pytest.mark.server


def test_json_records_carry_their_context() -> None:
    record = logging.LogRecord(
        "broker.x", logging.INFO, __file__, 1, "turn %s ended", ("t1",), None
    )
    record.turn_id = "t1"
    record.attempt = 2
    record.event = "attempt_ended"
    entry = orjson.loads(JsonFormatter().format(record))
    assert entry["message"] == "turn t1 ended"
    assert (entry["level"], entry["logger"]) == ("INFO", "broker.x")
    assert (entry["turn_id"], entry["attempt"], entry["event"]) == ("t1", 2, "attempt_ended")
    assert "stream_id" not in entry
    assert entry["ts"].endswith("+00:00")


def test_a_broker_logs_one_json_line_per_attempt_outcome(
    broker_processes: Callable[[dict[str, str]], BrokerProcess], redis_url: str
) -> None:
    proc = broker_processes(
        {
            "BROKER_REDIS_URL": redis_url,
            "BROKER_KEY_PREFIX": f"logs{os.getpid()}",
            "BROKER_LOG_FORMAT": "json",
        }
    )
    turn = start_turn(proc.base_url, turn_id="logged", tokens=3, tokens_per_s=0)
    read_sse(proc.base_url, turn["stream_id"])

    def ended() -> dict[str, object] | None:
        for line in list(proc.lines):
            if line.startswith("{") and '"attempt_ended"' in line:
                entry: dict[str, object] = orjson.loads(line)
                return entry
        return None

    entry = wait_until(ended, 10)
    assert entry["turn_id"] == "logged"
    assert entry["stream_id"] == turn["stream_id"]
    assert (entry["attempt"], entry["status"]) == (1, "complete")
    proc.stop(signal.SIGTERM)
    json_lines = [line for line in proc.lines if line.strip().startswith("{")]
    assert all(isinstance(orjson.loads(line), dict) for line in json_lines)
    assert any('"turn_started"' in line for line in json_lines)
