"""The OpenAI page's example (docs/openai.md), run verbatim against `broker serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.conftest import BrokerProcess, _prefixes
from tests.doc_pages import snippets

# Brokers of its own processes, on the server the session names: a test of the server too.
pytestmark = pytest.mark.server

SpawnBroker = Callable[[dict[str, str]], BrokerProcess]

PAGE, TITLE = "openai.md", "OpenAI Responses and Chat Completions"


def test_the_openai_sdk_snippet_cuts_resumes_and_cancels(
    broker_processes: SpawnBroker, redis_url: str
) -> None:
    (code,) = snippets(PAGE, TITLE, "python")
    assert "http://127.0.0.1:8000/v1" in code
    broker: BrokerProcess = broker_processes(
        {"BROKER_REDIS_URL": redis_url, "BROKER_KEY_PREFIX": f"readme-openai-{next(_prefixes)}"}
    )
    run = subprocess.run(
        [sys.executable, "-c", code.replace("http://127.0.0.1:8000", broker.base_url)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ),
    )
    assert run.returncode == 0, run.stderr
    # (The snippet asserts that the resumed text is the response's; the answers span lines.)
    *answers, status = run.stdout.splitlines()
    assert len("".join(answers)) > 40
    assert status == "cancelled"
