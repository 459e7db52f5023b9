"""End-to-end tests of the demo page in a real Chromium, against a real broker.

Playwright's sync API drives Debian's Chromium (never a downloaded browser); the module is
skipped when /usr/bin/chromium is missing. One browser serves the whole module, one context
(fresh storage) each test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import missing_tool, read_sse

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    missing_tool(f"{CHROMIUM} is not installed (apt-get install chromium)", module=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]  # fmt: skip
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "demo.png"
PROMPT = "Tell me about tunnels"
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 900, "height": 820})
    context.set_default_timeout(WAIT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


def full_answer(broker: RunningBroker, seed: str, tokens: int) -> str:
    """The uninterrupted answer for the page's prompt, read over plain HTTP at full speed."""
    body: dict[str, Any] = {
        "conversation_id": "reference",
        "messages": [{"role": "user", "content": PROMPT}],
        "params": {"simulate": {"seed": seed, "tokens": tokens, "tokens_per_s": 0}},
    }
    turn = httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10).json()
    read = read_sse(broker.base_url, turn["stream_id"])
    assert read.events[-1].event == "end"
    assert read.events[-1].data["status"] == "complete"
    return "".join(e.data["text"] for e in read.events if e.event == "delta")


def send(
    page: Page,
    broker: RunningBroker,
    *,
    seed: str,
    tokens: int,
    pace: float,
    break_after: int | None = None,
) -> None:
    page.goto(broker.base_url + "/")
    page.get_by_label("Message").fill(PROMPT)
    page.get_by_label("Tokens", exact=True).fill(str(tokens))
    page.get_by_label("Tokens per second").fill(str(pace))
    page.get_by_label("Seed").fill(seed)
    page.get_by_label("Break after N deltas").fill("" if break_after is None else str(break_after))
    page.get_by_test_id("send").click()


def answer(page: Page) -> str:
    return page.get_by_test_id("answer").text_content() or ""


def wait_for_words(page: Page, count: int) -> None:
    page.wait_for_function(
        """n => (document.querySelector('[data-testid="answer"]').textContent.match(/\\S+/g)
                  || []).length >= n""",
        arg=count,
        timeout=WAIT_MS,
    )


def test_drop_connection_and_second_tab_show_the_same_answer(
    broker_factory: BrokerFactory, page: Page
) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "drop", 40)
    send(page, broker, seed="drop", tokens=40, pace=12)
    status = page.get_by_test_id("status")
    expect(status).to_have_text("streaming")
    wait_for_words(page, 3)

    # A second tab attaches to the same turn and shows the same text live.
    with page.context.expect_page() as opened:
        page.get_by_test_id("second-tab").click()
    second = opened.value
    expect(second.get_by_test_id("status")).to_have_text("streaming")

    page.get_by_test_id("drop").click()
    expect(page.get_by_test_id("reconnects")).not_to_have_text("0")
    expect(status).to_have_text("complete")
    assert answer(page) == expected
    expect(second.get_by_test_id("status")).to_have_text("complete")
    assert answer(second) == expected
    expect(page.get_by_test_id("stop")).to_be_disabled()


def test_reload_mid_answer_resumes(broker_factory: BrokerFactory, page: Page) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "reload", 40)
    send(page, broker, seed="reload", tokens=40, pace=12)
    wait_for_words(page, 4)
    page.reload()
    # The reloaded page reads on from the offset it kept, not from the start.
    expect(page.get_by_test_id("offset")).to_have_text(re.compile(r"^\d{16}-\d+$"))
    assert answer(page).strip(), "the text read before the reload is shown again"
    expect(page.get_by_test_id("status")).to_have_text("complete")
    assert answer(page) == expected


def test_stop_ends_cancelled(broker_factory: BrokerFactory, page: Page) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "stop", 300)
    send(page, broker, seed="stop", tokens=300, pace=10)
    wait_for_words(page, 2)
    page.get_by_test_id("stop").click()
    expect(page.get_by_test_id("status")).to_have_text("cancelled")
    text = answer(page)
    assert text
    assert expected.startswith(text)
    assert len(text) < len(expected)
    expect(page.get_by_test_id("recovery")).to_be_hidden()


def test_interrupted_answer_continues_or_regenerates(
    broker_factory: BrokerFactory, page: Page
) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "cut", 30)
    status = page.get_by_test_id("status")
    recovery = page.get_by_test_id("recovery")

    # Continue: the partial text plus the rest is the full answer.
    send(page, broker, seed="cut", tokens=30, pace=40, break_after=10)
    expect(status).to_have_text("interrupted")
    expect(recovery).to_be_visible()
    expect(page.get_by_test_id("answer")).to_have_class(re.compile(r"\bpartial\b"))
    partial = answer(page)
    assert partial
    assert expected.startswith(partial)
    assert partial != expected
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    page.get_by_test_id("continue").click()
    expect(status).to_have_text("complete")
    expect(page.get_by_test_id("attempt")).to_have_text("2")
    assert page.get_by_test_id("prefix").text_content() == partial
    assert answer(page) == expected
    expect(recovery).to_be_hidden()

    # Regenerate: a fresh answer replaces the partial one (the simulator is deterministic, so
    # the fresh answer is the full one, carrying nothing over).
    send(page, broker, seed="cut", tokens=30, pace=40, break_after=10)
    expect(status).to_have_text("interrupted")
    assert answer(page) == partial
    page.get_by_test_id("regenerate").click()
    expect(status).to_have_text("complete")
    expect(page.get_by_test_id("attempt")).to_have_text("2")
    assert page.get_by_test_id("prefix").text_content() == ""
    assert answer(page) == expected
    turn_id = page.get_by_test_id("turn-id").text_content()
    turn = httpx.get(f"{broker.base_url}/v1/turns/{turn_id}", timeout=10).json()
    assert [a["strategy"] for a in turn["attempts"]] == ["initial", "regenerate"]
