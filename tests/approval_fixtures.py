"""A payment endpoint for the tool tests (``payments``, which counts what it is asked to do), and
a payment tool over it whose calls over 100 wait for a person's approval, as the approval tests
of every door use it: its tools file and a broker that serves it (``approved_broker``). The
fixtures are registered for every test module by ``tests/conftest.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import ToolEndpoint

PAYMENT_SCHEMA = {
    "type": "object",
    "required": ["to", "amount"],
    "properties": {"to": {"type": "string"}, "amount": {"type": "number"}},
}
OVER_100 = {"when": {"properties": {"amount": {"exclusiveMinimum": 100}}}}
BIG = {"to": "bob", "amount": 500}
SMALL = {"to": "bob", "amount": 10}


@pytest.fixture
def payments() -> Iterator[ToolEndpoint]:
    """A payment endpoint that counts what it is asked to do."""
    endpoint = ToolEndpoint("/pay", lambda n: {"payment_id": f"pay_{n}"})
    yield endpoint
    endpoint.close()


@pytest.fixture
def approved_broker(
    broker_factory: BrokerFactory, tmp_path: Path, payments: ToolEndpoint
) -> RunningBroker:
    return broker_factory(tools=str(tools_file(tmp_path, payments.url)))


def tools_file(tmp_path: Path, url: str, **extra: Any) -> Path:
    path = tmp_path / "tools.json"
    tool = {
        "name": "send_payment",
        "class": "unkeyed_write",
        "schema": PAYMENT_SCHEMA,
        "endpoint": url,
        "timeout_s": 5,
        "approval": OVER_100,
        **extra,
    }
    path.write_text(json.dumps({"tools": [tool]}))
    return path
