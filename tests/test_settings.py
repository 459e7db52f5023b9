"""Settings come from BROKER_* variables, once, with clear errors."""

from __future__ import annotations

import pytest

from broker.settings import Settings, SettingsError


def test_defaults_need_no_environment() -> None:
    settings = Settings.from_env({})
    assert settings.redis_url is None
    assert settings.port == 8000
    assert settings.stream_ttl == 86_400
    assert settings.role == "all"


def test_variables_are_read_and_typed() -> None:
    settings = Settings.from_env(
        {
            "BROKER_PORT": "9001",
            "BROKER_STREAM_TTL": "2h",
            "BROKER_TOMBSTONE_TTL": "90",
            "BROKER_SSE_HEARTBEAT_S": "0.5",
            "BROKER_REDIS_URL": "unix:///tmp/r.sock",
            "BROKER_ROLE": "worker",
        }
    )
    assert settings.port == 9001
    assert settings.stream_ttl == 7200
    assert settings.tombstone_ttl == 90
    assert settings.sse_heartbeat_s == 0.5
    assert settings.redis_url == "unix:///tmp/r.sock"
    assert settings.runs_worker
    assert not settings.runs_api


def test_explicit_overrides_win_over_the_environment() -> None:
    settings = Settings.from_env({"BROKER_PORT": "9001"}, port=9002, host=None)
    assert settings.port == 9002
    assert settings.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BROKER_PORT": "eighty"}, "BROKER_PORT must be a number"),
        ({"BROKER_STREAM_TTL": "a day"}, "BROKER_STREAM_TTL must be a duration"),
        ({"BROKER_ROLE": "boss"}, "BROKER_ROLE must be one of all, api, worker"),
        ({"BROKER_REDIS_URL": "localhost:6379"}, "BROKER_REDIS_URL must start with"),
        ({"BROKER_MAX_STREAM_EVENTS": "0"}, "BROKER_MAX_STREAM_EVENTS must be positive"),
        ({"BROKER_KEY_PREFIX": "a{b}"}, "BROKER_KEY_PREFIX"),
        (
            {"BROKER_LEASE_TTL_MS": "5000", "BROKER_JOB_RECLAIM_IDLE_MS": "4000"},
            "must exceed BROKER_LEASE_TTL_MS",
        ),
    ],
)
def test_bad_values_are_refused_with_the_variable_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)
