"""The AI SDK example page (``examples/ai-sdk``) in a real Chromium: ``useChat({ resume: true })``
reloaded mid-answer resumes it, and the answer completes once with the uninterrupted text; a
page reloaded while a tool call waits for approval shows the request again and answers it.

The page is bundled by the example's own server from its node_modules (esbuild) and talks to a
real broker through it, as docs/aisdk.md tells a reader to run it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from tests.chromium import CHROMIUM, launched
from tests.conftest import BrokerFactory, free_port
from tests.helpers import ToolEndpoint, missing_tool

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

if not CHROMIUM.exists():
    missing_tool(f"{CHROMIUM} is not installed (apt-get install chromium)", module=True)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples/ai-sdk"
WAIT_MS = 20_000
PROMPT = "Tell me about tunnels"
SIMULATE = {"seed": "reload", "tokens": 80, "tokens_per_s": 25}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launched() as browser:
        yield browser


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    context.set_default_timeout(WAIT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


def serve_example(broker_url: str) -> tuple[subprocess.Popen[str], str]:
    """The example's own server (``npm start``), on a free port; its base URL once it listens."""
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the example page needs Node >= 20)")
    if not (EXAMPLE / "node_modules/@ai-sdk/react").is_dir():
        missing_tool("examples/ai-sdk has no node_modules: run `npm ci` there")
    port = free_port()
    env = {**os.environ, "BROKER_URL": broker_url, "PORT": str(port)}
    process = subprocess.Popen(
        [node, "serve.mjs"],
        cwd=EXAMPLE,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        process.kill()
        raise TimeoutError("the example server did not start") from None
    assert f"http://127.0.0.1:{port}" in line, line
    return process, f"http://127.0.0.1:{port}"


def reference_text(broker_url: str) -> str:
    """The uninterrupted answer to the same prompt and knobs, at full speed, in its own chat."""
    body = {
        "id": "reference",
        "messages": [{"id": "ref-1", "role": "user", "parts": [{"type": "text", "text": PROMPT}]}],
        "trigger": "submit-message",
        "params": {"simulate": {**SIMULATE, "tokens_per_s": 0}},
    }
    with httpx.Client(base_url=broker_url, timeout=20) as http:
        assert http.post("/v1/ui/chat", json=body).status_code == 200
        turn = http.get("/v1/turns/ref-1").json()
    assert turn["status"] == "complete"
    text: str = turn["canonical"]["text"]
    return text


def test_reload_mid_answer_resumes_and_completes_once(
    broker_factory: BrokerFactory, page: Page
) -> None:
    broker = broker_factory()
    expected = reference_text(broker.base_url)
    server, base = serve_example(broker.base_url)
    try:
        page.goto(f"{base}/?chat=reload-chat&simulate={json.dumps(SIMULATE)}")
        page.get_by_placeholder("Ask").fill(PROMPT)
        page.get_by_role("button", name="Send").click()
        answer = page.locator("article[data-role=assistant] .text")
        page.wait_for_function(
            "() => (document.querySelector('article[data-role=assistant] .text')"
            "?.textContent ?? '').length >= 30"
        )
        turn_id = page.locator("article[data-role=user]").get_attribute("data-id")
        assert turn_id
        before = answer.text_content() or ""
        assert expected.startswith(before)
        turn_url = f"{broker.base_url}/v1/turns/{turn_id}"
        assert httpx.get(turn_url, timeout=10).json()["status"] == "streaming", "not mid-answer"

        page.reload()
        expect(answer).to_have_text(expected, timeout=WAIT_MS)
        expect(page.locator("main")).to_have_attribute("data-status", "ready")
        expect(page.locator("article[data-role=assistant]")).to_have_count(1)
        assert answer.text_content() == expected  # completed once: nothing appended after
        turn = httpx.get(turn_url, timeout=10).json()
        assert turn["status"] == "complete"
        assert len(turn["attempts"]) == 1, "the reload started no second generation"
        assert turn["canonical"]["text"] == expected
        assert page.locator("[role=alert]").count() == 0
    finally:
        server.kill()
        server.wait(timeout=10)


def test_a_client_tool_runs_in_the_page_and_the_answer_follows(
    broker_factory: BrokerFactory, page: Page
) -> None:
    """useChat runs the page's own tool (local_time) on the broker's call and sends the
    output back by itself; the answer to it goes on in the same message."""
    broker = broker_factory()
    server, base = serve_example(broker.base_url)
    simulate = {
        "seed": "tools",
        "tokens": 12,
        "tokens_per_s": 0,
        "tool_calls": [{"name": "local_time", "args": {}, "after": 3}],
    }
    try:
        page.goto(f"{base}/?chat=tools-chat&simulate={json.dumps(simulate)}")
        page.get_by_placeholder("Ask").fill("What time is it here?")
        page.get_by_role("button", name="Send").click()
        tool = page.locator("article[data-role=assistant] .tool")
        expect(tool).to_have_attribute("data-state", "output-available")
        answer = page.locator("article[data-role=assistant] .text")
        expect(answer).to_contain_text("(1 tool results")
        expect(page.locator("main")).to_have_attribute("data-status", "ready")
        expect(page.locator("article[data-role=assistant]")).to_have_count(1)
        expect(tool).to_have_count(1)
        turn_id = page.locator("article[data-role=user]").get_attribute("data-id")
        first = httpx.get(f"{broker.base_url}/v1/turns/{turn_id}", timeout=10).json()
        assert first["status"] == "requires_action"
        [call] = first["tool_calls"]
        assert call["name"] == "local_time"
        output = json.loads((tool.text_content() or "").split(": ", 1)[1])
        assert set(output) == {"time", "zone"}, "the page's own tool ran"
        assert page.locator("[role=alert]").count() == 0
    finally:
        server.kill()
        server.wait(timeout=10)


def test_a_reload_while_an_approval_waits_shows_it_again_and_allow_completes_the_answer(
    broker_factory: BrokerFactory, page: Page, tmp_path: Path
) -> None:
    """A server tool that waits for a person: the page shows Allow/Deny; reloaded, it shows
    the request again (it lives in the broker); Allow runs the payment once and the answer
    completes in the same message."""
    payments = ToolEndpoint("/pay", lambda n: {"payment_id": f"pay_{n}"})
    tools = tmp_path / "tools.json"
    tool = {
        "name": "send_payment",
        "class": "unkeyed_write",
        "endpoint": payments.url,
        "timeout_s": 5,
        "approval": "always",
    }
    tools.write_text(json.dumps({"tools": [tool]}))
    broker = broker_factory(tools=str(tools))
    server, base = serve_example(broker.base_url)
    simulate = {
        "seed": "approval",
        "tokens": 10,
        "tokens_per_s": 0,
        "tool_calls": [{"name": "send_payment", "args": {"to": "bob", "amount": 500}, "after": 3}],
    }
    try:
        page.goto(f"{base}/?chat=approval-chat&simulate={json.dumps(simulate)}")
        page.get_by_placeholder("Ask").fill("Pay bob 500")
        page.get_by_role("button", name="Send").click()
        tool_part = page.locator("article[data-role=assistant] .tool")
        expect(tool_part).to_have_attribute("data-state", "approval-requested")
        expect(page.locator("main")).to_have_attribute("data-status", "ready")
        turn_id = page.locator("article[data-role=user]").get_attribute("data-id")
        turn_url = f"{broker.base_url}/v1/turns/{turn_id}"
        assert httpx.get(turn_url, timeout=10).json()["status"] == "awaiting_approval"

        page.reload()
        expect(tool_part).to_have_attribute("data-state", "approval-requested")
        expect(page.locator("main")).to_have_attribute("data-status", "ready")
        assert payments.requests == [], "nothing ran before a person said yes"
        page.get_by_role("button", name="Allow").click()
        expect(tool_part).to_have_attribute("data-state", "output-available")
        expect(page.locator("main")).to_have_attribute("data-status", "ready")
        turn = httpx.get(turn_url, timeout=10).json()
        assert turn["status"] == "complete"
        answer = page.locator("article[data-role=assistant] .text")
        expect(answer).to_have_text(turn["canonical"]["text"])
        expect(page.locator("article[data-role=assistant]")).to_have_count(1)
        assert len(payments.requests) == 1, "the payment ran once"
        assert "pay_1" in (tool_part.text_content() or "")
        assert page.locator("[role=alert]").count() == 0
    finally:
        server.kill()
        server.wait(timeout=10)
        payments.close()
