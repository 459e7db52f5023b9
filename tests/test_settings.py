"""Settings come from BROKER_* variables, once, with clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from broker.__main__ import _parser, serve_settings
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
        ({"BROKER_PORT": "eighty"}, "BROKER_PORT must be a whole number"),
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


# Regression (issue 34, finding 10): a port past 65535 was bound modulo 65536, a negative one
# failed with a cryptic error, an unknown log level raised a traceback, and nan or inf passed
# every check (then broke a timer). Each is now the one line the other settings give.
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BROKER_PORT": "99999"}, "BROKER_PORT must be from 0 to 65535, not 99999"),
        ({"BROKER_PORT": "70000"}, "BROKER_PORT must be from 0 to 65535, not 70000"),
        ({"BROKER_PORT": "65536"}, "BROKER_PORT must be from 0 to 65535, not 65536"),
        ({"BROKER_PORT": "-1"}, "BROKER_PORT must be from 0 to 65535, not -1"),
        ({"BROKER_PORT": "80.5"}, "BROKER_PORT must be a whole number, not '80.5'"),
        (
            {"BROKER_LOG_LEVEL": "LOUD"},
            "BROKER_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, not 'LOUD'",
        ),
        ({"BROKER_DRAIN_TIMEOUT_S": "nan"}, "BROKER_DRAIN_TIMEOUT_S must be a finite number"),
        ({"BROKER_SSE_HEARTBEAT_S": "inf"}, "BROKER_SSE_HEARTBEAT_S must be a finite number"),
        ({"BROKER_STREAM_TTL": "1e999s"}, "BROKER_STREAM_TTL must be a finite number"),
        ({"BROKER_TURN_RATE_PER_S": "-inf"}, "BROKER_TURN_RATE_PER_S must be a finite number"),
        (
            {"BROKER_OPENAI_CONTINUE_FINAL_MESSAGE": "7"},
            "BROKER_OPENAI_CONTINUE_FINAL_MESSAGE must be from 0 to 1, not 7",
        ),
        (
            {"BROKER_MAX_CONNECTIONS": "9" * 5000},  # past int()'s digit limit: still one line
            "BROKER_MAX_CONNECTIONS must be a whole number, not '99999",
        ),
    ],
)
def test_out_of_range_numbers_and_unknown_words_are_one_line_errors(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(env)
    text = str(refused.value)
    assert text.startswith(message)
    assert "\n" not in text
    assert len(text) < 120


@pytest.mark.parametrize(
    ("field", "value"),
    [("port", 65_536), ("port", -1), ("log_level", "LOUD"), ("drain_timeout_s", float("nan"))],
)
def test_values_given_in_code_are_checked_as_the_environment_is(field: str, value: object) -> None:
    with pytest.raises(SettingsError, match=f"BROKER_{field.upper()} must be"):
        Settings(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "port", "level"),
    [({}, 8000, "INFO"), ({"BROKER_PORT": "0", "BROKER_LOG_LEVEL": "debug"}, 0, "debug")],
)
def test_the_edges_of_the_ranges_are_accepted(env: dict[str, str], port: int, level: str) -> None:
    settings = Settings.from_env(env)
    assert (settings.port, settings.log_level) == (port, level)
    assert Settings.from_env({"BROKER_PORT": "65535"}).port == 65_535


def serve(*flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``broker serve`` with these flags and variables, on a Redis it never reaches."""
    return subprocess.run(
        [sys.executable, "-m", "broker", "serve", *flags],
        env={**os.environ, "BROKER_REDIS_URL": "redis://127.0.0.1:1/0", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("flags", "env", "line"),
    [
        (
            ("--port", "99999"),
            {},
            "broker: BROKER_PORT must be from 0 to 65535, not 99999 (given as --port)",
        ),
        ((), {"BROKER_PORT": "70000"}, "broker: BROKER_PORT must be from 0 to 65535, not 70000"),
        (
            (),
            {"BROKER_LOG_LEVEL": "LOUD"},
            "broker: BROKER_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
            "not 'LOUD'",
        ),
    ],
)
def test_the_command_line_refuses_bad_settings_in_one_line(
    flags: tuple[str, ...], env: dict[str, str], line: str
) -> None:
    result = serve(*flags, **env)
    assert (result.returncode, result.stderr, result.stdout) == (2, line + "\n", "")


def test_a_flag_is_read_as_its_variable_and_wins_over_it() -> None:
    args = _parser().parse_args(["serve", "--port", "9001", "--host", "0.0.0.0"])
    settings = serve_settings(args, {"BROKER_PORT": "9000", "BROKER_ROLE": "api"})
    assert (settings.host, settings.port, settings.role) == ("0.0.0.0", 9001, "api")
    bad = _parser().parse_args(["serve", "--port", "99999"])
    with pytest.raises(SettingsError) as refused:
        serve_settings(bad, {"BROKER_PORT": "9000"})
    assert str(refused.value) == (
        "BROKER_PORT must be from 0 to 65535, not 99999 (given as --port)"
    )
    with pytest.raises(SettingsError) as refused:  # the variable's own value: no flag named
        serve_settings(_parser().parse_args(["serve"]), {"BROKER_PORT": "-1"})
    assert str(refused.value) == "BROKER_PORT must be from 0 to 65535, not -1"
