"""The upstream error taxonomy and the retry pause it leads to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from broker.deps import Deps
from broker.metrics import ERROR_CODES, Metrics, error_code
from broker.providers.taxonomy import (
    ADMISSION,
    RETRYABLE,
    classify_status,
    retry_after,
    status_error,
    transport_error,
)
from broker.retry import RetryPolicy
from broker.settings import Settings


@pytest.mark.parametrize(
    ("status", "code", "retryable"),
    [
        (400, "upstream_bad_request", False),
        (401, "upstream_unauthorized", False),
        (403, "upstream_forbidden", False),
        (404, "upstream_not_found", False),
        (422, "upstream_unprocessable", False),
        (408, "upstream_timeout", True),
        (409, "upstream_conflict", True),
        (429, "upstream_rate_limited", True),
        (500, "upstream_unavailable", True),
        (503, "upstream_unavailable", True),
        (529, "upstream_overloaded", True),
        (418, "upstream_http_418", False),
    ],
)
def test_every_status_has_one_class(status: int, code: str, retryable: bool) -> None:
    assert classify_status(status) == (code, retryable)


@pytest.mark.parametrize(
    ("code", "label"),
    [
        ("upstream_rate_limited", "upstream_rate_limited"),
        ("upstream_unavailable", "upstream_unavailable"),
        ("upstream_overloaded", "upstream_overloaded"),
        ("upstream_timeout", "upstream_timeout"),
        ("upstream_connection", "upstream_connection"),
        ("upstream_incomplete", "upstream_incomplete"),
        ("upstream_stream_error", "upstream_stream_error"),
        ("upstream_unauthorized", "upstream_unauthorized"),
        ("upstream_http_418", "upstream_other"),
        ("upstream_http_302", "upstream_other"),
        ("upstream_client_error", "upstream_other"),
        ("none", "upstream_other"),  # only a cause without an upstream error is none
        ("", "upstream_other"),
        (None, "none"),
    ],
)
def test_an_error_code_labels_metrics_from_a_fixed_set(code: str | None, label: str) -> None:
    """Issue 34, finding 11: retries, exhausted attempts and interruptions carry the code."""
    assert error_code(code) == label
    assert label in ERROR_CODES


def test_every_code_of_the_taxonomy_tables_is_its_own_label() -> None:
    codes = {*ADMISSION.values(), *RETRYABLE.values(), classify_status(503)[0]}
    codes |= {transport_error(kind, "x").code for kind in ("timeout", "connection")}
    assert {code: error_code(code) for code in codes} == {code: code for code in codes}


def test_retry_after_is_read_as_seconds_or_a_date() -> None:
    assert retry_after("3") == 3.0
    assert retry_after("-1") == 0.0
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert retry_after("soon") is None
    assert retry_after(None) is None
    assert status_error(429, "slow down", "2").retry_after_s == 2.0
    assert status_error(401, "no", "2").retry_after_s is None


def test_a_retry_after_is_held_within_the_backoff_window() -> None:
    settings = Settings(retry_backoff_min_ms=200, retry_backoff_max_ms=400)
    policy = RetryPolicy(Deps(None, None, None, settings, Metrics()))  # type: ignore[arg-type]
    assert policy.backoff_s(0.05) == 0.2
    assert policy.backoff_s(0.3) == 0.3
    assert policy.backoff_s(30) == 0.4
    assert all(0.2 <= policy.backoff_s() <= 0.4 for _ in range(50))


def test_broker_providers_lists_models_and_never_keys() -> None:
    env = {
        **os.environ,
        "BROKER_OPENAI_MODELS": "gpt-a,gpt-b",
        "BROKER_OPENAI_API_KEY": "sk-secret-1",
        "BROKER_OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "BROKER_ANTHROPIC_MODELS": "claude-a",
        "BROKER_ANTHROPIC_API_KEY": "sk-ant-secret-2",
    }
    result = subprocess.run(
        [sys.executable, "-m", "broker", "providers"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "simulated" in result.stdout
    assert "gpt-a, gpt-b" in result.stdout
    assert "claude-a" in result.stdout
    assert "secret" not in result.stdout + result.stderr
