"""Whole numbers from the wire: one parser (broker.numbers), and every parameter that reads one
answers a 400 in its door's error shape for what is not a number in range.

Issue 34, finding 6: integers of more than 4,300 digits in ``wait``, ``heartbeat``,
``batch_ms`` and OpenAI's ``starting_after`` were 500s with a traceback, because ``int()``
refused them before the range check could.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from broker.numbers import whole_number
from broker.providers.openai import _status_of
from tests.conftest import RunningBroker
from tests.helpers import start_turn, wait_final

HUGE = "9" * 5000  # past int()'s 4,300-digit limit
ZEROS = "0" * 5000 + "7"


@pytest.mark.parametrize(
    ("raw", "low", "high", "expected"),
    [
        ("0", 0, 25, 0),
        ("25", 0, 25, 25),
        ("26", 0, 25, None),
        ("007", 0, 25, 7),
        (ZEROS, 0, 25, 7),  # leading zeros are not significant, however many
        (HUGE, 0, 25, None),
        (HUGE, 0, 2**53, None),
        ("-" + HUGE, -1, 2**53, None),
        ("9007199254740992", -1, 2**53, 2**53),
        ("9007199254740993", -1, 2**53, None),
        ("-1", -1, 2**53, -1),
        ("-2", -1, 2**53, None),
        ("-0", 0, 25, None),  # no sign where the range has no negatives
        ("-5", 0, 25, None),
        ("+5", 0, 25, None),
        (" 5", 0, 25, None),
        ("5 ", 0, 25, None),
        ("5\n", 0, 25, None),
        ("5_0", 0, 100, None),
        ("²", 0, 25, None),  # str.isdigit() holds, int() raises
        ("٣", 0, 25, None),  # Arabic-Indic three: int() would take it
        ("1.5", 0, 25, None),
        ("1e3", 0, 5000, None),
        ("", 0, 25, None),
        ("-", -1, 25, None),
        ("15", 15, 120, 15),
        ("14", 15, 120, None),
        ("121", 15, 120, None),
    ],
)
def test_a_whole_number_is_read_only_when_it_is_one_in_range(
    raw: str, low: int, high: int, expected: int | None
) -> None:
    assert whole_number(raw, low, high) == expected


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"code": "429"}, 429),
        ({"status": 503}, 503),
        ({"code": "²"}, None),
        ({"code": HUGE}, None),
        ({"status_code": "200"}, None),
    ],
)
def test_an_upstream_error_object_names_a_status_only_in_digits(
    body: dict[str, Any], status: int | None
) -> None:
    assert _status_of(body) == status


# --- through HTTP ---------------------------------------------------------------------------


def assert_bad_request(response: httpx.Response, code: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"code", "message"}
    assert error["code"] == code


@pytest.fixture
def finished(broker: RunningBroker) -> str:
    """The stream id of a finished turn."""
    turn = start_turn(broker.base_url, turn_id="numbers", tokens=3, tokens_per_s=0)
    wait_final(broker.base_url, "numbers")
    stream_id: str = turn["stream_id"]
    return stream_id


@pytest.mark.parametrize("value", [HUGE, "²", "-1", "+5", "5_0"])
@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"format": "json"}, "bad_wait"),  # wait=<value>
        ({}, "bad_heartbeat"),  # heartbeat=<value>, SSE
        ({}, "bad_batch"),  # batch_ms=<value>, SSE
    ],
    ids=["wait", "heartbeat", "batch_ms"],
)
def test_a_stream_read_refuses_a_parameter_that_is_no_number_in_range(
    broker: RunningBroker, finished: str, params: dict[str, str], code: str, value: str
) -> None:
    name = {"bad_wait": "wait", "bad_heartbeat": "heartbeat", "bad_batch": "batch_ms"}[code]
    response = httpx.get(
        f"{broker.base_url}/v1/streams/{finished}", params={**params, name: value}, timeout=10
    )
    assert_bad_request(response, code)


def test_a_stream_read_still_takes_numbers_in_range(broker: RunningBroker, finished: str) -> None:
    url = f"{broker.base_url}/v1/streams/{finished}"
    page = httpx.get(url, params={"format": "json", "wait": "0"}, timeout=10)
    assert page.status_code == 200, page.text
    assert page.json()["closed"] is True
    with httpx.stream("GET", url, params={"heartbeat": "30", "batch_ms": "007"}) as sse:
        assert sse.status_code == 200
        assert "event: end" in sse.read().decode()


@pytest.mark.parametrize("value", [HUGE, "-" + HUGE, "²"])
def test_starting_after_refuses_what_is_no_number_in_range(
    broker: RunningBroker, value: str
) -> None:
    response = httpx.get(
        f"{broker.base_url}/v1/responses/resp_x",
        params={"stream": "true", "starting_after": value},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "starting_after"
